"""JSON encoding of non-tensor training state, exact and without pickle.

Scheduler, scaler, optimizer hyperparameters, RNG tuples and the engine's own state are plain
Python values that JSON almost covers. The gaps are filled with small tagged objects so that a
round trip is exact: tuples stay tuples (Adam's ``betas``), non-finite floats survive
(``ReduceLROnPlateau.mode_worse`` is ``inf``), dicts may have non-string keys, numpy scalars keep
their dtype, and tensors found inside such state are moved to the snapshot's tensor table and
replaced by a reference to their name. Anything else (functions, arbitrary objects) is refused
with :class:`~safetrain.errors.SnapshotError`, because storing it would need pickle.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping

import numpy as np
import torch

from ..errors import SnapshotError

__all__ = ["encode", "decode"]

# Tags are single-key objects whose key starts with "$"; plain dicts with such keys are tagged too.
_TUPLE, _FLOAT, _DICT, _TENSOR, _NUMPY = "$tuple", "$float", "$dict", "$tensor", "$numpy"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Values JSON holds as they are (exact types: bool/int subclasses such as numpy's or IntEnum are not).
_AS_IS = frozenset({bool, int, str, type(None)})
_LEAVES = _AS_IS | {float}  # what decode returns as it is


def encode(obj: Any, path: str, sink: Callable[[str, torch.Tensor], None]) -> Any:
    """Turn ``obj`` into a JSON-ready value; tensors go to ``sink(name, tensor)`` as references.

    Args:
        obj: the value to encode: None, bool, int, float, str, list, tuple, dict, numpy scalar
            or ``torch.Tensor``, nested freely.
        path: where ``obj`` lives, ``/``-separated (``"sched/_last_lr"``); used for tensor names
            and for error messages.
        sink: called with ``(path, tensor)`` for every tensor met; the tensor is stored under
            that name and the JSON holds ``{"$tensor": path}``.

    Returns:
        A value made of dicts with string keys, lists, strings, ints, finite floats, bools and None.

    Raises:
        SnapshotError: ``obj`` holds a value that cannot be stored without pickle; the message
            gives its path and type.
    """
    kind = type(obj)  # (exact types first, without a call: a snapshot encodes hundreds of values)
    if kind in _AS_IS or (kind is float and obj - obj == 0.0):
        return obj
    if kind is dict and all([type(k) is str and k[:1] != "$" for k in obj]):  # (a plain value: no call)
        return {
            k: v if type(v) in _AS_IS or (type(v) is float and v - v == 0.0) else encode(v, f"{path}/{k}", sink)
            for k, v in obj.items()
        }
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # (optimizer state: no isinstance chain)
        sink(path, obj)
        return {_TENSOR: path}
    if kind is list:
        return _encode_items(obj, path, sink)
    if isinstance(obj, (np.number, np.bool_)):  # before float: np.float64 subclasses float
        return {_NUMPY: [obj.dtype.str, encode(obj.item(), path, sink)]}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {_FLOAT: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, torch.Tensor):
        sink(path, obj)
        return {_TENSOR: path}
    if isinstance(obj, tuple):
        return {_TUPLE: _encode_items(obj, path, sink)}
    if isinstance(obj, list):
        return _encode_items(obj, path, sink)
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, f"{path}/{k}", sink) for k, v in obj.items()}
        return {_DICT: [[encode(k, f"{path}/key", sink), encode(v, f"{path}/{k}", sink)] for k, v in obj.items()]}
    what = "a function" if callable(obj) else f"a {type(obj).__module__}.{type(obj).__qualname__}"
    raise SnapshotError(
        f"{path}: is {what}, which a snapshot cannot hold without pickle; snapshots store tensors, "
        "numbers, strings, lists, tuples and dicts (make the object's state_dict() return those)"
    )


def _encode_items(items: Any, path: str, sink: Callable[[str, torch.Tensor], None]) -> list:
    """Encode a sequence's items; plain numbers and strings are taken as they are, without a call
    each (a loss window of 128 floats is most of the engine's state, snapshotted every 100 steps)."""
    return [
        v if type(v) in _AS_IS or (type(v) is float and v - v == 0.0) else encode(v, f"{path}/{i}", sink)
        for i, v in enumerate(items)
    ]


def decode(obj: Any, tensors: Mapping[str, torch.Tensor], where: str = "snapshot") -> Any:
    """Invert :func:`encode`: rebuild tuples, non-finite floats, keyed dicts and tensor references.

    Args:
        obj: a value produced by :func:`encode` (after a JSON round trip).
        tensors: the snapshot's tensors by name, for ``{"$tensor": name}`` references.
        where: the file or store named in error messages.

    Raises:
        SnapshotError: a reference names a missing tensor, or a tag is malformed.
    """
    kind = type(obj)  # (exact types first, without a call: JSON gives exact lists and dicts)
    if kind is list or (kind is not dict and isinstance(obj, list)):  # (a plain item as it is: no call per item)
        return [v if type(v) in _LEAVES else decode(v, tensors, where) for v in obj]
    if kind is not dict and not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == _TUPLE:
            return tuple(decode(v, tensors, where) for v in value)
        if tag == _FLOAT:
            if value not in _NONFINITE:
                raise SnapshotError(f"{where}: bad float tag {value!r} in metadata (corrupted?)")
            return _NONFINITE[value]
        if tag == _TENSOR:
            if value not in tensors:
                raise SnapshotError(f"{where}: metadata refers to tensor {value!r}, which the snapshot lacks")
            return tensors[value]
        if tag == _NUMPY:
            return np.dtype(value[0]).type(decode(value[1], tensors, where))
        if tag == _DICT:
            return {decode(k, tensors, where): decode(v, tensors, where) for k, v in value}
    return {k: v if type(v) in _LEAVES else decode(v, tensors, where) for k, v in obj.items()}


def tensor_refs(obj: Any) -> Dict[str, None]:
    """The tensor names an encoded value refers to, in order (a dict used as an ordered set)."""
    found: Dict[str, None] = {}

    def walk(o: Any) -> None:
        if isinstance(o, list):
            for v in o:
                walk(v)
        elif isinstance(o, dict):
            if len(o) == 1 and _TENSOR in o:
                found[o[_TENSOR]] = None
            else:
                for v in o.values():
                    walk(v)

    walk(obj)
    return found
