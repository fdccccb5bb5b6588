"""The guard's sync: one object whose methods make a step's read and slow-path decisions agree
across ranks (:class:`DistributedSync`, one collective inside the step's one read) or, in one
process, return their input at no cost (:class:`LocalSync`).

The sync is only the collective: the guard's parts that must agree too are made so by factories
that take it (:func:`.replay.wrap_replayer`, :func:`.store.wrap_store`), and the slow paths
that run on one rank's own (the weight replay, the quarantine) ask it :attr:`LocalSync.steps_alone`
and :attr:`LocalSync.rank`, never the process: a plain model in a process group made for
another reason has a :class:`LocalSync`."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..adapters.compiled import plain_namer
from ..detect.flags import Layout, packed_order, parse_read
from .group import active, rank
from .sharding import DDP, FSDP2, layout_of

__all__ = ["LocalSync", "DistributedSync", "make_sync", "from_rank0"]

logger = logging.getLogger(__name__)

_FIRST, _SUM, _MEAN, _HYPOT = 0, 1, 2, 3
#: Floating values that are counts, not magnitudes: summed over ranks like bool flags.
_SUMMED = frozenset({"found_inf"})
#: Under FSDP2, norms of each rank's shard: the whole tensor's norm is the root of their summed squares.
_SHARDED = frozenset({"grad_norms", "total_norm"})


class LocalSync:
    """One process: every agreement is the rank's own answer, at no cost (the same methods as
    :class:`DistributedSync`, so the guard never branches on being distributed)."""

    world = 1
    #: A rank's steps and slow paths are its own: it may skip a step (an empty batch), replay
    #: updates or quarantine samples with no other rank waiting in a collective.
    steps_alone = True
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

    def agree_gradient(self, finding: Any) -> Any:
        """This rank's gradient finding."""
        return finding

    def total(self, count: int) -> int:
        """This rank's ``count``."""
        return count

    def same_count(self, count: int) -> bool:
        """One rank always agrees with itself."""
        return True

    def gather_object(self, obj: Any) -> List[Any]:
        """``[obj]``: this rank's object, the only one."""
        return [obj]


def make_sync(device: torch.device, model: Optional[torch.nn.Module] = None) -> "LocalSync | DistributedSync":
    """The guard's sync: a :class:`DistributedSync` under a process group of more than one rank
    with a DDP or FSDP2 model, else a :class:`LocalSync`.

    Raises:
        SafetrainError: a model spread in a way safetrain does not handle (see :func:`layout_of`).
    """
    sync = DistributedSync.from_environment(device, model)
    return sync if sync is not None else LocalSync(rank())


def from_rank0(value: Any, model: Optional[torch.nn.Module] = None) -> Any:
    """Rank 0's ``value`` on every rank of a run whose ranks step together (a DDP or FSDP2 ``model``
    under a process group of more than one rank: one ``broadcast_object_list``); ``value`` itself
    otherwise (one process, or a plain model whose ranks each run alone). For what only rank 0
    learns before the guard exists (whether it holds the run directory's lock)."""
    if not active() or (model is not None and layout_of(model) not in (DDP, FSDP2)):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class DistributedSync:
    """Combines one step's flags across ranks, and makes slow-path decisions collectively.

    * **One collective inside the one sync.** :meth:`DistributedSync.reduce` is the
      :class:`~safetrain.detect.StepFlags` hook: one ``all_gather`` of the packed step vector, one
      ``tolist()`` of every rank's row, combined on the host: a check value (a bool flag, an input
      sum, an activation sum, ``found_inf``) trips everywhere when it trips on any rank, ``loss`` is
      the mean over ranks (so the spike detector sees the same number everywhere), and the gradient
      norms and the scaler's scale are rank 0's (identical after DDP's all-reduce; a non-finite value
      on any rank still wins). Under FSDP2 (``sharded``) each rank's gradient norms are of its own
      shards: combined as the root of their summed squares, the whole gradient's norm. Each rank's
      own row is kept, so the journal can say which ranks
      tripped (:meth:`DistributedSync.tripped_ranks`).
    * **Slow paths agree.** A decision that a rank makes from its own data (an exact forward re-run,
      a replay, the rows left after ``drop_rows``, a snapshot's finiteness, a restore) is combined
      with one small collective that every rank enters, so no rank is left waiting; re-runs for
      diagnosis run under :func:`~safetrain.distributed.local`, with no DDP collective at all.

    Args:
        device: where the slow-path agreement tensors live (the model's CUDA device with NCCL;
            the CPU with gloo).
        group: the process group (``None``: the default group).

    Example::

        >>> sync = DistributedSync.from_environment(torch.device("cpu"))  # None: not distributed
        >>> flags = StepFlags(reduce=sync.reduce if sync else None)       # doctest: +SKIP
    """

    #: Every rank must run every step (the step's read is a collective), and every slow-path
    #: decision is taken by every rank together.
    steps_alone = False

    def __init__(
        self, device: torch.device, group: Any = None, *, sharded: bool = False, names: Sequence[str] = ()
    ) -> None:
        self.group = group
        #: FSDP2: the gradient norms are of each rank's shard, combined as a root of summed squares.
        self.sharded = sharded
        #: The model's parameter and buffer names (the same on every rank), for weight findings.
        self.names: Tuple[str, ...] = tuple(names)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        self.device = device if device.type != "cpu" and backend != "gloo" else torch.device("cpu")
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._plans: Dict[Tuple[Any, ...], List[Tuple[int, int, int]]] = {}
        self._rows: List[List[float]] = []
        self._layout: Tuple[Any, ...] = ()

    @classmethod
    def from_environment(
        cls, device: torch.device, model: Optional[torch.nn.Module] = None, group: Any = None
    ) -> Optional["DistributedSync"]:
        """A sync when ``group`` has more than one rank and ``model`` is DDP-wrapped or FSDP2
        (``fully_shard``), else ``None``.

        A plain model in a process group (independent runs) keeps per-rank decisions: its ranks'
        flag layouts need not match. A model spread in another way is refused (:func:`layout_of`).
        """
        layout = layout_of(model) if model is not None else DDP
        if not active(group):
            return None
        if layout not in (DDP, FSDP2):
            logger.info(
                "process group of %d ranks, but the model is not DistributedDataParallel: "
                "each rank decides on its own flags",
                dist.get_world_size(group),
            )
            return None
        if model is None:
            return cls(device, group)
        plain = plain_namer(model)  # the names the weight findings use (no torch.compile segment)
        names = [plain(n) for n, _ in model.named_parameters()] + [plain(n) for n, _ in model.named_buffers()]
        return cls(device, group, sharded=layout == FSDP2, names=names)

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
        rows = [flat[r * n : (r + 1) * n] for r in range(self.world)]
        key = tuple(layout)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # layouts that keep changing: do not grow without bound
                self._plans.clear()
            plan = self._plans[key] = _plan(layout, self.sharded)
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
        agreed = empty(ranks) if finding is None else dataclasses.replace(finding, ranks=ranks)
        return self._all_counts(agreed, finding) if self.names else agreed

    def _all_counts(self, agreed: Any, finding: Any) -> Any:
        """Every rank's NaN/Inf counts per parameter (one small collective, slow path only), so that
        every rank's finding, rank 0's journal among them, names the same parameters: summed under
        FSDP2 (each rank counts its shards), the largest replica's under DDP (each rank counts a
        whole copy)."""
        index = {n: i for i, n in enumerate(self.names)}
        mine = torch.zeros(2 * len(self.names), dtype=torch.float64, device=self.device)
        strays = []
        for name, nan, inf in getattr(finding, "counts", ()) or ():
            if name in index:
                mine[2 * index[name]], mine[2 * index[name] + 1] = float(nan), float(inf)
            else:
                strays.append((name, nan, inf))
        out = torch.empty(self.world * mine.numel(), dtype=torch.float64, device=self.device)
        self._gather(out, mine, group=self.group)
        per_rank = out.view(self.world, len(self.names), 2)
        total = (per_rank.sum(0) if self.sharded else per_rank.amax(0)).tolist()  # host sync: slow path only
        counts = [(n, int(c[0]), int(c[1])) for n, c in zip(self.names, total) if c[0] or c[1]] + strays
        return dataclasses.replace(agreed, nonfinite=tuple(n for n, _, _ in counts), counts=tuple(counts))

    def agree_gradient(self, finding: Any) -> Any:
        """Under FSDP2, a ``gradient`` finding on every rank when some rank's shard holds NaN/Inf
        (a rank whose own shard is finite would call an Inf norm an overflow, ``grad_norm``); one
        small collective. Under DDP the gradients are the same everywhere: the finding as it is."""
        if not self.sharded:
            return finding
        votes = self.gather_int(finding.kind == "gradient")
        if any(votes) and finding.kind != "gradient":
            return dataclasses.replace(finding, kind="gradient")
        return finding

    def total(self, count: int) -> int:
        """The sum of ``count`` over ranks (one small collective)."""
        return sum(self.gather_int(count))

    def same_count(self, count: int) -> bool:
        """Whether every rank has the same ``count`` (micro-batches left to re-run, say)."""
        return len(set(self.gather_int(count))) == 1

    def gather_object(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` (JSON-like: it is pickled for the wire), in rank order (one
        ``all_gather_object``; slow path only)."""
        out: List[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _plan(layout: Layout, sharded: bool = False) -> List[Tuple[int, int, int]]:
    """``(start, end, rule)`` segments of the packed vector, adjacent equal rules merged;
    ``sharded`` (FSDP2): the gradient norms are each rank's shard's, combined as a root of
    summed squares."""
    plan: List[Tuple[int, int, int]] = []
    pos = 0
    for name, count, is_bool, _ in packed_order(layout):
        rule = _MEAN if name == "loss" else _SUM if is_bool or name in _SUMMED else _FIRST
        if sharded and name in _SHARDED:
            rule = _HYPOT
        if plan and plan[-1][2] == rule and plan[-1][1] == pos:
            plan[-1] = (plan[-1][0], pos + count, rule)
        else:
            plan.append((pos, pos + count, rule))
        pos += count
    return plan


def _combine(rows: Sequence[List[float]], plan: Sequence[Tuple[int, int, int]]) -> List[float]:
    """Rank 0's row with: sums where counted, the mean loss, roots of summed squares for sharded
    norms, and any rank's non-finite value."""
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
        elif rule == _HYPOT:  # squares of float32 norms fit a Python float; NaN/Inf stay so
            for i in range(start, end):
                out[i] = math.sqrt(sum(row[i] * row[i] for row in rows))
        elif rule == _SUM:
            for i in range(start, end):
                out[i] = sum(row[i] for row in rows)
        else:  # mean, divided first so that large finite losses cannot overflow the sum
            for i in range(start, end):
                out[i] = sum(row[i] / world for row in rows)
    return out
