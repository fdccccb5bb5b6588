"""Quarantine under DDP on 2 gloo ranks: the ranks share what they isolated and stay in step.

Two samples of the dataset (indices 5 and 22) have a target whose loss is ``-log(0)``; a replay
bisects each one down to its dataset index on whichever rank drew it. Without the union across
ranks the other rank would keep training on them; without equal-length shards the rank that
drops them would run fewer batches and the next collective would wait for ever (the test's
timeout turns such a hang into a failure).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
from typing import Any, Dict, List

import pytest
import torch

pytestmark = pytest.mark.slow

TIMEOUT = 120
BAD = (5, 22)


def _risky_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(out, dim=1) * (target != 2).float().unsqueeze(1)  # class 2: probability 0
    return -torch.log(probs.gather(1, target.unsqueeze(1))).mean()


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from safetrain import SafeTrainer, load_config
    from safetrain.diagnose.quarantine import QuarantineSampler

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    y[list(BAD)] = 2
    sampler = QuarantineSampler(DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0))
    loader = DataLoader(TensorDataset(x, y), batch_size=2, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    cfg = load_config(None, ["log.progress=false", "detect.mode=lazy", f"log.dir={tmp}/run", "recovery.max_retries=9"])
    result = SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=_risky_loss).fit(
        loader, epochs=3
    )
    events = [e.to_dict() for e in result.events]
    out = {
        "steps": result.steps,
        "quarantined": sorted(sampler.quarantined),
        "isolated": sorted(
            i
            for e in events
            if e["event"] == "anomaly"
            for i in (e["detail"].get("diagnosis") or {}).get("dataset_indices", [])
        ),
        "anomaly_epochs": [e["epoch"] for e in events if e["event"] == "anomaly"],
        "quarantine_events": [(e["action"], e["detail"]) for e in events if e["event"] == "quarantine"],
        "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
    }
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    del model
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    from tests.helpers.processes import run_two_ranks  # here, not in the ranks' processes

    tmp = tmp_path_factory.mktemp("ddpq")
    run_two_ranks(__file__, tmp, TIMEOUT, "the 2-rank quarantine run")
    runs = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    runs[0]["file"] = json.loads((tmp / "run" / "quarantine.json").read_text())
    return runs


def test_every_rank_quarantines_what_any_rank_isolated(ranks):
    isolated = sorted(set(ranks[0]["isolated"]) | set(ranks[1]["isolated"]))
    assert isolated == list(BAD), "bisection on the ranks found exactly the two bad samples"
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == list(BAD)
    assert ranks[0]["file"]["indices"] == list(BAD), "rank 0 wrote the union to quarantine.json"


def test_ranks_stay_in_step_and_later_epochs_are_clean(ranks):
    r0, r1 = ranks
    assert r0["steps"] == r1["steps"] == 3 * 8, "16 samples per rank, batches of 2, 3 epochs: no rank ran short"
    assert set(r0["anomaly_epochs"]) == set(r1["anomaly_epochs"]) == {0}, "quarantined samples never came back"
    assert r0["params"] == r1["params"], "the ranks' parameters diverged"
    skips = [d for run in ranks for action, d in run["quarantine_events"] if action == "skip"]
    assert all(d["skipped"] == d["repeated"] for d in skips), "each skipped sample was replaced by a repeat"
    assert sum(d["skipped"] for d in skips) == 2 * len(BAD), "epochs 1 and 2 each passed over both samples"


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
