"""The engine end to end: inject a fault, run fit(), assert the events and the final state."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from safetrain import TrainingAborted, load_config
from safetrain.guard import Guard
from safetrain.testing import GradFault, LRFault, OutputFault, PoisonRows, WeightFault
from tests.helpers.engine import BASE, anomalies, fit, full_loss
from tests.helpers.models import finite_params, loader, mlp, regression_data


def test_clean_run_is_healthy_and_learns(device):
    before = full_loss(mlp())
    result, model, _ = fit(device=device)
    assert anomalies(result) == []
    assert result.steps == result.healthy_steps == 32
    assert full_loss(model) < 0.2 * before, (before, full_loss(model))
    assert finite_params(model)


@pytest.mark.parametrize("action,trained_rows", [("skip_batch", 0), ("drop_rows", 15)])
def test_nan_input_rows(action, trained_rows, device):
    data = PoisonRows(regression_data(), indices=[7])
    result, model, _ = fit([f"sanitize.inputs={action}"], dataset=data, epochs=1, device=device)
    found = anomalies(result, "input")
    assert found == [("input", action)], found
    event = next(e for e in result.events if e.kind == "input")
    rows = event.detail["rows"]
    assert rows and all(r["nan_count"] >= 1 for r in rows), rows
    assert finite_params(model)
    if action == "skip_batch":
        assert result.skipped_batches == 1 and result.dropped_rows == 0
    else:
        assert result.dropped_rows == 1 and result.skipped_batches == 0
        assert result.healthy_steps == result.steps - 1


def test_nan_target_is_skipped(device):
    data = PoisonRows(regression_data(), indices=[3, 100], where="targets")
    result, model, _ = fit(dataset=data, epochs=1, device=device)
    assert anomalies(result, "target") == [("target", "skip_batch")] * 2
    assert result.skipped_batches == 2 and finite_params(model)


@pytest.mark.parametrize("replay", [True, False])
def test_layer_emits_nan_once_one_step_fault_matches_clean_run(replay, device):
    clean, clean_model, _ = fit(epochs=3, device=device)
    assert full_loss(clean_model) < 0.05 * full_loss(mlp()), "the clean run converges"

    def poison(model, opt):
        poison.fault = OutputFault(model[0], calls=[9])

    result, model, _ = fit([f"detect.replay.enabled={replay}"], setup=poison, epochs=3, device=device)
    found = anomalies(result)
    event = next(e for e in result.events if e.kind == "forward")
    assert event.detail["finding"]["module"] == "0", event.detail
    if replay:  # the replay from the same state is finite: transient, retried once, not skipped
        assert found == [("forward", "retry")], found
        assert event.detail["diagnosis"]["reproducible"] is False
        assert result.skipped_batches == 0 and result.healthy_steps == result.steps - 1
    else:
        assert found == [("forward", "skip_batch")], found
        assert result.skipped_batches == 1
    assert finite_params(model)
    assert full_loss(model) == pytest.approx(full_loss(clean_model), rel=0.05)


def test_inf_gradient_in_one_parameter_is_zeroed(device):
    def poison(model, opt):
        GradFault(model[2].bias, calls=(5, 6), value=math.inf)  # the step and its replay

    result, model, _ = fit(setup=poison, device=device)
    assert anomalies(result) == [("gradient", "zero_grads")]
    event = next(e for e in result.events if e.kind == "gradient")
    assert "2.bias" in json.dumps(event.detail), event.detail
    assert event.detail["diagnosis"]["nonfinite_grads"] == ["2.bias"]
    assert result.zeroed_grads == 1 and result.skipped_batches == 0
    assert finite_params(model)


def test_weights_poisoned_after_a_step_are_restored(device):
    def poison(model, opt):
        WeightFault(opt, model[0].weight, (0, 0), steps=[10], value=math.nan)

    result, model, _ = fit(["detect.check_weights_every=1"], setup=poison, device=device)
    kinds = anomalies(result)
    assert kinds[0] == ("weights", "restore"), kinds
    assert result.restores == 1
    assert any(e.name == "restored" for e in result.events)
    assert finite_params(model)


def test_lr_blow_up_restores_and_scales_lr(device):
    def poison(model, opt):
        LRFault(opt, steps=(12, 13, 14), factor=1000)

    result, model, _ = fit(
        [
            "recovery.actions.loss=restore",
            "recovery.actions.spike=restore",
            "recovery.actions.forward=restore",
            "recovery.escalate=[scale_lr]",
        ],
        setup=poison,
        epochs=3,
        device=device,
    )
    assert result.restores >= 1
    assert any(e.name == "lr_changed" for e in result.events), anomalies(result)
    assert result.lr_scale < 1.0
    assert not any(e.name == "aborted" for e in result.events)
    assert finite_params(model) and math.isfinite(result.final_loss)


def test_loss_spike_without_nan_is_skipped(device):
    data = PoisonRows(regression_data(), indices=[160], where="targets", value=300.0)
    result, model, _ = fit(dataset=data, epochs=1, seed=0, device=device)
    assert ("spike", "skip_batch") in anomalies(result), anomalies(result)
    event = next(e for e in result.events if e.kind == "spike")
    assert event.detail["z"] > 6
    assert finite_params(model)


def test_fp16_overflow_is_a_scaler_skip_not_a_failure(device):
    result, model, _ = fit(["amp.dtype=float16", "amp.init_scale=1048576"], epochs=1, device=device)
    skips = anomalies(result, "scaler")
    assert skips and all(action == "skip_batch" for _, action in skips), skips
    assert result.scaler_skips == len(skips)
    assert result.restores == 0 and not result.aborted
    assert result.healthy_steps == result.steps - result.scaler_skips
    assert finite_params(model)


def test_fp16_overflow_steps_do_not_pay_for_an_exact_weight_check(monkeypatch):
    """An overflow makes the unscaled gradients Inf (a gradient trip), but the scaler explains it:
    the exact check of every parameter (for weights already broken) is not run on those steps."""
    from safetrain.detect import WeightCheck

    runs = []
    real = WeightCheck.run
    monkeypatch.setattr(WeightCheck, "run", lambda self, force=False: runs.append(force) or real(self, force))
    result, _, _ = fit(["amp.dtype=float16", "amp.init_scale=1048576", "detect.check_weights_every=0"], epochs=1)
    assert anomalies(result, "scaler"), "the run had overflow steps"
    assert runs == [], runs


def test_persistent_fault_aborts_after_max_retries_with_model_finite(device):
    model = mlp()
    fault = OutputFault(model[1], calls=range(6, 10_000))  # healthy for 5 steps, then NaN for ever
    with pytest.raises(TrainingAborted) as info:
        fit(["recovery.max_retries=3"], model=model, device=device)
    result = info.value.result
    assert result.aborted and fault.count >= 9
    assert [a for _, a in anomalies(result)] == ["skip_batch", "restore", "scale_lr", "scale_lr", "abort"]
    assert info.value.event.name == "aborted"
    assert result.healthy_steps == 5 and result.restores == 4
    assert finite_params(model), "abort leaves the model at the last good snapshot"


def test_guard_in_a_hand_written_loop_equals_fit(device):
    fitted, fit_model, _ = fit(epochs=1, device=device)
    model = mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    with Guard(model, opt, load_config(None, BASE), loss_fn=F.mse_loss) as guard:
        guard.begin_epoch(0)
        for batch in loader(regression_data()):
            guard.step(batch)
    for a, b in zip(fit_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert guard.counters.steps == fitted.steps


def test_journal_and_result_agree(tmp_path):
    data = PoisonRows(regression_data(), indices=[3], where="targets")
    result, _, _ = fit([f"log.dir={tmp_path}"], dataset=data, epochs=1)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [rec["event"] for rec in lines[:-1]] == [e.name for e in result.events]
    summary = lines[-1]
    assert summary["event"] == "summary"
    for key in ("steps", "healthy_steps", "skipped_batches", "restores"):
        assert summary[key] == getattr(result, key), key
    assert sum(1 for rec in lines if rec["event"] == "anomaly") == summary["skipped_batches"] == 1


def test_passthrough_modules_are_unhooked_by_default_and_hooked_in_strict():
    """A Tanh cannot turn finite inputs into NaN/Inf: the default config leaves it unhooked
    (cheaper eager mode), configs/strict.yaml hooks every module for debugging."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, load_config(None, ["log.progress=false"]), loss_fn=F.mse_loss) as guard:
        assert guard.monitor.names == ("0", "2")
    strict = load_config(Path(__file__).parents[2] / "configs" / "strict.yaml", ["log.progress=false"])
    with Guard(model, opt, strict, loss_fn=F.mse_loss) as guard:
        assert guard.monitor.names == ("0", "1", "2")


def test_the_batch_is_copied_only_for_a_model_whose_forward_updates_buffers():
    """Zero-filling NaN inputs costs a copy of every batch; it protects BatchNorm's running
    statistics from the optimistic forward. A model without buffers gets the user's tensor."""
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(x.data_ptr())
            return x

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for with_bn in (False, True):
        torch.manual_seed(0)
        layers = [Probe(), torch.nn.Linear(4, 4)] + ([torch.nn.BatchNorm1d(4)] if with_bn else [])
        model = torch.nn.Sequential(*layers)
        with Guard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            load_config(None, ["log.progress=false"]),
            loss_fn=F.mse_loss,
        ) as guard:
            seen.clear()
            assert guard.step((x, y)).trained
            assert (seen == [x.data_ptr()]) is not with_bn, "copied if and only if the model has buffers"
            poisoned = x.clone()
            poisoned[3, 1] = math.nan
            result = guard.step((poisoned, y))
            assert result.trained and result.action == "drop_rows"
            assert finite_params(model) and all(torch.isfinite(b).all() for b in model.buffers())


@pytest.mark.parametrize("kind", [tuple, list])
def test_step_fn_gets_a_pair_of_the_users_type_cleaned_only_when_needed(kind):
    """A plain (inputs, targets) pair skips split_batch on the hot path: a step_fn must still get
    a pair of the user's type, zero-filled for a model with buffers."""
    got = []

    def step_fn(model, batch):
        got.append(batch)
        return F.mse_loss(model(batch[0]), batch[1])

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    for with_bn in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), *([torch.nn.BatchNorm1d(4)] if with_bn else []))
        with Guard(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            load_config(None, ["log.progress=false"]),
            step_fn=step_fn,
        ) as guard:
            got.clear()
            batch = kind((x, y))
            assert guard.step(batch).trained
            assert type(got[0]) is kind, f"{kind.__name__} batch arrived as {type(got[0]).__name__}"
            # The user's tuple itself unless it was zero-filled; a list (mutable: a step_fn may
            # change it, and the replay keeps the step's batches) is always a new one.
            assert (got[0] is batch) is (kind is tuple and not with_bn)


def test_gradients_made_outside_the_guard_between_steps_are_not_added_to_the_next_step():
    """The guard drops its gradients after each step and skips zero_grad at the next start; a
    user's own backward in between (a probe, an evaluation with gradients) must not leak into it."""
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def run(meddle):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Guard(model, opt, load_config(None, ["log.progress=false"]), loss_fn=F.mse_loss) as guard:
            for _ in range(3):
                guard.step((x, y))
                if meddle:
                    model(x).pow(2).sum().backward()  # gradients left behind on every parameter
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_an_optimizer_with_its_own_zero_grad_is_asked_to_clear_its_gradients():
    """The guard frees the gradients itself only for torch's own ``zero_grad``; an optimizer that
    overrides it (one that keeps flat gradient buffers, say) has it called after every update."""

    class OwnZeroGrad(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            type(self).calls += 1
            super().zero_grad(set_to_none)

    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model = mlp()
    opt = OwnZeroGrad(model.parameters(), lr=0.1)
    with Guard(model, opt, load_config(None, ["log.progress=false"]), loss_fn=F.mse_loss) as guard:
        for _ in range(3):
            assert guard.step((x, y)).trained
    assert OwnZeroGrad.calls >= 3, "once per update at least"
    assert all(p.grad is None for p in model.parameters())


def test_gradients_are_freed_after_each_update_and_zero_grad_shows_under_the_profiler():
    """After a healthy step every gradient is None (what ``zero_grad(set_to_none=True)`` leaves);
    while a profiler runs the guard goes through ``optimizer.zero_grad``, so its range is traced."""
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, load_config(None, ["log.progress=false"]), loss_fn=F.mse_loss) as guard:
        assert guard.step((x, y)).trained
        assert all(p.grad is None for p in model.parameters())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            assert guard.step((x, y)).trained
        assert all(p.grad is None for p in model.parameters())
    names = {e.name for e in prof.events()}
    assert any(n.startswith("Optimizer.zero_grad#") for n in names), sorted(n for n in names if "Optimizer" in n)


def test_a_zero_grad_set_on_the_optimizer_instance_is_called():
    """An instance-level ``zero_grad`` (patched in by a wrapper library) is honoured like a class's."""
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.zero_grad = lambda set_to_none=True: calls.append(set_to_none) or torch.optim.SGD.zero_grad(opt, set_to_none)
    with Guard(model, opt, load_config(None, ["log.progress=false"]), loss_fn=F.mse_loss) as guard:
        for _ in range(2):
            assert guard.step((x, y)).trained
    assert len(calls) >= 2 and all(calls)


def test_an_optimizer_wrapper_that_forwards_attributes_works():
    """A thin wrapper that is not an ``Optimizer`` and forwards everything through ``__getattr__``."""

    class Wrapped:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    x, y = torch.randn(16, 8), torch.randn(16, 1)
    model = mlp()
    with Guard(
        model,
        Wrapped(torch.optim.SGD(model.parameters(), lr=0.1)),
        load_config(None, ["log.progress=false"]),
        loss_fn=F.mse_loss,
    ) as guard:
        assert all(guard.step((x, y)).trained for _ in range(3))
    assert all(p.grad is None for p in model.parameters())
