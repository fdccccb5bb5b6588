"""Resume under a process group: every rank loads the same snapshot file and agrees on its step."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from ..errors import SnapshotError
from ..snapshot import SnapshotInfo
from ..snapshot import load_snapshot as _load_snapshot
from ..snapshot.store import CorruptSnapshotError
from .group import active, keep_rng
from .loading import load_sharded
from .sharding import ShardedState
from .snapdir import MARK, sharded_snapshots
from .store import agree_restored
from .sync import DistributedSync

__all__ = ["load_snapshot", "resume_sharded"]

logger = logging.getLogger(__name__)


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


def resume_sharded(path: Any, state: Any, sync: Any) -> SnapshotInfo:
    """Every rank: load the sharded snapshot ``path`` (a ``step-*`` directory), or the newest
    complete one of a snapshot directory that verifies, and agree on its step.

    In a directory, a snapshot that is damaged (a file fails its checksum: every rank agrees) is
    passed over with a warning, left in place, and listed in the result's ``passed_over``; the
    next older one is tried, as :func:`safetrain.snapshot.load_snapshot` does for files.

    Raises:
        SnapshotError: no usable complete sharded snapshot there, or it does not fit the live state.
    """
    path = os.fspath(path)
    single = os.path.isfile(os.path.join(path, MARK))
    candidates = [path] if single else list(reversed(sharded_snapshots(path)))
    gather = getattr(sync, "gather_int", lambda v: [v])
    if not candidates:
        raise SnapshotError(f"{path}: no complete sharded snapshot (step-*/ with {MARK}) here")
    failures = []
    for snap in candidates:
        info, error = None, None
        try:
            info = load_sharded(snap, state, sync)
        except SnapshotError as exc:
            error = exc
        corrupt = isinstance(error, CorruptSnapshotError)
        steps = gather(info.step if info is not None else (-1 if corrupt else -2))
        if -2 not in steps and -1 in steps and not single:  # damaged (every rank agrees): the next older one
            why = str(error) if error is not None else f"{snap}: damaged on rank {steps.index(-1)}"
            logger.warning("snapshot unusable, trying an older one: %s", why)
            failures.append((snap, why[len(snap) + 2 :] if why.startswith(f"{snap}: ") else why))
            continue
        if error is not None:
            raise error
        if len(set(steps)) != 1:
            raise SnapshotError(f"{path}: resume: ranks loaded different steps {steps}")
        if failures:
            logger.warning("resumed from %s, passing over %d newer snapshot(s)", snap, len(failures))
        return dataclasses.replace(info, passed_over=tuple(failures))  # type: ignore[arg-type]
    raise SnapshotError(f"{path}: no usable sharded snapshot; " + "; ".join(f"{p}: {w}" for p, w in failures))
