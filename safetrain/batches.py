"""How a batch becomes a loss: the three batch conventions, and the input/target split.

* ``(inputs, targets)`` -> ``loss_fn(model(inputs), targets)``;
* a mapping -> ``model(**batch)``, whose output has ``.loss`` or ``["loss"]`` (Hugging Face);
* anything, with a user ``step_fn(model, batch) -> loss``.

A model on an accelerator gets each batch's CPU tensors copied there first (:func:`to_device`).

For sanitizing, a mapping's keys named like targets (``labels``, ``label``, ``targets``,
``target``, ``y``) are its targets and the rest its inputs; a pair's second element is its target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from .detect.batch_scan import TARGET_KEYS
from .detect.walk import iter_tensors, map_tensors
from .errors import BatchError

if TYPE_CHECKING:
    from .detect import RowFinding

__all__ = ["BatchParts", "split_batch", "compute_loss", "row_findings", "without_rows", "to_device", "pageable_tensors"]


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


def to_device(batch: Any, device: torch.device) -> Any:
    """The batch with every CPU tensor copied to ``device``.

    Tensors already on an accelerator stay where they are (a model-parallel user placed them),
    and containers are rebuilt only when something moved. On CUDA the copies are
    ``non_blocking``: from a ``DataLoader(pin_memory=True)`` the host queues them without waiting
    (they run on the current stream, before the forward that reads them); from pageable memory
    the driver stages them first. Other accelerators copy synchronously, since a ``non_blocking``
    copy from pageable memory to MPS can read the source after it was freed.

    Args:
        batch: any nesting of tensors in tuples, lists, dicts and dataclasses.
        device: the model's device.

    Returns:
        The batch on ``device``; a CPU ``device`` returns the batch itself.

    Example::

        >>> batch = {"x": torch.ones(2, 3), "n": 4}
        >>> to_device(batch, torch.device("cpu")) is batch
        True
    """
    if device.type == "cpu":
        return batch
    non_blocking = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking) if t.device.type == "cpu" else t

    return map_tensors(batch, move)


def pageable_tensors(batch: Any) -> List[str]:
    """Paths of the batch's CPU tensors that are not in pinned memory (``batch[0]``...)."""
    return [path for path, t in iter_tensors(batch) if t.device.type == "cpu" and not t.is_pinned()]


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
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:  # first: the common case, before the ABC check
        if loss_fn is None:
            raise BatchError("batch is an (inputs, targets) pair but no loss_fn was given; pass loss_fn= or step_fn=")
        loss = loss_fn(model(batch[0]), batch[1])
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
    else:
        raise BatchError(
            f"cannot train on a batch of type {type(batch).__name__}; expected an (inputs, targets) pair, a dict "
            "for model(**batch), or a step_fn=(model, batch) -> loss"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BatchError(f"the loss must be a scalar tensor; got {shape} (use reduction='mean' or 'sum')")
    return loss


def row_findings(batch: Any, sanitize: Any, root: str = "batch") -> List["RowFinding"]:
    """Exact NaN/Inf rows of a batch by tensor path, for the parts ``sanitize`` checks (slow path: host syncs).

    Args:
        batch: the batch as the loader gave it.
        sanitize: the ``sanitize`` section (a part set to ``off`` is not looked at).
        root: the batch's name in the paths, e.g. ``batch`` gives ``batch[0]`` or ``batch["pixels"]``.
    """
    from .detect import describe_rows

    parts = split_batch(batch)
    if parts.style == "pair":
        found = describe_rows(parts.inputs, f"{root}[0]", "input") if sanitize.inputs != "off" else []
        if sanitize.targets != "off":
            size = parts.inputs.shape[0] if isinstance(parts.inputs, torch.Tensor) and parts.inputs.dim() else None
            found += describe_rows(parts.targets, f"{root}[1]", "target", batch_size=size)
        return found
    found = describe_rows(batch, root, "input", target_keys=TARGET_KEYS if parts.style == "mapping" else None)
    return [f for f in found if getattr(sanitize, "inputs" if f.kind == "input" else "targets") != "off"]


def without_rows(batch: Any, findings: Sequence["RowFinding"]) -> Tuple[Any, int]:
    """The batch without the rows named in ``findings`` (inputs and targets together), and how many went.

    Returns ``(None, n)`` when every row is bad.
    """
    from .detect import drop_rows, iter_tensors

    bad = sorted({r for f in findings for r in f.rows})
    if not bad:
        return batch, 0
    first = next((t for _, t in iter_tensors(split_batch(batch).inputs) if t.dim() > 0), None)
    size = first.shape[0] if first is not None else None
    if size is not None and len(bad) >= size:
        return None, len(bad)
    return drop_rows(batch, bad, batch_size=size), len(bad)
