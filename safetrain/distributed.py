"""Data parallel training: every rank detects together, decides together, restores together.

Under an initialized process group with more than one rank and a ``DistributedDataParallel``
model, the guard builds a :class:`DistributedSync` once, at construction; all below follows:

* **One collective inside the one sync.** :meth:`DistributedSync.reduce` is the
  :class:`~safetrain.detect.StepFlags` hook: one ``all_gather`` of the packed step vector, one
  ``tolist()`` of every rank's row, combined on the host: a check value (a bool flag, an input
  sum, an activation sum, ``found_inf``) trips everywhere when it trips on any rank, ``loss`` is
  the mean over ranks (so the spike detector sees the same number everywhere), and the gradient
  norms and the scaler's scale are rank 0's (identical after DDP's all-reduce; a non-finite value
  on any rank still wins). Each rank's own row is kept, so the journal can say which ranks
  tripped (:meth:`DistributedSync.tripped_ranks`).
* **Slow paths agree.** A decision that a rank makes from its own data (an exact forward re-run,
  a replay, the rows left after ``drop_rows``, a snapshot's finiteness, a restore) is combined
  with one small collective that every rank enters, so no rank is left waiting; re-runs for
  diagnosis run under :func:`local`, with no DDP collective at all.
* **Snapshots.** :class:`DistributedStore`: the memory store keeps one ring per rank; the
  safetensors store is written by rank 0 only and read by every rank. That file holds rank 0's
  random generators: on restore and resume the other ranks keep their own (see :func:`keep_rng`).

One process uses :class:`LocalSync` instead: the same methods, each a no-op that returns its
input, so the guard never asks whether it is distributed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .detect.flags import Layout, packed_order, parse_read
from .errors import SnapshotError
from .snapshot import SafetensorsStore, SnapshotInfo, load_snapshot as _load_snapshot
from .snapshot.store import make_info
from .snapshot.state import Captured
from .snapshot.tensors import nonfinite

__all__ = ["LocalSync", "DistributedSync", "make_sync", "DistributedStore", "active", "rank", "local", "keep_rng", "load_snapshot"]

logger = logging.getLogger("safetrain")

_FIRST, _SUM, _MEAN = 0, 1, 2
#: Floating values that are counts, not magnitudes: summed over ranks like bool flags.
_SUMMED = frozenset({"found_inf"})


def active(group: Any = None) -> bool:
    """Whether a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group``; 0 when no process group is initialized."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def local(model: torch.nn.Module) -> Iterator[None]:
    """Run forwards and backwards of a DDP model with no collective: no gradient all-reduce, no
    buffer broadcast (for re-runs and replays, whose count may differ between ranks).

    DDP's own ``forward_param_sync`` state is put back on exit, so the next training step
    broadcasts buffers as it would have. Any other model: a no-op.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_forward_param_sync
    model.require_forward_param_sync = False
    try:
        with model.no_sync():
            yield
    finally:
        model.require_forward_param_sync = saved


@contextlib.contextmanager
def keep_rng(enabled: bool = True) -> Iterator[None]:
    """Put the torch (CPU and CUDA), numpy and Python generators back as they were on exit."""
    if not enabled:
        yield
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


class LocalSync:
    """One process: every agreement is the rank's own answer, at no cost (the same methods as
    :class:`DistributedSync`, so the guard never branches on being distributed)."""

    world = 1
    #: No hook on the step's read (see :class:`~safetrain.detect.StepFlags`).
    reduce = None

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank  # a rank deciding on its own still stamps its events with its rank

    def annotate(self, detail: Dict[str, Any], kind: str) -> Dict[str, Any]:
        """An anomaly event's detail, as it is (one rank: no ``ranks`` map)."""
        return detail

    def agree_finding(self, finding: Any, fallback: Callable[[], Any]) -> Any:
        """This rank's finding."""
        return finding

    def agree_weights(self, finding: Any, empty: Callable[[Tuple[int, ...]], Any]) -> Any:
        """This rank's weight finding."""
        return finding

    def total(self, count: int) -> int:
        """This rank's ``count``."""
        return count

    def same_count(self, count: int) -> bool:
        """One rank always agrees with itself."""
        return True

    def wrap_store(self, store: Any) -> Any:
        """The store, as it is."""
        return store

    def wrap_replayer(self, replayer: Any, model: torch.nn.Module) -> Any:
        """The replayer, as it is."""
        return replayer


def make_sync(device: torch.device, model: Optional[torch.nn.Module] = None) -> "LocalSync | DistributedSync":
    """The guard's sync: a :class:`DistributedSync` under a process group of more than one rank
    with a DDP model, else a :class:`LocalSync`."""
    sync = DistributedSync.from_environment(device, model)
    return sync if sync is not None else LocalSync(rank())


class DistributedSync:
    """Combines one step's flags across ranks, and makes slow-path decisions collectively.

    Args:
        device: where the slow-path agreement tensors live (the model's CUDA device with NCCL;
            the CPU with gloo).
        group: the process group (``None``: the default group).

    Example::

        >>> sync = DistributedSync.from_environment(torch.device("cpu"))  # None: not distributed
        >>> flags = StepFlags(reduce=sync.reduce if sync else None)       # doctest: +SKIP
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        self.device = device if device.type != "cpu" and backend != "gloo" else torch.device("cpu")
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._plans: Dict[Tuple[Any, ...], List[Tuple[int, int, int]]] = {}
        self._rows: List[List[float]] = []
        self._layout: Tuple[Any, ...] = ()

    @classmethod
    def from_environment(cls, device: torch.device, model: Optional[torch.nn.Module] = None,
                         group: Any = None) -> Optional["DistributedSync"]:
        """A sync when ``group`` has more than one rank and ``model`` is DDP-wrapped, else ``None``.

        A model that is not ``DistributedDataParallel`` in a process group (model or pipeline
        parallel, FSDP, independent runs) keeps per-rank decisions: its ranks' flag layouts need
        not match, and FSDP's sharded gradient norms need other rules (see the README).
        """
        if not active(group):
            return None
        if model is not None and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            logger.info("process group of %d ranks, but the model is not DistributedDataParallel: "
                        "each rank decides on its own flags", dist.get_world_size(group))
            return None
        return cls(device, group)

    # ------------------------------------------------------------------ the step's one read
    def reduce(self, packed: Tensor, layout: Layout) -> List[float]:
        """Gather every rank's packed step vector, combine on the host (a :data:`~.detect.flags.Reduce`).

        Every rank must put the same layout (same model, detectors and batch structure): the
        vectors are gathered position by position.

        Returns:
            The combined values, laid out as ``packed``.
        """
        n = packed.numel()
        out = packed.new_empty(self.world * n)
        self._gather(out, packed.contiguous(), group=self.group)  # the step's one collective
        flat = out.tolist()  # host sync: the step's one read, every rank's row
        rows = [flat[r * n:(r + 1) * n] for r in range(self.world)]
        key = tuple(layout)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # layouts that keep changing: do not grow without bound
                self._plans.clear()
            plan = self._plans[key] = _plan(layout)
        self._rows, self._layout = rows, key
        return _combine(rows, plan)

    def tripped_ranks(self) -> Dict[str, List[int]]:
        """For the last read, each kind that tripped on some rank's own values, with those ranks."""
        out: Dict[str, List[int]] = {}
        for r, row in enumerate(self._rows):
            for kind in parse_read(row, list(self._layout)).tripped():
                out.setdefault(kind, []).append(r)
        return out

    # ------------------------------------------------------------------ slow-path agreement
    def gather_int(self, value: int) -> List[int]:
        """Every rank's ``value``, in rank order (one small collective; slow path only)."""
        mine = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        out = torch.empty(self.world, dtype=torch.float64, device=self.device)
        self._gather(out, mine, group=self.group)
        return [int(v) for v in out.tolist()]  # host sync: slow path only

    def agree_finding(self, finding: Any, fallback: Callable[[], Any]) -> Any:
        """After a per-rank confirmation (an exact re-run): a finding on every rank if some rank
        confirmed one (``fallback()`` gives the unconfirmed one here), else ``None`` everywhere."""
        votes = self.gather_int(finding is not None)
        if not any(votes):
            return None
        return finding if finding is not None else fallback()

    def annotate(self, detail: Dict[str, Any], kind: str) -> Dict[str, Any]:
        """An anomaly event's detail with ``ranks``: which ranks' own values tripped (for ``kind``
        when it tripped, else every kind that did)."""
        ranks = self.tripped_ranks()
        return {**detail, "ranks": {kind: ranks[kind]} if kind in ranks else ranks}

    def agree_weights(self, finding: Any, empty: Callable[[Tuple[int, ...]], Any]) -> Any:
        """A weight finding on every rank when some rank has one, naming those ranks (``empty(ranks)``
        makes it where this rank's parameters are finite), else ``None`` everywhere."""
        ranks = tuple(r for r, v in enumerate(self.gather_int(finding is not None)) if v)
        if not ranks:
            return None
        return empty(ranks) if finding is None else dataclasses.replace(finding, ranks=ranks)

    def total(self, count: int) -> int:
        """The sum of ``count`` over ranks (one small collective)."""
        return sum(self.gather_int(count))

    def same_count(self, count: int) -> bool:
        """Whether every rank has the same ``count`` (micro-batches left to re-run, say)."""
        return len(set(self.gather_int(count))) == 1

    # ------------------------------------------------------------------ wrapping
    def wrap_store(self, store: Any) -> "DistributedStore":
        """The guard's snapshot store, made collective (see :class:`DistributedStore`)."""
        return DistributedStore(store, self)

    def wrap_replayer(self, replayer: Any, model: torch.nn.Module) -> "_AgreedReplayer":
        """The guard's replayer, run without DDP collectives and agreed on ``reproducible``."""
        return _AgreedReplayer(replayer, self, model)


def _plan(layout: Layout) -> List[Tuple[int, int, int]]:
    """``(start, end, rule)`` segments of the packed vector, adjacent equal rules merged."""
    plan: List[Tuple[int, int, int]] = []
    pos = 0
    for name, count, is_bool, _ in packed_order(layout):
        rule = _MEAN if name == "loss" else _SUM if is_bool or name in _SUMMED else _FIRST
        if plan and plan[-1][2] == rule and plan[-1][1] == pos:
            plan[-1] = (plan[-1][0], pos + count, rule)
        else:
            plan.append((pos, pos + count, rule))
        pos += count
    return plan


def _combine(rows: Sequence[List[float]], plan: Sequence[Tuple[int, int, int]]) -> List[float]:
    """Rank 0's row with: sums where counted, the mean loss, and any rank's non-finite value."""
    out = list(rows[0])
    others, world = rows[1:], len(rows)
    for start, end, rule in plan:
        if rule == _FIRST:
            for row in others:
                if math.isfinite(sum(row[start:end])):  # the usual case: one C-level sum per rank
                    continue
                for i in range(start, end):
                    if not math.isfinite(row[i]) and math.isfinite(out[i]):
                        out[i] = row[i]
        elif rule == _SUM:
            for i in range(start, end):
                out[i] = sum(row[i] for row in rows)
        else:  # mean, divided first so that large finite losses cannot overflow the sum
            for i in range(start, end):
                out[i] = sum(row[i] / world for row in rows)
    return out


class DistributedStore:
    """A snapshot store whose every decision is the same on all ranks.

    * ``save``: each rank checks its own state's finiteness; if any rank's is not finite the
      snapshot is refused everywhere (one collective). A memory store then saves per rank. A
      safetensors store is written by rank 0 only; the collective that follows is the barrier
      after which every rank may read the file (a failed write raises on every rank).
    * ``restore``: every rank restores (a safetensors store: from rank 0's file, the other ranks
      keeping their own random generators); then all check they restored the same step, and a
      rank that could not restore makes every rank raise.

    Anything else (``paths()``, ``directory``, ``latest()``...) is the wrapped store's.

    Args:
        store: a :class:`~safetrain.snapshot.MemoryStore` or :class:`~safetrain.snapshot.SafetensorsStore`.
        sync: the guard's :class:`DistributedSync`.
    """

    def __init__(self, store: Any, sync: DistributedSync) -> None:
        self.inner, self.sync = store, sync
        self.shared = isinstance(store, SafetensorsStore)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def close(self) -> None:
        """Close the wrapped store (no collective: a rank may close while others are gone)."""
        self.inner.close()

    def save(self, state: Any, counters: Any, extra: Any = None, extra_tensors: Any = None) -> Optional[SnapshotInfo]:
        """Take a snapshot on every rank or on none; see the class docstring."""
        self.inner._require_open("save")
        captured = state.capture(counters, extra, extra_tensors)
        bad = nonfinite((n, captured.tensors[n]) for n in captured.checked)  # host sync: snapshot steps only
        refused = self.sync.gather_int(len(bad))
        step = captured.meta["counters"]["step"]
        if any(refused):
            where = [r for r, n in enumerate(refused) if n]
            logger.warning("snapshot refused at step %d: non-finite state on rank(s) %s%s; keeping the previous "
                           "snapshot", step, where, f" (here: {', '.join(bad[:5])})" if bad else "")
            return None
        trusted = Captured(captured.tensors, captured.meta, [])  # already checked, on every rank
        if not self.shared:
            return self.inner._save(trusted)
        info, error = None, None
        if self.sync.rank == 0:
            try:
                info = self.inner._save(trusted)
            except SnapshotError as exc:
                error = exc
        failed = self.sync.gather_int(error is not None)[0]  # the barrier: rank 0's file is complete
        if error is not None:
            raise error
        if failed:
            raise SnapshotError(f"{self.inner.directory}: rank 0 could not write the snapshot of step {step}; "
                                "see rank 0's log")
        if info is None:
            paths = self.inner.paths()
            path = paths[-1] if paths else None
            info = make_info(captured.meta, captured.tensors, path, path or "", copy=lambda n, t: t.clone())
        return info

    def discard_newest(self) -> bool:
        """Drop the newest snapshot on every rank (a shared directory: rank 0 deletes, then a barrier)."""
        dropped = self.inner.discard_newest() if (not self.shared or self.sync.rank == 0) else True
        self.sync.gather_int(int(dropped))  # the barrier: no rank restores before the file is gone
        return dropped

    def restore(self, state: Any, older: int = 0) -> SnapshotInfo:
        """Restore on every rank, and check they all restored the same step; see the class docstring."""
        info: Optional[SnapshotInfo] = None
        error: Optional[SnapshotError] = None
        try:
            with keep_rng(self.shared and self.sync.rank != 0):
                info = self.inner.restore(state, older=older)
        except SnapshotError as exc:
            error = exc
        return _agree_restored(self.sync, info, error, "restore")


def _agree_restored(sync: DistributedSync, info: Optional[SnapshotInfo], error: Optional[Exception],
                    what: str) -> SnapshotInfo:
    steps = sync.gather_int(info.step if info is not None else -1)
    if error is not None:
        raise error
    if -1 in steps:
        raise SnapshotError(f"{what}: rank(s) {[r for r, s in enumerate(steps) if s == -1]} could not load a "
                            "snapshot (see their log); every rank stops")
    if len(set(steps)) != 1:
        raise SnapshotError(f"{what}: ranks loaded snapshots of different steps {steps}; a safetensors "
                            "snapshot directory must be shared by every rank")
    return info  # type: ignore[return-value]  # not None: no error and no rank failed


def load_snapshot(path: Any, state: Any) -> SnapshotInfo:
    """:func:`safetrain.snapshot.load_snapshot` for every rank (resume under ``torchrun``).

    Every rank reads the same file (rank 0's); ranks other than 0 keep their own random
    generators; then all check they loaded the same step. Without a process group (or for a
    model that is not DDP-wrapped) it is exactly :func:`safetrain.snapshot.load_snapshot`.

    Raises:
        SnapshotError: the file is unusable on some rank (then on every rank), or the ranks
            loaded different steps (directories not shared).
    """
    if not active() or not isinstance(state.model, torch.nn.parallel.DistributedDataParallel):
        return _load_snapshot(path, state)
    sync = DistributedSync(_device_of(state))
    info, error = None, None
    try:
        with keep_rng(sync.rank != 0):
            info = _load_snapshot(path, state)
    except SnapshotError as exc:
        error = exc
    return _agree_restored(sync, info, error, f"{os.fspath(path)}: resume")


def _device_of(state: Any) -> torch.device:
    return next((p.device for p in state.model.parameters()), torch.device("cpu"))


class _AgreedReplayer:
    """The guard's replayer, run under :func:`local` and agreed on ``reproducible`` across ranks.

    A rank whose own data was clean replays a finite step: on its own it would call the fault
    transient and retry while the others take the ladder. Here the fault is reproducible if it
    reproduced on any rank, and a ``weights`` fault if some rank's parameters were non-finite
    before the step; an error in some rank's replay is raised on every rank.
    """

    def __init__(self, inner: Any, sync: DistributedSync, model: torch.nn.Module) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_sync", sync)
        object.__setattr__(self, "_model", model)

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def replay(self, *args: Any, **kwargs: Any) -> Any:
        """Replay locally, then agree: reproducible if it reproduced on some rank, a ``weights``
        fault if some rank's parameters were non-finite before the step."""
        diagnosis, error = None, None
        try:
            with local(self._model):
                diagnosis = self._inner.replay(*args, **kwargs)
        except Exception as exc:  # re-raised below, after every rank has voted
            error = exc
        vote = 4 if error is not None else int(bool(diagnosis.reproducible)) | (2 if diagnosis.kind == "weights" else 0)
        votes = self._sync.gather_int(vote)
        if error is not None:
            raise error
        if 4 in votes:
            raise RuntimeError(f"the replay failed on rank(s) {[r for r, v in enumerate(votes) if v == 4]}; "
                               "see their log")
        if any(v & 2 for v in votes) and diagnosis.kind != "weights":
            diagnosis = dataclasses.replace(diagnosis, reproducible=True, kind="weights", note="non-finite "
                                            f"parameters on rank(s) {[r for r, v in enumerate(votes) if v & 2]}")
        elif any(votes) and not diagnosis.reproducible:
            diagnosis = dataclasses.replace(diagnosis, reproducible=True,
                                            note=f"reproduced on rank(s) {[r for r, v in enumerate(votes) if v]}")
        return diagnosis
