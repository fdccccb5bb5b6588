"""Running code in other processes: a script in its own session, a 2-rank launch, torchrun, an example.

Each runs from the repository root with the repository first on PYTHONPATH; a hang is killed with
everything it started and fails the test instead of blocking CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

__all__ = ["ROOT", "join_gloo_group", "run_example", "run_session", "run_torchrun", "run_two_ranks"]

ROOT = Path(__file__).resolve().parents[2]


def _python_path() -> str:
    """The repository first on PYTHONPATH, the caller's entries kept after it."""
    return os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def run_session(
    cmd: List[str], timeout: float, what: str, env: Optional[Dict[str, str]] = None, drop: Sequence[str] = ()
) -> str:
    """Run ``cmd`` from the repository root in its own session (the repository first on
    PYTHONPATH, one OpenMP thread, ``env`` on top, the variables in ``drop`` removed); a hang is
    killed, launcher and ranks together, and fails the test instead of blocking CI. Returns the
    output; a non-zero exit fails with its tail."""
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(PYTHONPATH=_python_path(), OMP_NUM_THREADS="1")
    full.setdefault("GOMP_SPINCOUNT", "10000")
    full.update(env or {})
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the whole session: the launcher and every rank
        log, _ = proc.communicate()
        pytest.fail(f"{what} hung for {timeout} s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}\n{log[-6000:]}"
    return log


def run_two_ranks(script: str, tmp: Path, timeout: float, what: str) -> None:
    """Run ``python script tmp`` (it spawns 2 gloo ranks) with :func:`run_session`."""
    run_session([sys.executable, script, str(tmp)], timeout, what)


def join_gloo_group(rank: int, world: int, tmp: str, timeout_s: float, rendezvous: str = "rendezvous") -> None:
    """In a rank spawned by a script that :func:`run_two_ranks` runs: one CPU thread, and the gloo
    group met through the file ``rendezvous`` in ``tmp`` (one per launch when a test launches
    several), its collectives failing after ``timeout_s`` (a hang turns into an error the test can name)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_torchrun(name: str, *args: str, timeout: float = 120) -> str:
    """Run ``examples/name`` on 2 ranks under torchrun (offline, gloo) with :func:`run_session`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return run_session([*cmd, str(ROOT / "examples" / name), *args], timeout, f"torchrun examples/{name} {args}")


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    """Run ``examples/name`` as a user would (one process, two OpenMP threads); its stdout."""
    env = dict(os.environ, PYTHONPATH=_python_path())
    env.setdefault("OMP_NUM_THREADS", "2")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout
