"""How a batch becomes a loss: the three batch conventions, and the input/target split.

* ``(inputs, targets)`` -> ``loss_fn(model(inputs), targets)``;
* a mapping -> ``model(**batch)``, whose output has ``.loss`` or ``["loss"]`` (Hugging Face);
* anything, with a user ``step_fn(model, batch) -> loss``.

A model on an accelerator gets each batch's CPU tensors copied there first (:func:`to_device`).

For sanitizing, a mapping's keys named like targets (``labels``, ``label``, ``targets``,
``target``, ``y``) are its targets and the rest its inputs; a pair's second element is its target.
A named tuple of two fields, or a dataclass of two fields none named like a target, is a pair
too (sanitized, and with ``loss_fn`` trained, like ``(inputs, targets)``); a dataclass with
target-named fields is split by those names, as a mapping is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from ..detect.batch_scan import TARGET_KEYS
from ..detect.walk import is_dataclass_instance, iter_tensors, map_tensors, rebuild_dataclass
from ..errors import BatchError

if TYPE_CHECKING:
    from ..detect import RowFinding

__all__ = [
    "BatchParts",
    "split_batch",
    "batch_rows",
    "compute_loss",
    "row_findings",
    "without_rows",
    "to_device",
    "pageable_tensors",
]


@dataclass(frozen=True)
class BatchParts:
    """A batch split into what the sanitizer treats as inputs and as targets.

    Attributes:
        inputs: the input part (any nesting of tensors).
        targets: the target part, or ``None`` when the batch has none that can be told apart.
        style: ``"pair"``, ``"mapping"``, ``"fields"`` (a dataclass split by field names) or
            ``"other"``; :meth:`join` rebuilds the batch's type.
        kind: the original container type, for :meth:`join`.
        source: the original batch when it is a dataclass (to rebuild it), else ``None``.
        names: the two field names of a named-tuple or dataclass pair, else ``None`` (for paths).
    """

    inputs: Any
    targets: Any
    style: str
    kind: type
    source: Any = None
    names: Optional[Tuple[str, str]] = None

    def join(self, inputs: Any, targets: Any) -> Any:
        """Rebuild a batch of the original shape from (possibly cleaned) parts."""
        if self.style == "pair":
            if self.names is not None:
                if self.source is not None:  # a dataclass pair
                    return rebuild_dataclass(self.source, dict(zip(self.names, (inputs, targets))))
                return self.kind(inputs, targets)  # a named tuple
            return self.kind((inputs, targets)) if self.kind in (tuple, list) else (inputs, targets)
        if self.style == "fields":
            return rebuild_dataclass(self.source, {**inputs, **(targets or {})})
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
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        names = getattr(batch, "_fields", None)  # a named tuple (x, y) is a pair too
        return BatchParts(batch[0], batch[1], "pair", type(batch), names=tuple(names) if names else None)
    if is_dataclass_instance(batch):
        fields = [f.name for f in dataclasses.fields(batch)]
        if any(name in TARGET_KEYS for name in fields):
            inputs = {n: getattr(batch, n) for n in fields if n not in TARGET_KEYS}
            targets = {n: getattr(batch, n) for n in fields if n in TARGET_KEYS}
            return BatchParts(inputs, targets, "fields", type(batch), source=batch)
        if len(fields) == 2:
            a, b = fields
            return BatchParts(getattr(batch, a), getattr(batch, b), "pair", type(batch), source=batch, names=(a, b))
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k not in TARGET_KEYS}
        targets = {k: v for k, v in batch.items() if k in TARGET_KEYS}
        return BatchParts(inputs, targets or None, "mapping", type(batch))
    return BatchParts(batch, None, "other", type(batch))


def batch_rows(batch: Any) -> Optional[int]:
    """The number of rows of a batch: the leading size of its first tensor with a dim (depth first,
    the rule of :mod:`safetrain.detect.batch_scan`); ``None`` when no tensor has one. Host only
    (shapes, no sync); ``0`` is an empty batch, which the guard skips as a data event.

    Example::

        >>> batch_rows((torch.zeros(0, 3), torch.zeros(0))), batch_rows({"x": torch.zeros(5, 2)})
        (0, 5)
    """
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor and batch[0].ndim:
        return batch[0].shape[0]  # the common case, without the walk
    return _first_rows(batch)


def _first_rows(obj: Any) -> Optional[int]:
    if isinstance(obj, torch.Tensor):
        return obj.shape[0] if obj.ndim > 0 else None
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif is_dataclass_instance(obj):
        items = (getattr(obj, f.name) for f in dataclasses.fields(obj))
    elif isinstance(obj, Mapping):
        items = obj.values()
    else:
        return None
    for item in items:
        rows = _first_rows(item)
        if rows is not None:
            return rows
    return None


def compute_loss(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
) -> torch.Tensor:
    """Run the forward pass and return the scalar loss, under the batch conventions above.

    Raises:
        BatchError: the batch fits no convention; its tensors are on the ``meta`` device; or the
            loss is not a floating scalar tensor, or (with autograd on) does not require grad.
    """
    try:
        loss = _forward(model, batch, loss_fn, step_fn)
    except (RuntimeError, NotImplementedError) as exc:
        meta = [p for p, t in iter_tensors(batch) if t.is_meta]
        if not meta:
            raise
        raise BatchError(
            f"batch tensors {', '.join(meta[:4])} are on the 'meta' device (shapes only, no data); expected "
            "tensors with data, on the model's device or the CPU"
        ) from exc
    if (
        not (loss.__class__ is torch.Tensor or isinstance(loss, torch.Tensor)) or loss.ndim != 0
    ):  # (a plain tensor: no call)
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BatchError(f"the loss must be a scalar tensor; got {shape} (use reduction='mean' or 'sum')")
    if loss.is_meta:
        raise BatchError(
            "the loss is on the 'meta' device (shapes only, no data); expected a model and batch with data "
            "(a model built on 'meta' needs to_empty() and its weights loaded first)"
        )
    if not loss.dtype.is_floating_point:
        raise BatchError(
            f"the loss has dtype {str(loss.dtype).replace('torch.', '')}; expected a floating-point scalar "
            "computed from the model's output (an integer or bool loss has no gradient)"
        )
    if not loss.requires_grad and torch.is_grad_enabled():
        raise BatchError(
            "the loss does not require grad (made with .detach(), .item(), torch.tensor(...) or under "
            "torch.no_grad()); expected a loss computed from the model's output with autograd on, so that "
            "backward() reaches the parameters"
        )
    return loss


def _forward(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Optional[Callable[..., torch.Tensor]],
    step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]],
) -> Any:
    if step_fn is not None:
        return step_fn(model, batch)
    plain = batch.__class__ is tuple or batch.__class__ is list  # (no call for the common case)
    if (plain or isinstance(batch, (tuple, list))) and len(batch) == 2:  # first: the common case, before the ABC check
        if loss_fn is None:
            raise BatchError("batch is an (inputs, targets) pair but no loss_fn was given; pass loss_fn= or step_fn=")
        return loss_fn(model(batch[0]), batch[1])
    if is_dataclass_instance(batch) and loss_fn is not None:
        parts = split_batch(batch)
        if parts.style == "pair":
            return loss_fn(model(parts.inputs), parts.targets)
    if isinstance(batch, Mapping):
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise BatchError(
                f"model(**batch) returned {type(out).__name__} without a 'loss'; expected an output with .loss or "
                "['loss'] (Hugging Face style), or pass step_fn=(model, batch) -> loss"
            )
        return loss
    raise BatchError(
        f"cannot train on a batch of type {type(batch).__name__}; expected an (inputs, targets) pair, a dict "
        "for model(**batch), or a step_fn=(model, batch) -> loss"
    )


def row_findings(batch: Any, sanitize: Any, root: str = "batch") -> List["RowFinding"]:
    """Exact NaN/Inf rows of a batch by tensor path, for the parts ``sanitize`` checks (slow path: host syncs).

    Args:
        batch: the batch as the loader gave it.
        sanitize: the ``sanitize`` section (a part set to ``off`` is not looked at).
        root: the batch's name in the paths, e.g. ``batch`` gives ``batch[0]`` or ``batch["pixels"]``.
    """
    from ..detect import describe_rows

    parts = split_batch(batch)
    if parts.style == "pair":
        sep = "." if parts.source is not None else ""  # a dataclass pair's paths name its fields
        first, second = (f"{sep}{n}" for n in parts.names) if parts.names and sep else ("[0]", "[1]")
        found = describe_rows(parts.inputs, f"{root}{first}", "input") if sanitize.inputs != "off" else []
        if sanitize.targets != "off":
            size = parts.inputs.shape[0] if isinstance(parts.inputs, torch.Tensor) and parts.inputs.dim() else None
            found += describe_rows(parts.targets, f"{root}{second}", "target", batch_size=size)
        return found
    named = parts.style in ("mapping", "fields")
    found = describe_rows(batch, root, "input", target_keys=TARGET_KEYS if named else None)
    return [f for f in found if getattr(sanitize, "inputs" if f.kind == "input" else "targets") != "off"]


def without_rows(batch: Any, findings: Sequence["RowFinding"]) -> Tuple[Any, int]:
    """The batch without the rows named in ``findings`` (inputs and targets together), and how many went.

    Returns ``(None, n)`` when every row is bad.
    """
    from ..detect import drop_rows, iter_tensors

    bad = sorted({r for f in findings for r in f.rows})
    if not bad:
        return batch, 0
    first = next((t for _, t in iter_tensors(split_batch(batch).inputs) if t.dim() > 0), None)
    size = first.shape[0] if first is not None else None
    if size is not None and len(bad) >= size:
        return None, len(bad)
    return drop_rows(batch, bad, batch_size=size), len(bad)
