"""Buffers non-finite by design (a float causal mask holds ``-inf``): accepted as part of the model.

A model that registers ``nn.Transformer.generate_square_subsequent_mask(n)`` (or a hand-written
``torch.triu(torch.full((n, n), float("-inf")), 1)``) as a buffer holds ``-inf`` on purpose; refusing
every snapshot of it would leave a run with nothing to restore. ``-inf`` above the diagonal is
what PyTorch's own helper returns (https://github.com/pytorch/pytorch/issues/28272 and
https://github.com/pytorch/pytorch/issues/29820 print it), so such a buffer is the model, not a fault.

Only infinities are accepted: a mask holds ``-inf`` (or ``+inf``), never NaN. A buffer holding NaN at
the start is a corrupted one (a BatchNorm ``running_var`` from a bad checkpoint conversion): it would
make every evaluation NaN, so it is not accepted and the run stops as a broken start, naming it.

What is accepted is the buffer AS IT WAS at the start of the run: its *pattern*, a cheap device-side
fingerprint (the counts of NaN, +inf and -inf and a position hash of the non-finite entries). A
snapshot checks an accepted buffer against its pattern instead of for finiteness, in the same
device pass and host read as every other tensor; a buffer that gains, loses or moves a non-finite
entry is refused like any non-finite state; one that turns all finite is not (a quantization
observer's ``+-inf`` start values become the data's range at its first batch). The patterns travel
in every snapshot's metadata, so a resumed run keeps the acceptance. Slow path only (a snapshot, the start of a run).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Sequence, Tuple, Union

import torch
from torch.nn.parameter import is_lazy

__all__ = ["Pattern", "pattern", "patterns_of", "matches", "pattern_tensor", "describe", "check_patterns"]

#: ``(nan, posinf, neginf, position hash)`` of a tensor's non-finite entries.
Pattern = Tuple[int, int, int, int]

# Position hash: each non-finite entry adds code * weight(index), code 1/2/3 for NaN/+inf/-inf and
# weight a multiplicative hash of the flat index in [1, _PRIME]; int64 holds index * _MIX below 3e9 entries.
_MIX = 2654435761
_PRIME = 1000003


def pattern(t: torch.Tensor) -> torch.Tensor:
    """The non-finite pattern of a real floating tensor, as a 4-element int64 tensor on its device
    (no host sync): counts of NaN, +inf, -inf, and a hash of where they are.

    Example::

        >>> pattern(torch.tensor([0.0, float("-inf"), float("-inf")])).tolist()[:3]
        [0, 0, 2]
    """
    flat = t.detach().reshape(-1)
    nan, pos, neg = torch.isnan(flat), torch.isposinf(flat), torch.isneginf(flat)
    idx = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64)
    code = nan.long() + 2 * pos.long() + 3 * neg.long()
    position = (code * ((idx * _MIX) % _PRIME + 1)).sum()
    return torch.stack([nan.sum(), pos.sum(), neg.sum(), position])


def patterns_of(named: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, Pattern]:
    """The patterns of the real floating tensors among ``named`` that hold an Inf and no NaN.

    Slow path (the start of a run): one host read for finiteness, then one per non-finite tensor.

    Example::

        >>> patterns_of([("w", torch.ones(2)), ("mask", torch.tensor([0.0, float("-inf")]))])["mask"][:3]
        (0, 0, 1)
    """
    items = [(n, t.detach()) for n, t in named if t.is_floating_point() and not (is_lazy(t) or t.is_meta) and t.numel()]
    if not items:
        return {}
    finite = torch.stack([torch.isfinite(t).all() for _, t in items]).tolist()  # host sync: start of a run
    found = {n: _as_pattern(pattern(t).tolist()) for (n, t), ok in zip(items, finite) if not ok}
    return {n: p for n, p in found.items() if p[0] == 0}  # NaN is no mask: corruption (a BatchNorm statistic)


def matches(t: torch.Tensor, expected: Union[Sequence[int], torch.Tensor]) -> torch.Tensor:
    """A 0-d float32 device value: 0 when ``t`` has the ``expected`` pattern or is all finite
    now, NaN when not. Going finite is no fault: a quantization observer's ``min_val``/``max_val``
    start at ``+inf``/``-inf`` and take the data's range at the first forward
    (``torch.ao.quantization.MinMaxObserver``); a NaN, or infinities elsewhere, are.

    ``expected`` as a tensor on ``t``'s device (:func:`pattern_tensor`) costs no host sync; as
    numbers it is copied to the device first (on CUDA a blocking copy: snapshot steps only).
    """
    want = expected if isinstance(expected, torch.Tensor) else pattern_tensor(expected, t.device)
    now = pattern(t)
    ok = (now == want).all() | (now[:3] == 0).all()
    return torch.where(ok, 0.0, float("nan")).to(torch.float32)


def pattern_tensor(expected: Sequence[int], device: torch.device) -> torch.Tensor:
    """``expected`` as the int64 device tensor :func:`matches` compares with (make it once, reuse it)."""
    return torch.tensor(list(expected), dtype=torch.int64, device=device)


def describe(patterns: Mapping[str, Sequence[int]], prefix: str = "model/") -> str:
    """``mask (-inf x 28), pe (NaN x 2)``: the accepted buffers for a message, ``prefix`` dropped.

    Example::

        >>> describe({"model/mask": (0, 0, 28, 1)})
        'mask (-inf x 28)'
    """
    parts = []
    for name, p in patterns.items():
        what = [f"{label} x {int(n)}" for label, n in zip(("NaN", "+inf", "-inf"), p[:3]) if n]
        parts.append(f"{name[len(prefix) :] if name.startswith(prefix) else name} ({', '.join(what)})")
    return ", ".join(parts)


def check_patterns(value: object, where: str) -> Dict[str, Pattern]:
    """A snapshot's ``model.accepted`` metadata, validated: ``{name: [nan, posinf, neginf, hash]}``.

    Raises:
        ValueError: naming ``where`` and what is malformed (the caller turns it into a corrupt-snapshot error).
    """
    if not isinstance(value, dict):
        raise ValueError(f"{where}: model.accepted is {type(value).__name__}; expected a dict")
    out: Dict[str, Pattern] = {}
    for name, p in value.items():
        ok = isinstance(p, (list, tuple)) and len(p) == 4
        if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in p):
            raise ValueError(f"{where}: model.accepted[{name!r}] is {p!r:.60}; expected 4 integers")
        out[str(name)] = _as_pattern(p)
    return out


def _as_pattern(values: List[int]) -> Pattern:
    a, b, c, d = (int(v) for v in values)
    return (a, b, c, d)
