"""SIGKILL a training process at 20 random moments: the newest snapshot on disk always loads.

One child Python process (``sys.executable``) imports torch once and forks a trainer per round;
each trainer resumes from the newest snapshot in the directory (as a restarted job would) and
writes a safetensors snapshot after every step, so most kills land in the middle of a write.
After each kill, every listed snapshot must load and verify, and leftovers of the interrupted
write must never be listed as snapshots.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from safetrain.snapshot import TrainState, inspect_snapshot, list_snapshots, load_snapshot

pytestmark = pytest.mark.slow

KILLS = 20

_CHILD = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    torch.set_num_threads(1)
    from safetrain.snapshot import SafetensorsStore, TrainState

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        return TrainState(model, opt, torch.optim.lr_scheduler.StepLR(opt, 10))

    def train(directory):
        state = build()
        store = SafetensorsStore(directory, keep=2)
        step = store.restore(state).step if len(store) else 0
        while True:
            state.model(torch.randn(32, 256)).pow(2).mean().backward()
            state.optimizer.step()
            state.scheduler.step()
            state.optimizer.zero_grad()
            step += 1
            store.save(state, {"step": step, "epoch": 0, "batch": step})

    directory = sys.argv[1]
    build()  # the first model and optimizer pull in lazy imports (seconds): do it once, before forking
    for line in sys.stdin:  # one trainer per line; the test kills it
        pid = os.fork()
        if pid == 0:
            try:
                train(directory)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
    """
)


def _state() -> TrainState:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return TrainState(model, opt, torch.optim.lr_scheduler.StepLR(opt, 10))


def test_sigkill_at_random_moments_leaves_a_loadable_snapshot(tmp_path):
    rng = random.Random(20240607)
    directory = tmp_path / "snaps"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    mid_write, steps = 0, []
    try:
        for kill in range(KILLS):
            child.stdin.write("go\n")
            child.stdin.flush()
            pid = int(child.stdout.readline())
            # Let it load the previous snapshot and write a new one (however slow a busy host makes
            # that: a fixed delay killed every trainer before its first write on a loaded machine);
            # then kill it wherever it is, mostly in the middle of a later write.
            newest = list_snapshots(directory)[-1:]
            deadline = time.monotonic() + 60
            while list_snapshots(directory)[-1:] == newest and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(pid, signal.SIGKILL)
            assert child.stdout.readline().strip() == "reaped", "the trainer is gone"
            names = os.listdir(directory) if directory.exists() else []
            mid_write += any(n.startswith(".tmp-") and "removed-" not in n for n in names)
            paths = list_snapshots(directory)
            assert paths, f"kill {kill}: a snapshot exists"
            assert all(os.path.basename(p).startswith("snapshot-") for p in paths)
            assert not [p for p in paths if ".tmp" in p], f"kill {kill}: temporary files are not snapshots"
            for path in paths:  # every listed file is complete and verifies
                report = inspect_snapshot(path)
                assert report["checksum_ok"] and report["all_finite"], f"kill {kill}: {path} verifies"
            info = load_snapshot(paths[-1], _state())  # the newest one, not a fallback
            steps.append(info.step)
    finally:
        child.stdin.close()
        child.kill()
        child.wait()
    assert steps == sorted(steps) and steps[-1] > steps[0], f"every restart resumed and progressed: {steps}"
    print(f"{mid_write} of {KILLS} kills interrupted a write; steps resumed from: {steps}")
    assert mid_write >= 3, f"only {mid_write} of {KILLS} kills hit a write in progress; make the model larger"
