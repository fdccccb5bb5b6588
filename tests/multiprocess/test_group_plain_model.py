"""A plain model in a process group made for another reason, on 2 gloo ranks: rank 0 trains alone.

Issue 25: the process's default group is initialised (a launcher did it, or another part of
the program uses it) but the model is not wrapped in DDP or FSDP2, so the guard's sync is a
``LocalSync`` and rank 0 decides on its own. Only rank 0 trains, on a dataset whose sample 5
has a target whose loss is ``-log(0)``; rank 1 is a peer busy with something else, waiting
in a barrier for rank 0 to finish. When the replay isolates sample 5 the quarantine asked the
process (``distributed.active()``) and entered ``all_gather_object`` alone: rank 0 died there,
or waited with rank 1 for the collective's timeout. With the guard's sync it quarantines alone
(skips the sample, as one process does: no repeats to keep ranks in step) and both ranks finish.
The group's timeout is short and the launch has one too, so a hang fails instead of blocking.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from typing import Any, Dict, List

import pytest
import torch

pytestmark = pytest.mark.slow

TIMEOUT = 180  # the whole launch; the scenarios take ~15 s, a hang in the group ~2 x GROUP_TIMEOUT
GROUP_TIMEOUT = 20  # seconds a collective waits before it fails (a hang turns into an error)
BAD = 5


def _risky_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(out, dim=1) * (target != 2).float().unsqueeze(1)  # class 2: probability 0
    return -torch.log(probs.gather(1, target.unsqueeze(1))).mean()


def _train_alone(phase: str, tmp: str) -> Dict[str, Any]:
    """Rank 0: 2 epochs of a plain model over 12 samples, one of them bad; ``phase`` is
    ``keeper`` (the guard and a QuarantineKeeper given the guard's sync, as ``fit`` does once it
    passes it) or ``fit`` (``SafeTrainer.fit`` as it is)."""
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    from safetrain import SafeTrainer, load_config
    from safetrain.diagnose.quarantine import QuarantineKeeper, QuarantineSampler, read_quarantine
    from safetrain.guard import Guard

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 2, (12,), generator=g)
    y[BAD] = 2
    dataset = TensorDataset(x, y)
    sampler = QuarantineSampler(SequentialSampler(dataset))
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run_dir = os.path.join(tmp, phase)
    cfg = load_config(None, ["log.progress=false", "detect.mode=lazy", f"log.dir={run_dir}", "recovery.max_retries=9"])
    out: Dict[str, Any] = {}
    if phase == "fit":
        result = SafeTrainer(model, opt, cfg, loss_fn=_risky_loss).fit(loader, epochs=2)
        out["steps"] = result.steps
    else:
        from pathlib import Path

        emitted: List[Any] = []
        with Guard(model, opt, cfg, loss_fn=_risky_loss, run_dir=run_dir) as guard:
            out["sync"] = type(guard.sync).__name__
            keeper = QuarantineKeeper.for_loader(
                loader, Path(run_dir), lambda *a, **k: emitted.append(a[0]), sync=guard.sync
            )
            steps = 0
            for epoch in range(2):
                guard.begin_epoch(epoch)
                for batch in loader:
                    result = guard.step(batch, keeper.indices_for(batch))
                    steps += 1
                    keeper.after_step(result.events if result is not None else ())
                keeper.end_epoch()
        out["steps"], out["emitted"] = steps, emitted
    out["quarantined"] = sorted(sampler.quarantined)
    out["skipped"], out["repeated"] = sampler.skipped, sampler.repeated
    out["file"] = read_quarantine(os.path.join(run_dir, "quarantine.json"))
    out["finite"] = all(math.isfinite(v) for p in model.parameters() for v in p.detach().reshape(-1).tolist())
    return out


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    from tests.helpers.processes import join_gloo_group

    join_gloo_group(rank, world, tmp, GROUP_TIMEOUT)
    out: Dict[str, Any] = {}
    for phase in ("keeper", "fit"):
        if rank == 0:
            try:
                out[phase] = _train_alone(phase, tmp)
            except Exception as exc:  # recorded: the test names what failed
                out[phase] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
        try:
            dist.barrier()  # rank 1, busy with something else, waits here for rank 0
            out[f"{phase}_barrier"] = "ok"
        except Exception as exc:  # a collective left waiting by a lone one on the other rank
            out[f"{phase}_barrier"] = f"{type(exc).__name__}: {exc}"[:300]
            break
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    from tests.helpers.processes import run_two_ranks  # here, not in the ranks' processes

    tmp = tmp_path_factory.mktemp("plain")
    run_two_ranks(__file__, tmp, TIMEOUT, "the plain model in a 2-rank group")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_plain_model_in_a_group_quarantines_alone_with_its_guards_sync(ranks):
    """The guard's sync is a LocalSync; the keeper given it makes no collective (fails before:
    ``all_gather_object`` with rank 1 waiting in a barrier)."""
    r0 = ranks[0]["keeper"]
    assert "error" not in r0, r0
    assert r0["sync"] == "LocalSync", "a plain model in a process group decides on its own"
    assert r0["quarantined"] == r0["file"] == [BAD], r0
    assert (r0["skipped"], r0["repeated"]) == (1, 0), "skipped as in one process, not replaced by a repeat"
    assert r0["steps"] == 6 + 6 and r0["finite"], r0
    assert "add" in r0["emitted"] and "skip" in r0["emitted"], r0["emitted"]
    assert ranks[0]["keeper_barrier"] == ranks[1]["keeper_barrier"] == "ok", "the peer was never made to wait"


def test_fit_on_a_plain_model_in_a_group_quarantines_alone(ranks):
    """``SafeTrainer.fit`` on the same plain model: rank 0 trains to the end and quarantines the
    sample alone; rank 1's barrier is met."""
    r0 = ranks[0].get("fit", {"error": "not run: the group broke in the keeper's phase"})
    assert "error" not in r0, r0
    assert r0["quarantined"] == r0["file"] == [BAD], r0
    assert (r0["skipped"], r0["repeated"]) == (1, 0), r0
    assert r0["steps"] == 6 + 6 and r0["finite"], r0
    assert ranks[0]["fit_barrier"] == ranks[1]["fit_barrier"] == "ok"


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
