"""A DDP run on a run directory another run holds: every rank stops at once, none hangs.

Only rank 0 takes the run directory's lock. When it was refused (another run writes the
directory), rank 0 raised ``RunDirBusy`` while the other ranks went on into the guard's first
collective and waited there for the group's timeout (a DDP job "hangs" instead of failing). Rank
0's answer is shared now (one ``broadcast_object_list`` at the start): every rank raises
``RunDirBusy`` naming the directory and the holder, before writing anything.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any, Dict, List

import pytest
import torch

pytestmark = pytest.mark.slow

TIMEOUT = 120  # the launch; the scenario takes a few seconds, a hang ~GROUP_TIMEOUT more
GROUP_TIMEOUT = 30


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from safetrain import SafeTrainer, load_config
    from safetrain.rundir import RunDirBusy
    from tests.helpers.processes import join_gloo_group

    join_gloo_group(rank, world, tmp, GROUP_TIMEOUT)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = load_config(None, ["log.progress=false", f"log.dir={tmp}/run"])
    data = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(4)]
    started = time.monotonic()
    out: Dict[str, Any] = {}
    try:
        SafeTrainer(model, opt, cfg, loss_fn=torch.nn.functional.mse_loss).fit(data)
        out["error"] = None
    except RunDirBusy as exc:
        out["error"] = f"RunDirBusy: {exc}"
    except Exception as exc:  # recorded: the test names what happened instead
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
    out["seconds"] = time.monotonic() - started
    out["files"] = sorted(os.listdir(f"{tmp}/run"))
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    from safetrain.rundir import lock_run_dir
    from tests.helpers.processes import run_two_ranks  # here, not in the ranks' processes

    tmp = tmp_path_factory.mktemp("busy")
    (tmp / "run").mkdir()
    held = lock_run_dir(tmp / "run")  # another run holds the directory
    try:
        run_two_ranks(__file__, tmp, TIMEOUT, "a DDP run on a held run directory")
    finally:
        held.release()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_rank_is_refused_at_once_when_rank_0_is(ranks):
    for r, out in enumerate(ranks):
        assert out["error"] is not None and out["error"].startswith("RunDirBusy: "), (r, out)
        assert out["seconds"] < GROUP_TIMEOUT / 2, f"rank {r} waited {out['seconds']:.1f} s: a collective timed out"
    assert "rank 0 was refused; rank 1 stops with it" in ranks[1]["error"]
    assert not [f for f in ranks[0]["files"] if f.startswith("events")], "nothing written by the refused run"


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
