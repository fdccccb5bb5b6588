"""Numerically safe tensor functions: finite values AND finite gradients for every finite input.

Cost: per call, one or two extra elementwise kernels (or at most one extra reduction); no host
sync. A leaf layer, for the user's model (safetrain's engine does not call it). The functions live
by concept in :mod:`~safetrain.numerics.elementwise`, :mod:`~safetrain.numerics.reductions` and
:mod:`~safetrain.numerics.limits` (``default_eps`` and its table); this package's ``__all__`` is
the public surface. Why the plain ops fail, and the rules every helper shares: the documentation's
"Numerically safe functions" (docs/numerics.md).
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
