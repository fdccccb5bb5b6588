"""Fuzzing the snapshot reader (issue 16, acceptance): byte flips, truncations and header edits of a
real snapshot file. Every outcome is a load identical to the original's or a ``SnapshotError``
naming the file: never another exception, a hang, or a load that differs."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from safetrain.errors import SnapshotError
from safetrain.snapshot import SafetensorsStore, TrainState, inspect_snapshot, load_snapshot
from safetrain.snapshot.fileformat import DTYPES

CODES = sorted(DTYPES.values())


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainState(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2))


def _capture(state: TrainState) -> dict:
    captured = state.capture({"step": 0})
    meta = {k: v for k, v in captured.meta.items() if k not in ("created", "counters")}
    return {"tensors": {n: t.clone() for n, t in captured.tensors.items()}, "meta": json.dumps(meta, sort_keys=True)}


def _identical(a: dict, b: dict) -> bool:
    if a["meta"] != b["meta"] or set(a["tensors"]) != set(b["tensors"]):
        return False
    for name, x in a["tensors"].items():
        y = b["tensors"][name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


class _Original(dict):
    """The fixture's value; a short repr, so that a failing example does not print the whole file."""

    def __repr__(self) -> str:
        return f"<snapshot of {len(self['data'])} bytes in {self['dir']}>"


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A small real snapshot (model with buffers, Adam state, scheduler, RNGs, extra state) and its load."""
    rng = torch.get_rng_state()
    directory = tmp_path_factory.mktemp("fuzz")
    state = _state(0)
    for _ in range(2):
        state.model(torch.randn(8, 3)).pow(2).mean().backward()
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad()
    with SafetensorsStore(directory, keep=1) as store:
        path = store.save(state, {"step": 7, "epoch": 1, "batch": 3}, extra={"lr_scale": 0.5, "seen": [1, 2]}).path
    data = open(path, "rb").read()
    fresh = _state(1)
    info = load_snapshot(path, fresh)
    reference = {"capture": _capture(fresh), "counters": info.counters, "extra": info.extra}
    yield _Original(data=data, dir=directory, reference=reference)
    torch.set_rng_state(rng)


def _header(data: bytes):
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + body


def _edit_string(draw, text: str) -> str:
    i = draw(st.integers(0, max(0, len(text) - 1)))
    return text[:i] + draw(st.characters(codec="ascii")) + text[i + 1 :]


def _header_edit(draw, data: bytes) -> bytes:
    n, header, body = _header(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["dtype", "shape", "offsets", "drop", "state", "table", "add_metadata", "length"]))
    if kind == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(CODES + ["X9", 3, None]))
    elif kind == "shape":
        header[name]["shape"] = draw(st.lists(st.integers(-2, 70), max_size=4))
    elif kind == "offsets":
        header[name]["data_offsets"] = draw(st.lists(st.integers(-1, len(body) + 8), min_size=1, max_size=3))
    elif kind == "drop":
        del header[name]
    elif kind in ("state", "table"):
        key = "safetrain.state" if kind == "state" else "safetrain.checksum"
        header["__metadata__"][key] = _edit_string(draw, header["__metadata__"][key])
    elif kind == "add_metadata":
        header["__metadata__"][draw(st.text(max_size=8))] = draw(st.text(max_size=8))
    else:  # the 8-byte length prefix
        return draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + data[8:]
    return _rewrite(header, body)


def _damage(draw, data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    how = draw(st.sampled_from(["flip", "flip_header", "truncate", "header_edit", "append"]))
    if how == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "append":
        return data + draw(st.binary(min_size=1, max_size=16))
    if how == "header_edit":
        return _header_edit(draw, data)
    out = bytearray(data)
    hi = 8 + n if how == "flip_header" else len(data)
    for _ in range(draw(st.integers(1, 4))):
        out[draw(st.integers(0, hi - 1))] ^= draw(st.integers(1, 255))
    return bytes(out)


@settings(
    max_examples=200,
    deadline=2000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_a_damaged_snapshot_loads_identically_or_raises_snapshot_error(original, data):
    """Issue 16, acceptance: a fuzz test of the snapshot reader. Fails before: a header edit of a
    dtype (F32 -> I32) or of a checksum-table key loaded differently or raised KeyError."""
    damaged = _damage(data.draw, original["data"])
    path = str(original["dir"] / "snapshot-0000000099.safetensors")
    with open(path, "wb") as f:
        f.write(damaged)
    fresh = _state(2)
    try:
        info = load_snapshot(path, fresh)
    except SnapshotError as exc:
        assert path in str(exc), f"the error names the file: {exc}"
    else:
        reference = original["reference"]
        assert _identical(_capture(fresh), reference["capture"]), "a damaged file loaded, and differently"
        assert info.counters == reference["counters"] and info.extra == reference["extra"]
    try:
        inspect_snapshot(path)
    except SnapshotError as exc:
        assert path in str(exc), f"the error names the file: {exc}"
