"""DDP on 2 gloo ranks: every rank detects together, decides together, restores together.

The scenarios run once, in ONE subprocess that spawns 2 ranks (a hang fails on the timeout
instead of blocking CI); each test asserts on its part of the ranks' JSON results. A fault
is injected on rank 1 only; rank 0's data stays clean. Adaptive clipping and the quarantine are
scenarios of the same launch (the launch, not the scenarios, is what costs). The host-side
combination rules are tested directly, without processes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import pytest
import torch

from tests.helpers.processes import join_gloo_group
from tests.helpers.ranks import decisions, digest, poisoned_batches

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180  # seconds for all scenarios together; they take ~15 s
MARK = 1e31  # a finite input value that the model's Spike layer turns into +inf (loss stays finite)
BAD = (5, 22)  # the quarantine scenario's samples whose loss is -log(0)


# ----------------------------------------------------------------------------- the ranks' side


class Spike(torch.nn.Module):
    """+inf where the input is above 1e30: a data-dependent fault that the loss does not show."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(x > 1e30, 1e10, 1.0)  # only a marked value overflows


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(Spike(), torch.nn.Tanh(), torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return torch.nn.parallel.DistributedDataParallel(net)


def _run(
    rank: int,
    overrides: List[str],
    poison: Callable[[int, torch.Tensor], None],
    steps: int = 10,
    after: Callable[[Any], Dict[str, Any]] = lambda guard: {},
    before: Callable[[int, Any], None] = lambda step, guard: None,
) -> Dict[str, Any]:
    import torch.nn.functional as F

    from safetrain import TrainingAborted, load_config
    from safetrain.guard import Guard
    from safetrain.testing import count_host_syncs

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = load_config(None, ["log.progress=false", "snapshot.every=3", *overrides])
    out: Dict[str, Any] = {"steps": [], "anomalies": [], "restored": [], "aborted_at": None}
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.bus.subscribe(
            lambda e: (
                out["anomalies"].append(
                    [
                        e.step,
                        e.kind,
                        e.action,
                        e.rank,
                        e.detail.get("ranks"),
                        e.detail.get("diagnosis"),
                        e.detail.get("finding"),
                    ]
                )
                if e.name == "anomaly"
                else None
            )
        )
        guard.bus.subscribe(
            lambda e: (
                out["restored"].append([e.step, e.detail.get("snapshot_step"), e.detail.get("path")])
                if e.name == "restored"
                else None
            )
        )
        guard.begin_epoch(0)
        try:
            for i, batch in enumerate(poisoned_batches(rank, steps, poison)):
                before(i + 1, guard)
                with count_host_syncs() as syncs:
                    result = guard.step(batch)
                snap = any(e.name == "snapshot" for e in result.events)
                out["steps"].append([result.step, result.trained, result.action, syncs.count, snap])
        except TrainingAborted:
            out["aborted_at"] = guard.counters.steps
        out.update(after(guard))
    out["digest"] = digest(model)
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def _skip(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step == 4:
            x[2, 1] = math.nan  # a NaN input on rank 1 -> both skip (sanitize.inputs=skip_batch)
        if step == 7:
            x[5, 0] = MARK  # an inf activation on rank 1, finite loss -> confirmed by a re-run -> both skip

    return _run(rank, ["sanitize.inputs=skip_batch"], poison)


def _drop(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step == 3:
            x[1, 0] = math.nan  # drop_rows: rank 1 drops a row, rank 0 none; both re-run the step
        if step == 5:
            x[:, 0] = math.nan  # every row of rank 1 is bad: nothing to re-run there, so both skip

    return _run(rank, [], poison, steps=6)


def _restore(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step == 8:
            x[0, 3] = MARK

    def after(guard: Any) -> Dict[str, Any]:
        torch.rand(1)  # move the generator on from where the snapshot saw it
        before = torch.get_rng_state().clone()
        info = guard.store.restore(guard.state)  # once more, from rank 0's newest file
        return {
            "rng_kept": torch.equal(before, torch.get_rng_state()),
            "final_restore": [info.step, info.path],
            "files": sorted(os.listdir(os.path.join(tmp, "snaps"))),
        }

    return _run(
        rank,
        ["snapshot.store=safetensors", f"snapshot.dir={tmp}/snaps", "recovery.actions.forward=restore"],
        poison,
        after=after,
    )


def _abort(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step >= 3:
            x[0, 0] = MARK  # a persistent fault on rank 1: the ladder climbs to abort

    return _run(rank, ["recovery.max_retries=2"], poison)


def _weights(rank: int, tmp: str, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    def before(step: int, guard: Any) -> None:
        if step == 5 and rank == 1:  # a weight turns NaN on rank 1 only, outside the step (a bit flip)
            with torch.no_grad():
                guard.model.module[2].weight[0, 0] = math.nan

    return _run(rank, list(overrides), lambda step, x: None, steps=7, before=before)


def _weights_checked(rank: int, tmp: str) -> Dict[str, Any]:
    return _weights(rank, tmp, ["detect.check_weights_every=1"])


def _clip(rank: int, tmp: str) -> Dict[str, Any]:
    """Adaptive clipping: every rank sees the same total norm, so every rank clips alike, even when
    only rank 1's data makes the outlier (DDP averages the gradients before the step's one read)."""
    import torch.nn.functional as F

    from safetrain import load_config
    from safetrain.guard import Guard
    from safetrain.testing import count_host_syncs

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
    out["digest"] = digest(model)
    return out


def _risky_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(out, dim=1) * (target != 2).float().unsqueeze(1)  # class 2: probability 0
    return -torch.log(probs.gather(1, target.unsqueeze(1))).mean()


def _quarantine(rank: int, tmp: str) -> Dict[str, Any]:
    """Quarantine: samples ``BAD`` have a target whose loss is ``-log(0)``; a replay bisects each one
    down to its dataset index on whichever rank drew it; every rank quarantines the union and the
    shards stay equal in length (else the next collective would wait for ever: the timeout)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from safetrain import SafeTrainer, load_config
    from safetrain.diagnose.quarantine import QuarantineSampler

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    y[list(BAD)] = 2
    sampler = QuarantineSampler(DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0))
    loader = DataLoader(TensorDataset(x, y), batch_size=2, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
    cfg = load_config(
        None, ["log.progress=false", "detect.mode=lazy", f"log.dir={tmp}/quarantine/run", "recovery.max_retries=9"]
    )
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
    del model
    gc.collect()
    return out


SCENARIOS = {
    "skip": _skip,
    "drop": _drop,
    "restore": _restore,
    "abort": _abort,
    "weights": _weights,
    "weights_checked": _weights_checked,
    "clip": _clip,
    "quarantine": _quarantine,
}


def _worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    join_gloo_group(rank, world, tmp, 60)
    results: Dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        results[name] = scenario(rank, tmp)
    from safetrain.distributed import LocalSync
    from safetrain.guard import Guard

    plain = torch.nn.Linear(4, 1)  # not DDP: each rank keeps deciding on its own flags
    with Guard(plain, torch.optim.SGD(plain.parameters(), lr=0.1)) as guard:
        results["plain_model_is_local"] = isinstance(guard.sync, LocalSync) and guard.rank == rank
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    gc.collect()  # free the DDP models (they hold the process group) before the group is destroyed
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the test's side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    from tests.helpers.processes import run_two_ranks  # here, not in the ranks' processes

    tmp = tmp_path_factory.mktemp("ddp")
    run_two_ranks(__file__, tmp, TIMEOUT, "the 2-rank run")
    runs = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    runs[0]["quarantine"]["file"] = json.loads((tmp / "quarantine" / "run" / "quarantine.json").read_text())
    return runs


def _torchrun(*args: str) -> str:
    """Run examples/ddp.py on 2 ranks under torchrun, killed (with its ranks) on the timeout."""
    from tests.helpers.processes import run_torchrun  # here, not in the ranks' processes

    return run_torchrun("ddp.py", *args, timeout=TIMEOUT)


def test_nan_on_rank_1_only_makes_both_ranks_skip_and_parameters_stay_identical(ranks):
    r0, r1 = ranks[0]["skip"], ranks[1]["skip"]
    assert decisions(r0) == decisions(r1), "the ranks decided differently"
    assert r0["steps"][3][1:3] == [False, "skip_batch"], r0["steps"]
    assert r0["steps"][6][1:3] == [False, "skip_batch"], r0["steps"]
    assert [s[2] for i, s in enumerate(r0["steps"]) if i not in (3, 6)] == [""] * 8, r0["steps"]
    assert r0["digest"] == r1["digest"] and r0["finite"], "parameters differ across ranks after training"
    # The journal says which rank saw what; every event names the rank that wrote it.
    assert [(a[1], a[4]) for a in r0["anomalies"]] == [("input", {"input": [1]}), ("forward", {"forward": [1]})]
    assert {a[3] for a in r0["anomalies"]} == {0} and {a[3] for a in r1["anomalies"]} == {1}


def test_a_healthy_ddp_step_makes_one_host_sync(ranks):
    for run in (ranks[0]["skip"], ranks[1]["skip"]):
        healthy = [s[3] for s in run["steps"][1:] if not s[2] and not s[4]]  # step 1 takes the first snapshot
        assert len(healthy) >= 4 and set(healthy) == {1}, run["steps"]
        # A snapshot step adds the finiteness check and one agreement across ranks.
        assert {s[3] for s in run["steps"] if not s[2] and s[4]} == {3}, run["steps"]


def test_drop_rows_reruns_on_every_rank_or_on_none(ranks):
    r0, r1 = ranks[0]["drop"], ranks[1]["drop"]
    assert decisions(r0) == decisions(r1)
    assert r0["steps"][2][1:3] == [True, "drop_rows"], r0["steps"]  # rank 0 re-ran its whole batch
    assert r0["steps"][4][1:3] == [False, "skip_batch"], r0["steps"]  # rank 1 had no row left
    assert r0["digest"] == r1["digest"]


def test_restore_on_both_ranks_from_rank_0s_safetensors_snapshot(ranks):
    r0, r1 = ranks[0]["restore"], ranks[1]["restore"]
    assert decisions(r0) == decisions(r1)
    assert r0["steps"][7][2] == "restore", r0["steps"]
    assert r0["restored"] == r1["restored"] and len(r0["restored"]) == 1, (r0["restored"], r1["restored"])
    assert r0["restored"][0][2].endswith(f"snapshot-{r0['restored'][0][1]:010d}.safetensors")
    assert r0["final_restore"] == r1["final_restore"]
    assert r0["files"] == r1["files"] and all(f.startswith("snapshot-") for f in r0["files"]), r0["files"]
    assert r0["digest"] == r1["digest"] and r0["finite"]
    # The file holds rank 0's generators; rank 1 keeps its own on restore.
    assert r1["rng_kept"] and not r0["rng_kept"]


def test_a_model_that_is_not_ddp_keeps_per_rank_decisions(ranks):
    assert ranks[0]["plain_model_is_local"] and ranks[1]["plain_model_is_local"]


def test_abort_raises_on_both_ranks_at_the_same_step(ranks):
    r0, r1 = ranks[0]["abort"], ranks[1]["abort"]
    assert r0["aborted_at"] is not None and r0["aborted_at"] == r1["aborted_at"], (r0["steps"], r1["steps"])
    assert decisions(r0) == decisions(r1)
    assert r0["digest"] == r1["digest"] and r0["finite"]


def test_weights_broken_on_one_rank_are_a_weights_fault_on_both_restored_without_a_weight_replay(ranks):
    """The trip's weight check agrees across ranks that some rank's parameters are non-finite (no
    step replay spent on it); the weight replay is skipped with a note on every rank (no rank
    waits on another), and both restore."""
    r0, r1 = ranks[0]["weights"], ranks[1]["weights"]
    f0, f1 = r0["anomalies"][0][6], r1["anomalies"][0][6]
    # Rank 0's own are finite; its finding (rank 0's journal is the run's) names rank 1 and the parameter.
    assert (f0["nonfinite"], f0["ranks"]) == (["module.2.weight"], [1]), f0
    assert f1["nonfinite"] == ["module.2.weight"] and f1["ranks"] == [1], f1
    assert f0["counts"] == f1["counts"] == [["module.2.weight", 1, 0]], "one replica's count, not a sum"
    assert decisions(r0) == decisions(r1)
    assert [a[:3] for a in r0["anomalies"]] == [[5, "weights", "restore"]], r0["anomalies"]
    assert [a[:3] for a in r1["anomalies"]] == [[5, "weights", "restore"]], r1["anomalies"]
    for run in (r0, r1):
        assert "torch.distributed" in run["anomalies"][0][5]["note"], run["anomalies"][0][5]
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_weights_caught_by_the_periodic_check_on_one_rank_are_judged_alike_on_both(ranks):
    """The weight check's flag is combined across ranks; rank 0's own parameters are finite, yet it
    must not judge the step from its other flags (rank 1 restores: both must, together)."""
    r0, r1 = ranks[0]["weights_checked"], ranks[1]["weights_checked"]
    assert decisions(r0) == decisions(r1)
    assert [a[:3] for a in r0["anomalies"]] == [a[:3] for a in r1["anomalies"]] == [[5, "weights", "restore"]]
    assert r0["anomalies"][0][6]["ranks"] == [1] and r0["anomalies"][0][6]["nonfinite"] == ["module.2.weight"]
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_both_ranks_clip_identically_when_one_ranks_data_makes_the_outlier(ranks):
    r0, r1 = ranks[0]["clip"], ranks[1]["clip"]
    assert r0["steps"] == r1["steps"], "same norms, same clips, same decisions, step by step"
    assert r0["stats"] == r1["stats"] and r0["digest"] == r1["digest"]
    clipped = [s[0] for s in r0["steps"] if s[4] != "nan"]
    assert 13 in clipped and r0["clipped_steps"] == len(clipped), clipped
    decided = {s[0]: s[2] for s in r0["steps"]}
    assert decided[12] == "skip_batch", "x8 targets on rank 1 at step 12: a far outlier (adaptive threshold) on both"
    assert all(a == "" for step, a in decided.items() if step != 12), "the rest clipped or left, never skipped"
    assert all(s[5] == 1 for s in r0["steps"][1:]), "one host sync per step (the read's collective)"


def test_every_rank_quarantines_what_any_rank_isolated(ranks):
    ranks = [r["quarantine"] for r in ranks]
    isolated = sorted(set(ranks[0]["isolated"]) | set(ranks[1]["isolated"]))
    assert isolated == list(BAD), "bisection on the ranks found exactly the two bad samples"
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == list(BAD)
    assert ranks[0]["file"]["indices"] == list(BAD), "rank 0 wrote the union to quarantine.json"


def test_ranks_stay_in_step_and_later_epochs_are_clean(ranks):
    ranks = [r["quarantine"] for r in ranks]
    r0, r1 = ranks
    assert r0["steps"] == r1["steps"] == 3 * 8, "16 samples per rank, batches of 2, 3 epochs: no rank ran short"
    assert set(r0["anomaly_epochs"]) == set(r1["anomaly_epochs"]) == {0}, "quarantined samples never came back"
    assert r0["params"] == r1["params"], "the ranks' parameters diverged"
    skips = [d for run in ranks for action, d in run["quarantine_events"] if action == "skip"]
    assert all(d["skipped"] == d["repeated"] for d in skips), "each skipped sample was replaced by a repeat"
    assert sum(d["skipped"] for d in skips) == 2 * len(BAD), "epochs 1 and 2 each passed over both samples"


def test_example_under_torchrun_and_resume_in_new_processes(tmp_path):
    full = _torchrun("--run-dir", str(tmp_path / "full"), "--epochs", "2")
    assert "parameters identical on all ranks: True" in full, full
    assert "tripped: {'input': [1]}" in full and "restored forward -> restore" in full, full
    assert (tmp_path / "full" / "events.jsonl").exists() and (tmp_path / "full" / "events-rank1.jsonl").exists()
    part = _torchrun("--run-dir", str(tmp_path / "cut"), "--epochs", "2", "--max-steps", "12")
    assert "12 steps" in part, part
    resumed = _torchrun("--run-dir", str(tmp_path / "cut"), "--epochs", "2", "--resume")
    marked = re.compile(r"identical on all ranks: True \(digest (\w+)\)")
    assert marked.search(resumed) and marked.search(resumed).group(1) == marked.search(full).group(1), resumed


def test_combination_rules_on_the_host():
    from safetrain.detect import StepFlags
    from safetrain.distributed.sync import _combine, _plan

    # Rank 1's own values: a NaN input sum, a tripped bool, found_inf, its loss, an inf activation.
    puts = [
        ("input", [1.0, 2.0]),
        ("weights", False),
        ("found_inf", 0.0),
        ("loss", 1.0),
        ("forward", [3.0, 4.0]),
        ("grad_norms", torch.tensor([3.0, 4.0])),
    ]
    rank1 = {"input": [1.0, math.nan], "weights": True, "found_inf": 1.0, "loss": 3.0, "forward": [math.inf, 4.0]}
    captured: List[Any] = []

    def reduce(packed: torch.Tensor, layout: Any) -> List[float]:
        row0 = packed.tolist()
        flags = StepFlags()
        for name, value in puts:
            flags.put(name, _tensors(rank1.get(name, value)))
        row1 = torch.cat([v.reshape(-1).float() for v in flags._scalars + flags._vectors]).tolist()
        captured.append(layout)
        return _combine([row0, row1], _plan(layout))

    flags = StepFlags(reduce=reduce)
    for name, value in puts:
        flags.put(name, _tensors(value))
    read = flags.read()
    assert read.input and read.weights and read.forward_tripped, read
    assert read.loss == 2.0, "loss is the mean over ranks"
    assert read.extra["found_inf"] == (1.0,), "found_inf is summed"
    assert read.grad_norms == (3.0, 4.0) and read.total_norm == 5.0, "norms are rank 0's (identical under DDP)"
    assert read.forward == (math.inf, 4.0), "locate() sees the position that tripped on rank 1"


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list):
        return [torch.tensor(v) for v in value]
    return torch.tensor(value)


def test_one_process_has_no_distributed_state():
    import torch.nn.functional as F

    from safetrain import distributed
    from safetrain.distributed import LocalSync
    from safetrain.guard import Guard

    model = torch.nn.Linear(4, 2)
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss) as guard:
        assert isinstance(guard.sync, LocalSync) and guard.rank == 0 and guard.forward.flags._reduce is None
    assert not distributed.active() and distributed.rank() == 0
    with distributed.local(model):  # a no-op for a plain module
        model(torch.ones(1, 4))


if __name__ == "__main__":
    torch.multiprocessing.spawn(_worker, args=(2, sys.argv[1]), nprocs=2, join=True)
