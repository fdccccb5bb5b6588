"""The process group as the guard sees it: whether one is active, this rank, and two contexts for
slow-path runs (no DDP collective; random generators put back)."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["active", "rank", "local", "keep_rng"]


def active(group: Any = None) -> bool:
    """Whether a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Any = None) -> int:
    """This process's rank in ``group``; 0 when no process group is initialized."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def local(model: torch.nn.Module) -> Iterator[None]:
    """Run forwards and backwards of a DDP model with no collective: no gradient all-reduce, no
    buffer broadcast (for re-runs and replays, whose count may differ between ranks).

    DDP's own ``forward_param_sync`` state is put back on exit, so the next training step
    broadcasts buffers as it would have. Any other model: a no-op.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    saved = model.require_forward_param_sync
    model.require_forward_param_sync = False
    try:
        with model.no_sync():
            yield
    finally:
        model.require_forward_param_sync = saved


@contextlib.contextmanager
def keep_rng(enabled: bool = True) -> Iterator[None]:
    """Put the torch (CPU and CUDA), numpy and Python generators back as they were on exit."""
    if not enabled:
        yield
        return
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
