"""Shared fixtures: a tiny model, a seeded random loader, the two-rank launcher.

The fault injectors (``PoisonRows``, ``OutputFault``, ...) live in :mod:`safetrain.testing`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

_ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(min(2, torch.get_num_threads()))


def run_session(
    cmd: List[str], timeout: float, what: str, env: Optional[Dict[str, str]] = None, drop: Sequence[str] = ()
) -> str:
    """Run ``cmd`` from the repository root in its own session (the repository first on
    PYTHONPATH, one OpenMP thread, ``env`` on top, the variables in ``drop`` removed); a hang is
    killed, launcher and ranks together, and fails the test instead of blocking CI. Returns the
    output; a non-zero exit fails with its tail."""
    path = os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)  # keep the caller's
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(PYTHONPATH=path, OMP_NUM_THREADS="1")
    full.setdefault("GOMP_SPINCOUNT", "10000")
    full.update(env or {})
    proc = subprocess.Popen(
        cmd,
        cwd=_ROOT,
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
    assert proc.returncode == 0, log[-6000:]
    return log


def run_two_ranks(script: str, tmp: Path, timeout: float, what: str) -> None:
    """Run ``python script tmp`` (it spawns 2 gloo ranks) with :func:`run_session`."""
    run_session([sys.executable, script, str(tmp)], timeout, what)


def join_gloo_group(rank: int, world: int, tmp: str, timeout_s: float) -> None:
    """In a rank spawned by a script that :func:`run_two_ranks` runs: one CPU thread, and the gloo
    group met through a file in ``tmp``, its collectives failing after ``timeout_s`` (a hang turns
    into an error the test can name)."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def regression_data(n: int = 256, d: int = 8, seed: int = 0) -> TensorDataset:
    """A learnable synthetic regression set: y = x @ w + small noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g) / d**0.5  # unit-variance targets
    y = x @ w + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def mlp(d: int = 8, hidden: int = 16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))


def loader(dataset: Dataset, batch_size: int = 16, seed: int = 0, shuffle: bool = True) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


def finite_params(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.fixture
def data() -> TensorDataset:
    return regression_data()


def run_torchrun(name: str, *args: str, timeout: float = 120) -> str:
    """Run an example on 2 ranks under torchrun (offline, gloo), killed with its ranks on the timeout."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(_ROOT / "examples" / name),
        *args,
    ]
    path = os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)  # keep the caller's
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun examples/{name} {' '.join(args)} hung:\n{out[-4000:]}")
    assert proc.returncode == 0, f"torchrun examples/{name} exited {proc.returncode}\n{out[-4000:]}"
    return out
