"""The Lightning callback under ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, launched
as a user launches it (issue #25): this file is also the script; ``python this_file TMP S1,S2,...``
runs ``trainer.fit`` for each scenario in turn (one ``Trainer`` each, as a script that fits twice)
and Lightning's own launcher starts rank 1 by running it again. A fault is injected on rank 1 only.
Each launch is one subprocess session killed on a timeout, so a hang fails the test instead of
blocking CI; each rank writes what it saw to ``TMP/HOME/SCENARIO-rank{r}.json``, HOME being the
scenario's own directory (a resume's is the run it resumes). The four ``ddp`` scenarios that start
a run share one launch: the launch, not the 8 steps, is what costs (~10-20 s on a shared CPU).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 90  # seconds per scenario of a 2-rank launch; each takes ~10-20 s on a shared CPU
FAULT_STEP = 4
CFG: Dict[str, Any] = {"snapshot": {"every": 3}, "detect": {"check_weights_every": 0}, "log": {"level": "WARNING"}}


# ----------------------------------------------------------------------------- the ranks' side


pl = pytest.importorskip("lightning.pytorch")


class Net(pl.LightningModule):
    """A small MLP (module level: ``ddp_spawn`` pickles it into the spawned ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.body(x))), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_train_start(self) -> None:
        from safetrain.testing import OutputFault

        if getattr(self, "spawned_fault", False) and self.global_rank == 1:  # ddp_spawn: rank known only here
            OutputFault(self.body, calls=[FAULT_STEP])


def _module() -> Any:
    return Net()


def _sharded_module() -> Any:
    """The same module, FSDP2-sharded in ``configure_model`` (Lightning's ``ModelParallelStrategy``)."""
    net = _module()

    def configure_model() -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = net.device_mesh["data_parallel"]
        for part in (net.body, net.head, net):
            fully_shard(part, mesh=mesh)

    net.configure_model = configure_model
    return net


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value (a DTensor's gathered on every rank: a collective)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _loader() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) / 2), batch_size=8, shuffle=False)


def _full_digest(model: torch.nn.Module) -> str:
    flat = torch.cat([_full(p.detach()).reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _home(scenario: str) -> str:
    """The directory of ``scenario`` under a launch's root: a resume's is the run it resumes."""
    return {"resume": "first", "fsdp_resume": "fsdp_first"}.get(scenario, scenario)


def main(root: str, scenarios: str) -> None:
    """One rank's runs of the comma-separated ``scenarios``, in order (rank 0 is this process;
    Lightning starts rank 1 at the first ``fit`` and reuses it for the others)."""
    for scenario in scenarios.split(","):
        tmp = os.path.join(root, _home(scenario))
        os.makedirs(tmp, exist_ok=True)
        _run(tmp, scenario)


def _run(tmp: str, scenario: str) -> None:
    """One rank's run of ``scenario`` in ``tmp``."""

    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy

    from safetrain import TrainingAborted
    from safetrain.integrations.lightning import SafeTrainingCallback
    from safetrain.testing import OutputFault, WeightFault

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher for rank 1 only
    sharded = scenario.startswith("fsdp")
    model = _sharded_module() if sharded else _module()
    cfg: Dict[str, Any] = json.loads(json.dumps(CFG))
    out: Dict[str, Any] = {"rank": rank, "aborted_at": None}
    if scenario in ("output", "first", "fsdp_first") and rank == 1:
        OutputFault(model.body, calls=[FAULT_STEP])  # the forward of step 4 on rank 1 only
    if scenario == "abort":
        cfg["recovery"] = {"max_retries": 2}
        if rank == 1:
            OutputFault(model.body, calls=range(FAULT_STEP, 10**9))  # persistent, on rank 1 only

    class Probe(pl.Callback):
        """Listed after SafeTrainingCallback: sees its guard as built (resumed) and as it ends."""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            out["start"] = vars(cb.guard.counts)
            out["lr_scale_at_start"] = cb.guard.lr_scale
            if scenario == "weight" and rank == 1:  # a weight turns NaN on rank 1 after step 5's update
                WeightFault(trainer.optimizers[0], pl_module.head.weight, (0, 3), steps=[5])

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if scenario == "fsdp_first" and rank == 1 and batch_idx == 5:  # rank 1's shard, after step 6
                with torch.no_grad():
                    pl_module.body.weight.to_local()[0, 0] = math.nan

    cb = SafeTrainingCallback(cfg, run_dir=None if scenario == "output" else f"{tmp}/run")
    logger = CSVLogger(tmp) if scenario == "output" else False
    steps = {"resume": 12, "fsdp_resume": 12}.get(scenario, 8)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded else "ddp"
    if scenario == "spawn":  # the ranks are spawned processes: the fault is set where the rank is known
        strategy, model.spawned_fault = "ddp_spawn", True
    callbacks = [cb] if scenario == "spawn" else [cb, Probe()]  # (spawn pickles them: no local class)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    try:
        ckpt = {"resume": f"{tmp}/first.ckpt", "fsdp_resume": f"{tmp}/fsdp_first.ckpt"}.get(scenario)
        trainer.fit(model, _loader(), ckpt_path=ckpt)
    except TrainingAborted as exc:
        out["aborted_at"] = cb.guard.steps if cb.guard is not None else -1
        out["abort_message"] = str(exc)
    if scenario in ("first", "fsdp_first"):
        trainer.save_checkpoint(f"{tmp}/{scenario}.ckpt")  # every rank calls (FSDP2: each writes its shards)
    if scenario == "spawn":  # the guard lived in the spawned ranks; the main process has the journal
        with open(os.path.join(tmp, "spawn-rank0.json"), "w") as f:
            json.dump({"guard": cb.guard is None, "digest": _full_digest(model), "finite": True}, f)
        with open(os.path.join(tmp, "spawn-rank1.json"), "w") as f:
            json.dump({}, f)
        return
    out["end"] = vars(cb.guard.counts)
    out["digest"], out["finite"] = _full_digest(model), all(bool(torch.isfinite(p).all()) for p in model.parameters())
    out["ended"] = cb.result.ended if cb.result is not None else None
    with open(os.path.join(tmp, f"{scenario}-rank{rank}.json"), "w") as f:
        json.dump(out, f)


# ----------------------------------------------------------------------------- the test's side


def launch(root: Path, *scenarios: str) -> Dict[str, List[Dict[str, Any]]]:
    """Run ``scenarios`` in turn on 2 ranks as a user would (``python script``; Lightning launches
    rank 1), in one session killed on the timeout; each scenario's results in rank order."""
    from tests.helpers.processes import run_session  # here, not in the ranks' processes

    log = run_session(
        [sys.executable, __file__, str(root), ",".join(scenarios)],
        TIMEOUT * len(scenarios),
        f"the 2-rank Lightning run {scenarios}",
        env={"PL_DISABLE_FORK": "1"},
        drop=("LOCAL_RANK", "WORLD_SIZE", "RANK", "NODE_RANK"),  # Lightning launches rank 1 itself
    )
    results = {}
    for scenario in scenarios:
        results[scenario] = []
        for r in range(2):
            f = root / _home(scenario) / f"{scenario}-rank{r}.json"
            assert f.exists(), f"rank {r} wrote no result for {scenario!r}:\n{log[-4000:]}"
            results[scenario].append(json.loads(f.read_text()))
    return results


def journal(run_dir: Path, rank: int = 0) -> List[Dict[str, Any]]:
    name = "events.jsonl" if rank == 0 else f"events-rank{rank}.jsonl"
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def anomalies(run_dir: Path, rank: int = 0) -> List[Dict[str, Any]]:
    return [e for e in journal(run_dir, rank) if e["event"] == "anomaly"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: Any) -> Any:
    """One launch of the ``ddp`` scenarios that start a run (the abort last: it ends the run)."""
    root = tmp_path_factory.mktemp("ddp")
    return root, launch(root, "first", "weight", "output", "abort")


@pytest.fixture
def first(ddp_runs: Any) -> Any:
    root, runs = ddp_runs
    return root / "first", runs["first"]


def test_a_nan_forward_on_rank_1_is_retried_on_both_ranks_at_that_step(first):
    """A layer's output goes NaN on rank 1 at step 4 (rank 0's data and forward are clean): both
    ranks retry step 4, the run trains to the end, the parameters are finite and equal, and rank
    0's journal names the rank and the layer."""
    tmp, (r0, r1) = first
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"], "parameters differ across ranks"
    assert r0["end"] == r1["end"], "the ranks counted differently"
    assert r0["end"]["retries"] == 1 and r0["end"]["optimizer_steps"] == 8 and r0["ended"] == "done", r0
    (found,) = anomalies(tmp / "run")
    assert (found["kind"], found["step"], found["action"], found["rank"]) == ("forward", FAULT_STEP, "retry", 0)
    assert found["detail"]["ranks"] == {"forward": [1]}, found["detail"]
    assert found["detail"]["finding"]["module"].endswith("body"), found["detail"]["finding"]
    (mine,) = anomalies(tmp / "run", rank=1)  # rank 1 journals beside it, stamped with its rank
    assert (mine["step"], mine["action"], mine["rank"]) == (FAULT_STEP, "retry", 1)


def test_resume_from_lightnings_checkpoint_in_a_new_launch_restores_the_guard_on_every_rank(first):
    tmp, _ = first
    r0, r1 = launch(tmp.parent, "resume")["resume"]
    for r in (r0, r1):
        assert r["start"]["steps"] == 8 and r["start"]["retries"] == 1, r["start"]
        assert r["end"]["steps"] == 12 and r["end"]["retries"] == 1 and r["ended"] == "done", r["end"]
    assert r0["digest"] == r1["digest"] and r0["finite"]
    started = [e for e in journal(tmp / "run") if e["event"] == "run_started"]
    assert [e["action"] for e in started] == ["start", "resume"], started


def test_a_nan_weight_on_rank_1_is_restored_on_both_ranks_bitwise_equal(ddp_runs):
    """After step 5's update a weight entry of rank 1 turns NaN (a bit flip on one replica): step 6
    trips on rank 1 only; both ranks restore the last good snapshot and end equal and finite."""
    root, runs = ddp_runs
    tmp, (r0, r1) = root / "weight", runs["weight"]
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"], "parameters differ across ranks"
    assert r0["end"] == r1["end"] and r0["end"]["restores"] == 1 and r0["ended"] == "done", r0["end"]
    (found,) = anomalies(tmp / "run")
    assert (found["kind"], found["step"], found["action"]) == ("weights", 6, "restore"), found
    finding = found["detail"]["finding"]
    assert finding["ranks"] == [1] and finding["nonfinite"] == ["module.head.weight"], finding


def test_a_persistent_fault_on_rank_1_aborts_both_ranks_at_the_same_step_without_a_hang(ddp_runs):
    root, runs = ddp_runs  # the launch's timeout: a rank left waiting fails the test
    tmp, (r0, r1) = root / "abort", runs["abort"]
    assert r0["aborted_at"] is not None and r0["aborted_at"] == r1["aborted_at"], (r0, r1)
    assert r0["finite"] and r0["digest"] == r1["digest"], "not both at the last good snapshot"
    assert "forward" in r0["abort_message"]
    ended = [e for e in journal(tmp / "run") if e["event"] == "run_ended"]
    assert ended and ended[-1]["action"] == "aborted", ended


def test_csv_logger_keeps_its_metrics_file_and_gets_the_lr_and_the_counters(ddp_runs):
    """docs/lightning.md's snippet with Lightning's CSV logger (no tensorboard installed): the callback's
    journal and metrics go to ``<log_dir>/safetrain/``, Lightning's ``metrics.csv`` stays Lightning's
    alone, carries the LR in force and the intervention counters, and ``safetrain report`` reads
    the run from the logger's directory."""
    from safetrain.rundir.runlog import read_run

    root, _ = ddp_runs
    version = root / "output" / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    assert rows and all(set(r) == set(rows[0]) for r in rows)
    assert "step" in rows[0] and "loss" not in rows[0], "safetrain's own rows are in Lightning's file"
    lrs = [float(r["safetrain/lr"]) for r in rows if r.get("safetrain/lr")]
    assert lrs and all(math.isclose(v, 0.05) for v in lrs), lrs
    retries = [(int(r["step"]), float(r["safetrain/retries"])) for r in rows if r.get("safetrain/retries")]
    assert (FAULT_STEP - 1, 1.0) in retries, retries  # logged at the step acted on (global_step 3 = step 4)
    run = read_run(version)
    assert run.metrics is not None and run.metrics["step"] == [float(s) for s in range(1, 9)], run.metrics
    assert [e["kind"] for e in anomalies(version / "safetrain")] == ["forward"]


def test_ddp_spawn_agrees_like_ddp_and_the_callback_pickles_without_its_config_mappings(tmp_path):
    """``strategy="ddp_spawn"`` pickles the callback into each spawned rank (the validated config's
    read-only mappings did not pickle); the ranks agree as under ``ddp``; the journal is the record
    (the guard and its result live in the spawned processes)."""
    r0, _ = launch(tmp_path, "spawn")["spawn"]
    tmp = tmp_path / "spawn"
    assert r0["guard"], "the main process's callback never built a guard"
    (found,) = anomalies(tmp / "run")
    assert (found["kind"], found["step"], found["action"]) == ("forward", FAULT_STEP, "retry"), found
    assert found["detail"]["ranks"] == {"forward": [1]}
    ended = [e for e in journal(tmp / "run") if e["event"] == "run_ended"]
    assert [e["action"] for e in ended] == ["done"] and anomalies(tmp / "run", rank=1)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: Any) -> Any:
    root = tmp_path_factory.mktemp("fsdp")
    return root / "fsdp_first", launch(root, "fsdp_first")["fsdp_first"]


def test_fsdp2_through_model_parallel_strategy_agrees_on_a_forward_and_a_weight_fault(sharded):
    """``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model`` (FSDP2) on CPU gloo: a NaN
    forward on rank 1 at step 4 is skipped on both ranks (replays are off under FSDP2), a NaN in
    rank 1's shard after step 6 makes both restore their shards of the same snapshot; the whole
    parameters end finite and equal on both ranks."""
    tmp, (r0, r1) = sharded
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]
    assert r0["end"] == r1["end"] and r0["ended"] == "done", (r0["end"], r1["end"])
    found = anomalies(tmp / "run")
    assert [(e["kind"], e["step"], e["action"]) for e in found] == [
        ("forward", FAULT_STEP, "skip_batch"),
        ("weights", 7, "restore"),
    ], found
    assert found[0]["detail"]["ranks"] == {"forward": [1]} and found[0]["detail"]["finding"]["module"] == "body"
    assert found[1]["detail"]["finding"]["ranks"] == [1] and found[1]["detail"]["finding"]["nonfinite"] == [
        "body.weight"
    ]
    restored = [e for e in journal(tmp / "run") if e["event"] == "restored"]
    assert [e["detail"]["snapshot_step"] for e in restored] == [3], restored


def test_fsdp2_resume_from_lightnings_distributed_checkpoint_restores_the_guard_on_every_rank(sharded):
    tmp, (first0, _) = sharded
    r0, r1 = launch(tmp.parent, "fsdp_resume")["fsdp_resume"]
    for r in (r0, r1):
        assert r["start"] == {**first0["end"]}, (r["start"], first0["end"])
        assert r["end"]["steps"] == 12 and r["end"]["restores"] == 1 and r["ended"] == "done", r["end"]
    assert r0["digest"] == r1["digest"] and r0["finite"]


def test_lightnings_fsdp1_strategy_is_refused_naming_the_alternatives():
    """``strategy="fsdp"`` is FSDP1 (``FullyShardedDataParallel``, flattened parameters)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    from safetrain.integrations.lightning import _guarded_module

    module = _module()
    strategy = FSDPStrategy.__new__(FSDPStrategy)  # as on_train_start finds it, without processes
    strategy._model, strategy._lightning_module = torch.nn.Linear(1, 1), module
    with pytest.raises(ValueError, match=r"FSDP1.*strategy='ddp'.*ModelParallelStrategy"):
        _guarded_module(SimpleNamespace(world_size=2, strategy=strategy), module)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
