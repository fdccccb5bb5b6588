"""Weight faults replayed from the newest snapshot: the update that broke them, or a change from outside."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from safetrain import load_config
from safetrain.guard import Guard
from tests.helpers.models import finite_params, loader, regression_data

BASE = ["log.progress=false", "snapshot.every=1000", "detect.check_weights_every=0"]


def dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def run(
    overrides: List[str],
    between: Optional[Callable[[int, Any], None]] = None,
    steps: int = 10,
    optimizer: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
) -> Dict[str, Any]:
    """``steps`` calls of ``guard.step``; ``between(i, guard)`` runs before the i-th (1-based) to inject a fault."""
    model = dropout_mlp()
    opt = optimizer(model.parameters())
    data = list(loader(regression_data(n=16 * steps), batch_size=16))
    events = []
    with Guard(model, opt, load_config(None, [*BASE, *overrides]), loss_fn=F.mse_loss) as guard:
        for step, batch in enumerate(data, start=1):
            if guard.phase.value == "ready":  # between steps, as a loader or augmentation would (the replay
                torch.rand(3)  # keeps each step's starting RNG; draws between micro-batches are not kept)
            if between is not None:
                between(step, guard)
            result = guard.step(batch)
            events += result.events if result is not None else ()
    return {"model": model, "opt": opt, "events": events, "guard": guard, "rng": torch.get_rng_state()}


def anomaly(result: Dict[str, Any]) -> Any:
    return next(e for e in result["events"] if e.name == "anomaly")


def inf_lr_at(k: int) -> Callable[[int, Any], None]:
    """The LR is inf for the update of step k only: the optimizer's update makes the weights non-finite."""

    def between(step: int, guard: Any) -> None:
        for group in guard.optimizer.param_groups:
            group["lr"] = math.inf if step == k else 0.02

    return between


def poison_weights_before(k: int) -> Callable[[int, Any], None]:
    """A weight turns NaN between steps k - 1 and k, outside any training step (a bit flip, user code)."""

    def between(step: int, guard: Any) -> None:
        if step == k:
            with torch.no_grad():
                guard.model[4].weight[0, 3] = math.nan

    return between


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("how", ["detect.check_weights_every=1", "detect.mode=eager", "detect.mode=lazy"])
def test_an_inf_lr_names_the_update_the_parameters_and_the_optimizer_op(how, foreach):
    """Found by the weight check, or by the next step's forward (eager) or loss (lazy) trip, after
    which the parameters are checked before anything else: either way a ``weights`` fault,
    replayed once from the snapshot (no step replay spent on the symptom)."""
    result = run([how], inf_lr_at(4), optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, foreach=foreach))
    event = anomaly(result)
    assert (event.step, event.kind, event.action) == (5, "weights", "restore"), event
    d = event.detail["diagnosis"]
    assert d["kind"] == "weights" and d["reproducible"] is True, d
    assert d["weights_step"] == 4, d
    assert set(d["nonfinite_weights"]) == {"0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "4.bias"}, d
    assert d["op"].startswith("aten._foreach_add_." if foreach else "aten.add_."), d
    assert set(event.detail["finding"]["nonfinite"]) == set(d["nonfinite_weights"]), event.detail["finding"]
    assert result["guard"].diagnoser.used == 1, "one replay: the weights', not also the tripped step's"
    assert finite_params(result["model"])


def test_a_hand_written_optimizer_is_named_with_the_users_line():
    class Blowup(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(group["lr"])  # the user's bug: a multiplicative update
            return None

    result = run(["detect.check_weights_every=1"], inf_lr_at(3), optimizer=lambda p: Blowup(p, lr=1.0))
    d = anomaly(result).detail["diagnosis"]
    assert d["weights_step"] == 3 and d["op"].startswith("aten.mul_."), d
    assert "test_replay_weights.py" in d["op_line"] and d["op_line"].endswith("in step"), d


@pytest.mark.parametrize("how", ["detect.check_weights_every=1", "detect.mode=eager", "detect.mode=lazy"])
def test_weights_poisoned_from_outside_are_transient_and_restored(how):
    result = run([how], poison_weights_before(5))
    event = anomaly(result)
    assert (event.step, event.kind, event.action) == (5, "weights", "restore"), event
    d = event.detail["diagnosis"]
    assert d["reproducible"] is False and d["weights_step"] is None, d
    assert "changed outside the training step" in d["note"] and "4 update(s)" in d["note"], d
    assert d["nonfinite_weights"] == ["4.weight"], "the live weights that are broken"
    # A faithful replay (same batches, LRs, dropout masks) ends where training was, but for the poke.
    assert d["note"].endswith("live parameters that differ from the replay: 4.weight"), d["note"]
    assert [e.name for e in result["events"]].count("restored") >= 1
    assert not any(e.action == "retry" for e in result["events"]), "a weights fault is restored, never retried"
    assert finite_params(result["model"])


def test_a_forward_trip_from_nan_weights_is_journaled_as_weights_even_without_a_weight_check():
    result = run(["detect.mode=eager", "detect.check_weights_every=0"], poison_weights_before(6))
    event = anomaly(result)
    assert event.kind == "weights" and event.action == "restore", event
    assert event.detail["finding"]["nonfinite"] == ["4.weight"], event.detail["finding"]
    assert event.detail["diagnosis"]["nonfinite_weights"] == ["4.weight"]
    assert result["guard"].diagnoser.used == 1, "the weight replay only"
    restored = next(e for e in result["events"] if e.name == "restored")
    assert restored.detail["snapshot_step"] == 0


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_broken_weights_are_restored_at_once_without_replay_or_weight_check(mode):
    """With the replay off and no periodic weight check, a forward (eager) or loss (lazy) trip
    from NaN weights is still named ``weights`` and restored at that step: skipping the batch would
    only trip again at the next one (a wasted step and a misleading ``forward``/``loss`` event)."""
    result = run(
        [f"detect.mode={mode}", "detect.check_weights_every=0", "detect.replay.enabled=false"], poison_weights_before(6)
    )
    anomalies = [e for e in result["events"] if e.name == "anomaly"]
    assert [(e.step, e.kind, e.action) for e in anomalies] == [(6, "weights", "restore")], anomalies
    assert anomalies[0].detail["finding"]["nonfinite"] == ["4.weight"]
    assert "diagnosis" not in anomalies[0].detail
    assert result["guard"].counters.restores == 1 and finite_params(result["model"])


@pytest.mark.parametrize("replay", ["true", "false"])
def test_a_frozen_parameter_gone_nan_is_a_weights_fault_restored_at_once(replay):
    """The exact check after a trip covers every parameter, not only those that train: a frozen
    layer's weight poked to NaN is named and restored at the trip (a snapshot holds it too)."""

    def frozen_first_layer() -> torch.nn.Module:
        model = dropout_mlp()
        model[0].weight.requires_grad_(False)
        return model

    model = frozen_first_layer()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.02)
    events = []
    cfg = load_config(None, [*BASE, "detect.mode=lazy", f"detect.replay.enabled={replay}"])
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        for step, batch in enumerate(loader(regression_data(n=16 * 8), batch_size=16), start=1):
            if step == 6:
                with torch.no_grad():
                    model[0].weight[2, 1] = math.nan
            events += guard.step(batch).events
    found = [(e.step, e.kind, e.action) for e in events if e.name == "anomaly"]
    assert found == [(6, "weights", "restore")], found
    assert next(e for e in events if e.name == "anomaly").detail["finding"]["nonfinite"] == ["0.weight"]
    assert guard.diagnoser.used == (1 if replay == "true" else 0)
    assert finite_params(model)


def test_a_nan_loss_with_finite_weights_is_not_called_a_weights_fault():
    """The check before the replay finds finite parameters: the trip keeps its own kind."""

    def nan_target(step: int, guard: Any) -> None:
        guard.loss_fn = (lambda out, y: F.mse_loss(out, y) * math.nan) if step == 4 else F.mse_loss

    result = run(["detect.mode=lazy", "detect.replay.enabled=false", "sanitize.targets=off"], nan_target)
    event = anomaly(result)
    assert (event.step, event.kind, event.action) == (4, "loss", "skip_batch"), event


@pytest.mark.parametrize("fault", ["inf_lr", "outside"])
def test_weight_replay_leaves_the_run_bitwise_equal_to_one_without_replay(fault):
    between = inf_lr_at(4) if fault == "inf_lr" else poison_weights_before(5)
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    runs = [
        run(["detect.check_weights_every=1", f"detect.replay.enabled={on}"], between, steps=12, optimizer=adam)
        for on in (True, False)
    ]
    with_replay, without = runs
    assert "diagnosis" in anomaly(with_replay).detail and "diagnosis" not in anomaly(without).detail
    for (name, a), b in zip(with_replay["model"].state_dict().items(), without["model"].state_dict().values()):
        assert torch.equal(a, b), name
    sa, sb = with_replay["opt"].state_dict()["state"], without["opt"].state_dict()["state"]
    for i in sa:
        for key in sa[i]:
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)
    assert torch.equal(with_replay["rng"], without["rng"])


def test_a_forced_weight_replay_on_a_healthy_run_changes_nothing():
    """No restore follows to hide a mistake: parameters, BatchNorm buffers, Adam state, the gradients
    accumulated so far, the model's mode and the RNG must come back exactly as the replay found them.
    The replay runs between the two micro-batches of step 3, with clipping on."""

    def forced(micro: int, guard: Any) -> None:
        if micro == 6:
            d = guard.diagnoser.explain("weights", store=guard.store)
            assert d.reproducible is False and "2 update(s)" in d.note, d
            assert d.note.endswith("differ from the replay: none"), "the replay reproduces training exactly"
            forced.used = guard.diagnoser.used

    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    cfg = ["guard.clip_grad_norm=0.5", "guard.accumulate_steps=2"]
    plain = run(cfg, steps=12, optimizer=adam)
    replayed = run(cfg, forced, steps=12, optimizer=adam)
    assert forced.used == 1, "a weight replay spends one replay of the budget"
    for (name, a), b in zip(plain["model"].state_dict().items(), replayed["model"].state_dict().values()):
        assert torch.equal(a, b), name
    sa, sb = plain["opt"].state_dict()["state"], replayed["opt"].state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert torch.equal(plain["rng"], replayed["rng"])


def test_a_snapshot_older_than_the_kept_updates_is_not_replayed():
    result = run(["detect.check_weights_every=1", "detect.replay.keep_steps=2"], poison_weights_before(6))
    event = anomaly(result)
    d = event.detail["diagnosis"]
    assert (event.kind, event.action) == ("weights", "restore")
    assert "5 updates old, more than detect.replay.keep_steps=2: not replayed" in d["note"], d
    assert d["nonfinite_weights"] == ["4.weight"] and d["weights_step"] is None, d
    assert result["guard"].diagnoser.used == 0, "nothing was replayed"


def test_batches_beyond_keep_mb_are_let_go_and_the_replay_says_why():
    """16 rows of 8 inputs and 1 target: 576 bytes a step; 0.002 MiB holds three steps' batches."""
    result = run(["detect.check_weights_every=1", "detect.replay.keep_mb=0.002"], poison_weights_before(6))
    d = anomaly(result).detail["diagnosis"]
    assert "exceed detect.replay.keep_mb=0.002: not kept, not replayed" in d["note"], d
    assert result["guard"].diagnoser.used == 0
    ample = run(["detect.check_weights_every=1", "detect.replay.keep_mb=0.004"], poison_weights_before(6))
    assert "keep_mb" not in anomaly(ample).detail["diagnosis"]["note"], "five steps fit in 0.004 MiB"


def test_keep_steps_zero_keeps_nothing():
    result = run(["detect.check_weights_every=1", "detect.replay.keep_steps=0"], poison_weights_before(3))
    assert "keep_steps=0" in anomaly(result).detail["diagnosis"]["note"]
    assert result["guard"].diagnoser.weight_replay.kept == 0


def test_kept_updates_start_again_at_every_snapshot_and_restore():
    result = run(["detect.check_weights_every=1", "snapshot.every=3"], poison_weights_before(8))
    d = anomaly(result).detail["diagnosis"]
    assert "replayed from the snapshot of step 6" in d["note"] and "1 update(s)" in d["note"], d


def test_describe_names_the_update_or_says_the_weights_were_changed_from_outside():
    from safetrain.diagnose import Diagnosis

    found = Diagnosis(
        reproducible=True,
        kind="weights",
        nonfinite_weights=("fc.weight",),
        weights_step=4,
        op="aten.add_.Tensor",
        op_line="train.py:9 in step",
    )
    assert found.describe() == (
        "weights: the update of step 4 made fc.weight non-finite by aten.add_.Tensor at train.py:9 in step"
    )
    outside = Diagnosis(
        reproducible=False,
        kind="weights",
        nonfinite_weights=("fc.weight",),
        note="weights were changed outside the training step: ...",
    )
    assert outside.describe().startswith("transient: weights were changed outside the training step")
    skipped = Diagnosis(
        reproducible=True, kind="weights", nonfinite_weights=("fc.weight",), note="no snapshot to replay from"
    )
    assert skipped.describe() == "weights: fc.weight non-finite (no snapshot to replay from)"
