"""Sharded snapshots on disk for FSDP2, the writer: one directory per snapshot (its layout in
:mod:`.snapdir`), written with ``torch.distributed.checkpoint`` (DCP) by every rank, no pickle anywhere.

Every rank writes its JSON part, then its tensors (DCP's ``HuggingFaceStorageWriter`` with
``save_distributed=True``); once every rank's files are on disk, rank 0 writes the completion
mark with a checksum of every other file (:mod:`.mark`, :mod:`.verify`), checked before any
load: a damaged snapshot is refused and an older one used. A directory without the mark is
never loaded, and its run removes it at its next save. (DCP's default ``FileSystemWriter``
pickles its ``.metadata`` file and writes tensors with ``torch.save``; neither is used here.)
With ``snapshot.async_save`` the tensors are staged and written in the background (:mod:`.background`).

Loading (:mod:`.loading`) reads the tensors with DCP's ``HuggingFaceStorageReader`` into the
live state (DCP reshards: the number of ranks may differ), then ``set_state_dict``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, List, Optional

from ..errors import SnapshotError
from ..rundir.safefile import real_dir, remove_tree
from ..snapshot.codec import encode
from ..snapshot.store import SnapshotInfo, SnapshotStore, make_info, run_of
from ..snapshot.tensors import nonfinite
from .background import BackgroundSaves
from .loading import load_sharded
from .mark import write_mark
from .snapdir import (
    MARK,
    dcp_modules,
    flat_state,
    rank_path,
    read_json,
    sharded_snapshots,
    step_dir,
    step_of,
    write_json,
)

__all__ = ["ShardedStore", "save_sharded"]

logger = logging.getLogger(__name__)

_MINE = ("model/", "optim/state/")  # captured tensors that DCP writes from get_state_dict instead


def save_sharded(snap: str, state: Any, captured: Any, sync: Any, run_id: str, background: Any = None) -> None:
    """Every rank: write this rank's JSON part and its tensors (a collective), checksum a share
    of the files (:mod:`.verify`); rank 0 then writes the completion mark with every checksum.
    With ``background`` (:class:`.background.BackgroundSaves`), the tensors are staged and the
    rest happens in the background."""
    dcp, _ = dcp_modules()
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    rank, world = getattr(sync, "rank", 0), getattr(sync, "world", 1)
    real_dir(snap)  # a link planted in its place is refused: DCP's files would go through it
    tensors, optim = flat_state(state)
    own = {n: t for n, t in captured.tensors.items() if not n.startswith(_MINE)}
    optim_json = encode(optim, "optim_json", lambda n, t: own.__setitem__(n, t.detach()))
    specs = {n: [list(t.shape), str(t.dtype)] for n, t in own.items()}
    meta = {k: v for k, v in captured.meta.items() if k not in ("model", "optimizer")}
    meta["accepted"] = captured.meta["model"].get("accepted", {})  # buffers non-finite by design (a resume keeps them)
    inner = state.optimizer.optimizer  # the user's optimizer (the state holds a LocalOptimizer around it)
    meta["optimizer_type"] = f"{type(inner).__module__}.{type(inner).__qualname__}"  # for safetrain inspect
    write_json(rank_path(snap, rank), {**meta, "run_id": run_id, "world": world, "optim": optim_json, "own": specs})
    tensors.update({f"rank{rank}/{n}": t.contiguous() for n, t in own.items()})
    if background is not None:
        return background.start(snap, tensors, captured.meta, run_id)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(snap, save_distributed=True))  # ends with a barrier
    write_mark(snap, captured.meta, sync, run_id)


class ShardedStore(SnapshotStore):
    """``snapshot.store: safetensors`` under FSDP2: a sharded snapshot directory per save, every
    rank writing its shards (see the module docstring). Every method is a collective: all ranks call it.

    Args:
        directory: the snapshot directory, shared by every rank (one node or a shared file system).
        keep: complete snapshots of this run kept.
        sync: the guard's sync (``gather_int`` votes; ``None`` in one process).
        run_id: the run this store belongs to.
        overwrite: a fresh run deletes another run's snapshots instead of refusing the directory.
        async_save: save in the background (:mod:`.background`), awaited before the next save,
            any restore or look at the snapshots, and at close.
    """

    def __init__(
        self,
        directory: str,
        keep: int,
        sync: Any,
        run_id: Optional[str] = None,
        overwrite: bool = False,
        async_save: bool = False,
    ):
        super().__init__(keep, run_id)
        self.directory, self.sync, self.overwrite = os.fspath(directory), sync, overwrite
        self.rank, self.world = getattr(sync, "rank", 0), getattr(sync, "world", 1)
        self._ids = {self.run_id}
        os.makedirs(self.directory, exist_ok=True)
        self.background = BackgroundSaves() if async_save else None

    def _vote(self, value: int) -> List[int]:
        gather = getattr(self.sync, "gather_int", None)
        return gather(value) if gather is not None else [value]

    def _run(self, snap: str) -> Optional[str]:
        try:
            return run_of(read_json(os.path.join(snap, MARK)))
        except SnapshotError:
            return None

    def paths(self) -> List[str]:
        """Complete snapshot directories of every run, oldest step first."""
        return sharded_snapshots(self.directory)

    def own_paths(self) -> List[str]:
        """This run's complete snapshot directories, oldest step first."""
        return [p for p in self.paths() if self._run(p) in self._ids]

    def foreign(self) -> List[str]:
        """Complete snapshots of other runs in the directory."""
        return [p for p in self.paths() if self._run(p) not in self._ids]

    def check_fresh(self) -> List[str]:
        """Refuse a directory holding another run's snapshots (``overwrite``: delete them)."""
        others = self.foreign()
        if others and not self.overwrite:
            raise SnapshotError(
                f"{self.directory}: holds {len(others)} sharded snapshot(s) of another run; continue it with "
                "fit(..., resume=DIR), use a new directory, or set snapshot.overwrite: true"
            )
        self._vote(0)  # every rank has looked before rank 0 deletes
        if self.rank == 0:
            for path in others:
                remove_tree(path)
        self._vote(0)
        return others

    def _adopt(self, run_id: Optional[str]) -> None:
        self._ids.add(run_id)

    def save(self, state: Any, counters: Any, extra: Any = None, extra_tensors: Any = None) -> Optional[SnapshotInfo]:
        """A snapshot on every rank or on none: each rank's finiteness is voted on first (one
        collective), then every rank writes its shards; ``None`` when refused."""
        self._require_open("save")
        self.drain()
        captured = state.capture(counters, extra, extra_tensors)
        bad = nonfinite(((n, captured.tensors[n]) for n in captured.checked), captured.accepted)  # host sync: snapshots
        refused = self._vote(len(bad))
        step = captured.meta["counters"]["step"]
        if any(refused):
            where = [r for r, n in enumerate(refused) if n]
            self.refused = tuple(bad) or ("(on another rank)",)
            logger.warning(
                "snapshot refused at step %d: non-finite state on rank(s) %s; keeping the previous one", step, where
            )
            return None
        self._live = state  # get_state_dict reads the live model and optimizer
        return self._save(captured)

    def _save(self, captured: Any) -> Optional[SnapshotInfo]:
        step = captured.meta["counters"]["step"]
        snap = step_dir(self.directory, step)
        if self.rank == 0:
            self._clean(snap)
        self._vote(0)  # the directory is empty before any rank writes into it
        failed = 0
        try:
            save_sharded(snap, self._live, captured, self.sync, self.run_id, self.background)
        except (OSError, SnapshotError, RuntimeError) as exc:
            failed = 1
            logger.error("%s: cannot write this rank's part of the snapshot: %s", snap, exc)
        if any(self._vote(failed)):
            raise SnapshotError(f"{snap}: the sharded snapshot of step {step} was not written (see the ranks' logs)")
        self._passed.discard(snap)
        if self.background is None:
            self._finished(step)
        extra = {n: t.clone() for n, t in captured.tensors.items() if n.startswith("extra/")}
        return make_info({**captured.meta, "run_id": self.run_id}, extra, snap, snap)

    def _finished(self, step: int) -> None:
        """The snapshot of ``step`` is complete on disk: rank 0 rotates."""
        if self.rank == 0:
            self._rotate(step)
        self._vote(0)

    def drain(self) -> None:
        """``async_save``: wait for the save in flight (every rank), then rotate.

        Raises:
            SnapshotError: the background save failed on some rank (its directory stays
                incomplete: never loaded, removed at the next save).
        """
        if self.background is None or not self.background.pending:
            return
        error = self.background.wait()
        if error is not None:
            logger.error("the background save of step %s failed on this rank: %s", self.background.step, error)
        if any(self._vote(int(error is not None))):
            raise SnapshotError(f"{self.directory}: the background save of step {self.background.step} failed")
        self._finished(self.background.step)  # type: ignore[arg-type]

    def _usable(self) -> List[Any]:
        self.drain()  # a restore, a look at the snapshots: the save in flight is complete first
        return super()._usable()

    def _close(self) -> None:
        if self.background is not None:
            try:
                self.drain()
            except SnapshotError as exc:
                logger.error("%s", exc)
            self.background.close()

    def _clean(self, snap: str) -> None:
        """Rank 0: clear ``snap`` and this run's incomplete directories (a save that was cut short)."""
        if os.path.islink(snap) or (os.path.lexists(snap) and not os.path.isdir(snap)):
            remove_tree(snap)  # a link or file planted in its place: the link only, never what it points to
        for path in sharded_snapshots(self.directory, complete=False):
            if os.path.isfile(os.path.join(path, MARK)) and path != snap:
                continue
            try:
                run = read_json(rank_path(path, 0)).get("run_id")
            except SnapshotError:
                run = None
            if path == snap or run in self._ids:
                logger.info("removing %s: an incomplete snapshot of this run", path)
                remove_tree(path)

    def _rotate(self, step: int) -> None:
        own = self.own_paths()
        doomed = [p for p in own if step_of(p) > step]  # rolled back
        usable = [p for p in own if p not in doomed and p not in self._passed]
        doomed += usable[: max(0, len(usable) - self.keep)]
        for path in doomed:
            self._passed.discard(path)
            remove_tree(path)

    def _candidates(self) -> Iterable[str]:
        return list(reversed(self.own_paths()))

    def _restore(self, snap: str, state: Any) -> SnapshotInfo:
        return load_sharded(snap, state, self.sync)

    def _info(self, snap: str) -> SnapshotInfo:
        meta = read_json(rank_path(snap, 0))
        return make_info({**meta, "extra_tensors": []}, {}, snap, snap)

    def restore(self, state: Any, older: int = 0) -> SnapshotInfo:
        """Restore on every rank (newest usable first), then check that every rank restored the same step."""
        info, error = None, None
        try:
            info = super().restore(state, older)
        except SnapshotError as exc:
            error = exc
        steps = self._vote(info.step if info is not None else -1)
        if error is not None:
            raise error
        if len(set(steps)) != 1:
            raise SnapshotError(f"{self.directory}: ranks restored different steps {steps}; every rank stops")
        return info  # type: ignore[return-value]

    def _set_aside(self, snap: str) -> None:
        """A damaged snapshot (every rank agreed): rank 0 renames it ``step-*.corrupt``, never tried again."""
        self._vote(0)
        if self.rank == 0:
            try:
                os.replace(snap, snap + ".corrupt")
                logger.warning("set aside damaged snapshot as %s.corrupt", snap)
            except OSError:
                pass
        self._vote(0)

    def _discard(self, snap: str) -> None:
        self._vote(0)
        if self.rank == 0:
            remove_tree(snap)
        self._vote(0)

    def _where(self) -> str:
        return self.directory
