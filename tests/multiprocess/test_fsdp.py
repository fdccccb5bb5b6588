"""FSDP2 (``fully_shard``) on 2 gloo ranks: sharded gradients and parameters, one read, one decision.

Issue #17 (first slice). The scenarios run once, in ONE subprocess that spawns 2 ranks (as
tests/multiprocess/test_ddp.py does); each test asserts on its part of the ranks' JSON results.
A fault is injected on rank 1 only. Parameters are compared as full tensors (every shard
gathered), so "equal across ranks" means the ranks hold one consistent model.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List

import pytest
import torch

from tests.helpers.fsdp import full_digest, launch, spawn_ranks
from tests.helpers.ranks import decisions, poisoned_batches

pytestmark = pytest.mark.slow

TIMEOUT = 150  # seconds for all scenarios together
MARK = 1e31  # an input value that the Spike layer turns into +inf (the loss stays finite)


# ----------------------------------------------------------------------------- the ranks' side


class Spike(torch.nn.Module):
    """+inf where the input is above 1e30: a layer emitting Inf on the rank whose data is marked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(x > 1e30, 1e10, 1.0)


class _Bomb(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf if GradBomb.armed else grad


class GradBomb(torch.nn.Module):
    """Identity forward; an Inf gradient in the backward while ``armed`` (set on rank 1 only)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Bomb.apply(x)


def _model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        Spike(),
        torch.nn.Linear(4, 8),
        torch.nn.Tanh(),
        GradBomb(),
        torch.nn.Linear(8, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 1),
    )
    for layer in (net[1], net[4], net[6]):
        fully_shard(layer)
    fully_shard(net)
    return net


def _full(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter as its full tensor (a collective: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _run(
    rank: int,
    overrides: List[str],
    poison: Callable[[int, torch.Tensor], None] = lambda step, x: None,
    steps: int = 10,
    after: Callable[[Any], Dict[str, Any]] = lambda guard: {},
    before: Callable[[int, Any], None] = lambda step, guard: None,
    batches: Any = None,
) -> Dict[str, Any]:
    import torch.nn.functional as F

    from safetrain import TrainingAborted, load_config
    from safetrain.guard import Guard
    from safetrain.testing import count_host_syncs

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = load_config(None, ["log.progress=false", "snapshot.every=3", *overrides])
    out: Dict[str, Any] = {"steps": [], "anomalies": [], "restored": [], "aborted_at": None}
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        out["replay"] = guard.cfg.detect.replay.enabled
        guard.bus.subscribe(
            lambda e: (
                out["anomalies"].append([e.step, e.kind, e.action, e.detail.get("ranks"), e.detail.get("finding")])
                if e.name == "anomaly"
                else None
            )
        )
        guard.bus.subscribe(
            lambda e: out["restored"].append([e.step, e.detail.get("snapshot_step")]) if e.name == "restored" else None
        )
        guard.begin_epoch(0)
        try:
            for i, batch in enumerate(batches if batches is not None else poisoned_batches(rank, steps, poison)):
                before(i + 1, guard)
                with count_host_syncs() as syncs:
                    result = guard.step(batch)
                snap = any(e.name == "snapshot" for e in result.events)
                out["steps"].append([result.step, result.trained, result.action, syncs.count, snap, result.loss])
        except TrainingAborted:
            out["aborted_at"] = guard.counters.steps
        out.update(after(guard))
    GradBomb.armed = False
    out["digest"] = full_digest(model)
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in _full(model).values())
    return out


def _reference(steps: int, clip: float) -> Dict[str, torch.Tensor]:
    """The same training in one process, unsharded: both ranks' rows in one batch, clipped by
    the norm of the whole gradient (what FSDP2 under the guard must match)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        Spike(),
        torch.nn.Linear(4, 8),
        torch.nn.Tanh(),
        GradBomb(),
        torch.nn.Linear(8, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 1),
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for (x0, y0), (x1, y1) in zip(
        poisoned_batches(0, steps, lambda s, x: None), poisoned_batches(1, steps, lambda s, x: None)
    ):
        opt.zero_grad()
        F.mse_loss(net(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in net.named_parameters()}


def _healthy(rank: int, tmp: str) -> Dict[str, Any]:
    def after(guard: Any) -> Dict[str, Any]:
        ref, full = _reference(8, 0.05), _full(guard.model)
        return {"max_diff_from_unsharded": max(float((full[n] - ref[n]).abs().max()) for n in ref)}

    return _run(rank, ["guard.clip_grad_norm=0.05"], steps=8, after=after)


def _faults(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step == 3:
            x[2, 1] = math.nan  # a NaN input on rank 1 -> both skip (sanitize.inputs=skip_batch)
        if step == 5:
            x[5, 0] = MARK  # Spike emits inf on rank 1 only, finite loss -> forward -> both skip

    def before(step: int, guard: Any) -> None:
        GradBomb.armed = rank == 1 and step == 7  # an Inf gradient on rank 1's backward -> both skip

    return _run(rank, ["sanitize.inputs=skip_batch", "recovery.reset_after=1"], poison, steps=9, before=before)


def _restore(rank: int, tmp: str) -> Dict[str, Any]:
    def poison(step: int, x: torch.Tensor) -> None:
        if step == 8:
            x[0, 3] = MARK

    def after(guard: Any) -> Dict[str, Any]:
        guard.snapshot()
        at, opt = _full(guard.model), guard.optimizer
        momentum = [s["momentum_buffer"].full_tensor().clone() for s in opt.state.values()]
        with torch.no_grad():  # spoil every rank's shards in place: parameters and optimizer state
            for p in guard.model.parameters():
                p.to_local().mul_(2.0).add_(1.0)
            for s in opt.state.values():
                s["momentum_buffer"].to_local().fill_(math.nan)
        info = guard.store.restore(guard.state)  # the snapshot just taken, back in place
        back = _full(guard.model)
        again = [s["momentum_buffer"].full_tensor() for s in opt.state.values()]
        return {
            "final_restore": info.step,
            "same_after_restore": all(torch.equal(at[n], back[n]) for n in at)
            and len(momentum) == 6
            and all(torch.equal(a, b) for a, b in zip(momentum, again)),
        }

    return _run(rank, ["recovery.actions.forward=restore"], poison, after=after)


def _poisoned(rank: int, tmp: str) -> Dict[str, Any]:
    """NaN written into rank 1's shard of a parameter between steps 5 and 6 (rank 0's is finite):
    found by the forward it poisons (FSDP2 all-gathers it into every rank's forward), and by the
    periodic weight check of each rank's own shard (``detect.check_weights_every=1``)."""

    def before(step: int, guard: Any) -> None:
        if step == 6 and rank == 1:
            with torch.no_grad():
                guard.model[1].weight.to_local()[0, 0] = math.nan  # rank 1 holds rows 4-7 of the 8x4 weight

    def after(guard: Any) -> Dict[str, Any]:
        return {"local_finite": all(bool(torch.isfinite(p.to_local()).all()) for p in guard.model.parameters())}

    return {
        "forward": _run(rank, [], before=before, steps=9, after=after),
        "periodic": _run(rank, ["detect.check_weights_every=1"], before=before, steps=9, after=after),
    }


def _spike(rank: int, tmp: str) -> Dict[str, Any]:
    """Targets x1e4 on rank 1 only at step 7 (after 6 healthy steps): the mean loss jumps ~1e8-fold."""

    def poison(step: int, x: torch.Tensor) -> None:
        pass

    batches = poisoned_batches(rank, 9, poison)

    def before(step: int, guard: Any) -> None:
        if step == 7 and rank == 1:
            batches[6][1].mul_(1e4)

    return _run(rank, ["guard.spike.hard_ratio=100"], before=before, steps=9, batches=batches)


def _refused(rank: int, tmp: str) -> Dict[str, str]:
    """What the guard says at construction for what it cannot protect."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

    from safetrain import SafetrainError
    from safetrain.guard import Guard

    def message(model: torch.nn.Module, overrides: Any = None) -> str:
        try:
            Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), overrides).close()
        except SafetrainError as exc:
            return str(exc)
        return ""

    mesh = init_device_mesh("cpu", (2,))
    tp = torch.nn.Linear(4, 4)
    tp = distribute_module(
        tp,
        mesh,
        lambda name, mod, mesh: (
            [
                mod.register_parameter(n, torch.nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))
                for n, p in list(mod.named_parameters())
            ]
            and None
        ),
    )
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(inner[0])  # the root left out
    sharded = _model()
    from safetrain import SnapshotError, distributed

    with Guard(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1)) as guard:
        try:
            distributed.load_snapshot(tmp, guard.state)
            resume = ""
        except SnapshotError as exc:
            resume = str(exc)
    return {
        "resume": resume,
        "tensor_parallel": message(tp),
        "root_not_sharded": message(inner),
        "safetensors": message(sharded, {"snapshot": {"store": "safetensors", "dir": f"{tmp}/snaps{rank}"}}),
    }


SCENARIOS = {
    "healthy": _healthy,
    "faults": _faults,
    "restore": _restore,
    "poisoned": _poisoned,
    "spike": _spike,
    "refused": _refused,
}


def _scenarios(rank: int, tmp: str, phase: str) -> Dict[str, Any]:
    return {name: scenario(rank, tmp) for name, scenario in SCENARIOS.items()}


# ----------------------------------------------------------------------------- the test's side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: Any) -> List[Dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    return launch(__file__, tmp, "scenarios", TIMEOUT, "the 2-rank FSDP2 run")


def test_a_healthy_fsdp2_run_trains_with_one_host_sync_per_step_and_one_model(ranks):
    r0, r1 = ranks[0]["healthy"], ranks[1]["healthy"]
    assert decisions(r0) == decisions(r1) and all(s[1] and not s[2] for s in r0["steps"]), r0["steps"]
    for run in (r0, r1):
        healthy = [s[3] for s in run["steps"][1:] if not s[4]]  # step 1 takes the first snapshot
        assert len(healthy) >= 4 and set(healthy) == {1}, run["steps"]
    assert [s[5] for s in r0["steps"]] == [s[5] for s in r1["steps"]], "the loss is the mean over ranks"
    assert r0["digest"] == r1["digest"] and r0["finite"]
    assert r0["replay"] is False and r1["replay"] is False, "replays are off under FSDP2"
    # Clipped by the global norm (a root of the ranks' summed squares), as one unsharded process.
    assert r0["max_diff_from_unsharded"] < 1e-5 and r1["max_diff_from_unsharded"] < 1e-5, r0


def test_faults_on_one_rank_are_detected_on_both_at_the_same_step_with_the_same_action(ranks):
    r0, r1 = ranks[0]["faults"], ranks[1]["faults"]
    assert decisions(r0) == decisions(r1), (r0["steps"], r1["steps"])
    assert [s[2] for s in r0["steps"]] == ["", "", "skip_batch", "", "skip_batch", "", "zero_grads", "", ""]
    for run in (r0, r1):
        assert [a[:3] for a in run["anomalies"]] == [
            [3, "input", "skip_batch"],
            [5, "forward", "skip_batch"],
            [7, "gradient", "zero_grads"],
        ], run["anomalies"]
    assert r0["anomalies"][0][3] == {"input": [1]} and r0["anomalies"][1][3] == {"forward": [1]}
    # The layer is named as in the user's code (no FSDP prefix), on both ranks.
    assert r0["anomalies"][1][4]["module"] == r1["anomalies"][1][4]["module"] == "0", r0["anomalies"][1][4]
    names = r1["anomalies"][2][4]["nonfinite"]
    assert names and all(not n.startswith(("_fsdp", "module.", "_orig_mod")) for n in names), names
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_a_restore_from_memory_snapshots_puts_every_rank_back_in_place(ranks):
    r0, r1 = ranks[0]["restore"], ranks[1]["restore"]
    assert decisions(r0) == decisions(r1)
    assert r0["steps"][7][2] == "restore", r0["steps"]
    assert r0["restored"] == r1["restored"] and len(r0["restored"]) == 1, r0["restored"]
    assert r0["final_restore"] == r1["final_restore"] and r0["same_after_restore"] and r1["same_after_restore"]
    assert r0["digest"] == r1["digest"] and r0["finite"]


def test_weights_poisoned_in_one_ranks_shard_restore_every_rank_at_that_step(ranks):
    """Issue #17 acceptance: NaN in rank 1's shard of ``1.weight`` only, written between steps 5
    and 6; both ranks call it ``weights`` at step 6, name the parameter and rank 1, and restore
    the snapshot of step 3 (``recovery.actions.weights: restore``)."""
    for how in ("forward", "periodic"):
        r0, r1 = ranks[0]["poisoned"][how], ranks[1]["poisoned"][how]
        assert decisions(r0) == decisions(r1), (how, r0["steps"], r1["steps"])
        assert [s[2] for s in r0["steps"]] == ["", "", "", "", "", "restore", "", "", ""], (how, r0["steps"])
        for run in (r0, r1):
            assert [a[:3] for a in run["anomalies"]] == [[6, "weights", "restore"]], (how, run["anomalies"])
            finding = run["anomalies"][0][4]
            assert finding["ranks"] == [1] and finding["nonfinite"] == ["1.weight"], (how, finding)
            assert finding["counts"] == [["1.weight", 1, 0]], (how, finding)
            assert run["restored"] == [[6, 3]] and run["local_finite"] and run["finite"], (how, run)
        assert r0["digest"] == r1["digest"], how
    assert ranks[0]["poisoned"]["forward"]["digest"] == ranks[0]["poisoned"]["periodic"]["digest"]


def test_a_loss_spike_on_one_rank_is_skipped_by_every_rank_at_that_step(ranks):
    """Issue #17 acceptance: rank 1's targets x1e4 at step 7; the loss is the mean over ranks, so
    both see the same ~1e7 loss against 6 healthy ones (``guard.spike.hard_ratio``) and skip it."""
    r0, r1 = ranks[0]["spike"], ranks[1]["spike"]
    assert decisions(r0) == decisions(r1), (r0["steps"], r1["steps"])
    assert [s[2] for s in r0["steps"]] == ["", "", "", "", "", "", "skip_batch", "", ""], r0["steps"]
    assert r0["steps"][6][5] == r1["steps"][6][5] > 1e5, r0["steps"][6]
    for run in (r0, r1):
        assert [a[:3] for a in run["anomalies"]] == [[7, "spike", "skip_batch"]], run["anomalies"]
        assert run["restored"] == [] and run["finite"]
    assert r0["digest"] == r1["digest"]


def test_what_safetrain_cannot_protect_is_refused_at_construction(ranks):
    said = ranks[0]["refused"]
    assert "tensor parallel" in said["tensor_parallel"] and "FSDP2" in said["tensor_parallel"], said
    assert "not to the root module" in said["root_not_sharded"], said
    # Since the second slice a safetensors store under FSDP2 writes sharded snapshots (test_fsdp_snapshots.py):
    # it is built without error, and resuming a directory without a sharded snapshot names what is missing.
    assert said["safetensors"] == "", said
    assert "no complete sharded snapshot" in said["resume"], said


def test_sharded_norms_combine_as_a_root_of_summed_squares():
    from safetrain.distributed.sync import _combine, _plan

    layout = [("loss", 1, False, False), ("grad_norms", 2, False, True)]
    rows = [[1.0, 3.0, 0.0], [3.0, 4.0, math.inf]]
    assert _combine(rows, _plan(layout, sharded=True)) == [2.0, 5.0, math.inf]
    assert _combine(rows, _plan(layout))[1:] == [3.0, math.inf], "DDP: rank 0's norms, a non-finite one wins"


if __name__ == "__main__":
    spawn_ranks(_scenarios, "scenarios")
