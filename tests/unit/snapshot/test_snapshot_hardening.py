"""Snapshot files that cannot be misread (issue 16, "Snapshot files"): the header is checksummed,
every malformed file is a ``SnapshotError`` naming it, non-regular files and nested JSON are refused,
meta-device models are refused, and ``safetrain inspect DIR`` lists a directory's snapshots."""

from __future__ import annotations

import json
import os
import threading

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from safetrain.cli import main
from safetrain.config import load_config
from safetrain.errors import SnapshotError
from safetrain.snapshot import SafetensorsStore, TrainState, inspect_snapshot, load_snapshot
from safetrain.snapshot.checksums import blocksum64
from safetrain.snapshot.fileformat import CHECKSUM_KEY, FileWriter, checksum, read_header
from safetrain.trainer import SafeTrainer
from tests.helpers.models import regression_data


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return state


def _save(directory, steps=(1, 2)):
    state = _state()
    with SafetensorsStore(directory, keep=len(steps)) as store:
        return state, [store.save(state, {"step": s, "epoch": 0, "batch": s}).path for s in steps]


def _header_json(path):
    data = open(path, "rb").read()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write_header(path, header, body):
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    open(path, "wb").write(len(raw).to_bytes(8, "little") + raw + body)


def _replace(path, old: bytes, new: bytes):
    data = open(path, "rb").read()
    assert data.count(old) == 1, old
    open(path, "wb").write(data.replace(old, new))


def _optim_state(state):
    return {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(state.optimizer.state.values())}


# -- the header is covered by the integrity check --------------------------------------------


def _dtype_f32_to_i32(path):
    _replace(path, b'"optim/state/0/exp_avg":{"dtype":"F32"', b'"optim/state/0/exp_avg":{"dtype":"I32"')


def _shape_transposed(path):
    _replace(path, b'"model/0.weight":{"dtype":"F32","shape":[8,4]', b'"model/0.weight":{"dtype":"F32","shape":[4,8]')


def _offsets_swapped(path):
    header, body = _header_json(path)
    a, b = header["optim/state/0/exp_avg"], header["optim/state/0/exp_avg_sq"]
    a["data_offsets"], b["data_offsets"] = b["data_offsets"], a["data_offsets"]
    _write_header(path, header, body)


def _metadata_added(path):
    header, body = _header_json(path)
    header["__metadata__"]["user.note"] = "added later"
    _write_header(path, header, body)


HEADER_EDITS = [_dtype_f32_to_i32, _shape_transposed, _offsets_swapped, _metadata_added]


@pytest.mark.parametrize("edit", HEADER_EDITS, ids=[e.__name__.strip("_") for e in HEADER_EDITS])
def test_a_header_edit_is_refused_by_load_and_inspect(edit, tmp_path, capsys):
    """Issue 16: 'F32' changed to 'I32' in optim/state/0/exp_avg's header loaded silently
    reinterpreted (~1e9 instead of ~0.03) and `safetrain inspect` said "checksum ok". Fails before."""
    state, (older, newest) = _save(tmp_path)
    edit(newest)
    with pytest.raises(SnapshotError, match="header fails its checksum") as err:
        load_snapshot(newest, _state(seed=1))
    assert newest in str(err.value)
    with pytest.raises(SnapshotError, match="header fails its checksum"):
        inspect_snapshot(newest)
    assert main(["inspect", newest]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert load_snapshot(tmp_path, _state(seed=1)).path == older, "the directory falls back to the older file"


def _as_version_1(path):
    """Rewrite a file the way safetrain wrote it before header checksums (checksum table v1, blocksum64)."""
    header, body = _header_json(path)
    table = json.loads(header["__metadata__"][CHECKSUM_KEY])
    del table["version"], table["header"]
    table["algorithm"] = "blocksum64"
    table["tensors"] = {n: blocksum64(t) for n, t in safetensors.torch.load_file(path).items()}
    header["__metadata__"][CHECKSUM_KEY] = json.dumps(table)
    _write_header(path, header, body)


def test_files_written_before_header_checksums_still_load(tmp_path):
    state, (_, newest) = _save(tmp_path)
    _as_version_1(newest)
    fresh = _state(seed=1)
    assert load_snapshot(newest, fresh).step == 2
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), fresh.model.parameters()))
    assert inspect_snapshot(newest)["checksum_ok"]


def test_an_unknown_checksum_table_version_is_refused_naming_it(tmp_path):
    _, (_, newest) = _save(tmp_path)
    header, body = _header_json(newest)
    table = json.loads(header["__metadata__"][CHECKSUM_KEY])
    table["version"] = 7
    header["__metadata__"][CHECKSUM_KEY] = json.dumps(table)
    _write_header(newest, header, body)
    with pytest.raises(SnapshotError, match="version 7") as err:
        load_snapshot(newest, _state())
    assert newest in str(err.value)


# -- malformed files: SnapshotError naming the file, and resume falls back --------------------


def test_a_damaged_checksum_table_key_is_a_snapshot_error_and_the_directory_falls_back(tmp_path):
    """Issue 16: one byte in a checksum-table key raised a bare KeyError: 'state'. Fails before."""
    _, (older, newest) = _save(tmp_path)
    _replace(newest, b'\\"state\\": \\"', b'\\"stale\\": \\"')
    with pytest.raises(SnapshotError, match="checksum") as err:
        load_snapshot(newest, _state())
    assert newest in str(err.value)
    info = load_snapshot(tmp_path, _state())
    assert info.path == older and info.step == 1
    assert [p for p, _ in info.passed_over] == [newest] and "checksum" in info.passed_over[0][1]


def test_resume_journals_the_file_used_and_the_ones_passed_over(tmp_path):
    """Issue 16: the journal only said "resumed from DIR". Fails before."""
    snaps = tmp_path / "snaps"

    def run(max_steps=None, resume=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = load_config(
            None,
            ["snapshot.store=safetensors", f"snapshot.dir={snaps}", "snapshot.every=5", "log.progress=false"],
        )
        trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss)
        data = torch.utils.data.DataLoader(regression_data(), batch_size=16, shuffle=True)
        return trainer.fit(data, epochs=1, max_steps=max_steps, resume=resume)

    run(max_steps=12)
    paths = sorted(str(p) for p in snaps.iterdir() if p.name.startswith("snapshot-"))
    newest = paths[-1]
    _replace(newest, b'\\"algorithm\\": \\"xxh3_64', b'\\"algorithm\\": \\"xxh3_65')
    result = run(resume=snaps)
    started = result.events[0]
    assert started.detail["resumed_from"] == paths[-2]
    assert [p["path"] for p in started.detail["passed_over"]] == [newest]
    assert "checksum" in started.detail["passed_over"][0]["why"]
    assert paths[-2] in started.message and newest in started.message


# -- hostile inputs: nested JSON, FIFOs ----------------------------------------------------------


def test_deeply_nested_header_json_is_a_snapshot_error(tmp_path, capsys):
    """Issue 16: a header of deeply nested JSON raised RecursionError; inspect printed a traceback."""
    path = str(tmp_path / "snapshot-0000000001.safetensors")
    raw = b"[" * 200_000 + b"]" * 200_000
    open(path, "wb").write(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(SnapshotError, match="nested") as err:
        read_header(path)
    assert path in str(err.value)
    assert main(["inspect", path]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_deeply_nested_state_json_with_valid_checksums_is_a_snapshot_error(tmp_path):
    path = str(tmp_path / "snapshot-0000000001.safetensors")
    tensors = {"model/0.weight": torch.ones(8, 4)}
    writer = FileWriter(path, tensors, "[" * 100_000 + "]" * 100_000)
    writer.finish({n: checksum(t) for n, t in tensors.items()})
    for action in (lambda: load_snapshot(path, _state()), lambda: inspect_snapshot(path)):
        with pytest.raises(SnapshotError, match="nested") as err:
            action()
        assert path in str(err.value)


def _within(seconds, fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_like_a_snapshot_is_refused_at_once(tmp_path, capsys):
    """Issue 16: a FIFO named *.safetensors hung `inspect` and `resume` forever. Fails before (hangs)."""
    _, (older,) = _save(tmp_path, steps=(1,))
    fifo = str(tmp_path / "snapshot-0000000009.safetensors")
    os.mkfifo(fifo)
    with pytest.raises(SnapshotError, match="not a regular file") as err:
        _within(5, lambda: load_snapshot(fifo, _state()))
    assert fifo in str(err.value)
    assert _within(5, lambda: load_snapshot(tmp_path, _state())).path == older
    assert _within(5, lambda: main(["inspect", fifo])) == 2
    assert "not a regular file" in capsys.readouterr().err


# -- meta device -------------------------------------------------------------------------------


def test_loading_into_a_meta_device_model_is_refused(tmp_path):
    """Issue 16: loading into a model on the meta device was a silent no-op. Fails before."""
    _, (_, newest) = _save(tmp_path)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    state = TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    with pytest.raises(SnapshotError, match="meta device.*to_empty") as err:
        load_snapshot(newest, state)
    assert newest in str(err.value)
    model.to_empty(device="cpu")  # the documented way: materialize, then load
    state = TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert load_snapshot(newest, state).step == 2


# -- inspect DIR ---------------------------------------------------------------------------------


def test_inspect_a_directory_lists_snapshots_newest_first(tmp_path, capsys):
    """Issue 16: `safetrain inspect DIR` failed with "Is a directory". Fails before."""
    _, paths = _save(tmp_path, steps=(3, 6, 9))
    data = bytearray(open(paths[1], "rb").read())
    data[-10] ^= 0xFF
    open(paths[1], "wb").write(bytes(data))
    code = main(["inspect", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if "snapshot-" in line]
    assert [os.path.basename(p) in row for p, row in zip(reversed(paths), rows)] == [True] * 3
    assert "9" in rows[0] and "ok" in rows[0]
    assert "FAILED" in rows[1] and "checksum" in rows[1]
    assert "ok" in rows[2]
    assert code == 1, "a snapshot that does not verify: exit 1"
    os.remove(paths[1])
    assert main(["inspect", str(tmp_path)]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
