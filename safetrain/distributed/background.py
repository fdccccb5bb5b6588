"""``snapshot.async_save``: a sharded snapshot written in the background with DCP's ``async_save``.

``save`` returns once every tensor is staged (copied to CPU memory by the storage writer,
DCP's ``HuggingFaceStorageWriter``: no pickle); the shards are then written by DCP's thread,
and a thread of ours waits for them, checksums the files and has rank 0 write the completion
mark (:func:`.mark.write_mark`): the mark is written only once the data is on disk, so a
kill during the background write leaves an incomplete directory, ignored on load.

The background collectives (DCP's plan and finish, the checksum gather) run on a process group
of their own (gloo, made once at construction, a collective), so they never interleave with the
step's collectives on the default group. One save is in flight at a time: :meth:`wait` is called
before the next save, before any restore or load, and at close.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import torch

from .mark import write_mark

__all__ = ["BackgroundSaves", "GroupSync"]

logger = logging.getLogger(__name__)


class GroupSync:
    """``rank``, ``world`` and ``gather_int`` over a process group (CPU tensors: gloo)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group, self.device = group, torch.device("cpu")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def gather_int(self, value: int) -> List[int]:
        """Every rank's ``value``, in rank order."""
        import torch.distributed as dist

        out = torch.empty(self.world, dtype=torch.float64)
        dist.all_gather_into_tensor(out, torch.tensor([float(value)], dtype=torch.float64), group=self.group)
        return [int(v) for v in out.tolist()]


class BackgroundSaves:
    """Sharded saves in the background, one in flight at a time (every method a collective
    when a process group is active: every rank calls it)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.sync: Optional[GroupSync] = GroupSync(self.group) if self.group is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safetrain-snapshot")
        self._pending: Optional[Future] = None
        self.step: Optional[int] = None  # the step of the save in flight (or just finished)

    def start(self, snap: str, tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], run_id: str) -> None:
        """Stage ``tensors`` (returns once they are copied) and write them to ``snap`` in the
        background, then the completion mark; ``meta`` holds ``counters`` and ``created``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        if self._pending is not None:
            raise RuntimeError("BackgroundSaves.start: a save is still in flight; wait() first")
        writer = HuggingFaceStorageWriter(snap, save_distributed=True)
        upload = dcp.async_save(tensors, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        mark = {"counters": dict(meta["counters"]), "created": meta["created"]}

        def finish() -> None:
            upload.result()  # every rank's shards on disk (DCP's finish ran on this group)
            write_mark(snap, mark, self.sync, run_id)

        self.step = int(mark["counters"]["step"])
        self._pending = self._pool.submit(finish)

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def wait(self) -> Optional[BaseException]:
        """Wait for the save in flight; its error (``None``: written, or none in flight)."""
        future, self._pending = self._pending, None
        if future is None:
            return None
        try:
            future.result()
        except Exception as exc:  # DCP raises its own types; the caller votes and raises SnapshotError
            return exc
        return None

    def close(self) -> None:
        """Stop the thread (after :meth:`wait`)."""
        self._pool.shutdown(wait=True)
