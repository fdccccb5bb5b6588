"""The safetensors store: naming, rotation, atomicity, corruption and fallback, no mmap, inspect."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import safetensors.torch
import torch
from torch import nn

from safetrain.config import SnapshotConfig
from safetrain.errors import ConfigError, SnapshotError
from safetrain.snapshot import (
    MemoryStore,
    SafetensorsStore,
    TrainState,
    format_inspection,
    inspect_snapshot,
    list_snapshots,
    load_snapshot,
    make_store,
)


def _state(out: int = 2) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, out))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, torch.optim.lr_scheduler.StepLR(opt, 3))
    _train(state)
    return state


def _train(state: TrainState) -> None:
    state.model(torch.randn(8, 4)).pow(2).mean().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()


def _weights(state: TrainState) -> dict:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def _same(state: TrainState, weights: dict) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in state.model.state_dict().items())


def test_names_sort_by_step_and_keep_rotates(tmp_path):
    state = _state()
    with SafetensorsStore(tmp_path, keep=3) as store:
        for step in (1, 2, 10, 100, 1000):
            store.save(state, {"step": step, "epoch": 0, "batch": step})
        names = [os.path.basename(p) for p in store.paths()]
        assert names == [f"snapshot-{s:010d}.safetensors" for s in (10, 100, 1000)], "the newest 3 are kept"
        assert len(store) == 3 and store.latest().step == 1000
        # After a rollback to step 100, a save at step 150 drops the abandoned step 1000.
        store.save(state, {"step": 150})
        assert [store_step(p) for p in store.paths()] == [10, 100, 150]
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(p) for p in list_snapshots(tmp_path)], "no stray files"


def store_step(path: str) -> int:
    return int(os.path.basename(path)[len("snapshot-") : -len(".safetensors")])


def test_a_save_at_an_existing_step_replaces_the_file(tmp_path):
    """The old file is kept alive by a hidden link through the rename, then unlinked in the
    background: the name always holds a whole file, and nothing is left over."""
    state = _state()
    with SafetensorsStore(tmp_path, keep=2) as store:
        first = store.save(state, {"step": 5}).path
        inode = os.stat(first).st_ino
        _train(state)
        weights = _weights(state)
        assert store.save(state, {"step": 5}).path == first
        assert os.stat(first).st_ino != inode, "a new file under the same name"
        store.drain()
        assert os.listdir(tmp_path) == ["snapshot-0000000005.safetensors"], "the hidden link is removed"
        _train(state)
        assert store.restore(state).step == 5 and _same(state, weights), "the second save is the one kept"


def test_temporary_files_are_never_listed_and_are_cleaned(tmp_path):
    (tmp_path / ".tmp-snapshot-0000000005-123-abcd").write_bytes(b"half a snapsh")
    (tmp_path / "snapshot-0000000004.safetensors.corrupt").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("mine")
    assert list_snapshots(tmp_path) == []
    with SafetensorsStore(tmp_path) as store:
        assert len(store) == 0
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "snapshot-0000000004.safetensors.corrupt"]


def test_files_are_plain_safetensors(tmp_path):
    """The official library reads the files: same tensors, metadata as strings."""
    state = _state()
    with SafetensorsStore(tmp_path) as store:
        path = store.save(state, {"step": 7}).path
    loaded = safetensors.torch.load_file(path)
    for k, v in state.model.state_dict().items():
        assert torch.equal(loaded[f"model/{k}"], v), k
    exp_avg = state.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(loaded["optim/state/0/exp_avg"], exp_avg)
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["safetrain.state"])["counters"] == {"step": 7}
    assert json.loads(meta["safetrain.checksum"])["algorithm"] == "xxh3_64"


def test_loading_keeps_no_file_mapped_or_open(tmp_path):
    """Rotated files must really go: no mmap, no open descriptor survives a load."""
    state = _state()
    with SafetensorsStore(tmp_path, keep=1) as store:
        first = store.save(state, {"step": 1}).path
        store.restore(state)
        info = store.latest()
        load_snapshot(tmp_path, state)
        store.save(state, {"step": 2})  # rotates step 1 out
        assert not os.path.exists(first)
        maps = open("/proc/self/maps").read()
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if _readable(fd)]
    assert str(tmp_path) not in maps, "no snapshot file is memory-mapped"
    assert not [f for f in fds if str(tmp_path) in f], f"no snapshot file is left open: {fds}"
    assert info.step == 1


def _readable(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
        return True
    except OSError:
        return False


# -- corruption ----------------------------------------------------------------------------------


class _Payload:
    """Unpickling this would create a marker file: the proof that loading ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _truncate_half(path, tmp_path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _truncate_header(path, tmp_path):
    open(path, "r+b").truncate(20)


def _flip_data(path, tmp_path):
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) - 40, len(data) - 30):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _flip_metadata(path, tmp_path):
    data = open(path, "rb").read()
    i = data.index(b"counters") + len(b"counters")  # inside the state JSON: '\"step\":2' becomes 3
    j = data.index(b"2", i)
    open(path, "wb").write(data[:j] + b"3" + data[j + 1 :])


def _other_model(path, tmp_path):
    with SafetensorsStore(tmp_path / "other") as other:
        src = other.save(_state(out=3), {"step": 2}).path
    os.replace(src, path)


def _empty(path, tmp_path):
    open(path, "wb").close()


def _pickle(path, tmp_path):
    with open(path, "wb") as f:
        pickle.dump({"model": _Payload(str(tmp_path / "MARKER"))}, f)


def _torch_save(path, tmp_path):
    torch.save({"x": _Payload(str(tmp_path / "MARKER"))}, path)


def _foreign_safetensors(path, tmp_path):
    safetensors.torch.save_file({"weight": torch.ones(2)}, path)


CORRUPTIONS = [
    ("truncated", _truncate_half, "truncated"),
    ("truncated in the header", _truncate_header, "header length"),
    ("flipped data bytes", _flip_data, "fails its checksum"),
    ("flipped metadata byte", _flip_metadata, "metadata fails its checksum"),
    ("another model", _other_model, "does not match the model|in the snapshot"),
    ("empty", _empty, "empty"),
    ("pickle renamed", _pickle, "not a safetensors file"),
    ("torch.save renamed", _torch_save, "not a safetensors file"),
    ("foreign safetensors", _foreign_safetensors, "without safetrain metadata"),
]


@pytest.mark.parametrize("what,corrupt,message", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corruption_is_named_and_the_previous_snapshot_used(what, corrupt, message, tmp_path, caplog):
    state = _state()
    directory = tmp_path / "snaps"
    with SafetensorsStore(directory, keep=2) as store:
        store.save(state, {"step": 1})
        good = _weights(state)
        _train(state)
        newest = store.save(state, {"step": 2}).path
        corrupt(newest, tmp_path)
        _train(state)
        # The file alone: a clear error naming it.
        with pytest.raises(SnapshotError, match=message) as err:
            load_snapshot(newest, state)
        assert newest in str(err.value), f"{what}: the error names the file: {err.value}"
        # The directory: the previous snapshot is used.
        with caplog.at_level(logging.WARNING, logger="safetrain"):
            assert load_snapshot(directory, state).step == 1, f"{what}: load_snapshot falls back"
        assert newest in caplog.text, f"{what}: the fallback is logged"
        _train(state)
        # The store: same, and a damaged file is set aside.
        assert store.restore(state).step == 1, f"{what}: restore falls back"
        assert _same(state, good), f"{what}: the previous snapshot's weights are back"
    assert not (tmp_path / "MARKER").exists(), f"{what}: loading ran no code"


def test_no_usable_snapshot_lists_every_failure(tmp_path):
    state = _state()
    with SafetensorsStore(tmp_path, keep=2) as store:
        paths = [store.save(state, {"step": s}).path for s in (1, 2)]
        for p in paths:
            _empty(p, tmp_path)
        with pytest.raises(SnapshotError, match="no usable snapshot") as err:
            store.restore(state)
        assert all(p in str(err.value) for p in paths)
        assert len(store) == 0, "damaged files were set aside"
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) + ".corrupt" for p in paths)


def test_load_snapshot_errors(tmp_path):
    state = _state()
    with pytest.raises(SnapshotError, match="no such snapshot"):
        load_snapshot(tmp_path / "missing.safetensors", state)
    with pytest.raises(SnapshotError, match="no snapshot files"):
        load_snapshot(tmp_path, state)


# -- config and inspect --------------------------------------------------------------------------


def test_make_store(tmp_path):
    assert isinstance(make_store(SnapshotConfig()), MemoryStore)
    store = make_store(SnapshotConfig(store="safetensors", keep=3), run_dir=tmp_path)
    assert store.directory == str(tmp_path / "snapshots") and store.keep == 3
    store.close()
    store = make_store(SnapshotConfig(store="safetensors", dir=str(tmp_path / "d")), run_dir=tmp_path)
    assert store.directory == str(tmp_path / "d")
    store.close()
    for error in (SnapshotError, ConfigError):
        with pytest.raises(error, match="snapshot.dir"):
            make_store(SnapshotConfig(store="safetensors"))


def test_inspect(tmp_path):
    state = _state()
    with SafetensorsStore(tmp_path) as store:
        path = store.save(
            state,
            {"step": 12, "epoch": 1, "batch": 4, "seen": 99},
            extra={"lr_scale": 0.5},
            extra_tensors={"epoch_rng": torch.get_rng_state()},
        ).path
    info = inspect_snapshot(path)
    expected = {
        "step": 12,
        "epoch": 1,
        "batch": 4,
        "checksum_ok": True,
        "all_finite": True,
        "n_model_tensors": 9,
        "size_bytes": os.path.getsize(path),
        "optimizer": "torch.optim.adam.Adam",
        "extra": {"lr_scale": 0.5},
        "extra_tensors": ["epoch_rng"],
    }
    for key, value in expected.items():
        assert info[key] == value, f"inspect: {key}"
    json.dumps(info)  # JSON-ready for `safetrain inspect --json`
    text = format_inspection(info)
    assert "step       12  (epoch 1, batch 4)" in text and "checksum   ok" in text and "{'seen': 99}" in text
    _flip_data(path, tmp_path)
    bad = inspect_snapshot(path)
    assert not bad["checksum_ok"] and bad["bad_checksums"], "inspect reports, not raises, bad data"
    assert "checksum   FAILED" in format_inspection(bad)


@pytest.mark.parametrize(
    "state_json",
    [
        '{"format": "safetrain.snapshot", "version": 1}',
        '{"format": "safetrain.snapshot", "version": 1, '
        '"counters": {"step": 1}, "model": {"aliases": 3}, "optimizer": [], "extra": {"$numpy": 5}}',
        "[]",
    ],
    ids=["missing sections", "wrong types", "not an object"],
)
def test_metadata_with_a_valid_checksum_but_nonsense_is_a_clear_error(state_json, tmp_path):
    """A crafted file passes the checksums; its metadata still cannot crash the loader."""
    from safetrain.snapshot.fileformat import FileWriter, checksum

    path = str(tmp_path / "snapshot-0000000001.safetensors")
    tensors = {"model/0.weight": torch.ones(8, 4)}
    writer = FileWriter(path, tensors, state_json)
    writer.finish({n: checksum(t) for n, t in tensors.items()})
    for action in (lambda: load_snapshot(path, _state()), lambda: inspect_snapshot(path)):
        with pytest.raises(SnapshotError, match="snapshot-0000000001.safetensors") as err:
            action()
        assert "Traceback" not in str(err.value)
