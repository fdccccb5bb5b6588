"""One run per run directory (issue 26, point 4): a run locks ``log.dir`` before writing anything,
a second run is refused at once naming the holder, a killed run's lock is taken over with a warning
so that ``resume="auto"`` goes on, and the lock is let go on every way out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, load_config
from safetrain.errors import SnapshotError
from safetrain.rundir import RunDirBusy, lock_run_dir, read_run
from tests.helpers.models import mlp

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="fcntl locks and POSIX signals")]

# A training job: `race` waits for a line on stdin before fit (so that two start together);
# it prints each step (paced) and exits 3 when the run directory is busy.
_JOB = textwrap.dedent(
    """
    import logging, sys, time
    import torch
    import torch.nn.functional as F
    from safetrain import SafeTrainer, load_config
    from safetrain.rundir import RunDirBusy

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    run_dir, mode, pace = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(60)]
    cfg = load_config(None, ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=5",
                             f"log.dir={run_dir}"])
    trainer = SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss)

    def paced():
        for i, batch in enumerate(data):
            print(f"step {i}", flush=True)
            if mode == "race" and i == 5:
                sys.stdin.readline()  # holds the run directory until the test says "finish"
            time.sleep(pace)
            yield batch

    if mode == "race":
        print("ready", flush=True)
        sys.stdin.readline()
    try:
        result = trainer.fit(paced(), epochs=1, resume="auto")
    except RunDirBusy as exc:
        print(f"busy: {exc}", flush=True)
        sys.exit(3)
    print(f"done {result.steps}", flush=True)
    """
)


def _job(run_dir: Path, mode: str, pace: float) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.Popen(
        [sys.executable, "-c", _JOB, str(run_dir), mode, str(pace)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_runs_started_together_on_one_dir_one_runs_the_other_is_refused_naming_it(tmp_path):
    """Fails before: both wrote events.jsonl, metrics.csv and snapshots/, and one later died with
    'SnapshotError: ... holds snapshot(s) of another run' (3 of 6 runs in the issue's test)."""
    jobs = [_job(tmp_path, "race", 0.0) for _ in range(2)]
    try:
        for job in jobs:
            assert job.stdout.readline().strip() == "ready", job.stderr.read()[-3000:]
        for job in jobs:
            job.stdin.write("go\n")
            job.stdin.flush()
        deadline = time.monotonic() + 120
        while all(job.poll() is None for job in jobs):  # the one refused ends; the other holds the dir
            assert time.monotonic() < deadline, "both runs are training in one run directory"
            time.sleep(0.05)
        for job in jobs:
            if job.poll() is None:
                job.stdin.write("finish\n")
                job.stdin.flush()
        outs = [job.communicate(timeout=180) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    codes = sorted(job.returncode for job in jobs)
    assert codes == [0, 3], [(job.returncode, err[-2000:]) for job, (_, err) in zip(jobs, outs)]
    won = 0 if jobs[0].returncode == 0 else 1
    winner, (out_won, _), (out_lost, _) = jobs[won], outs[won], outs[1 - won]
    assert "done 60" in out_won
    busy = [line for line in out_lost.splitlines() if line.startswith("busy: ")]
    assert busy and f"log.dir={tmp_path}" in busy[0] and f"pid {winner.pid} on host " in busy[0], out_lost
    assert "step 0" not in out_lost, "refused before its first step"
    run = read_run(tmp_path)
    assert [e["action"] for e in run.events if e["event"] == "run_started"] == ["start"]
    assert [e["action"] for e in run.events if e["event"] == "run_ended"] == ["done"]
    assert run.metrics["step"] == list(range(1, 61)), "one run's rows only"


def test_a_sigkilled_run_resumes_with_auto_and_its_stale_lock_is_taken_over(tmp_path):
    """Resume of the same run after a crash keeps working: a real SIGKILL, then resume='auto'."""
    first = _job(tmp_path, "run", 0.03)
    try:
        for line in first.stdout:
            if line.strip() == "step 13":  # snapshots of steps 5 and 10 are on disk
                first.send_signal(signal.SIGKILL)
                break
        first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    second = _job(tmp_path, "run", 0.0)
    out, err = second.communicate(timeout=180)
    assert second.returncode == 0, err[-3000:]
    assert "done 60" in out
    assert f"{tmp_path}: taking over a stale lock: its holder (pid {first.pid} on host " in err, err[-3000:]
    run = read_run(tmp_path)
    started = [(e["action"], e["step"]) for e in run.events if e["event"] == "run_started"]
    assert started[0] == ("start", 0) and started[1][0] == "resume" and started[1][1] in (10, 13), started
    assert [e["action"] for e in run.events if e["event"] == "run_ended"] == ["done"]


def _fit(log_dir: Path, loss_fn=F.mse_loss, steps: int = 6):
    model = mlp()
    cfg = load_config(None, ["log.progress=false", "snapshot.store=safetensors", f"log.dir={log_dir}"])
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(steps)]
    return SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=loss_fn).fit(data)


def test_fit_on_a_held_run_dir_is_refused_before_writing_anything(tmp_path):
    held = lock_run_dir(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
            _fit(tmp_path)
        assert sorted(os.listdir(tmp_path)) == [], "no journal, no metrics, no snapshots"
    finally:
        held.release()
    assert _fit(tmp_path).ended == "done"


def test_the_lock_is_let_go_when_fit_fails(tmp_path):
    def broken(out, target):
        raise ValueError("a bug in loss_fn")

    with pytest.raises(ValueError, match="a bug"):
        _fit(tmp_path, loss_fn=broken)
    lock_run_dir(tmp_path).release()  # free again
    assert read_run(tmp_path).events[-1]["action"] == "failed"


def test_a_standalone_guard_is_refused_on_a_snapshot_dir_another_guard_writes(tmp_path):
    """The standalone Guard writes only snapshots in its run_dir: the same lock, role 'snapshots'."""
    cfg = load_config(None, ["snapshot.store=safetensors", "snapshot.every=1"])
    batch = (torch.randn(16, 8), torch.randn(16, 1))
    a, b = mlp(), mlp()
    with Guard(a, torch.optim.SGD(a.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss, run_dir=str(tmp_path)) as first:
        first.step(batch)
        other = Guard(b, torch.optim.SGD(b.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss, run_dir=str(tmp_path))
        before = [p.detach().clone() for p in b.parameters()]
        with pytest.raises(SnapshotError, match=f"another run is writing snapshots.*pid {os.getpid()} on host "):
            other.step(batch)  # its first step snapshots the starting state: refused before any update
        assert all(torch.equal(x, p) for x, p in zip(before, b.parameters())), "refused before it trained"
        other.close()
    with Guard(b, torch.optim.SGD(b.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss, run_dir=str(tmp_path)) as last:
        last.store.adopt(first.store.run_id)  # the lock is free once the first guard closed
        last.step(batch)


def test_the_lock_is_let_go_when_the_policy_aborts(tmp_path):
    from safetrain import TrainingAborted

    calls = [0]

    def nan_at_3(out, target):
        calls[0] += 1
        return F.mse_loss(out, target) * (float("nan") if calls[0] >= 3 else 1.0)

    model = mlp()
    cfg = load_config(None, ["log.progress=false", f"log.dir={tmp_path}", "recovery.actions.loss=abort"])
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(6)]
    with pytest.raises(TrainingAborted):
        SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=nan_at_3).fit(data)
    lock_run_dir(tmp_path).release()  # free again
    assert read_run(tmp_path).events[-1]["action"] == "aborted"
