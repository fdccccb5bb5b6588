"""A schedule bug: the LR scheduler returns 1000x its LR for 3 steps. A snapshot taken right after
the scheduler computed the bad LR holds it; the next step reads clean (that LR has not acted yet).

Before, that read vouched for the snapshot and every restore re-installed the bad LR: updates ran
at x1000, x500, x250..., until the run aborted or ended "done" with the LR scale stuck low. Now a
snapshot is vouched for only once the update that used its state and LR read clean, and a restore
holds the schedule to the LR of the last healthy update, naming the scheduler. The public pattern:
schedules whose LR is off by orders of magnitude for some steps (a LambdaLR lambda written to return
an LR instead of a factor, lhoyer/MIC#60; scheduler LRs 10x off at the milestones, pytorch/pytorch#22107).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from tests.helpers.loops import batches, caller_loop, make
from tests.helpers.models import loader, mlp, regression_data

LR = 0.02


def spiky(opt, first, steps=3):
    """LambdaLR at 1000x for ``steps`` scheduler steps from ``first`` on."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1000.0 if first <= s < first + steps else 1.0)


def record_lrs(opt):
    used = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    return used


def full_loss(model):
    x, y = regression_data().tensors
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


@pytest.mark.parametrize("every,first", [(4, 8), (4, 9), (2, 8), (1, 8)])
def test_no_update_after_the_recovery_runs_at_the_bad_lr_in_fit(every, first):
    """``first`` = 8 with ``every`` = 4: the snapshot of step 8 is taken right after the scheduler
    set 1000x for update 9, and step 9 reads clean (issue 23's case)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    used = record_lrs(opt)
    start = full_loss(model)
    cfg = load_config(None, ["log.progress=false", "guard.spike.min_history=8", f"snapshot.every={every}"])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=spiky(opt, first))
    result = trainer.fit(loader(regression_data()), epochs=2)
    bad = [i for i, lr in enumerate(used) if lr > LR * 1.001]
    assert len(bad) == 1, f"only the first bad update (no step could see it coming): {used}"
    assert result.ended == "done" and result.lr_scale == 1.0, result
    assert full_loss(model) < 0.2 * start, (start, full_loss(model))
    held = [e for e in result.events if e.name == "lr_changed" and "LambdaLR" in e.message]
    assert held and "x1e+03 the last healthy update's" in held[0].message, [e.message for e in result.events]


def test_the_caller_owned_verbs_hold_a_followed_scheduler():
    """The Lightning and Hugging Face callbacks' way: the caller steps the optimizer and the
    scheduler; the guard follows the scheduler and holds it after a restore."""
    model, opt, sched, guard = make(
        {"snapshot": {"every": 4}, "guard": {"spike": {"min_history": 8}}}, sched=lambda o: spiky(o, 8)
    )
    used = record_lrs(opt)
    with guard:
        results = caller_loop(guard, model, opt, batches(n=16) * 2, sched=sched)
    trained = [lr for (decided, _), lr in zip(results, used) if decided.trained]
    assert sum(lr > 0.05 * 1.001 for lr in trained) == 1, trained
    assert guard.counters.restores >= 1 and guard.backoff.scale == 1.0
    assert any(e.name == "lr_changed" and "LambdaLR" in e.message for e in guard.bus.events)


def test_with_a_snapshot_every_step_the_restore_passes_over_every_snapshot_not_vouched_for():
    """snapshot.every=1: the snapshot of step 9 holds the weights update 9 ruined, that of step 8
    the LR that ruined them (read clean once, by step 9); step 7's is the newest two clean reads
    vouch for. The restore passes over both and lands on it."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    cfg = load_config(None, ["log.progress=false", "guard.spike.min_history=8", "snapshot.every=1", "snapshot.keep=4"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=spiky(opt, 8)).fit(loader(regression_data()))
    restored = [e for e in result.events if e.name == "restored" and e.action == "restore"]
    assert [e.detail["snapshot_step"] for e in restored] == [7], [e.message for e in restored]
    assert "step 9" in restored[0].detail["passed_over"] and "step 8" in restored[0].detail["passed_over"]
    assert result.ended == "done" and result.lr_scale == 1.0
