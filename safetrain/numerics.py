"""Numerically safe tensor functions: finite values AND finite gradients for every finite input.

The plain ops fail at their edges: ``log(0)``, ``a / 0``, ``sqrt`` and ``norm`` at 0 (infinite
slope), ``acos``/``asin`` at +-1 (and NaN just outside, which rounding produces), ``exp`` overflow,
softmax over a fully masked (all ``-inf``) row. The usual fix, ``torch.where(b == 0, 0, a / b)``,
repairs the value but not the gradient: autograd still differentiates the branch it did not take
and ``0 * inf`` is NaN. Every helper here either feeds the risky op only safe inputs (the
"double where") or is an ``autograd.Function`` whose backward bounds the derivative explicitly.

Shared rules:

- The epsilon depends on the dtype of the tensor actually computed on (after autocast), never a
  fixed ``1e-8``, which is 0 in float16. Pass ``eps=`` to override; an ``eps`` that would round to
  a subnormal or zero in that dtype raises ``ValueError`` instead of silently vanishing.
- Outputs are clamped to the dtype's finite range ``[-finfo.max, finfo.max]``; where a value
  saturates, its gradient is 0, exactly as for ``torch.clamp``.
- Gradients are clamped to the finite range too, so a huge upstream gradient saturates instead
  of overflowing. NaN inputs are not hidden: they give NaN outputs (use :func:`sanitize` first).
- No helper synchronizes the host: no ``.item()``, no Python branch on tensor values.
- Second derivatives are not supported by the ``autograd.Function`` helpers (they raise).

Default epsilon, ``default_eps(dtype) = max(finfo.eps ** 2, finfo.tiny)``. Its square root is
about the machine epsilon (the scale that matters for the slopes of sqrt, acos and asin) and it
is never subnormal, so ``1 / eps`` is finite:

============  ===========  ============  ==========  ==============  =============
dtype         finfo.eps    default_eps   1 / eps     sqrt(eps)       log(eps)
============  ===========  ============  ==========  ==============  =============
float64       2.2e-16      4.9e-32       2.0e+31     2.2e-16         -72.1
float32       1.2e-07      1.4e-14       7.0e+13     1.2e-07         -31.9
bfloat16      7.8e-03      6.1e-05       1.6e+04     7.8e-03         -9.70
float16       9.8e-04      6.1e-05       1.6e+04     7.8e-03         -9.70
============  ===========  ============  ==========  ==============  =============
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = [
    "default_eps",
    "safe_log",
    "safe_div",
    "safe_sqrt",
    "safe_exp",
    "safe_pow",
    "safe_norm",
    "safe_acos",
    "safe_asin",
    "stable_softmax",
    "stable_log_softmax",
    "masked_softmax",
    "safe_logsumexp",
    "sanitize",
]

_NEG_INF = float("-inf")


def default_eps(dtype: torch.dtype) -> float:
    """The default epsilon for ``dtype``: ``max(finfo.eps ** 2, finfo.tiny)`` (module table).

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


# ---------------------------------------------------------------------------- autograd functions


class _SafeDiv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, a: Tensor, b: Tensor, eps: float | None) -> Tensor:
        dtype = torch.result_type(a, b)
        ac, bc = a.to(dtype), b.to(dtype)
        e = _eps(eps, dtype, "safe_div")
        eps_t = bc.new_full((), e)
        small = bc.abs() < e
        b_safe = torch.where(small, torch.where(bc >= 0, eps_t, -eps_t), bc)
        raw = ac / b_safe
        sat = raw.abs() > torch.finfo(dtype).max
        out = _finite(raw)
        ctx.like = (a.shape, a.dtype), (b.shape, b.dtype)
        ctx.save_for_backward(b_safe, out, small, sat)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        b_safe, out, small, sat = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _grad_for(torch.where(sat, 0.0, _finite(g / b_safe)), ctx.like[0])
        if ctx.needs_input_grad[1]:
            d = -g * _finite(out / b_safe)  # -g * a / b**2, each factor kept finite
            gb = _grad_for(torch.where(sat | small, 0.0, _finite(d)), ctx.like[1])
        return ga, gb, None


class _SafeSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, eps: float | None) -> Tensor:
        ctx.eps = _eps(eps, x.dtype, "safe_sqrt")
        ctx.save_for_backward(x)
        return x.clamp(min=0).sqrt()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        d = 0.5 * x.clamp(min=ctx.eps).rsqrt()
        return torch.where(x > 0, _finite(g * d), 0.0), None


class _SafeArc(torch.autograd.Function):
    """acos (``sign=-1``) or asin (``sign=+1``) on ``clamp(x, -1, 1)``, slope capped at 1/sqrt(eps)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, eps: float | None, sign: int) -> Tensor:
        ctx.eps, ctx.sign = _eps(eps, x.dtype, "safe_acos" if sign < 0 else "safe_asin"), sign
        ctx.save_for_backward(x)
        xc = x.clamp(-1.0, 1.0)
        return xc.acos() if sign < 0 else xc.asin()

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        d = ((1 - x) * (1 + x)).clamp(min=ctx.eps).rsqrt()  # (1-x)(1+x) is exact near +-1
        return torch.where(x.abs() <= 1, _finite(ctx.sign * g * d), 0.0), None, None


class _SafePow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, p: Tensor, eps: float | None) -> Tensor:
        dtype = torch.result_type(x, p)
        xc, pc = x.to(dtype), p.to(dtype)
        e = _eps(eps, dtype, "safe_pow")
        is_int = pc == pc.round()
        neg = xc < 0
        outside = neg & ~is_int  # negative base, fractional exponent: not real
        mag = torch.where(outside, 0.0, xc.abs())
        floored = (pc < 0) & (mag < e)  # 0 ** negative: the base is floored at eps
        mag_f = torch.where(floored, e, mag)
        odd = is_int & (torch.remainder(pc, 2) == 1)
        raw = torch.pow(mag_f, pc)
        raw = torch.where(neg & odd, -raw, raw)
        sat = raw.abs() > torch.finfo(dtype).max
        out = _finite(raw)
        ctx.eps, ctx.like = e, ((x.shape, x.dtype), (p.shape, p.dtype))
        ctx.save_for_backward(pc, mag, mag_f, out, neg & is_int & ~odd, outside, floored, sat)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        pc, mag, mag_f, out, flip, outside, floored, sat = ctx.saved_tensors
        gx = gp = None
        if ctx.needs_input_grad[0]:
            mag_g = torch.where(pc < 1, mag.clamp(min=ctx.eps), mag)  # bound p*|x|^(p-1) at 0
            pa = pc.to(_acc(pc.dtype))  # p - 1 rounded to bfloat16 would cost ~2% accuracy
            d = _finite(pa * torch.pow(mag_g.to(pa.dtype), pa - 1), pc.dtype).to(pc.dtype)
            d = torch.where(flip, -d, d)  # d/dx x**p = p x**(p-1) flips sign for even p, x < 0
            gx = _grad_for(torch.where(outside | floored | sat, 0.0, _finite(g * d)), ctx.like[0])
        if ctx.needs_input_grad[1]:
            live = (mag_f > 0) & ~outside & ~sat
            log_mag = torch.where(live, mag_f, 1.0).log()  # double where: log never sees 0
            gp = _grad_for(torch.where(live, _finite(g * _finite(out * log_mag)), 0.0), ctx.like[1])
        return gx, gp, None


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


# ---------------------------------------------------------------------------- public helpers


def safe_log(x: Tensor, eps: float | None = None) -> Tensor:
    """``log(max(x, eps))``: finite for every input, gradient at most ``1 / eps``.

    Equals ``torch.log`` for ``x >= eps``. Below ``eps`` (including 0, -0, negatives and
    subnormals, where the plain op gives -inf, NaN or a huge slope) it returns ``log(eps)`` with
    zero gradient. ``eps`` defaults to :func:`default_eps` of ``x.dtype`` (6.1e-05 in float16 and
    bfloat16, 1.4e-14 in float32), so it never underflows under autocast.

    Args:
        x: input tensor.
        eps: floor; ``None`` for the dtype default.

    Returns:
        A tensor of ``x``'s dtype with values in ``[log(eps), log(finfo.max)]``.

    Example::

        >>> safe_log(torch.tensor([0.0, 1.0], dtype=torch.float16))
        tensor([-9.7031,  0.0000], dtype=torch.float16)
    """
    x = _float(x)
    return x.clamp(min=_eps(eps, x.dtype, "safe_log")).log()


def safe_div(a: Tensor | float, b: Tensor | float, eps: float | None = None) -> Tensor:
    """``a / b`` with a floored denominator, finite values and finite gradients.

    Where ``|b| < eps`` the denominator is replaced by ``sign(b) * eps`` with ``sign(+-0) = +1``,
    and its gradient with respect to ``b`` is 0 there; elsewhere the result equals ``a / b``.
    Quotients beyond the dtype's range (``a / eps`` overflows easily in float16) are clamped to
    ``+-finfo.max`` with zero gradient. ``eps`` defaults to :func:`default_eps` of the promoted
    dtype. Unlike ``torch.where(b == 0, 0, a / b)``, no NaN reaches the gradient.

    Args:
        a: numerator (tensor or number).
        b: denominator (tensor or number); broadcast against ``a``.
        eps: denominator floor; ``None`` for the dtype default.

    Returns:
        A tensor of the promoted dtype of ``a`` and ``b``.

    Example::

        >>> safe_div(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), eps=0.5)
        tensor([2., 0.])
    """
    a, b = _pair(a, b)
    return _SafeDiv.apply(a, b, eps)


def safe_sqrt(x: Tensor, eps: float | None = None) -> Tensor:
    """``sqrt(max(x, 0))`` with a bounded slope.

    Values equal ``torch.sqrt`` for ``x >= 0``; negatives (NaN in the plain op) give 0. The
    gradient is ``1 / (2 sqrt(max(x, eps)))`` for ``x > 0``, so at most ``0.5 / sqrt(eps)``
    (64 in float16/bfloat16) instead of infinite near 0, and 0 for ``x <= 0``.

    Args:
        x: input tensor.
        eps: where the slope stops growing; ``None`` for :func:`default_eps` of ``x.dtype``.

    Returns:
        A tensor of ``x``'s dtype.

    Example::

        >>> safe_sqrt(torch.tensor([-1.0, 0.0, 4.0]))
        tensor([0., 0., 2.])
    """
    return _SafeSqrt.apply(_float(x), eps)


def safe_exp(x: Tensor) -> Tensor:
    """``exp(min(x, log(finfo.max) - 1))``: never overflows, nor does its gradient.

    Equals ``torch.exp`` for ``x <= log(finfo.max) - 1`` (10.09 in float16, 87.7 in float32 and
    bfloat16); above that the value saturates at about ``finfo.max / e`` with zero gradient,
    where the plain op gives inf. No epsilon is involved.

    Args:
        x: input tensor.

    Returns:
        A tensor of ``x``'s dtype in ``[0, finfo.max / e]``.

    Example::

        >>> safe_exp(torch.tensor([0.0, 1e4], dtype=torch.float16))
        tensor([1.0000e+00, 2.4192e+04], dtype=torch.float16)
    """
    x = _float(x)
    return x.clamp(max=math.log(torch.finfo(x.dtype).max) - 1.0).exp()


def safe_pow(x: Tensor | float, exponent: Tensor | float, eps: float | None = None) -> Tensor:
    """``x ** exponent`` on a defined real domain, with finite values and gradients.

    Domain: a negative base is allowed with an integer exponent (``(-2) ** 3 = -8``); with a
    fractional exponent (NaN in the plain op) the base is taken as 0. For a negative exponent the
    base's magnitude is floored at ``eps`` (``0 ** -1`` is ``1 / eps``, not inf). Results beyond
    ``finfo.max`` are clamped with zero gradient. Gradient in ``x``: ``p * |x| ** (p - 1)``, with
    ``|x|`` floored at ``eps`` when ``p < 1`` (finite at 0), 0 where the base was replaced or
    floored. Gradient in the exponent: ``out * log|x|`` (with the floored base), 0 where the base
    is 0 or was replaced. ``eps`` defaults to :func:`default_eps` of the promoted dtype.

    Args:
        x: base (tensor or number).
        exponent: exponent (tensor or number); broadcast against ``x``.
        eps: base floor; ``None`` for the dtype default.

    Returns:
        A tensor of the promoted dtype.

    Example::

        >>> safe_pow(torch.tensor([-2.0, -2.0, 4.0]), torch.tensor([3.0, 0.5, 0.5]))
        tensor([-8.,  0.,  2.])
    """
    x, p = _pair(x, exponent)
    return _SafePow.apply(x, p, eps)


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


def safe_acos(x: Tensor, eps: float | None = None) -> Tensor:
    """``acos(clamp(x, -1, 1))`` with a slope bounded by ``1 / sqrt(eps)``.

    Values equal ``torch.acos`` on ``[-1, 1]``; just outside (rounding makes cosine similarities
    like ``1.0000001``) the plain op is NaN and this returns ``acos(+-1)`` with zero gradient.
    The gradient is ``-1 / sqrt(max(1 - x**2, eps))``: finite at +-1 (128 in float16 and
    bfloat16 with the default eps) instead of infinite.

    Args:
        x: input tensor.
        eps: floor of ``1 - x**2``; ``None`` for :func:`default_eps` of ``x.dtype``.

    Returns:
        A tensor of ``x``'s dtype in ``[0, pi]``.

    Example::

        >>> safe_acos(torch.tensor([1.0000001, 0.0]))
        tensor([0.0000, 1.5708])
    """
    return _SafeArc.apply(_float(x), eps, -1)


def safe_asin(x: Tensor, eps: float | None = None) -> Tensor:
    """``asin(clamp(x, -1, 1))`` with a slope bounded by ``1 / sqrt(eps)``.

    The mirror of :func:`safe_acos`: equals ``torch.asin`` on ``[-1, 1]``, returns ``+-pi/2`` with
    zero gradient outside it (NaN in the plain op), gradient ``1 / sqrt(max(1 - x**2, eps))``.

    Args:
        x: input tensor.
        eps: floor of ``1 - x**2``; ``None`` for :func:`default_eps` of ``x.dtype``.

    Returns:
        A tensor of ``x``'s dtype in ``[-pi/2, pi/2]``.

    Example::

        >>> safe_asin(torch.tensor([-1.5, 0.0]))
        tensor([-1.5708,  0.0000])
    """
    return _SafeArc.apply(_float(x), eps, 1)


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


def sanitize(
    tensor: Tensor, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None
) -> Tensor:
    """``torch.nan_to_num`` whose replacements are guaranteed finite in the tensor's dtype.

    NaN becomes ``nan``, +inf ``posinf`` (default ``finfo.max``), -inf ``neginf`` (default
    ``finfo.min``). Replacement values are clamped to ``[-finfo.max, finfo.max]``, so
    ``posinf=1e6`` on a float16 tensor gives 65504 rather than inf. Finite entries are unchanged
    and replaced entries get zero gradient. Integer and bool tensors are returned as they are.

    Args:
        tensor: input tensor.
        nan: replacement for NaN; must not be NaN.
        posinf: replacement for +inf; ``None`` for ``finfo.max``.
        neginf: replacement for -inf; ``None`` for ``finfo.min``.

    Returns:
        A tensor of the same dtype with only finite values.

    Raises:
        ValueError: if a replacement value is NaN.

    Example::

        >>> sanitize(torch.tensor([float("nan"), float("inf")], dtype=torch.float16), posinf=1e6)
        tensor([    0., 65504.], dtype=torch.float16)
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    fmax = torch.finfo(tensor.dtype).max
    values = {"nan": nan, "posinf": fmax if posinf is None else posinf}
    values["neginf"] = -fmax if neginf is None else neginf
    for name, v in values.items():
        if math.isnan(v):
            raise ValueError(f"sanitize: {name}=nan would leave the tensor non-finite; pass a finite number.")
    return torch.nan_to_num(tensor, **{k: min(max(float(v), -fmax), fmax) for k, v in values.items()})
