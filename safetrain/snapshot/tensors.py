"""Tensor plumbing shared by the stores: the finiteness check, buffer allocation and bulk copies.

The finiteness check is the one place a snapshot reads every value, so it is a single
device-side pass with one host read: a cheap reduction per tensor whose result is non-finite
whenever the tensor holds a NaN or an Inf (a sum of squares for float32/float64, a float32 sum
for half types), all stacked and read together. Such a reduction can also overflow on huge
finite values; the few tensors it flags are then checked exactly with ``isfinite`` so an
overflow is never mistaken for a NaN.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

__all__ = ["nonfinite", "alloc_like", "layout_of", "copy_all_", "byte_view", "is_cuda_available"]

_FAST_DOT = (torch.float32, torch.float64)


def is_cuda_available() -> bool:
    """Whether CUDA can be used in this process (without initializing it)."""
    return torch.cuda.is_available()


def _probe(t: torch.Tensor) -> torch.Tensor:
    """A 0-d float tensor on ``t``'s device that is non-finite if ``t`` holds a NaN or an Inf."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if t.dtype in _FAST_DOT and t.is_contiguous():
        flat = t.view(-1)
        return torch.dot(flat, flat).float()  # BLAS dot: the fastest full read torch offers on CPU
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.sum(dtype=torch.float32)
    if t.dtype in _FAST_DOT:
        return t.sum().float()
    # Rare dtypes (float8, complex): exact, at the price of a temporary.
    return torch.where(torch.isfinite(t).all(), 0.0, float("nan")).to(torch.float32)


def nonfinite(named: Iterable[Tuple[str, torch.Tensor]]) -> List[str]:
    """Names of the floating-point tensors that hold a NaN or an Inf.

    One reduction per tensor on its own device and one host read per device (usually one in
    all); integer and bool tensors are skipped.

    Args:
        named: ``(name, tensor)`` pairs on any devices.

    Returns:
        The names of the non-finite tensors, in input order; empty when all are finite.

    Example::

        >>> nonfinite([("w", torch.ones(3)), ("b", torch.tensor([float("nan")]))])
        ['b']
    """
    by_device: Dict[torch.device, List[Tuple[str, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for name, t in named:
        if t.is_floating_point() or t.is_complex():
            by_device[t.device].append((name, t, _probe(t)))
    suspects: List[Tuple[str, torch.Tensor]] = []
    for items in by_device.values():
        # host sync: one read of all the probes on this device.
        ok = torch.isfinite(torch.stack([p for _, _, p in items])).tolist()
        suspects.extend((name, t) for (name, t, _), good in zip(items, ok) if not good)
    # Only flagged tensors get the exact (allocating) check; an overflowed probe is not a NaN.
    return [name for name, t in suspects if not bool(torch.isfinite(t).all())]


def alloc_like(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized buffer for ``src`` on ``device`` with its layout; pinned for CUDA sources.

    Pinned host memory lets ``copy_(non_blocking=True)`` from and to CUDA run asynchronously;
    it is only requested when the source lives on CUDA and the buffer on the CPU.
    """
    pin = device.type == "cpu" and src.device.type == "cuda"
    return torch.empty_strided(src.size(), layout_of(src), dtype=src.dtype, device=device, pin_memory=pin)


def layout_of(t: torch.Tensor) -> Tuple[int, ...]:
    """The strides ``empty_like(t)`` would give: ``t``'s own when dense (channels_last kept)."""
    if t.is_contiguous():
        return tuple(t.stride())
    return tuple(torch.empty_like(t, device="meta").stride())  # meta: computes strides, allocates nothing


def copy_all_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i], non_blocking=True)`` for all i, grouped so each group is one foreach call.

    Copies between CUDA and pinned host memory stay asynchronous on the current stream; later
    work on that stream (the next optimizer step, a restore) is ordered after them.
    """
    groups: Dict[Tuple[torch.device, torch.device], Tuple[List[torch.Tensor], List[torch.Tensor]]] = defaultdict(
        lambda: ([], [])
    )
    for d, s in zip(dst, src):
        pair = groups[(d.device, s.device)]
        pair[0].append(d)
        pair[1].append(s)
    with torch.no_grad():
        for ds, ss in groups.values():
            torch._foreach_copy_(ds, ss, non_blocking=True)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (for checksums and file I/O)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
