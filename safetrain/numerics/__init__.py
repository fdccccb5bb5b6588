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

The functions live by concept in :mod:`~safetrain.numerics.elementwise`,
:mod:`~safetrain.numerics.reductions` and :mod:`~safetrain.numerics.limits` (``default_eps``
and its table); this package's ``__all__`` is the public surface.
"""

from __future__ import annotations

from .elementwise import safe_acos, safe_asin, safe_div, safe_exp, safe_log, safe_pow, safe_sqrt, sanitize
from .limits import default_eps
from .reductions import masked_softmax, safe_logsumexp, safe_norm, stable_log_softmax, stable_softmax

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
