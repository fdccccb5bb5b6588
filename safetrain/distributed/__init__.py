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

from .group import active, keep_rng, local, rank
from .replay import AgreedReplay
from .resume import load_snapshot
from .store import DistributedStore
from .sync import DistributedSync, LocalSync, make_sync

__all__ = [
    "LocalSync",
    "DistributedSync",
    "make_sync",
    "DistributedStore",
    "AgreedReplay",
    "active",
    "rank",
    "local",
    "keep_rng",
    "load_snapshot",
]
