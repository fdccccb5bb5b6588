"""Snapshots of the whole training state, in memory or as safetensors files, without pickle.

A :class:`TrainState` names what is captured (model, optimizer, scheduler, scaler, RNGs); a
store (:class:`MemoryStore`, :class:`SafetensorsStore`, or :func:`make_store` from the config)
takes snapshots, refusing non-finite state, and restores the newest usable one.
:func:`load_snapshot` resumes from a file or directory; :func:`inspect_snapshot` describes a file.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.Adam(model.parameters())
    >>> state = TrainState(model, opt)
    >>> store = MemoryStore(keep=2)
    >>> store.save(state, counters={"step": 10, "epoch": 0, "batch": 10}).step
    10
    >>> store.restore(state).counters
    {'step': 10, 'epoch': 0, 'batch': 10}
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
