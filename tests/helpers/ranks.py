"""What the 2-rank scripts build alike: batches poisoned on one rank, a parameter digest, the decisions.

Imported inside the spawned ranks too, so it imports nothing but torch.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List

import torch

__all__ = ["decisions", "digest", "poisoned_batches"]


def poisoned_batches(rank: int, n: int, poison: Callable[[int, torch.Tensor], None]) -> List[Any]:
    """``n`` (x, y) batches of 8 rows, different on each rank, the same on each launch; on rank 1,
    ``poison(step, x)`` edits step ``step``'s inputs in place (steps count from 1)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for step in range(1, n + 1):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if rank == 1:
            poison(step, x)
        out.append((x, y))
    return out


def digest(model: torch.nn.Module) -> str:
    """A digest of every parameter as this rank holds it (equal digests: equal parameters)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def decisions(run: Dict[str, Any]) -> List[Any]:
    """Each step's first three entries of a rank's ``run["steps"]``: what the rank decided."""
    return [s[:3] for s in run["steps"]]
