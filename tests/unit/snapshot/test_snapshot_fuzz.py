"""Fuzzing the snapshot reader (issue 16, acceptance): byte flips, truncations and header edits of a
real snapshot file. Every outcome is a load identical to the original's or a ``SnapshotError``
naming the file: never another exception, a hang, or a load that differs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from safetrain.errors import SnapshotError
from safetrain.snapshot import SafetensorsStore, TrainState, inspect_snapshot, load_snapshot
from safetrain.snapshot.fileformat import DTYPES
from tests.helpers.snapshots import edit_mark, rechecksum, set_offsets, sharded_snapshot

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


# --- issue 36: hostile headers and sharded snapshots, each answered within a second --------------------

HUGE = [2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
dims = st.one_of(st.integers(0, 6), st.sampled_from(HUGE), st.integers(-3, -1), st.sampled_from([1.5, True, "2", None]))
shapes = st.one_of(
    st.lists(dims, max_size=6),
    st.tuples(dims, st.integers(0, 80_000), st.sampled_from([[], [0], [1], [2**62, 0]])).map(
        lambda t: [t[0]] * t[1] + t[2]  # tens of thousands of dimensions, often ending in 0
    ),
    st.just("not a list"),
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(CODES + ["X9", 3]),
        "shape": shapes,
        "data_offsets": st.lists(st.integers(0, 64) | st.sampled_from(HUGE), min_size=2, max_size=2)
        | st.sampled_from([[0], [0, -8], "0,8"]),
    }
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.dictionaries(st.text(max_size=4), entries, max_size=3), data=st.binary(max_size=64))
def test_hostile_headers_are_read_or_refused_within_a_second(tmp_path_factory, header, data):
    """Issue 36, the fuzz test: shapes of many or huge dimensions, zeros, offsets past the data.
    A clear SnapshotError or a layout that fits the file: within a second of CPU, in bounded memory.
    Fails before: a shape of 80,000 huge dimensions took tens of seconds; some sound-looking
    headers made torch raise (stride overflow) when the tensor was allocated."""
    from safetrain.snapshot.header import read_layout
    from tests.helpers.bounds import bounded

    path = tmp_path_factory.mktemp("hdr") / "snapshot-0000000001.safetensors"
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    with bounded():
        try:
            layout = read_layout(str(path))
        except SnapshotError as exc:
            assert str(path) in str(exc) and len(str(exc)) < 1000, str(exc)[:300]
        else:
            assert sum(e.end - e.begin for e in layout.entries) == len(data)
            for e in layout.entries:
                t = torch.empty(e.shape, dtype=e.dtype)  # no stride overflow
                assert t.numel() * t.element_size() == e.end - e.begin
        with pytest.raises(SnapshotError):  # no safetrain metadata: refused, never a traceback
            inspect_snapshot(str(path))


NAMES = ["../x.json", "/etc/hostname", "a/rank-0.json", "", ".", "..", ".hidden.json", "rank-0.json\x00", "x" * 300]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.sampled_from([1e300, -1e300, "\x1b[2J", "a\u202eb", "x" * 500]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return sharded_snapshot(tmp_path_factory.mktemp("sharded"))


def _damage_sharded(draw, snap) -> str:
    """One hostile edit of a copied sharded snapshot; returns what kind it was."""
    kind = draw(st.sampled_from(["mark", "names", "rank", "offsets", "flip", "fifo", "link"]))
    if kind == "mark":
        edit_mark(
            snap, **{draw(st.sampled_from(["counters", "created", "world", "run_id", "files"])): draw(json_values)}
        )
    elif kind == "names":
        files = json.loads((snap / "safetrain.json").read_text())["files"]
        edit_mark(snap, files={**files, draw(st.sampled_from(NAMES)): draw(st.text(max_size=8))})
    elif kind == "rank":
        path = snap / "rank-0.json"
        key = draw(st.sampled_from(["counters", "optimizer_type", "extra", "accepted", "scaler", "own", "created"]))
        path.write_text(json.dumps({**json.loads(path.read_text()), key: draw(json_values)}))
        if draw(st.booleans()):
            rechecksum(snap)
    elif kind == "offsets":
        offsets = draw(st.lists(st.integers(0, 8) | st.sampled_from(HUGE) | st.integers(-2, -1), max_size=3))
        set_offsets(snap, draw(st.sampled_from(["model/w", "model/b"])), offsets)
    elif kind == "flip":
        file = draw(st.sampled_from(sorted(p for p in snap.iterdir() if p.name != "safetrain.json")))
        data = bytearray(file.read_bytes())
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        file.write_bytes(bytes(data))
    else:
        file = draw(st.sampled_from(sorted(p for p in snap.iterdir() if p.name != "safetrain.json")))
        file.unlink()
        if kind == "fifo":
            os.mkfifo(file)
        else:
            file.symlink_to(snap.parent / "elsewhere")
    return kind


@settings(
    max_examples=int(os.environ.get("SAFETRAIN_FUZZ_EXAMPLES", 30)),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_hostile_sharded_marks_and_metadata_are_read_or_refused_within_a_second(sharded, tmp_path_factory, data):
    """Issue 36, the fuzz test over sharded snapshots: hostile mark fields and names, rank parts,
    sharding offsets, flipped bytes, FIFOs and links. Inspect and export answer with a clear
    SnapshotError or a sound description, within a second, in bounded memory, never blocking;
    what inspect prints holds no control character. Fails before: offsets past the data
    allocated them; names outside the snapshot were read; a FIFO blocked; created=1e300 and
    rank-part types raised OverflowError or TypeError."""
    import shutil

    from safetrain.distributed.export import export_model
    from safetrain.distributed.inspection import inspect_sharded
    from safetrain.snapshot import format_inspection
    from tests.helpers.bounds import bounded

    root = tmp_path_factory.mktemp("case")
    snap = root / sharded.name
    shutil.copytree(sharded, snap)
    (root / "elsewhere").write_text("{}")
    kind = _damage_sharded(data.draw, snap)
    held = sum(p.stat().st_size for p in snap.iterdir() if p.is_file() and not p.is_symlink())
    with bounded():
        try:
            info = inspect_sharded(str(snap))
        except SnapshotError as exc:
            assert str(snap) in str(exc), exc
        else:
            assert kind != "names", "a name outside the snapshot is refused"
            assert kind != "flip" or info["checksum_ok"] is False, "a flipped byte fails its checksum"
            text = format_inspection(info)
            assert all(line.isprintable() for line in text.splitlines()), text
            assert info["data_bytes"] <= held
        out = root / "model.safetensors"
        try:
            export_model(str(snap), str(out))
        except SnapshotError:
            assert not out.exists()
        else:
            assert out.stat().st_size <= held + 4096
