"""Reductions that stay finite: ``safe_norm``, ``stable_softmax``, ``stable_log_softmax``,
``masked_softmax`` and ``safe_logsumexp``.

Half dtypes accumulate in float32 (as CUDA autocast does for softmax); fully masked (all ``-inf``)
rows give zeros (or ``-inf`` for the log forms) with zero gradient instead of NaN. One extra
reduction per call at most, no host sync. Part of :mod:`safetrain.numerics`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from .limits import _NEG_INF, _acc, _dead_rows, _finite, _float

__all__ = ["safe_norm", "stable_softmax", "stable_log_softmax", "masked_softmax", "safe_logsumexp"]


class _SafeNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
        m = x.abs().amax(dim=dims, keepdim=True)
        u = x / torch.where(m > 0, m, 1.0)  # scaled so that sum(u**2) cannot overflow
        r = u.square().sum(dim=dims, keepdim=True).sqrt()  # >= 1 unless x is all zeros
        raw = m * r
        sat = raw > torch.finfo(x.dtype).max
        ctx.save_for_backward(u, r, sat)
        out = _finite(raw)
        return out if keepdim else out.squeeze(dims)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor, None, None]:
        u, r, sat = ctx.saved_tensors
        g = g.reshape(r.shape)
        # d||x||/dx = x/||x|| = u/||u||, |.| <= 1; at x = 0, u = 0 and the subgradient is 0.
        return torch.where(sat, 0.0, g) * (u / r.clamp(min=1.0)), None, None


def safe_norm(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """Euclidean norm whose gradient at the zero vector is 0 instead of NaN, and which never overflows.

    Computed as ``max|x| * ||x / max|x|||`` so squares near ``finfo.max`` cannot overflow (the
    plain op gives inf for a float16 vector with entries near 256); values equal
    ``torch.linalg.vector_norm`` otherwise, clamped to ``finfo.max`` with zero gradient if the true
    norm is out of range. The gradient is ``x / ||x||``, bounded by 1 per entry. No epsilon.

    Args:
        x: input tensor.
        dim: dimension(s) to reduce; ``None`` reduces all.
        keepdim: keep reduced dimensions with size 1.

    Returns:
        The 2-norm, in ``x``'s dtype.

    Example::

        >>> safe_norm(torch.tensor([[3.0, 4.0], [0.0, 0.0]]), dim=-1)
        tensor([5., 0.])
    """
    x = _float(x)
    if x.ndim == 0:
        return safe_norm(x.reshape(1), dim=None, keepdim=False)
    if dim is None:
        dims = tuple(range(x.ndim))
    else:
        dims = tuple(d % x.ndim for d in ((dim,) if isinstance(dim, int) else dim))
    return _SafeNorm.apply(x, dims, keepdim)


def stable_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax accumulated in float32 for half dtypes, with all ``-inf`` rows mapped to zeros.

    Equals ``torch.softmax`` wherever that is defined. A row that is entirely ``-inf`` (plain
    softmax: ``0 / 0 = NaN``) gives zeros with zero gradient, via the double-where pattern. ``-inf``
    entries in other rows give 0 as usual. No epsilon.

    Args:
        x: logits.
        dim: dimension to normalise over.

    Returns:
        Probabilities in ``x``'s dtype.

    Example::

        >>> stable_softmax(torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]]))
        tensor([[0.5000, 0.5000],
                [0.0000, 0.0000]])
    """
    x = _float(x)
    dead = _dead_rows(x, dim)
    p = torch.softmax(torch.where(dead, 0.0, x), dim=dim, dtype=_acc(x.dtype)).to(x.dtype)
    return torch.where(dead, 0.0, p)


def stable_log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Log-softmax that equals ``torch.log_softmax`` where defined, and stays finite otherwise.

    Uses ``torch.log_softmax`` (``x - max - log(sum(exp(x - max)))``, accumulated in float32 for
    half dtypes), not the common mistake ``x - max - log(sum(x - max))``. Results below
    ``-finfo.max`` from finite logits (e.g. ``[max, -max]``) are clamped to ``-finfo.max`` instead
    of -inf; ``-inf`` inputs still give ``-inf``. A row that is entirely ``-inf`` gives 0 with zero
    gradient (not NaN), so it adds nothing to a sum of log-probabilities. No epsilon.

    Args:
        x: logits.
        dim: dimension to normalise over.

    Returns:
        Log-probabilities in ``x``'s dtype.

    Example::

        >>> stable_log_softmax(torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]]))
        tensor([[-0.6931, -0.6931],
                [ 0.0000,  0.0000]])
    """
    x = _float(x)
    dead = _dead_rows(x, dim)
    ls = torch.log_softmax(torch.where(dead, 0.0, x), dim=dim, dtype=_acc(x.dtype))
    ls = torch.where(x == _NEG_INF, _NEG_INF, ls.clamp(min=-torch.finfo(x.dtype).max)).to(x.dtype)
    return torch.where(dead, 0.0, ls)


def masked_softmax(x: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """Softmax over the entries where ``mask`` is True; fully masked rows give zeros.

    ``mask`` follows ``scaled_dot_product_attention``: True means "take part" (the opposite of
    ``nn.MultiheadAttention``'s ``key_padding_mask``). It broadcasts against ``x``. Masked entries
    get probability 0 and zero gradient; a row with no True entry (NaN in the usual
    ``masked_fill(-inf)`` + softmax) gives zeros with zero gradient. See :func:`stable_softmax`.

    Args:
        x: logits.
        mask: bool tensor broadcastable to ``x``, True = keep.
        dim: dimension to normalise over.

    Returns:
        Probabilities in ``x``'s dtype.

    Raises:
        TypeError: if ``mask`` is not a bool tensor.

    Example::

        >>> masked_softmax(torch.zeros(2, 2), torch.tensor([[True, False], [False, False]]))
        tensor([[1., 0.],
                [0., 0.]])
    """
    if mask.dtype != torch.bool:
        raise TypeError(
            f"masked_softmax: mask must be a bool tensor (True = keep), got {mask.dtype}. "
            "Use mask.bool(), or stable_softmax(x + additive_mask) for an additive float mask."
        )
    return stable_softmax(torch.where(mask, _float(x), _NEG_INF), dim=dim)


def safe_logsumexp(x: Tensor, dim: int | Sequence[int] = -1, keepdim: bool = False) -> Tensor:
    """``torch.logsumexp`` with finite values for finite input and a zero gradient on all ``-inf`` rows.

    Accumulates in float32 for half dtypes and clamps results above ``finfo.max`` (e.g.
    ``[max, max]`` in float16). A row that is entirely ``-inf`` returns ``-inf``, like
    ``torch.logsumexp`` (the log of an empty sum), but its gradient is 0 where the plain op's is
    NaN (``exp(-inf - -inf)``). No epsilon.

    Args:
        x: input tensor.
        dim: dimension(s) to reduce.
        keepdim: keep reduced dimensions with size 1.

    Returns:
        A tensor of ``x``'s dtype.

    Example::

        >>> safe_logsumexp(torch.tensor([[0.0, 0.0], [float("-inf"), float("-inf")]]))
        tensor([0.6931,   -inf])
    """
    x = _float(x)
    dead = _dead_rows(x, dim)
    lse = torch.logsumexp(torch.where(dead, 0.0, x).to(_acc(x.dtype)), dim=dim, keepdim=True)
    out = torch.where(dead, _NEG_INF, _finite(lse, x.dtype)).to(x.dtype)
    return out if keepdim else out.squeeze(dim)
