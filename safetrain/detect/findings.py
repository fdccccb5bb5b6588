"""Typed, frozen descriptions of what a detector found, built on the host after a flag tripped.

Every finding is a frozen dataclass with the step's context (``step``, ``epoch``,
``batch_index``) and a ``kind`` from :data:`safetrain.kinds.ANOMALY_KINDS` (``input``,
``target``, ``forward``, ``loss``, ``gradient``, ``weights``). ``to_dict()`` gives a JSON-ready
dict (non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``, tuples become lists)
and ``to_json()`` the strict JSON text. Nothing here runs on the healthy path: building a
finding reads tensors on the host, and each such read is marked ``# host sync:``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .norms import HUGE_NORM

__all__ = [
    "Finding",
    "TensorStats",
    "RowFinding",
    "ModuleFinding",
    "LossFinding",
    "GradFinding",
    "WeightFinding",
    "tensor_stats",
]

#: How many leading values of a tensor a finding keeps (``TensorStats.head``).
HEAD = 8


def _json_ready(value: Any) -> Any:
    """Turn a value into something ``json.dumps(allow_nan=False)`` accepts."""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


@dataclass(frozen=True, kw_only=True)
class TensorStats:
    """What a tensor held when it was found non-finite (host-side numbers only).

    Attributes:
        shape: the tensor's shape.
        dtype: the dtype's name, e.g. ``"float32"``.
        nan_count: number of NaN elements.
        inf_count: number of +-Inf elements.
        finite_min: the smallest finite value, ``None`` when no element is finite.
        finite_max: the largest finite value, ``None`` when no element is finite.
        head: the first :data:`HEAD` values in memory order (flattened), NaN/Inf kept.
    """

    shape: Tuple[int, ...]
    dtype: str
    nan_count: int
    inf_count: int
    finite_min: Optional[float]
    finite_max: Optional[float]
    head: Tuple[float, ...]

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict of these statistics."""
        return _json_ready(dataclasses.asdict(self))


def tensor_stats(tensor: torch.Tensor, head: int = HEAD) -> TensorStats:
    """Summarize a tensor for a finding: shape, dtype, NaN/Inf counts, finite range, first values.

    Slow path only: this reads the tensor on the host.

    Args:
        tensor: any tensor; non-floating tensors report zero NaN/Inf.
        head: how many leading values to keep.

    Returns:
        A :class:`TensorStats`.
    """
    t = tensor.detach()
    dtype = str(t.dtype).replace("torch.", "")
    if not (t.is_floating_point() or t.is_complex()):
        t = t.double()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    nan = torch.isnan(flat)
    inf = torch.isinf(flat)
    finite = flat[~(nan | inf)]
    # host sync: slow path only; counts, range and head come to the host together.
    packed = torch.stack(
        [
            nan.sum().double(),
            inf.sum().double(),
            finite.min().double() if finite.numel() else torch.tensor(math.nan, dtype=torch.float64, device=t.device),
            finite.max().double() if finite.numel() else torch.tensor(math.nan, dtype=torch.float64, device=t.device),
        ]
    ).tolist()
    any_finite = finite.numel() > 0
    return TensorStats(
        shape=tuple(tensor.shape),
        dtype=dtype,
        nan_count=int(packed[0]),
        inf_count=int(packed[1]),
        finite_min=packed[2] if any_finite else None,
        finite_max=packed[3] if any_finite else None,
        head=tuple(float(v) for v in flat[:head].double().tolist()),  # host sync: slow path only
    )


@dataclass(frozen=True, kw_only=True)
class Finding:
    """The base of every finding: its kind and where in training it happened.

    Attributes:
        kind: one of ``input``, ``target``, ``forward``, ``loss``, ``gradient``, ``weights``.
        step: the optimizer step (the guard's counter), ``None`` outside a guard.
        epoch: the epoch, ``None`` when unknown.
        batch_index: the batch's index in its epoch, ``None`` when unknown.
    """

    kind: str
    step: Optional[int] = None
    epoch: Optional[int] = None
    batch_index: Optional[int] = None

    def with_context(
        self, step: Optional[int] = None, epoch: Optional[int] = None, batch_index: Optional[int] = None
    ) -> "Finding":
        """A copy with the step context filled in (``None`` keeps the current value).

        Args:
            step: the optimizer step.
            epoch: the epoch.
            batch_index: the batch's index in its epoch.

        Returns:
            A new finding of the same class.
        """
        return dataclasses.replace(
            self,
            step=self.step if step is None else step,
            epoch=self.epoch if epoch is None else epoch,
            batch_index=self.batch_index if batch_index is None else batch_index,
        )

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict: ``{"type": <class name>, <fields>...}``; non-finite floats as strings."""
        out: Dict[str, Any] = {"type": type(self).__name__}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, TensorStats) else value
        return _json_ready(out)

    def to_json(self) -> str:
        """Strict JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), allow_nan=False)

    def describe(self) -> str:
        """One human-readable line (used in logs and error messages)."""
        return f"{self.kind} anomaly{_where(self)}"


def _where(f: Finding) -> str:
    parts = [f"{n} {v}" for n, v in (("step", f.step), ("epoch", f.epoch), ("batch", f.batch_index)) if v is not None]
    return f" at {', '.join(parts)}" if parts else ""


@dataclass(frozen=True, kw_only=True)
class RowFinding(Finding):
    """Non-finite values in one tensor of a batch, by row (``kind`` is ``input`` or ``target``).

    Attributes:
        path: where the tensor sits in the batch, e.g. ``batch["pixels"]`` or ``batch[0]``.
        rows: indices (along dim 0) of the rows holding NaN or Inf.
        nan_count: NaN elements in the whole tensor.
        inf_count: Inf elements in the whole tensor.
        shape: the tensor's shape.
        dtype: the dtype's name.
        row_counts: ``(row, nan, inf)`` per bad row, in row order.
    """

    path: str
    rows: Tuple[int, ...]
    nan_count: int
    inf_count: int
    shape: Tuple[int, ...]
    dtype: str
    row_counts: Tuple[Tuple[int, int, int], ...] = ()

    def describe(self) -> str:
        """``batch["pixels"]: rows [3, 7] hold 5 NaN and 1 Inf (shape (8, 3), float32)``."""
        rows = list(self.rows[:20]) + (["..."] if len(self.rows) > 20 else [])
        rows_text = ", ".join(str(r) for r in rows)
        return (
            f"{self.path}: rows [{rows_text}] hold {self.nan_count} NaN and {self.inf_count} Inf "
            f"(shape {tuple(self.shape)}, {self.dtype}){_where(self)}"
        )


@dataclass(frozen=True, kw_only=True)
class ModuleFinding(Finding):
    """The first module, in execution order, whose output was non-finite (``kind="forward"``).

    Attributes:
        module: the module's qualified name (``""`` is the root model).
        module_type: the module's class name.
        call_index: which call of that module in the forward (0 for the first; shared modules and
            RNN cells are called several times).
        position: the index of that call among all monitored calls of the forward.
        value: the cheap reduction the hook recorded (non-finite when it tripped).
        confirmed: ``True`` when an exact host-side check of the output showed NaN/Inf; ``False``
            when only the cheap reduction is known (it may have overflowed on finite values).
        output: statistics of the output, when the tensors were inspected.
        input: statistics of the first floating input, when the tensors were inspected.
    """

    module: str
    module_type: str
    call_index: int = 0
    position: int = 0
    value: float = math.nan
    confirmed: bool = False
    output: Optional[TensorStats] = None
    input: Optional[TensorStats] = None

    def describe(self) -> str:
        """``non-finite output in module 'layers.3' (Linear), call 0``, with counts when known."""
        name = self.module or "<root>"
        text = f"non-finite output in module '{name}' ({self.module_type}), call {self.call_index}"
        if self.output is not None:
            text += f": {self.output.nan_count} NaN, {self.output.inf_count} Inf in shape {tuple(self.output.shape)}"
        return text + _where(self)


@dataclass(frozen=True, kw_only=True)
class LossFinding(Finding):
    """A non-finite loss (``kind="loss"``).

    Attributes:
        value: the loss as read on the host.
    """

    value: float

    def describe(self) -> str:
        """``loss is nan at step 12``."""
        return f"loss is {self.value}{_where(self)}"


@dataclass(frozen=True, kw_only=True)
class GradFinding(Finding):
    """Non-finite or too-large gradients, by parameter (``kind="gradient"`` or ``"grad_norm"``).

    Attributes:
        total_norm: the total L2 norm of all gradients: the true one when every element is
            finite, even where the float32 squares overflowed (Inf when some gradient is).
        threshold: ``guard.grad_norm_threshold`` when set.
        nonfinite: names of the parameters whose gradient holds NaN or Inf.
        above_threshold: names of the parameters whose gradient norm exceeds ``threshold``.
        norms: ``(name, norm)`` for every parameter named above, largest first.
        overflowing: names of the parameters whose float32 norm overflowed to Inf although every
            element of their gradient is finite (their true norm is in ``norms``).
    """

    total_norm: float
    threshold: Optional[float] = None
    nonfinite: Tuple[str, ...] = ()
    above_threshold: Tuple[str, ...] = ()
    norms: Tuple[Tuple[str, float], ...] = ()
    overflowing: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        """As :meth:`Finding.to_dict`, with ``norms`` as a ``{name: norm}`` mapping."""
        out = super().to_dict()
        out["norms"] = _json_ready({name: norm for name, norm in self.norms})
        return out

    def describe(self) -> str:
        """``gradient: non-finite in fc.weight; total norm inf``, or for finite gradients too
        large for float32 ``grad_norm: ...; total norm 3.2e+21 (overflows float32, every element finite)``."""
        parts = []
        if self.nonfinite:
            parts.append(f"non-finite in {', '.join(self.nonfinite[:10])}")
        if self.overflowing:
            parts.append(f"float32 norm overflows in {', '.join(self.overflowing[:10])}")
        if self.above_threshold:
            parts.append(f"above {self.threshold} in {', '.join(self.above_threshold[:10])}")
        total = f"total norm {self.total_norm:.4g}"
        if not self.nonfinite and math.isfinite(self.total_norm) and self.total_norm >= HUGE_NORM:
            total += " (overflows float32, every element finite)"
        return f"{self.kind}: {'; '.join(parts) or 'no parameter named'}; {total}{_where(self)}"


@dataclass(frozen=True, kw_only=True)
class WeightFinding(Finding):
    """Parameters holding NaN or Inf at a weight check (``kind="weights"``).

    Attributes:
        nonfinite: names of the poisoned parameters (on this process).
        counts: ``(name, nan, inf)`` per poisoned parameter.
        ranks: under ``torch.distributed``, the ranks whose parameters are poisoned (this one's
            ``nonfinite`` is empty when only others' are); empty in one process.
    """

    nonfinite: Tuple[str, ...]
    counts: Tuple[Tuple[str, int, int], ...] = ()
    ranks: Tuple[int, ...] = ()

    def describe(self) -> str:
        """``weights: non-finite values in fc.weight``."""
        ranks = ", ".join(map(str, self.ranks))
        if not self.nonfinite:
            return f"weights: non-finite parameters on rank(s) {ranks}{_where(self)}"
        on = f" (rank(s) {ranks})" if self.ranks else ""
        return f"weights: non-finite values in {', '.join(self.nonfinite[:10])}{on}{_where(self)}"
