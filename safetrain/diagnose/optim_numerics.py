"""Known optimizer numerics that make NaN by construction: an ``eps`` the update's dtype cannot hold.

Adam-family and Adagrad-like updates divide by ``sqrt(v) + eps``. An element whose gradient has
always been zero (an embedding row never looked up, a padding row, a dead unit) has ``v = 0`` and a
zero numerator, so with ``eps = 0`` its update is ``0 / (sqrt(0) + 0)`` = NaN at the first step,
whatever the learning rate. ``eps=1e-8`` on float16 parameters or state is the same fault: it
rounds to 0 (float16 holds nothing below ~6e-8). No restore or LR backoff changes it; the fix is in
the optimizer's configuration. Slow path only (called by a diagnosis, never on a healthy step).

Example::

    >>> import torch
    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> explain_optimizer(torch.optim.Adam([p], eps=0.0)).startswith("Adam eps=0")
    True
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

__all__ = ["explain_optimizer", "DIVIDES_BY_EPS"]

#: Optimizers whose update divides by ``sqrt(state) + eps`` (a subclass counts, a name containing
#: one of these too: apex ``FusedAdam``, bitsandbytes ``Adam8bit``).
DIVIDES_BY_EPS = ("Adam", "AdamW", "Adamax", "RAdam", "NAdam", "SparseAdam", "Adagrad", "RMSprop", "Adadelta")


def _divides_by_eps(optimizer: torch.optim.Optimizer) -> bool:
    names = [c.__name__ for c in type(optimizer).__mro__]
    return any(n in DIVIDES_BY_EPS or "adam" in n.lower() or "adagrad" in n.lower() for n in names)


def _held(eps: float, dtype: torch.dtype) -> bool:
    """Whether ``eps`` > 0 survives a cast to ``dtype`` (``torch.tensor(1e-8, dtype=torch.float16) == 0``)."""
    return eps > 0 and (not dtype.is_floating_point or float(torch.tensor(eps, dtype=dtype)) > 0)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fix(dtype: Optional[torch.dtype]) -> str:
    if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits == 16 and dtype != torch.bfloat16:
        return (
            f"fix: an eps {_name(dtype)} can hold (1e-4 is common for float16; the smallest it holds is "
            f"{float(torch.finfo(dtype).smallest_normal) * 2.0**-10:.2g}), or keep float32 master weights and "
            "optimizer state (torch.amp autocast with float32 parameters)"
        )
    return "fix: a positive eps (1e-8, the default, for float32), or float32 optimizer state"


def explain_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] = ()) -> str:
    """Name a known numerics fault of ``optimizer`` for ``params`` (every parameter when empty): an
    ``eps`` that is 0 or rounds to 0 in the parameter's or its state's dtype. ``""`` when none is known.

    Args:
        optimizer: the optimizer whose update broke the weights.
        params: the parameters found non-finite (only their groups are looked at).

    Returns:
        One line naming the optimizer, the ``eps``, the dtype, why it makes NaN and the fix; ``""``
        for an optimizer outside the Adam and Adagrad families, or an ``eps`` the dtypes hold.
    """
    if not _divides_by_eps(optimizer):
        return ""
    ids = {id(p) for p in params}
    found: List[str] = []
    for i, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if isinstance(eps, (tuple, list)):  # Adafactor-style (eps1, eps2): the divisor's is the first
            eps = eps[0]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            continue
        mine = [p for p in group["params"] if not ids or id(p) in ids]
        if not mine:
            continue
        dtypes = {p.dtype for p in mine}
        for p in mine:  # the state the update divides by (exp_avg_sq, square_avg, sum...)
            dtypes |= {t.dtype for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor) and t.dim()}
        lost = sorted((d for d in dtypes if d.is_floating_point and not _held(float(eps), d)), key=str)
        if eps > 0 and not lost:
            continue
        where = f" (param_groups[{i}])" if len(optimizer.param_groups) > 1 else ""
        name = type(optimizer).__name__
        if eps <= 0:
            why = f"{name} eps={eps:g}{where}"
        else:
            why = f"{name} eps={eps:g}{where} rounds to 0 in {', '.join(map(_name, lost))}"
        found.append(
            f"{why}: an element whose gradient is always zero (an unused embedding row, a dead unit) "
            f"gets 0 / (sqrt(0) + 0) = NaN in the update, whatever the learning rate; {_fix(lost[0] if lost else None)}"
        )
    return "; ".join(found)
