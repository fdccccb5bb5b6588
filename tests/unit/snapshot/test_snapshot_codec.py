"""The JSON codec of non-tensor state: exact round trips, tensor references, refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from safetrain.errors import SnapshotError
from safetrain.snapshot.codec import decode, encode, tensor_refs


def _roundtrip(obj):
    tensors = {}
    encoded = encode(obj, "root", tensors.__setitem__)
    text = json.dumps(encoded, allow_nan=False)  # standard JSON: no NaN/Infinity literals
    return decode(json.loads(text), tensors), tensors


def _same(a, b) -> bool:
    """Equality that also checks types (tuple vs list, int vs float) and treats NaN as equal."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k1, k2) and _same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


CASES = [
    ("Adam betas stay a tuple", {"lr": 0.001, "betas": (0.9, 0.999)}),
    ("ReduceLROnPlateau mode_worse is inf", {"mode_worse": math.inf, "best": -math.inf}),
    ("NaN survives", {"x": math.nan}),
    ("int keys (optimizer state)", {0: {"step": 3}, 7: {"step": 1}}),
    ("mixed keys", {1: "a", "b": 2, (1, 2): 3}),
    ("python random state", (3, tuple(range(625)), None)),
    ("a dict whose key looks like a tag", {"$tuple": [1, 2]}),
    ("bools are not ints", [True, 1, False, 0]),
    ("big ints", [2**63 + 1, -(2**70)]),
    ("float repr is exact", [0.1 + 0.2, 1e-310, 5e-324, 1.7976931348623157e308]),
    ("numpy scalars keep their dtype", [np.float32(0.1), np.int64(3), np.float64(2.5), np.bool_(True)]),
    ("nested empties", {"a": [], "b": {}, "c": ()}),
]


@pytest.mark.parametrize("name,obj", CASES, ids=[c[0] for c in CASES])
def test_roundtrip_is_exact(name, obj):
    back, _ = _roundtrip(obj)
    assert _same(back, obj), f"{name}: {obj!r} came back as {back!r}"


def test_tensors_become_references():
    lr = torch.tensor(0.01)
    back, tensors = _roundtrip({"lr": lr, "hist": [torch.ones(2), 3]})
    assert list(tensors) == ["root/lr", "root/hist/0"], "tensor names follow the path"
    assert back["lr"] is tensors["root/lr"] and back["hist"][1] == 3
    assert list(tensor_refs(encode({"a": lr}, "x", lambda n, t: None))) == ["x/a"]


@pytest.mark.parametrize(
    "value,fragment",
    [(lambda e: e, "a function"), (object(), "builtins.object"), ({"f": open}, "root/f")],
    ids=["lambda", "object", "builtin in dict"],
)
def test_refuses_what_needs_pickle(value, fragment):
    with pytest.raises(SnapshotError, match="without pickle") as err:
        encode(value, "root", lambda n, t: None)
    assert fragment in str(err.value), f"the error names the value: {err.value}"


def test_dangling_tensor_reference_is_an_error():
    with pytest.raises(SnapshotError, match="lacks"):
        decode({"$tensor": "optim/state/0/exp_avg"}, {}, "f.safetensors")


_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5)
)
_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        st.dictionaries(st.integers(), inner, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_roundtrip_property(obj):
    back, tensors = _roundtrip(obj)
    assert not tensors
    assert _same(back, obj)
