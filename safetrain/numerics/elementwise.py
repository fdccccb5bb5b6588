"""Elementwise safe functions: ``safe_log``, ``safe_div``, ``safe_sqrt``, ``safe_exp``, ``safe_pow``,
``safe_acos``, ``safe_asin`` and ``sanitize`` (a ``nan_to_num`` with finite replacements).

Each either feeds the risky op only safe inputs (the "double where") or is an
``autograd.Function`` whose backward bounds the derivative explicitly; one or two extra
elementwise kernels per call, no host sync. Part of :mod:`safetrain.numerics`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from .limits import _acc, _eps, _finite, _float, _grad_for, _pair

__all__ = ["safe_log", "safe_div", "safe_sqrt", "safe_exp", "safe_pow", "safe_acos", "safe_asin", "sanitize"]


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


def sanitize(tensor: Tensor, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None) -> Tensor:
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
