"""A real SIGKILL of a 2-rank FSDP2 job writing sharded snapshots, then ``fit(resume="auto")``.

Issue #17 acceptance ("SIGKILL of the whole job after a sharded snapshot, ``resume=`` continues
and ends bitwise equal to the uninterrupted run"). Two launches, each its own process group of
a launcher and 2 gloo ranks (``torch.multiprocessing.spawn``):

1. ``killed``: trains with ``snapshot.store: safetensors`` (sharded snapshot directories every 3
   steps). The save of step 6 is held, in rank 0, just before its completion mark
   (``safetrain.json``) is written: every rank's shards of step 6 are on disk, the mark is not.
   The test waits for that moment (a file the hold writes outside the snapshot directory), then
   ``os.killpg(..., SIGKILL)``: launcher and ranks die at once, nothing is flushed or closed.
2. ``resume``: new processes, the same code and config, ``fit(resume="auto")``: the newest
   *complete* snapshot (step 3) is loaded, the incomplete step-6 directory is ignored (and
   removed by the run's next save), 7 steps run instead of 10; then an uninterrupted run of 10
   steps in another directory, the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests.helpers.fsdp import batches, fsdp_mlp, full_digest, launch, spawn_ranks

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 60  # seconds per launch
STEPS, HELD = 10, 6  # the save of step 6 is cut by the kill; the newest complete snapshot is of step 3


def _fit(rank: int, directory: str) -> Dict[str, Any]:
    """The job's training code: the same in the killed launch and in the relaunch."""
    import torch.nn.functional as F

    from safetrain import SafeTrainer, load_config

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    forwards: List[int] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        forwards.append(1)  # one forward per step (replays are off under FSDP2)
        return F.mse_loss(out, y)

    cfg = load_config(
        None,
        [
            "log.progress=false",
            "snapshot.every=3",
            "snapshot.keep=2",
            "snapshot.store=safetensors",
            f"snapshot.dir={directory}",
        ],
    )
    result = SafeTrainer(model, opt, cfg, loss_fn=loss_fn).fit(batches(rank, STEPS), epochs=1, resume="auto")
    return {
        "steps": result.steps,
        "forwards": len(forwards),
        "digest": full_digest(model, opt, ("exp_avg", "exp_avg_sq")),
    }


def _hold_the_mark(tmp: str) -> None:
    """Rank 0, killed launch: stop just before the completion mark of step 6 is written, and say so."""
    from safetrain.distributed import mark, snapdir

    write = mark.write_json

    def held(path: str, obj: Any) -> None:
        if os.path.basename(path) == snapdir.MARK and f"step-{HELD:010d}" in path:
            Path(tmp, "held").write_text(path)
            time.sleep(TIMEOUT)  # the SIGKILL lands here
        write(path, obj)

    mark.write_json = held


def _job(rank: int, tmp: str, phase: str) -> Dict[str, Any]:
    if phase == "killed":
        if rank == 0:
            _hold_the_mark(tmp)
        _fit(rank, f"{tmp}/snaps")
        raise AssertionError("the killed launch was not killed")
    listing = {p.name: sorted(f.name for f in p.iterdir()) for p in Path(tmp, "snaps").iterdir()}
    out = {"before": listing, "resumed": _fit(rank, f"{tmp}/snaps")}
    out["after"] = sorted(os.listdir(f"{tmp}/snaps"))
    out["full"] = _fit(rank, f"{tmp}/full")
    return out


# ----------------------------------------------------------------------------- the test's side


def _launch(tmp: Path, phase: str) -> subprocess.Popen:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", SAFETRAIN_TEST_PHASE=phase)
    env.setdefault("GOMP_SPINCOUNT", "10000")
    return subprocess.Popen(
        [sys.executable, __file__, str(tmp)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: Any) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fsdp_kill")
    proc = _launch(tmp, "killed")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not (tmp / "held").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the killed launch never reached the save of step {HELD}:\n{proc.communicate()[0][-4000:]}"
                )
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole job: launcher and both ranks, nothing flushed
    proc.communicate()
    killed = proc.returncode
    shutil.copytree(tmp / "snaps", tmp / "at-kill")  # as the kill left it, for safetrain inspect
    ranks = launch(__file__, tmp, "resume", TIMEOUT, "the relaunch after SIGKILL")
    return {"killed": killed, "ranks": ranks, "at_kill": tmp / "at-kill"}


def test_the_job_died_of_sigkill_with_step_6_on_disk_but_not_marked_complete(job):
    assert job["killed"] == -signal.SIGKILL
    before = job["ranks"][0]["before"]
    assert sorted(before) == ["step-0000000000", "step-0000000003", "step-0000000006"], before
    assert "safetrain.json" in before["step-0000000003"], before  # (step 0's is rotated out by step 6's save)
    held = before["step-0000000006"]
    assert "safetrain.json" not in held and len([f for f in held if f.endswith(".safetensors")]) == 2, held


def test_resume_after_sigkill_runs_fewer_steps_and_ends_bitwise_equal_to_the_uninterrupted_run(job):
    for run in job["ranks"]:
        resumed, full = run["resumed"], run["full"]
        assert full["steps"] == resumed["steps"] == STEPS and full["forwards"] == STEPS, run
        assert resumed["forwards"] == STEPS - 3, "resumed from step 3, the newest complete snapshot"
        assert resumed["digest"] == full["digest"], "bitwise equal to the uninterrupted run"
    assert job["ranks"][0]["resumed"]["digest"] == job["ranks"][1]["resumed"]["digest"]
    # the incomplete directory was ignored, then removed by the resumed run's next save
    assert job["ranks"][0]["after"] == ["step-0000000006", "step-0000000009"], job["ranks"][0]["after"]


def _poison_a_model_shard(snap: Path) -> str:
    """Write NaN over the first value of a float32 model tensor in one rank's shard file."""
    for file in sorted(snap.glob("*.safetensors")):
        data = bytearray(file.read_bytes())
        n = int.from_bytes(data[:8], "little")
        for name, entry in json.loads(data[8 : 8 + n]).items():
            begin, end = entry["data_offsets"] if name.startswith("model/") else (0, 0)
            if entry.get("dtype") == "F32" and end > begin:
                data[8 + n + begin : 8 + n + begin + 4] = bytes.fromhex("0000c07f")  # a float32 NaN
                file.write_bytes(bytes(data))
                return name
    raise AssertionError(f"no float32 model tensor in {snap}")


def test_safetrain_inspect_reads_the_sharded_snapshots_the_kill_left(job, tmp_path, capsys):
    """`safetrain inspect` of a sharded snapshot directory: each step-* snapshot, newest first,
    the incomplete one (cut by the SIGKILL) failing; of one snapshot: what it says of a file."""
    from safetrain.cli import main

    at_kill = job["at_kill"]
    assert main(["inspect", str(at_kill)]) == 1  # one snapshot does not verify: the incomplete one
    rows = capsys.readouterr().out.splitlines()
    assert "(3, newest first)" in rows[0], rows
    assert rows[2].split()[:3] == ["6", "step-0000000006", "FAILED"] and "incomplete" in rows[2], rows
    assert rows[3].split() == ["3", "step-0000000003", "ok"] and rows[4].split() == ["0", "step-0000000000", "ok"]

    assert main(["inspect", str(at_kill / "step-0000000003")]) == 0
    out = capsys.readouterr().out
    needles = [
        "step       3  (epoch 0, batch 3)",
        "sharded    2 rank(s)",
        "(32 tensors, 6 in the model)",
        "finite     ok",
        "optimizer  torch.optim.adam.Adam",
        "checksum   ok",
        "'healthy_steps': 3",
    ]
    for needle in needles:
        assert needle in out, (needle, out)

    poisoned = tmp_path / "step-0000000003"
    shutil.copytree(at_kill / "step-0000000003", poisoned)
    name = _poison_a_model_shard(poisoned)
    assert main(["inspect", str(poisoned)]) == 1
    assert f"finite     FAILED  ({name}" in capsys.readouterr().out
    assert main(["inspect", str(at_kill / "step-0000000006")]) == 2  # incomplete: not a snapshot
    assert "incomplete (no safetrain.json)" in capsys.readouterr().err


if __name__ == "__main__":
    spawn_ranks(_job, "killed", timeout=TIMEOUT)
