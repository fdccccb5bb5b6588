"""Resume under a process group: every rank loads the same snapshot file and agrees on its step."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import SnapshotError
from ..snapshot import SnapshotInfo
from ..snapshot import load_snapshot as _load_snapshot
from .checkpoint import resume_sharded
from .group import active, keep_rng
from .sharding import ShardedState
from .store import agree_restored
from .sync import DistributedSync

__all__ = ["load_snapshot"]


def load_snapshot(path: Any, state: Any) -> SnapshotInfo:
    """:func:`safetrain.snapshot.load_snapshot` for every rank (resume under ``torchrun``).

    Every rank reads the same file (rank 0's); ranks other than 0 keep their own random
    generators; then all check they loaded the same step. Without a process group (or for a
    model that is not DDP-wrapped) it is exactly :func:`safetrain.snapshot.load_snapshot`. An
    FSDP2 model's state is read from a sharded snapshot directory (:mod:`.checkpoint`).

    Raises:
        SnapshotError: the file is unusable on some rank (then on every rank), the ranks
            loaded different steps (directories not shared).
    """
    if isinstance(state, ShardedState):  # a sharded snapshot directory (DCP), read by every rank
        return resume_sharded(path, state, DistributedSync(_device_of(state)) if active() else None)
    if not active() or not isinstance(state.model, torch.nn.parallel.DistributedDataParallel):
        return _load_snapshot(path, state)
    sync = DistributedSync(_device_of(state))
    info, error = None, None
    try:
        with keep_rng(sync.rank != 0):
            info = _load_snapshot(path, state)
    except SnapshotError as exc:
        error = exc
    return agree_restored(sync, info, error, f"{os.fspath(path)}: resume")


def _device_of(state: Any) -> torch.device:
    return next((p.device for p in state.model.parameters()), torch.device("cpu"))
