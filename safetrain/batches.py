"""How a batch becomes a loss: the three batch conventions, and the input/target split.

* ``(inputs, targets)`` -> ``loss_fn(model(inputs), targets)``;
* a mapping -> ``model(**batch)``, whose output has ``.loss`` or ``["loss"]`` (Hugging Face);
* anything, with a user ``step_fn(model, batch) -> loss``.

For sanitizing, a mapping's keys named like targets (``labels``, ``label``, ``targets``,
``target``, ``y``) are its targets and the rest its inputs; a pair's second element is its target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from .errors import BatchError

__all__ = ["BatchParts", "split_batch", "compute_loss", "TARGET_KEYS"]

#: Mapping keys treated as targets by the sanitizer.
TARGET_KEYS = frozenset({"labels", "label", "targets", "target", "y"})


@dataclass(frozen=True)
class BatchParts:
    """A batch split into what the sanitizer treats as inputs and as targets.

    Attributes:
        inputs: the input part (any nesting of tensors).
        targets: the target part, or ``None`` when the batch has none that can be told apart.
        style: ``"pair"``, ``"mapping"`` or ``"other"``; :meth:`join` rebuilds the batch's type.
        kind: the original container type, for :meth:`join`.
    """

    inputs: Any
    targets: Any
    style: str
    kind: type

    def join(self, inputs: Any, targets: Any) -> Any:
        """Rebuild a batch of the original shape from (possibly cleaned) parts."""
        if self.style == "pair":
            return self.kind((inputs, targets)) if self.kind in (tuple, list) else (inputs, targets)
        if self.style == "mapping":
            merged = {**inputs, **(targets or {})}
            try:
                return self.kind(merged)
            except TypeError:
                return merged
        return inputs


def split_batch(batch: Any) -> BatchParts:
    """Split a batch into inputs and targets (see the module docstring for the rules)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not hasattr(batch, "_fields"):
        return BatchParts(batch[0], batch[1], "pair", type(batch))
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k not in TARGET_KEYS}
        targets = {k: v for k, v in batch.items() if k in TARGET_KEYS}
        return BatchParts(inputs, targets or None, "mapping", type(batch))
    return BatchParts(batch, None, "other", type(batch))


def compute_loss(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
) -> torch.Tensor:
    """Run the forward pass and return the scalar loss, under the batch conventions above.

    Raises:
        BatchError: the batch fits no convention, or the loss is not a scalar tensor.
    """
    if step_fn is not None:
        loss = step_fn(model, batch)
    elif isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise BatchError(
                f"model(**batch) returned {type(out).__name__} without a 'loss'; expected an output with .loss or "
                "['loss'] (Hugging Face style), or pass step_fn=(model, batch) -> loss"
            )
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        if loss_fn is None:
            raise BatchError("batch is an (inputs, targets) pair but no loss_fn was given; pass loss_fn= or step_fn=")
        loss = loss_fn(model(batch[0]), batch[1])
    else:
        raise BatchError(
            f"cannot train on a batch of type {type(batch).__name__}; expected an (inputs, targets) pair, a dict "
            "for model(**batch), or a step_fn=(model, batch) -> loss"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BatchError(f"the loss must be a scalar tensor; got {shape} (use reduction='mean' or 'sum')")
    return loss
