"""Snapshots under a process group: every rank saves and restores together (a finiteness vote;
rank 0 writes the safetensors file, every rank reads it) and resume agrees on the step."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Optional

from ..errors import SnapshotError
from ..snapshot import SafetensorsStore, SnapshotInfo
from ..snapshot.state import Captured
from ..snapshot.store import make_info
from ..snapshot.tensors import nonfinite
from .group import keep_rng

if TYPE_CHECKING:
    from .sync import DistributedSync

__all__ = ["DistributedStore", "wrap_store", "agree_restored"]

logger = logging.getLogger(__name__)


def wrap_store(store: Any, sync: Any) -> Any:
    """The guard's snapshot store for ``sync``: as it is when the rank steps alone
    (:class:`~.sync.LocalSync`), else made collective (:class:`DistributedStore`)."""
    return store if sync.steps_alone else DistributedStore(store, sync)


class DistributedStore:
    """A snapshot store whose every decision is the same on all ranks.

    * ``save``: each rank checks its own state's finiteness; if any rank's is not finite the
      snapshot is refused everywhere (one collective). A memory store then saves per rank. A
      safetensors store is written by rank 0 only; the collective that follows is the barrier
      after which every rank may read the file (a failed write raises on every rank).
    * ``restore``: every rank restores (a safetensors store: from rank 0's file, the other ranks
      keeping their own random generators); then all check they restored the same step, and a
      rank that could not restore makes every rank raise.

    So the memory store keeps one ring per rank; the safetensors store is written by rank 0 only
    and read by every rank. That file holds rank 0's random generators: on restore and resume the
    other ranks keep their own (see :func:`~safetrain.distributed.keep_rng`).

    Anything else (``paths()``, ``directory``, ``latest()``...) is the wrapped store's.

    Args:
        store: a :class:`~safetrain.snapshot.MemoryStore` or :class:`~safetrain.snapshot.SafetensorsStore`.
        sync: the guard's :class:`DistributedSync`.
    """

    def __init__(self, store: Any, sync: "DistributedSync") -> None:
        self.inner, self.sync = store, sync
        self.shared = isinstance(store, SafetensorsStore)
        if self.shared and re.fullmatch(r"[0-9a-f]{32}", store.run_id):
            # rank 0 writes the files: every rank's store belongs to rank 0's run (4 x 32 bits)
            parts = [sync.gather_int(int(store.run_id[i : i + 8], 16))[0] for i in range(0, 32, 8)]
            store.run_id = "".join(f"{p:08x}" for p in parts)
            store._ids.add(store.run_id)

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
        bad = nonfinite(((n, captured.tensors[n]) for n in captured.checked), captured.accepted)  # host sync: snapshots
        refused = self.sync.gather_int(len(bad))
        step = captured.meta["counters"]["step"]
        if any(refused):
            where = [r for r, n in enumerate(refused) if n]
            self.inner.refused = tuple(bad) or ("(on another rank)",)
            logger.warning(
                "snapshot refused at step %d: non-finite state on rank(s) %s%s; keeping the previous snapshot",
                step,
                where,
                f" (here: {', '.join(bad[:5])})" if bad else "",
            )
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
            raise SnapshotError(
                f"{self.inner.directory}: rank 0 could not write the snapshot of step {step}; see rank 0's log"
            )
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
        return agree_restored(self.sync, info, error, "restore")


def agree_restored(
    sync: "DistributedSync", info: Optional[SnapshotInfo], error: Optional[Exception], what: str
) -> SnapshotInfo:
    steps = sync.gather_int(info.step if info is not None else -1)
    if error is not None:
        raise error
    if -1 in steps:
        raise SnapshotError(
            f"{what}: rank(s) {[r for r, s in enumerate(steps) if s == -1]} could not load a "
            "snapshot (see their log); every rank stops"
        )
    if len(set(steps)) != 1:
        raise SnapshotError(
            f"{what}: ranks loaded snapshots of different steps {steps}; a safetensors "
            "snapshot directory must be shared by every rank"
        )
    return info  # type: ignore[return-value]  # not None: no error and no rank failed
