"""Tensor plumbing shared by the stores: the finiteness check, buffer allocation and bulk copies.

The finiteness check is the one place a snapshot reads every value, so it is a single
device-side pass with one host read: a cheap reduction per tensor whose result is non-finite
whenever the tensor holds a NaN or an Inf (a sum of squares for float32/float64, a float32 sum
for half types), all stacked and read together. Such a reduction can also overflow on huge
finite values; the few tensors it flags are then checked exactly with ``isfinite`` so an
overflow is never mistaken for a NaN.

On the CPU that check is a second full read of memory next to the copy. :func:`copy_checked_`
does both in one pass instead: chunk by chunk, each chunk is checked right after it is copied,
while it is still in the core's L2 cache, on several threads (numpy's copy and BLAS dot release
the GIL). It writes before it knows, so a store uses it only where a refused copy may be dropped.
"""

from __future__ import annotations

import ctypes
import math
from collections import defaultdict
from concurrent.futures import Executor
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from .accepted import matches

__all__ = [
    "nonfinite",
    "alloc_like",
    "layout_of",
    "copy_all_",
    "put_buffer_",
    "copy_checked_",
    "Chunks",
    "chunks_of",
    "copy_chunks_checked_",
    "streamable",
    "byte_view",
    "unpinned_array",
    "is_cuda_available",
]

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


def nonfinite(
    named: Iterable[Tuple[str, torch.Tensor]], accepted: Optional[Mapping[str, Sequence[int]]] = None
) -> List[str]:
    """Names of the floating-point tensors that hold a NaN or an Inf.

    One reduction per tensor on its own device and one host read per device (usually one in
    all); integer and bool tensors are skipped. A tensor named in ``accepted`` (a buffer non-finite
    by design, :mod:`.accepted`) is flagged when its non-finite pattern differs from the accepted
    one instead, in the same pass.

    Args:
        named: ``(name, tensor)`` pairs on any devices.
        accepted: ``name -> pattern`` of the tensors whose non-finite entries are part of the model.

    Returns:
        The names of the non-finite tensors, in input order; empty when all are finite.

    Example::

        >>> nonfinite([("w", torch.ones(3)), ("b", torch.tensor([float("nan")]))])
        ['b']
    """
    accepted = accepted or {}
    by_device: Dict[torch.device, List[Tuple[str, torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for name, t in named:
        if t.is_floating_point() or t.is_complex():
            probe = matches(t, accepted[name]) if name in accepted else _probe(t)
            by_device[t.device].append((name, t, probe))
    suspects: List[Tuple[str, torch.Tensor]] = []
    for items in by_device.values():
        # host sync: one read of all the probes on this device.
        ok = torch.isfinite(torch.stack([p for _, _, p in items])).tolist()
        suspects.extend((name, t) for (name, t, _), good in zip(items, ok) if not good)
    # Only flagged tensors get the exact (allocating) check; an overflowed probe is not a NaN.
    return [name for name, t in suspects if name in accepted or not bool(torch.isfinite(t).all())]


# Per copy-and-check step. 256-512 KiB measured best on a 2-core Xeon (2 MiB L2 per core): small
# enough that a chunk is still cached when it is checked, large enough that the ~3 us of Python per
# chunk stays small next to the copy. 1 MiB chunks measured 8% slower, 128 KiB 10% slower.
_CHUNK_BYTES = 256 * 2**10
# Each thread beyond the caller's gets at least this much work: handing a share to a pool thread
# and waiting for it costs tens of microseconds, as much as copying and checking a few hundred KiB.
_BYTES_PER_THREAD = 2**20


def streamable(src: torch.Tensor, device: torch.device) -> bool:
    """Whether :func:`copy_checked_` can copy ``src`` into an :func:`alloc_like` buffer on ``device``:
    a dense float32/float64 tensor, CPU to CPU."""
    return src.device.type == "cpu" and device.type == "cpu" and src.dtype in _FAST_DOT and src.is_contiguous()


def copy_checked_(
    named: Sequence[Tuple[str, torch.Tensor, torch.Tensor]], pool: Optional[Executor] = None, threads: int = 1
) -> List[str]:
    """Copy each ``src`` into its ``dst`` and say which held a NaN or an Inf, in one pass over memory.

    Each tensor is cut into chunks; a chunk is copied and then checked with a BLAS dot of the
    copy with itself while it is cache-hot, so the check costs no second read from memory. The
    chunks are dealt round-robin to ``threads`` threads: the caller's and ``threads - 1`` from
    ``pool``. A chunk whose dot is not finite is re-checked exactly (a sum of squares of huge
    finite values overflows), so there are no false alarms.

    Every ``dst`` is written before the answer is known: use it only where a copy found
    non-finite can be thrown away.

    Args:
        named: ``(name, dst, src)`` triples: ``src`` one that :func:`streamable` accepts, ``dst``
            a contiguous CPU tensor of the same shape and dtype.
        pool: runs the other threads' shares; needed when ``threads > 1``.
        threads: how many threads share the work (the caller's included).

    Returns:
        The names whose ``src`` holds a NaN or an Inf, in input order; empty when all are finite.

    Example::

        >>> src, dst = torch.tensor([1.0, float("inf")]), torch.empty(2)
        >>> copy_checked_([("w", dst, src)])
        ['w']
        >>> dst
        tensor([1., inf])
    """
    pairs = [(dst.detach().view(-1).numpy(), unpinned_array(src)) for _, dst, src in named]  # (buffer; live tensor)
    return [named[i][0] for i in copy_chunks_checked_(chunks_of(pairs), pool, threads)]


class Chunks(NamedTuple):
    """Flat ``(dst, src)`` arrays cut into the chunks :func:`copy_chunks_checked_` deals to its threads.

    Valid while every array's memory is: a store that keeps its buffers and sees the same live
    tensors at the same addresses reuses one instead of cutting the arrays again at each copy.
    """

    tasks: List[Tuple[int, np.ndarray, np.ndarray, int, int]]  # (pair index, dst, src, lo, hi)
    nbytes: int


def chunks_of(pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Chunks:
    """Cut each ``(dst, src)`` pair of flat float32/float64 arrays of one size into chunks."""
    tasks: List[Tuple[int, np.ndarray, np.ndarray, int, int]] = []
    total = 0
    for i, (d, s) in enumerate(pairs):
        step = _CHUNK_BYTES // d.itemsize  # (itemsize 4 or 8: thousands of elements a chunk)
        for lo in range(0, d.size, step):
            tasks.append((i, d, s, lo, lo + step))
        total += d.nbytes
    return Chunks(tasks, total)


def copy_chunks_checked_(chunks: Chunks, pool: Optional[Executor] = None, threads: int = 1) -> List[int]:
    """Copy and check ``chunks`` as :func:`copy_checked_` does; the indices of the pairs whose
    source holds a NaN or an Inf, in order."""
    tasks = chunks.tasks
    threads = max(1, min(threads, chunks.nbytes // _BYTES_PER_THREAD)) if pool is not None else 1
    futures = [pool.submit(_copy_check, tasks[k::threads]) for k in range(1, threads)]
    try:
        flagged = _copy_check(tasks[::threads])
    finally:
        flagged_elsewhere = [future.result() for future in futures]  # also waits if the caller's share raised
    for more in flagged_elsewhere:
        flagged += more
    # Only flagged chunks get the exact (allocating) check; an overflowed dot is not a NaN.
    return sorted({i for i, d, lo, hi in flagged if not np.isfinite(d[lo:hi]).all()})


def _copy_check(
    share: Sequence[Tuple[int, np.ndarray, np.ndarray, int, int]],
) -> List[Tuple[int, np.ndarray, int, int]]:
    """Copy and probe one thread's chunks; the chunks whose probe is not finite."""
    flagged = []
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing probe is expected, not an error
        for i, d, s, lo, hi in share:
            chunk = d[lo:hi]
            np.copyto(chunk, s[lo:hi])
            if not math.isfinite(np.dot(chunk, chunk)):
                flagged.append((i, d, lo, hi))
    return flagged


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


def put_buffer_(live: torch.Tensor, saved: torch.Tensor) -> None:
    """Write ``saved`` into the buffer ``live`` in place (every reference to it stays valid),
    taking ``saved``'s shape and dtype when they differ: a buffer that changed shape or dtype since
    it was kept (an observer's per-channel ``min_val``, empty before the first forward) goes back
    as it was, on its own device. The module keeps the same tensor object either way."""
    with torch.no_grad():
        if live.shape == saved.shape and live.dtype == saved.dtype:
            live.copy_(saved)
        else:  # slow path: the buffer's metadata changes (a fresh copy: ``saved`` may be reused)
            live.data = saved.detach().to(device=live.device, copy=True)


def byte_view(t: torch.Tensor, into: bool = False) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (for checksums and file I/O).

    Read out through :func:`unpinned_array`, so a snapshot leaves the live model's storages
    resizable; ``into``: the view is written into (a read from a file into a fresh tensor)."""
    if t.numel() == 0:
        return memoryview(b"")
    if into or not t.is_contiguous():  # (a fresh tensor, or a copy: numpy's array keeps it alive)
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return memoryview(unpinned_array(t.view(-1).view(torch.uint8))).cast("B")


_NUMPY = {torch.uint8: np.uint8, torch.float32: np.float32, torch.float64: np.float64}


def unpinned_array(t: torch.Tensor) -> np.ndarray:
    """A flat numpy array over a contiguous CPU tensor's memory (uint8, float32 or float64), without
    a copy, that leaves its storage resizable (``t`` must be contiguous: a view, never a copy).

    ``Tensor.numpy()`` pins a storage's size for good: a quantization observer's ``scale``, one
    element until its first forward resizes it to one per channel, would then fail that forward
    ("Trying to resize storage that is not resizable") after a snapshot read it. The array is
    valid while ``t`` lives and keeps its size: a snapshot's own synchronous copies and writes.
    """
    flat = t.detach().view(-1)  # (a view: t's storage, which the caller holds)
    if flat.numel() == 0:
        return np.empty(0, dtype=_NUMPY[flat.dtype])
    raw = (ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
    return np.frombuffer(raw, dtype=_NUMPY[flat.dtype])
