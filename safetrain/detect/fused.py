"""One fused pass over many tensors: their norms per (device, dtype) group, without a host sync.

The computation under :mod:`.grads`' checks: ``torch._foreach_norm`` per group (sparse COO tensors,
``nn.Embedding(sparse=True)``'s gradients, by their coalesced values), and on the CPU a BLAS ``dot``
plan for large tensors (:class:`DotPlan`), where ``_foreach_norm`` is a loop on one thread.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.nn.parameter import is_lazy

from .flags import gathered

__all__ = ["HALF", "DTensor", "DotPlan", "fused_norms", "local", "stack_norms"]

#: Half types, reduced in float32 so that a finite norm cannot overflow their range.
HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float64)
#: Elements from which a CPU gradient's norm is a BLAS dot (faster than _foreach_norm from ~16K
#: elements here; 64K leaves small models on the single fused call).
_DOT_MIN = 1 << 16


try:  # FSDP2 shards parameters and gradients as DTensors: the checks look at each rank's shard
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]


def local(t: Any) -> Any:
    """A ``DTensor``'s local shard (a view of its live storage); anything else as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def fused_norms(tensors: Sequence[Tensor], ord: float = 2.0) -> List[Tensor]:
    """Every tensor's norm in one fused pass per (device, dtype) group, as 0-dim tensors.

    Args:
        tensors: dense or sparse tensors, any devices and dtypes (low precision is reduced in
            float32 so a finite norm cannot overflow the half range).
        ord: the norm's order (``2.0`` for gradients).

    Returns:
        ``len(tensors)`` 0-dim tensors, in order, each on its tensor's device. No host sync.
    """
    first = tensors[0]
    if all(t.device == first.device and t.dtype == first.dtype and not t.is_sparse for t in tensors):
        return list(torch._foreach_norm(list(tensors), ord, dtype=torch.float32 if first.dtype in HALF else None))
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, t in enumerate(tensors):
        if not t.is_sparse:
            groups.setdefault((t.device, t.dtype), []).append(i)
    out: List[Optional[Tensor]] = [None] * len(tensors)
    for (_, dtype), idx in groups.items():
        norms = torch._foreach_norm([tensors[i] for i in idx], ord, dtype=torch.float32 if dtype in HALF else None)
        for i, n in zip(idx, norms):
            out[i] = n
    for i, t in enumerate(tensors):
        if t.is_sparse:
            out[i] = torch.linalg.vector_norm(t.coalesce().values(), ord)
    return out  # type: ignore[return-value]


class DotPlan:
    """Which tensors of a fixed list take their L2 norm by a BLAS ``dot`` on the CPU.

    ``torch._foreach_norm`` on the CPU is a per-tensor loop on one thread; a ``dot(t, t)`` is
    multi-threaded and 2-2.5x faster from about 16K elements (the MLP's 8.4 MB of gradients: 430
    against 290 us). Same result: a sum of squares, NaN/Inf exactly when the norm is, overflowing
    exactly when the norm does. Planned once (one CPU device, one fp32/fp64 dtype, contiguous
    tensors of :data:`_DOT_MIN` elements or more); a GPU keeps its fused ``_foreach_norm``.
    """

    __slots__ = ("big", "small")

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        first = tensors[0] if tensors else None
        every = tuple(range(len(tensors)))
        self.big: Tuple[int, ...] = ()
        if (
            first is not None
            and first.device.type == "cpu"
            and first.dtype in _FLOATS
            and all(t.device == first.device and t.dtype == first.dtype for t in tensors)
            and not any(is_lazy(t) for t in tensors)
        ):
            self.big = tuple(i for i, t in enumerate(tensors) if t.numel() >= _DOT_MIN and t.is_contiguous())
        self.small = tuple(i for i in every if i not in self.big)

    def norms(self, tensors: List[Tensor]) -> Optional[List[Tensor]]:
        """The tensors' norms (aligned with the planned list), or ``None`` when nothing is planned
        or a large tensor has no flat view (laid out unlike planned, sparse): the plan is then
        dropped, and the caller's fused pass is used from now on."""
        if not self.big:
            return None
        out: List[Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        try:
            flat = [tensors[i].view(-1) for i in self.big]
            for i, root in zip(self.big, torch._foreach_sqrt([t.dot(t) for t in flat])):
                out[i] = root
        except RuntimeError:
            self.big, self.small = (), tuple(range(len(tensors)))  # not tried again
            return None
        if self.small:
            for i, norm in zip(self.small, torch._foreach_norm([tensors[i] for i in self.small], 2.0)):
                out[i] = norm
        return out


def _stack(norms: List[Tensor]) -> Tensor:
    try:
        return torch.stack(norms).float()
    except RuntimeError:  # norms on several devices: gather on an accelerator (see gather_device)
        return torch.stack(gathered(norms)).float()


def stack_norms(norms: List[Tensor]) -> Tensor:
    """0-dim norms as one float32 vector (gathered on one device when they are on several)."""
    try:
        return torch.stack(norms).float()
    except RuntimeError:  # norms on several devices: gather on an accelerator (see gather_device)
        return torch.stack(gathered(norms)).float()
