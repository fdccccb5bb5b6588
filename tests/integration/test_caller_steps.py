"""A loop the caller owns (issue #19): forward, backward and ``optimizer.step()`` are the caller's;
the guard is told at ``begin_batch``, ``record_loss``, ``decide`` and ``finish_step``, the verbs
``Guard.step`` itself is built from. The same decision loop as ``Guard.step``: the same steps, the same
actions, the same model bitwise; one host sync per healthy step; a skipped step does not move the
parameters even though the caller calls ``optimizer.step()``; the scheduler follows the guard."""

from __future__ import annotations

import math
from typing import Any, List

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, TrainingAborted
from safetrain.testing import OutputFault, PoisonRows, count_host_syncs
from tests.helpers.loops import CFG, batches, caller_loop, loss_of, make
from tests.helpers.models import mlp, regression_data


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_caller_owned_run_is_bitwise_the_guard_owned_run_with_the_same_actions():
    """One implementation: a NaN loss at the 4th forward is skipped in both, and both models end equal."""
    own_model, _, _, own = make(loss_fn=F.mse_loss)
    fault_own = OutputFault(own_model[2], calls=[4])
    own_actions = [own.step(b).action for b in batches()]
    model, opt, _, guard = make(step_fn=loss_of)
    fault = OutputFault(model[2], calls=[4])
    results = caller_loop(guard, model, opt, batches())
    fault.remove(), fault_own.remove()
    assert [final.action for _, final in results] == own_actions
    assert own_actions[3] == "retry" and own_actions.count("") == 15  # the replay found it transient
    assert torch.equal(flat(model), flat(own_model)), "the same updates, bitwise"
    assert vars(guard.counters) == vars(own.counters)


def test_a_skipped_step_leaves_the_parameters_although_the_caller_steps_the_optimizer():
    model, opt, _, guard = make()
    before: List[torch.Tensor] = []
    OutputFault(model[2], calls=[3])
    for i, batch in enumerate(batches(n=4)):
        batch = guard.begin_batch(batch)
        loss = loss_of(model, batch)
        loss.backward()
        guard.record_loss(loss)
        before.append(flat(model).clone())
        decided = guard.decide()
        opt.step()
        guard.finish_step()
        opt.zero_grad()
        if i == 2:
            assert not decided.trained and decided.action == "skip_batch"
            assert torch.equal(flat(model), before[-1]), "a skipped step must not move a parameter"
        else:
            assert decided.trained and not torch.equal(flat(model), before[-1])
    assert guard.counters.optimizer_steps == 3 and guard.counters.skipped_batches == 1


def test_one_host_sync_per_healthy_caller_owned_step():
    model, opt, _, guard = make({"snapshot": {"every": 1000}})  # (a snapshot's copies are not a step's cost)
    caller_loop(guard, model, opt, batches(n=2))  # the first step's forced snapshot is not a healthy step's cost
    data = batches(n=12)[2:]
    with count_host_syncs() as syncs:
        results = caller_loop(guard, model, opt, data)
    assert all(final.action == "" for _, final in results)
    assert syncs.count == len(data), syncs.count


def test_the_scheduler_the_caller_steps_follows_the_guard_and_keeps_the_backoff():
    """A skipped step does not advance the schedule; an LR backoff stays a scale on top of it."""
    model, opt, sched, guard = make(sched=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9))
    OutputFault(model[2], calls=[2])
    caller_loop(guard, model, opt, batches(n=4), sched=sched)
    assert sched.last_epoch == 3, "4 steps, one skipped: the schedule moved 3 times"
    guard.recovery.lr_changed(0.5, "test: a backoff")
    caller_loop(guard, model, opt, batches(n=2), sched=sched)
    assert sched.last_epoch == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.9**5 * 0.5)


def test_a_bad_input_row_is_dropped_by_a_rerun_through_step_fn():
    data = PoisonRows(regression_data(), indices=[3])
    model, opt, _, guard = make(step_fn=loss_of)
    results = caller_loop(guard, model, opt, batches(data, n=3))
    assert results[0][1].action == "drop_rows" and results[0][1].trained
    assert guard.counters.dropped_rows == 1 and all(math.isfinite(v) for v in flat(model).tolist())


def test_without_a_step_fn_a_rerun_action_skips_the_batch_instead():
    data = PoisonRows(regression_data(), indices=[3])
    model, opt, _, guard = make()
    results = caller_loop(guard, model, opt, batches(data, n=3))
    assert not guard.cfg.detect.replay.enabled, "no forward the guard can run: no replays"
    assert results[0][1].action == "skip_batch" and not results[0][1].trained
    assert guard.counters.dropped_rows == 0 and guard.counters.skipped_batches == 1


def test_gradient_accumulation_decides_once_per_optimizer_step():
    own_model, _, _, own = make({"guard": {"accumulate_steps": 2}}, loss_fn=F.mse_loss)
    for b in batches(n=8):
        own.step(b)
    model, opt, _, guard = make({"guard": {"accumulate_steps": 2}})
    results = caller_loop(guard, model, opt, batches(n=8), accumulate=2)
    assert len(results) == 4 and guard.counters.steps == own.counters.steps == 4
    assert torch.allclose(flat(model), flat(own_model), atol=1e-6)
    assert guard.last_loss == pytest.approx(own.last_loss)


def test_an_unfixable_fault_aborts_from_decide_at_the_last_good_state():
    """A layer NaN from the 4th step on: skip, restore, scale_lr, then abort. The snapshot of step 2
    was read clean once (step 3) but the update that used its optimizer state and LR (step 3's) was
    never read clean (step 4 trips): it is not vouched for (policy.VOUCH_READS), so the model and
    the optimizer end at the snapshot before it, the run's start (no momentum yet)."""
    model, opt, _, guard = make({"recovery": {"max_retries": 2}, "snapshot": {"every": 2}})
    start = flat(model).clone()
    OutputFault(model[2], calls=range(4, 10**9))
    with pytest.raises(TrainingAborted):
        for batch in batches(n=12):
            batch = guard.begin_batch(batch)
            loss = loss_of(model, batch)
            loss.backward()
            guard.record_loss(loss)
            guard.decide()
            opt.step()
            guard.finish_step()
            opt.zero_grad()
    assert torch.equal(flat(model), start), "the model is the last vouched snapshot's (step 0)"
    assert all("momentum_buffer" not in opt.state[p] for p in model.parameters()), "and so is its optimizer"
    assert guard.counters.restores >= 2 and guard.counters.optimizer_steps == 3


def test_one_driver_a_run_the_guard_step_or_the_callers_verbs():
    """The first verb fixes who drives the guard: a guard driven by ``Guard.step`` refuses the
    caller's verbs, and the other way round, each with a sentence naming both ways."""
    model, opt, _, guard = make(loss_fn=F.mse_loss)
    guard.step(batches(n=1)[0])
    with pytest.raises(RuntimeError, match=r"driven by Guard.step.*begin_batch, record_loss"):
        guard.begin_batch(batches(n=1)[0])
    model, opt, _, guard = make()
    with pytest.raises(RuntimeError, match="begin_batch"):
        guard.decide()
    with pytest.raises(RuntimeError, match=r"driven by the verbs.*Guard.step\(batch\) runs forward"):
        guard.step(batches(n=1)[0])


def test_a_rerun_under_the_callers_fp16_scaler_is_scaled_and_unscaled_like_the_guards_own():
    """fp16 autocast with the caller's GradScaler, a loss so small that its unscaled gradients
    underflow in half precision, a NaN input row at step 1 (dropped, the step re-run through
    step_fn): the re-run's backward is scaled (and unscaled by the guard's read) as the caller's
    was, so it trains as the guard-owned run does; the caller's scaler reads the re-run's flags."""

    def tiny_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16):
            return 1e-8 * F.mse_loss(model(x).float(), y)

    amp = {"amp": {"dtype": "float16"}}
    data = batches(PoisonRows(regression_data(), indices=[3]), n=4)
    start = flat(mlp()).clone()
    own_model = mlp()  # an LR large enough for updates of gradients ~1e-7 to show in float32
    own = Guard(own_model, torch.optim.SGD(own_model.parameters(), lr=1e5), {**CFG, **amp}, step_fn=tiny_loss)
    for b in data:
        own.step(b)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e5)
    scaler = torch.amp.GradScaler("cpu", init_scale=own.cfg.amp.init_scale)
    guard = Guard(model, opt, {**CFG, **amp}, scaler=scaler, step_fn=tiny_loss)
    actions = []
    for batch in data:
        batch = guard.begin_batch(batch)
        loss = tiny_loss(model, batch)
        scaler.scale(loss).backward()
        guard.record_loss(loss)
        actions.append(guard.decide().action)
        scaler.step(opt)
        scaler.update()
        guard.finish_step()
        opt.zero_grad()
    assert actions[0] == "drop_rows" and guard.counters.dropped_rows == 1
    assert guard.counters.optimizer_steps == own.counters.optimizer_steps == 4
    moved, own_moved = flat(model) - start, flat(own_model) - start
    assert own_moved.abs().max() > 1e-3, "the guard-owned run trained"
    assert torch.allclose(moved, own_moved, rtol=1e-2, atol=1e-5), (moved - own_moved).abs().max()  # 4e-4 before
