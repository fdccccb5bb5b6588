"""Preemption (issue #16): SIGTERM stops fit within one step, snapshots it, closes the journal
``interrupted``; ``resume="auto"`` continues and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from safetrain import TrainingInterrupted, load_config
from safetrain.rundir import read_run
from safetrain.snapshot import list_snapshots
from tests.helpers.models import regression_data
from tests.helpers.signals import SignalAt, signal_trainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "requeue.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals"),
]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), str(run_dir), *args], env=_env(), capture_output=True, text=True, timeout=180
    )


def test_sigterm_in_a_subprocess_stops_within_a_step_and_auto_resume_ends_bitwise_equal(tmp_path):
    """The issue's acceptance test: a real process, a real SIGTERM, a second process with resume='auto'."""
    from safetensors.torch import load_file

    ref = _run(tmp_path / "ref", "--save", str(tmp_path / "ref.safetensors"))
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(run_dir), "--pace", "0.03"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = -1
    try:
        for line in proc.stdout:
            if line.startswith("step ") and (seen := int(line.split()[1])) >= 23:  # 23: not on a snapshot step
                proc.send_signal(signal.SIGTERM)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, f"{out[-2000:]}\n{err[-3000:]}"
    run = read_run(run_dir)
    ended = [e for e in run.events if e["event"] == "run_ended"]
    assert [e["action"] for e in ended] == ["interrupted"], ended
    stopped = ended[0]["step"]
    assert seen <= stopped <= seen + 1, f"signal at step {seen}, stopped at {stopped}: more than one step later"
    assert run.summary is not None and run.summary["ended"] == "interrupted"
    assert any(f"snapshot-{stopped:010d}" in str(p) for p in list_snapshots(run_dir / "snapshots")), (
        f"no snapshot of step {stopped}"
    )

    again = _run(run_dir, "--save", str(tmp_path / "resumed.safetensors"))
    assert again.returncode == 0, again.stderr[-3000:]
    run = read_run(run_dir)
    started = [e for e in run.events if e["event"] == "run_started"]
    assert [e["action"] for e in started] == ["start", "resume"]
    assert started[1]["step"] == stopped, "the resumed run did not continue from the signal's step"
    assert [e["action"] for e in run.events if e["event"] == "run_ended"] == ["interrupted", "done"]
    a, b = load_file(str(tmp_path / "ref.safetensors")), load_file(str(tmp_path / "resumed.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"


@pytest.fixture(autouse=True)
def _no_default_sigterm():
    """A recording SIGTERM handler around each test: were fit's handler missing, the signal would
    not kill the test run (and the handler fit must restore is this one)."""
    got = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    yield got
    signal.signal(signal.SIGTERM, old)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_snapshots_and_restores_the_handlers(tmp_path, sig):
    """Fails before: SIGTERM killed the process (no snapshot, no journal end); SIGINT ended 'done'."""
    loader = DataLoader(regression_data(64), batch_size=8)
    model, trainer = signal_trainer(tmp_path)
    previous = signal.getsignal(sig)
    with pytest.raises(TrainingInterrupted, match=signal.Signals(sig).name) as info:
        trainer.fit(SignalAt(loader, 3, sig), epochs=2)
    assert signal.getsignal(sig) is previous
    assert info.value.result.steps == 4 and info.value.result.ended == "interrupted"
    run = read_run(tmp_path)
    assert run.events[-1]["event"] == "run_ended" and run.events[-1]["action"] == "interrupted"
    assert any("snapshot-0000000004" in str(p) for p in list_snapshots(tmp_path / "snapshots"))
    assert not model[0]._forward_hooks, "hooks left on the model"


def test_on_signal_return_returns_the_result_and_signals_off_lets_sigterm_through(tmp_path, _no_default_sigterm):
    _no_default_sigterm_got = _no_default_sigterm
    loader = DataLoader(regression_data(64), batch_size=8)
    _, trainer = signal_trainer(tmp_path, "log.on_signal=return")
    result = trainer.fit(SignalAt(loader, 3), epochs=1)
    assert result.ended == "interrupted" and result.steps == 4
    _, trainer = signal_trainer(tmp_path / "b", "log.signals=off")
    result = trainer.fit(SignalAt(loader, 2), epochs=1)
    assert _no_default_sigterm_got == [signal.SIGTERM] and result.ended == "done" and result.steps == 8


def test_a_second_signal_stops_at_once(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    _, trainer = signal_trainer(tmp_path)
    with pytest.raises(TrainingInterrupted, match="again"):
        trainer.fit(SignalAt(loader, 2, times=2), epochs=1)
    assert read_run(tmp_path).events[-1]["action"] == "interrupted"


def test_resume_auto_starts_fresh_without_a_snapshot_and_resumes_with_one(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    _, trainer = signal_trainer(tmp_path)
    with pytest.raises(TrainingInterrupted):
        trainer.fit(SignalAt(loader, 3), epochs=1, resume="auto")  # nothing there: a fresh start
    _, trainer = signal_trainer(tmp_path)
    result = trainer.fit(loader, epochs=1, resume="auto")
    assert result.steps == 8 and result.ended == "done"
    started = [e for e in read_run(tmp_path).events if e["event"] == "run_started"]
    assert [(e["action"], e["step"]) for e in started] == [("start", 0), ("resume", 4)]


def test_signal_handlers_are_left_alone_off_the_main_thread(tmp_path):
    import threading

    loader = DataLoader(regression_data(32), batch_size=8)
    _, trainer = signal_trainer(tmp_path)
    out, before = {}, signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=lambda: out.setdefault("r", trainer.fit(loader, epochs=1)))
    t.start()
    t.join(60)
    assert out["r"].ended == "done" and signal.getsignal(signal.SIGTERM) is before


def test_resume_auto_finds_a_sharded_snapshot_directory(tmp_path):
    """resume='auto' looked for snapshot files only: an FSDP2 run's sharded snapshot directories
    (complete ones, with their mark) were not found and the run started fresh."""
    from safetrain.distributed.snapdir import MARK
    from safetrain.trainer import _auto_resume

    cfg = load_config(None, ["snapshot.store=safetensors", f"snapshot.dir={tmp_path}"])
    (tmp_path / "step-0000000005").mkdir()
    assert _auto_resume(cfg, None) is None, "an incomplete snapshot directory is no snapshot"
    (tmp_path / "step-0000000005" / MARK).write_text("{}")
    assert _auto_resume(cfg, None) == str(tmp_path)
