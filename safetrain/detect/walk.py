"""Walking nested batches: tensors inside tuples, lists, named tuples, dicts and dataclasses.

Shared by the sanitizer's hot path (:func:`map_tensors` rebuilds a container only when one of
its leaves changed, so a batch with nothing to change comes back as the same object) and its
slow path (:func:`iter_tensors` names every tensor by a Python-like path).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple

from torch import Tensor

__all__ = [
    "iter_tensors",
    "map_tensors",
    "batch_size_of",
    "top_items",
    "is_dataclass_instance",
    "rebuild_seq",
    "rebuild_map",
    "rebuild_dataclass",
]


def is_dataclass_instance(obj: Any) -> bool:
    """``True`` for a dataclass instance (not a dataclass type)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def rebuild_seq(obj: Any, items: List[Any]) -> Any:
    """A sequence of ``obj``'s type (named tuples included) holding ``items``."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*items)
    if type(obj) in (list, tuple):
        return type(obj)(items)
    try:
        return type(obj)(items)
    except Exception:  # a sequence subclass with its own constructor: fall back to the base
        return list(items) if isinstance(obj, list) else tuple(items)


def rebuild_map(obj: Mapping, items: dict) -> Any:
    """A mapping of ``obj``'s type (plain ``dict`` if it cannot be built) holding ``items``."""
    if type(obj) is dict:
        return items
    try:
        return type(obj)(items)
    except Exception:  # a mapping subclass with its own constructor
        return dict(items)


def rebuild_dataclass(obj: Any, changes: dict) -> Any:
    """A copy of a dataclass instance with some fields changed (``init=False`` fields too)."""
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError):  # fields with init=False
        new = copy.copy(obj)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        return new


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor of a nested batch; containers are rebuilt only if a leaf changed."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        new = [map_tensors(o, fn) for o in obj]
        if all(n is o for n, o in zip(new, obj)):
            return obj
        return rebuild_seq(obj, new)
    if is_dataclass_instance(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            old = getattr(obj, f.name)
            value = map_tensors(old, fn)
            if value is not old:
                changes[f.name] = value
        return rebuild_dataclass(obj, changes) if changes else obj
    if isinstance(obj, Mapping):
        new_items = {k: map_tensors(v, fn) for k, v in obj.items()}
        if all(new_items[k] is v for k, v in obj.items()):
            return obj
        return rebuild_map(obj, new_items)
    return obj


def top_items(batch: Any) -> Optional[List[Tuple[Any, Any]]]:
    """``(key, value)`` pairs of a dict or dataclass batch's top level; ``None`` for anything else."""
    if is_dataclass_instance(batch):
        return [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    if isinstance(batch, Mapping):
        return list(batch.items())
    return None


def iter_tensors(batch: Any, path: str = "batch") -> Iterator[Tuple[str, Tensor]]:
    """Yield ``(path, tensor)`` for every tensor of a nested batch, depth first.

    Paths read like Python: ``batch["pixels"]``, ``batch[0]``, ``batch.field``.

    Args:
        batch: a nested batch.
        path: the name of the root.

    Returns:
        An iterator of ``(path, tensor)`` pairs.
    """
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, (list, tuple)):
        for i, item in enumerate(batch):
            yield from iter_tensors(item, f"{path}[{i}]")
    elif is_dataclass_instance(batch):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name), f"{path}.{f.name}")
    elif isinstance(batch, Mapping):
        for key, value in batch.items():
            yield from iter_tensors(value, f"{path}[{key!r}]".replace("'", '"'))


def batch_size_of(batch: Any, batch_size: Optional[int] = None) -> Optional[int]:
    """``batch_size`` when given, else the leading size of the first tensor with a dim (depth first)."""
    if batch_size is not None:
        return batch_size
    for _, t in iter_tensors(batch):
        if t.dim() > 0:
            return t.shape[0]
    return None
