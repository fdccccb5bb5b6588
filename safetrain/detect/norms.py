"""True gradient norms where float32 squares overflow: the slow path's exact look at an Inf norm.

The fused norms of :mod:`.grads` sum squares in float32 (float16 and bfloat16 gradients too), as
:func:`torch.nn.utils.clip_grad_norm_` does: a gradient whose elements pass about 1.8e19 has an
Inf norm although every element is finite. Only after the step's read showed a non-finite norm
(never on a healthy step) does :func:`true_norm` tell the two apart and give the real norm: the
largest magnitude first (NaN or Inf there: the elements are not finite), then the norm of the
tensor divided by it (at most ``sqrt(numel)``, so it cannot overflow), multiplied back on the
host in double precision.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["HUGE_NORM", "true_norm", "true_norms"]

#: The norm whose square overflows float32 (about 1.84e19): a total norm at or above it is Inf in
#: float32 (``clip_grad_norm_``'s), so finite gradients this large are a ``grad_norm`` anomaly
#: whatever ``guard.grad_norm_threshold`` says.
HUGE_NORM = math.sqrt(torch.finfo(torch.float32).max)


def true_norm(tensor: Tensor) -> float:
    """The L2 norm of ``tensor`` as a host float, exact where float32 squares overflow.

    Slow path only: one host read (the largest magnitude and the rescaled norm together).

    Args:
        tensor: a dense or sparse floating tensor of any dtype and device.

    Returns:
        The norm (float64 on the host); NaN or Inf exactly when some element is NaN or Inf.

    Example::

        >>> torch.full((4,), 2.0**70).norm().item()       # float32's own norm: the squares overflow
        inf
        >>> true_norm(torch.full((4,), 2.0**70)) == 2.0**71
        True
    """
    t = tensor.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    if t.numel() == 0:
        return 0.0
    work = t.to(torch.float64 if t.dtype is torch.float64 else torch.float32)
    peak = work.abs().amax()  # NaN propagates: a NaN element makes the peak NaN
    scaled = torch.linalg.vector_norm(work / torch.where(peak > 0, peak, torch.ones_like(peak)))
    top, rest = torch.stack([peak, scaled]).tolist()  # host sync: slow path
    if not math.isfinite(top):
        return top
    return top * rest


def true_norms(tensors: Sequence[Tensor], norms: Optional[Sequence[float]] = None) -> List[float]:
    """Each tensor's true L2 norm (host floats); with ``norms`` (the float32 norms already read)
    only the non-finite ones are worked out again.

    Args:
        tensors: the tensors (gradients).
        norms: their float32 norms as read, aligned with ``tensors``; ``None``: all are computed.

    Returns:
        One host float per tensor: NaN or Inf exactly when the tensor holds NaN or Inf.
    """
    if norms is None:
        return [true_norm(t) for t in tensors]
    return [n if math.isfinite(n) else true_norm(t) for t, n in zip(tensors, norms)]
