"""Adaptive clipping on 2 gloo ranks: every rank sees the same total norm, so every rank clips alike.

DDP averages the gradients before the step's one read; the statistics are fed by the read's total
norm, so the ranks' statistics, clips and parameters stay identical even when only rank 1's data
makes the outlier. Runs in ONE subprocess that spawns 2 ranks (a hang fails on the timeout).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from typing import Any, Dict, List

import pytest
import torch

pytestmark = pytest.mark.slow

TIMEOUT = 120  # seconds; the run takes a few


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from safetrain import load_config
    from safetrain.guard import Guard
    from safetrain.testing import count_host_syncs
    from tests.helpers.processes import join_gloo_group

    join_gloo_group(rank, world, tmp, 60)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    overrides = ["log.progress=false", "snapshot.every=1000", "guard.clip.mode=adaptive", "guard.clip.warmup_steps=5"]
    cfg = load_config(None, [*overrides, "guard.grad_norm_threshold=adaptive"])
    g = torch.Generator().manual_seed(100 + rank)
    out: Dict[str, Any] = {"steps": []}
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        for step in range(1, 21):
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
            if rank == 1 and step in (12, 13):
                y = y * 8.0  # rank 1's targets only: a large loss, an outlier of the averaged gradient
            with count_host_syncs() as syncs:
                r = guard.step((x, y))
            out["steps"].append([r.step, r.trained, r.action, repr(r.grad_norm), repr(r.clipped_to), syncs.count])
        out["stats"] = guard.state_dict()["grad_norm"]
        out["clipped_steps"] = guard.counts.clipped_steps
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["digest"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    from tests.helpers.processes import run_two_ranks  # here, not in the ranks' processes

    tmp = tmp_path_factory.mktemp("ddp_clip")
    run_two_ranks(__file__, tmp, TIMEOUT, "the 2-rank run")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_both_ranks_clip_identically_when_one_ranks_data_makes_the_outlier(ranks):
    r0, r1 = ranks
    assert r0["steps"] == r1["steps"], "same norms, same clips, same decisions, step by step"
    assert r0["stats"] == r1["stats"] and r0["digest"] == r1["digest"]
    clipped = [s[0] for s in r0["steps"] if s[4] != "nan"]
    assert 13 in clipped and r0["clipped_steps"] == len(clipped), clipped
    decided = {s[0]: s[2] for s in r0["steps"]}
    assert decided[12] == "skip_batch", "x8 targets on rank 1 at step 12: a far outlier (adaptive threshold) on both"
    assert all(a == "" for step, a in decided.items() if step != 12), "the rest clipped or left, never skipped"
    assert all(s[5] == 1 for s in r0["steps"][1:]), "one host sync per step (the read's collective)"


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
