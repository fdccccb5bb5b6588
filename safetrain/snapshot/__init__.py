"""Snapshots of the whole training state, in memory or as safetensors files, without pickle.

A :class:`TrainState` names what is captured (model, optimizer, scheduler, scaler, RNGs); a
store (:class:`MemoryStore`, :class:`SafetensorsStore`, or :func:`make_store` from the config)
takes snapshots, refusing non-finite state, and restores the newest usable one.
:func:`load_snapshot` resumes from a file or directory; :func:`inspect_snapshot` describes a file.
Cost: each snapshot copies and checks the whole state, so the guard takes one every
``snapshot.every`` healthy steps. Used by ``guard``, ``distributed`` and ``trainer``; builds on
``config``, ``errors``, ``rundir`` and ``wrappers`` only. An example: :class:`SnapshotStore`.
"""

from __future__ import annotations

from .disk import SafetensorsStore, list_snapshots, load_snapshot
from .inspection import format_directory, format_inspection, inspect_directory, inspect_snapshot
from .make import SnapshotConfigError, make_store
from .memory import MemoryStore
from .state import TrainState
from .store import CorruptSnapshotError, SnapshotInfo, SnapshotStore, StoreState
from .tensors import nonfinite

__all__ = [
    "TrainState",
    "SnapshotInfo",
    "SnapshotStore",
    "StoreState",
    "MemoryStore",
    "SafetensorsStore",
    "make_store",
    "load_snapshot",
    "list_snapshots",
    "inspect_snapshot",
    "format_inspection",
    "inspect_directory",
    "format_directory",
    "nonfinite",
    "CorruptSnapshotError",
    "SnapshotConfigError",
]
