"""What a replay found: :class:`Diagnosis`, the one result of :meth:`safetrain.diagnose.Diagnoser.explain`.

A frozen record, journaled in the ``anomaly`` event's ``diagnosis`` detail (``to_dict``) and
summed up in the journal line (``describe``). No torch: the replays fill it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..events import jsonable

__all__ = ["Diagnosis"]


@dataclass(frozen=True)
class Diagnosis:
    """What a replay found.

    Attributes:
        reproducible: the replay was non-finite again (``False``: a transient fault; for a
            ``weights`` fault: the steps replayed from the snapshot stayed finite, so the weights
            were changed outside the training step).
        kind: ``"weights"`` when the fault is in the parameters: non-finite before the step, or
            a weight replay; ``None`` for a fault of the step itself.
        nonfinite_weights: the non-finite parameters (before the step, or after the replayed
            step that made them so).
        weights_step: the step (global step number) whose update first made a weight non-finite
            in a weight replay.
        module: the first module (qualified name) whose output was non-finite, ``None`` if none.
        module_type: its class name.
        call_index: which call of that module.
        op: the first op whose output was non-finite from finite inputs and flowed on into a
            non-finite module output or the loss (``aten.log.default``), or, for a weight replay,
            into the broken parameters.
        op_line: the ``file:line in function`` of the user's or the model's code (the innermost,
            say the ``forward`` that ran it) that called it; for a weight replay, the optimizer
            with its hyperparameters (``Adam(lr=0.001, betas=(0.9, 0.999), eps=0, ...)``).
        op_caller: the line that called ``op_line``'s code (a parent module, the user's script).
        backward_node: the autograd node anomaly mode named (``LogBackward0``), if any.
        nonfinite_grads: parameters whose gradient was non-finite in the replay.
        traceback: the forward traceback of that node, trimmed to the user's frames.
        bad_rows: positions in the batch whose loss is non-finite (bisection), in order.
        dataset_indices: the dataset indices of those rows, when known.
        forward_passes: forward passes the bisection used.
        seconds: time the replay took.
        note: why something is missing (budget, time limit, not separable...).
        numerics: a known optimizer numerics fault behind a ``weights`` fault, with its fix
            (``Adam eps=0: ... = NaN in the update ...; fix: ...``), ``""`` when none is known
            (:mod:`.optim_numerics`): no restore or LR backoff changes it.
        micro: which micro-batch of the step the step replay found non-finite (0-based).
        epoch: that micro-batch's epoch (the guard fills it in; ``None``: not known).
        batch_index: that micro-batch's batch index in its epoch (the guard fills it in).
    """

    reproducible: bool
    kind: Optional[str] = None
    nonfinite_weights: Tuple[str, ...] = ()
    weights_step: Optional[int] = None
    module: Optional[str] = None
    module_type: Optional[str] = None
    call_index: Optional[int] = None
    op: Optional[str] = None
    op_line: Optional[str] = None
    op_caller: Optional[str] = None
    backward_node: Optional[str] = None
    nonfinite_grads: Tuple[str, ...] = ()
    traceback: Tuple[str, ...] = ()
    bad_rows: Tuple[int, ...] = ()
    dataset_indices: Tuple[int, ...] = ()
    forward_passes: int = 0
    seconds: float = 0.0
    note: str = ""
    numerics: str = ""
    micro: Optional[int] = None
    epoch: Optional[int] = None
    batch_index: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form for the journal."""
        return jsonable({k: getattr(self, k) for k in self.__dataclass_fields__})

    def describe(self) -> str:
        """One line: where it started and whether it reproduces."""
        if self.kind == "weights":
            return self._describe_weights()
        if not self.reproducible:
            return "transient: the replay from the same state was finite"
        parts = []
        if self.module is not None:
            parts.append(f"first non-finite output in module '{self.module or '<root>'}' ({self.module_type})")
        if self.op is not None:
            parts.append(
                f"op {self.op} at {self.op_line}" + (f" (called from {self.op_caller})" if self.op_caller else "")
            )
        if self.backward_node is not None:
            parts.append(f"backward {self.backward_node}")
        if self.nonfinite_grads:
            parts.append(f"non-finite gradients in {', '.join(self.nonfinite_grads[:5])}")
        if self.bad_rows:
            parts.append(f"bad rows {list(self.bad_rows)} ({self.forward_passes} forward passes)")
        return "reproducible: " + ("; ".join(parts) or self.note or "non-finite again")

    def _describe_weights(self) -> str:
        names = ", ".join(self.nonfinite_weights[:5]) or "parameters"
        if self.weights_step is not None:
            op = f" by {self.op}" + (f" at {self.op_line}" if self.op_line else "") if self.op else ""
            known = f"; {self.numerics}" if self.numerics else ""
            return f"weights: the update of step {self.weights_step} made {names} non-finite{op}{known}"
        if not self.reproducible:
            return f"transient: {self.note}"
        known = f"; {self.numerics}" if self.numerics else ""
        return f"weights: {names} non-finite" + (f" ({self.note})" if self.note else "") + known
