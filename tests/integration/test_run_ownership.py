"""A run owns its snapshots (issue 16, "Data loss first"): run ids, two processes on one directory,
and a sound snapshot kept after data faults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.errors import SnapshotError
from safetrain.rundir import read_run
from safetrain.snapshot import SafetensorsStore, TrainState, list_snapshots
from tests.helpers.models import mlp


def _batches(n: int, seed: int, bad=()):
    """``n`` batches of 16 rows; in the batches ``bad`` rows 3 and 7 have a huge (finite) target,
    so the loss overflows to inf: a data fault, whatever the weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True) / 3
        if i in bad:
            y = y.clone()
            y[[3, 7]] = 3e38
        out.append((x, y))
    return out


def _fit(log_dir, batches, seed, *over, resume=None, model=None):
    model = model or mlp(seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = load_config(
        None,
        ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=5", f"log.dir={log_dir}", *over],
    )
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(batches, resume=resume)
    return result, model


def _steps(directory):
    return [int(os.path.basename(p)[9:19]) for p in list_snapshots(directory)]


def test_a_fresh_run_refuses_a_directory_holding_another_runs_snapshots(tmp_path):
    """Issue 16: run 2 (a new model, same directory, no resume=) deleted run 1's snapshots 15
    and 20 at its step 5 and on its first restore loaded run 1's step 20: run 2 ended bitwise
    equal to run 1."""
    _, first = _fit(tmp_path, _batches(20, 0), 0)
    snaps = tmp_path / "snapshots"
    assert _steps(snaps) == [15, 20]
    kept = {p: open(p, "rb").read() for p in list_snapshots(snaps)}
    with pytest.raises(SnapshotError) as info:
        _fit(tmp_path, _batches(20, 1, bad=(6, 7)), 1)
    text = str(info.value)
    assert str(snaps) in text and "resume=" in text and "snapshot.overwrite" in text and "new directory" in text
    assert {p: open(p, "rb").read() for p in list_snapshots(snaps)} == kept, "run 1's files untouched"


def test_overwrite_starts_a_fresh_run_that_never_restores_the_old_one(tmp_path):
    _fit(tmp_path, _batches(20, 0), 0)
    result, second = _fit(tmp_path, _batches(20, 1, bad=(6, 7)), 1, "snapshot.overwrite=true")
    restored = [e for e in result.events if e.name == "restored"]
    assert restored and all(e.detail["snapshot_step"] <= 5 for e in restored), "its own snapshot, not run 1's"
    started = [e for e in result.events if e.name == "run_started"][0]
    assert len(started.detail["overwritten"]) == 2
    runs = {SafetensorsStore(tmp_path / "snapshots").run_id}  # direct use: the newest snapshot's run
    assert runs == {started.detail["run_id"]}


def test_a_resumed_run_keeps_its_run_id_and_owns_its_files(tmp_path):
    batches = _batches(20, 0)
    first, _ = _fit(tmp_path, batches[:12], 0)
    run_id = [e for e in first.events if e.name == "run_started"][0].detail["run_id"]
    assert len(run_id) == 32
    second, _ = _fit(tmp_path, batches, 0, resume="auto")
    started = [e for e in second.events if e.name == "run_started"][0]
    assert started.action == "resume" and started.detail["run_id"] == run_id
    assert _steps(tmp_path / "snapshots") == [15, 20], "the resumed run rotated the files it resumed from"
    log = read_run(tmp_path)
    assert log.runs == 2 and log.run_ids == [run_id] and log.resumes == 1


def test_report_keeps_two_runs_in_one_log_dir_apart(tmp_path):
    _fit(tmp_path, _batches(12, 0), 0)
    _fit(tmp_path, _batches(8, 1), 1, "snapshot.overwrite=true")
    log = read_run(tmp_path)
    assert log.runs == 2 and len(log.run_ids) == 2 and log.resumes == 0
    runs = log.metrics["run"]
    assert len(log.metrics["step"]) == 20, "run 2's steps 1-8 do not replace run 1's"
    assert runs.count(log.run_ids[0]) == 12 and runs.count(log.run_ids[1]) == 8
    from safetrain.cli.report import format_report

    text = format_report(log)
    assert "2 runs" in text and log.run_ids[0][:8] in text and log.run_ids[1][:8] in text


def test_data_faults_after_a_sound_snapshot_keep_it_and_restore_it(tmp_path):
    """Issue 16: two NaN-loss batches right after a healthy snapshot at step 10 deleted that file
    and rolled back to step 5, though the bad steps' updates were never applied."""
    result, _ = _fit(tmp_path, _batches(16, 0, bad=(10, 11)), 0)
    restored = [e for e in result.events if e.name == "restored" and e.action == "restore"]
    assert len(restored) == 1
    assert restored[0].detail["snapshot_step"] == 10 and not restored[0].detail["passed_over"]
    assert 10 in _steps(tmp_path / "snapshots")


_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from safetrain.snapshot import SafetensorsStore, TrainState
    model = torch.nn.Linear(4, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    store = SafetensorsStore(sys.argv[1], keep=2)
    store.save(state, {"step": 1, "epoch": 0, "batch": 1})
    # a write in flight: the temporary file of this live process
    name = ".tmp-snapshot-" + sys.argv[2] + "." + str(os.getpid()) + "-0000000002-abcdef01"
    open(os.path.join(sys.argv[1], name), "w").close()
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_a_second_writer_gets_a_clear_error_and_leaves_the_first_ones_files(tmp_path):
    """Issue 16: opening a store deleted every .tmp-snapshot-* file, another process's mid-write
    one included, and nothing locked the directory."""
    from safetrain.rundir.dirlock import HOST as _HOST

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), _HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        tmp = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-snapshot-")]
        assert len(tmp) == 1
        model = torch.nn.Linear(4, 2)
        state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with SafetensorsStore(tmp_path, keep=2) as store:
            with pytest.raises(SnapshotError) as info:
                store.save(state, {"step": 2, "epoch": 0, "batch": 2})
            assert str(tmp_path) in str(info.value) and f"pid {child.pid}" in str(info.value), str(info.value)
        assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-snapshot-")] == tmp, "its write survives"
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    # the writer is gone: its lock is free and its temporary file is stale
    with SafetensorsStore(tmp_path, keep=2) as store:
        store.save(state, {"step": 2, "epoch": 0, "batch": 2})
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-snapshot-")]
    assert _steps(tmp_path) == [1, 2]
