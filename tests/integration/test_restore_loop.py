"""No restore loop ends "done" (issue #32): a run that keeps coming back to the same snapshot stops
with a reason naming the point, the cause and the fix; a run left at its start is never "done";
and ``snapshot.every: auto`` keeps restores close (tens of steps back, not the run's start).

The public pattern: a one-cycle schedule whose peak LR is too high (OneCycleLR's ``max_lr`` found by
an LR range test and used as is; "loss explodes with OneCycleLR", fastai forums and
pytorch/pytorch#23580-style reports of NaN losses at the peak of a cyclic schedule).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.errors import TrainingAborted
from safetrain.guard.returns import Returns, cause_of
from tests.helpers.models import loader, mlp, regression_data


def test_a_one_cycle_schedule_whose_peak_is_too_high_never_ends_done_at_its_start():
    """The issue's case, small: OneCycleLR to max_lr 3 over 8 epochs of a tiny MLP, with the
    previous default ``snapshot.every: 100`` (the step-0 snapshot the only one). Before: the LR hold
    lifted after 20 clean reads while the schedule still rose, the run diverged again, 7 restores
    all to step 0, the last step anomalous, put back to step 0 and "done" with the start's weights
    and a final loss 200x the first. Now the hold stays while the schedule is above the LR that
    failed, and the run stops naming the scheduler and the LR to stay below."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = loader(regression_data())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3.0, total_steps=len(data) * 8)
    cfg = load_config(None, ["log.progress=false", "snapshot.every=100"])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=sched)
    with pytest.raises(TrainingAborted) as info:
        trainer.fit(data, epochs=8)
    message = str(info.value)
    assert "OneCycleLR" in message and "peak LR below" in message, message
    held = [e.message for e in trainer.guard.bus.events if "hold kept" in e.message]
    assert held, "the hold outlived 20 clean reads: the schedule was still above the LR that failed"
    assert trainer.guard.bus.events[-1].action == "aborted"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_returns_that_get_a_step_or_two_further_each_time_are_a_loop(seed):
    """``benchmarks/causes.py``'s ``peak``: SGD with momentum under OneCycleLR to max_lr 1.5 over 220
    steps of an 8-32-1 MLP, the step-0 snapshot the only one (``snapshot.every`` fixed at 1000 so
    that the test does not depend on measured timings; ``auto`` on a busy host lands here too).
    Before: after the first restore the LR backoff made each return get a step or two further
    (41, 43, 44 steps past the snapshot), which counted as progress; 7 restores, all to step 0, and
    "done" with a model 49x the loss of the same run with a 10x lower peak. Now a return must get a
    quarter further to count, and the fifth restore to one snapshot stops the run naming the
    scheduler and the LR to stay below."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32 * 220, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(32 * 220, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.5, total_steps=221)
    cfg = load_config(None, ["log.progress=false", "snapshot.every=1000"])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=sched)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    loop = r"restore loop: the run was put back to the snapshot of step 0 5 times"
    with pytest.raises(TrainingAborted, match=loop) as info:
        trainer.fit(data)
    message = str(info.value)
    assert "LR scheduler OneCycleLR rises" in message and "lower the schedule's peak LR" in message, message
    restores = [e.detail["snapshot_step"] for e in trainer.guard.bus.events if e.name == "restored"]
    assert restores == [0] * 5, restores
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _fault_at_update(opt, param, update, factor=1e4):
    """A step_fn whose loss is ``factor`` x at the optimizer's ``update``-th update (Adam's ``step``,
    part of every snapshot): each restore brings the run back to the same fault at the same point."""

    def step_fn(model, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        state = opt.state.get(param)
        return loss * factor if state and int(state["step"]) == update else loss

    return step_fn


def test_a_run_that_keeps_returning_to_the_same_snapshot_stops_naming_the_point_the_cause_and_the_fix():
    """A fault at the 20th update, part of the restored state (Adam's step count): each restore to
    the snapshot of step 15 meets it again 5 steps later. Before: restores to step 15 until the end
    (``recovery.escalate: [restore]``, ``reset_after: 4`` so the ladder restarts between them), and
    "done". Now the third return that gets no further stops it."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step_fn = _fault_at_update(opt, next(model.parameters()), 20)
    overrides = ["snapshot.every=5", "recovery.escalate=[restore]", "recovery.reset_after=4"]
    cfg = load_config(None, ["log.progress=false", *overrides])
    trainer = SafeTrainer(model, opt, cfg, step_fn=step_fn)
    with pytest.raises(TrainingAborted, match=r"restore loop: the run was put back to the snapshot of step 15 3 times"):
        trainer.fit(loader(regression_data()), epochs=3)
    restores = [e for e in trainer.guard.bus.events if e.name == "restored"]
    assert len(restores) == 3 and {e.detail["snapshot_step"] for e in restores} == {15}, restores
    message = trainer.guard.bus.events[-2].message
    assert "never got more than 7 steps past it" in message and "cause: the spike fault" in message, message
    assert "fix:" in message


def test_the_cause_names_the_schedule_when_it_climbs_back_to_the_lr_that_failed():
    r = Returns()
    assert [r.arrive(0, n) for n in (12, 20, 28, 44)] == [0, 1, 2, 0], "a return that got further resets it"
    assert r.furthest == 16 and r.restores == 4 and not r.stuck
    assert r.arrive(0, 61) == 1 and r.stuck, "17 steps past it, one more than 16: no further; 5 restores stop it"
    n = Returns()  # a step or two further each time (noise at the same point) is no progress
    assert [n.arrive(0, t) for t in (41, 84, 128)] == [0, 1, 2]
    d = Returns()  # a return under a lower LR is a new try (the ladder bounds the backoffs)
    assert [d.arrive(0, n, s) for n, s in [(4, 1.0), (7, 0.5), (10, 0.25), (13, 0.25)]] == [0, 0, 0, 1]
    e = Returns()  # returns with no update between them: anomalous steps in a row, the ladder's
    assert [e.arrive(0, n, trained=False) for n in (4, 5, 6, 7)] == [0, 0, 0, 0]
    schedule = cause_of("divergence", failed_lr=[0.6], snapshot_lr=[0.12], scheduler="OneCycleLR")
    assert "OneCycleLR rises from lr 0.12 at the snapshot to lr 0.6" in schedule and "below 0.6" in schedule
    assert "cause: the spike fault" in cause_of("spike", failed_lr=[0.1], snapshot_lr=[0.1])


def test_a_run_that_ends_restored_to_its_start_is_not_done():
    """The last steps' faults put the run back to its only snapshot, the start's, with no update
    after: none of its training was kept. Before: "done"."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = list(loader(regression_data(64), batch_size=8))  # 8 steps

    def step_fn(m, batch):
        loss = F.mse_loss(m(batch[0]), batch[1])
        return loss * 1e6 if trainer.guard.counters.steps >= 7 else loss  # the last two steps: spikes

    cfg = load_config(None, ["log.progress=false", "snapshot.every=100", "guard.spike.min_history=4"])
    trainer = SafeTrainer(model, opt, cfg, step_fn=step_fn)
    with pytest.raises(TrainingAborted, match=r"run: the run ended restored to its start \(the snapshot of step 0"):
        trainer.fit(data, epochs=1)
    assert trainer.guard.bus.events[-1].action == "aborted"


def test_with_every_auto_a_restore_goes_back_tens_of_steps_not_to_the_start():
    """Issue #32 point 4: with ``snapshot.every: 100`` every restore in a run of a few hundred steps
    went back to step 0. With ``auto`` the interval is ``snapshot / (overhead x step)``: two bad
    batches at steps 91 and 92 restore a snapshot tens of steps before them (before: step 0). (This
    test model's step, ~1 ms, is as short as a snapshot's fixed cost, ~1.5 ms, so at the default 1%
    it would snapshot every ~150 steps; ``overhead`` 5% stands for a real model, whose step is tens
    of ms.)"""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step_fn(m, batch):
        loss = F.mse_loss(m(batch[0]), batch[1])
        return loss * float("nan") if trainer.guard.counters.steps in (90, 91) else loss

    cfg = load_config(None, ["log.progress=false", "snapshot.overhead=0.05"])
    trainer = SafeTrainer(model, opt, cfg, step_fn=step_fn)
    result = trainer.fit(loader(regression_data()), epochs=8)  # 128 steps
    taken = [e.step for e in result.events if e.name == "snapshot"]
    restores = [e.detail["snapshot_step"] for e in result.events if e.name == "restored"]
    assert len(taken) >= 4 and restores and all(30 <= s <= 90 for s in restores), (taken, restores)
    assert all(e.detail["every"] >= 5 for e in result.events if e.name == "snapshot" and not e.detail["forced"])
    assert result.ended == "done"


def test_a_fixed_interval_is_still_honoured():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = load_config(None, ["log.progress=false", "snapshot.every=7"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), epochs=2)
    assert [e.step for e in result.events if e.name == "snapshot"] == [0, 7, 14, 21, 28], result.events
    assert all("every" not in e.detail for e in result.events if e.name == "snapshot")
