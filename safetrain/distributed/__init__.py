"""Data parallel training: every rank detects together, decides together, restores together.

Under an initialized process group with more than one rank and a ``DistributedDataParallel``
or FSDP2 (``fully_shard``) model, the guard builds a :class:`DistributedSync` once, at
construction (:func:`make_sync`). One
process uses :class:`LocalSync` instead: the same methods, each a no-op that returns its input, so
the guard never asks whether it is distributed. Cost: one collective inside the step's one sync,
plus one small collective per slow-path decision. Used by ``guard`` and ``diagnose``; builds on
``detect`` (the step's read) and ``snapshot`` (the stores).
"""

from .checkpoint import ShardedStore
from .group import active, keep_rng, local, rank
from .replay import AgreedReplay, wrap_replayer
from .resume import load_snapshot
from .sharding import DDP, FSDP2, LOCAL, ShardedState, for_layout, layout_of, train_state
from .snapdir import sharded_snapshots
from .store import DistributedStore, wrap_store
from .stores import make_store
from .sync import DistributedSync, LocalSync, from_rank0, make_sync

__all__ = [
    "LocalSync",
    "DistributedSync",
    "make_sync",
    "from_rank0",
    "DistributedStore",
    "sharded_snapshots",
    "AgreedReplay",
    "wrap_replayer",
    "wrap_store",
    "active",
    "rank",
    "local",
    "keep_rng",
    "load_snapshot",
    "layout_of",
    "for_layout",
    "train_state",
    "ShardedState",
    "LOCAL",
    "DDP",
    "FSDP2",
    "ShardedStore",
    "make_store",
]
