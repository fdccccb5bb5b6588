"""Dtype limits for the safe functions: the default epsilon and the private clamping helpers.

Pure tensor helpers shared by :mod:`~safetrain.numerics.elementwise` and
:mod:`~safetrain.numerics.reductions` (the bottom of :mod:`safetrain.numerics`: it imports neither);
none synchronizes the host. The epsilon depends on the dtype actually computed on: :func:`default_eps`,
with its table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["default_eps"]

_NEG_INF = float("-inf")


def default_eps(dtype: torch.dtype) -> float:
    """The default epsilon for ``dtype``: ``max(finfo.eps ** 2, finfo.tiny)``.

    Its square root is about the machine epsilon (the scale that matters for the slopes of sqrt,
    acos and asin) and it is never subnormal, so ``1 / eps`` is finite:

    ============  ===========  ============  ==========  ==============  =============
    dtype         finfo.eps    default_eps   1 / eps     sqrt(eps)       log(eps)
    ============  ===========  ============  ==========  ==============  =============
    float64       2.2e-16      4.9e-32       2.0e+31     2.2e-16         -72.1
    float32       1.2e-07      1.4e-14       7.0e+13     1.2e-07         -31.9
    bfloat16      7.8e-03      6.1e-05       1.6e+04     7.8e-03         -9.70
    float16       9.8e-04      6.1e-05       1.6e+04     7.8e-03         -9.70
    ============  ===========  ============  ==========  ==============  =============

    Args:
        dtype: a floating-point dtype.

    Returns:
        A positive normal number of ``dtype``; ``1 / eps`` is finite in ``dtype``.

    Example::

        >>> default_eps(torch.float16)
        6.103515625e-05
    """
    info = torch.finfo(dtype)
    return max(info.eps**2, info.tiny)


# ---------------------------------------------------------------------------- private helpers


def _float(x: Tensor) -> Tensor:
    """Integer/bool tensors are computed in the default float dtype (as ``torch.log`` does)."""
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _eps(eps: float | None, dtype: torch.dtype, fn: str) -> float:
    """Resolve ``eps`` for ``dtype``; reject values that vanish in that dtype (pure Python)."""
    if eps is None:
        return default_eps(dtype)
    tiny = torch.finfo(dtype).tiny
    if not math.isfinite(eps) or eps < tiny:
        raise ValueError(
            f"{fn}: eps={eps!r} is not a positive normal {dtype} number (smallest is {tiny:.3g}); "
            f"it would round to a subnormal or 0 and the guard would vanish. Pass eps=None for "
            f"default_eps({dtype}) = {default_eps(dtype):.3g}, or an eps >= {tiny:.3g}."
        )
    return float(eps)


def _finite(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Clamp to the finite range of ``dtype`` (default ``t.dtype``); NaN stays NaN."""
    fmax = torch.finfo(dtype or t.dtype).max
    return t.clamp(-fmax, fmax)


def _grad_for(grad: Tensor, like: tuple[torch.Size, torch.dtype]) -> Tensor:
    """Reduce a broadcast gradient to an input's shape, clamped to and cast to its dtype."""
    shape, dtype = like
    return _finite(grad.sum_to_size(shape), dtype).to(dtype)


def _pair(a: Tensor | float, b: Tensor | float) -> tuple[Tensor, Tensor]:
    """Turn a Python number into a 0-dim tensor next to the other operand (no host transfer)."""
    if isinstance(a, Tensor) and not isinstance(b, Tensor):
        a = _float(a)
        return a, a.new_full((), float(b))
    if isinstance(b, Tensor) and not isinstance(a, Tensor):
        b = _float(b)
        return b.new_full((), float(a)), b
    if not isinstance(a, Tensor):
        names = f"{type(a).__name__} and {type(b).__name__}"
        raise TypeError(f"expected at least one Tensor operand, got {names}")
    return _float(a), _float(b)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Reductions over float16/bfloat16 accumulate in float32, as CUDA autocast does for softmax."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dead_rows(x: Tensor, dim: int | Sequence[int]) -> Tensor:
    """Rows along ``dim`` that are entirely -inf (fully masked). A NaN row is not dead: NaN propagates."""
    return x.amax(dim=dim, keepdim=True) == _NEG_INF
