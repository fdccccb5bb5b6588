"""LR backoff under every common scheduler: after one backoff the LR is exactly factor x schedule."""

from __future__ import annotations

import pytest
import torch
from torch.optim import lr_scheduler as S

from safetrain.guard.lr import LRBackoff


def make(kind):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    opt.param_groups[0]["lr"] = 0.1
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.03})
    sched = {
        "StepLR": lambda: S.StepLR(opt, step_size=3, gamma=0.5),
        "ExponentialLR": lambda: S.ExponentialLR(opt, gamma=0.9),
        "CosineAnnealingLR": lambda: S.CosineAnnealingLR(opt, T_max=10, eta_min=0.001),
        "LambdaLR": lambda: S.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
        "OneCycleLR": lambda: S.OneCycleLR(opt, max_lr=[0.5, 0.2], total_steps=40),
        "SequentialLR": lambda: S.SequentialLR(
            opt, [S.LinearLR(opt, start_factor=0.1, total_iters=5), S.CosineAnnealingLR(opt, T_max=20)], milestones=[5]
        ),
        "ReduceLROnPlateau": lambda: S.ReduceLROnPlateau(opt, factor=0.5, patience=1),
    }[kind]()
    return opt, sched


def metric(i):
    return 1.0  # never improves: plateau fires repeatedly


KINDS = ["StepLR", "ExponentialLR", "CosineAnnealingLR", "LambdaLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau"]


@pytest.mark.parametrize("kind", KINDS)
def test_backoff_holds_under_scheduler(kind):
    plain_opt, plain_sched = make(kind)
    opt, sched = make(kind)
    backoff = LRBackoff(opt)
    factor = 0.25
    for i in range(30):
        if i == 4:
            backoff.set_scale(factor)
        args = (metric(i),) if kind == "ReduceLROnPlateau" else ()
        plain_opt.step()
        opt.step()
        plain_sched.step(*args)
        backoff.step(sched, *args)
        expected = [g["lr"] * (factor if i >= 4 else 1.0) for g in plain_opt.param_groups]
        assert backoff.lrs() == pytest.approx(expected, rel=1e-12), f"{kind} step {i}"


def test_min_lr_is_a_floor_for_backoff_only():
    opt, sched = make("ExponentialLR")
    backoff = LRBackoff(opt, min_lr=0.02)
    backoff.set_scale(0.01)
    assert backoff.lrs() == pytest.approx([0.02, 0.02]), "backoff never goes below min_lr"
    for _ in range(40):
        opt.step()
        backoff.step(sched)
    # The schedule alone has gone below min_lr (0.1 * 0.9**40 = 0.0015): we do not raise it.
    assert backoff.lrs() == pytest.approx([0.1 * 0.9**40, 0.03 * 0.9**40])


def test_state_round_trip_keeps_current_scale():
    opt, sched = make("StepLR")
    backoff = LRBackoff(opt)
    for _ in range(3):
        opt.step()
        backoff.step(sched)
    saved = backoff.state_dict()
    backoff.set_scale(0.5)
    for _ in range(3):
        opt.step()
        backoff.step(sched)
    backoff.load_state_dict({"unscaled": saved["unscaled"]})
    assert backoff.scale == 0.5
    assert backoff.lrs() == pytest.approx([x * 0.5 for x in saved["unscaled"]])


@pytest.mark.parametrize("kind", ["StepLR", "CosineAnnealingLR", "OneCycleLR", "SequentialLR"])
def test_a_followed_scheduler_someone_else_steps_keeps_the_backoff_and_asks_first(kind):
    """A framework steps the scheduler itself (Lightning, the HF Trainer): after ``follow`` every
    LR is still exactly the scale times the schedule's, a step is skipped while ``may_step()`` is
    false, and the scheduler's state_dict holds nothing of the wrapping (a function there would
    not save without pickle)."""
    opt, sched = make(kind)
    twin_opt, twin = make(kind)
    backoff, allowed = LRBackoff(opt), [True]
    backoff.follow(sched, lambda: allowed[0])
    backoff.set_scale(0.25)
    for i in range(12):
        allowed[0] = i % 3 != 1  # every third step was not applied: no advance
        sched.step()
        if allowed[0]:
            twin.step()
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.25 * g["lr"] for g in twin_opt.param_groups])
    assert isinstance(sched, type(twin)) and sched.last_epoch == twin.last_epoch == 8
    assert "step" not in sched.state_dict(), "nothing of the wrapping in the scheduler's state"


def _spiky(opt, bad):
    """A LambdaLR whose schedule returns 1000x its LR at the scheduler steps in ``bad`` (a schedule bug)."""
    return S.LambdaLR(opt, lambda s: 1000.0 if s in bad else 1.0)


def test_a_restore_holds_the_schedule_to_the_last_healthy_updates_lr():
    """After a restore no update runs above the LRs of the last update a clean read followed:
    the restored LR, and the schedule computing its 1000x again, are held (once journaled, naming
    the scheduler), and the hold lifts when the schedule comes back."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = _spiky(opt, {3, 4})
    told = []
    backoff = LRBackoff(opt, journal=lambda cls, kind, action, message, detail: told.append((message, detail)))
    for _ in range(2):  # two updates at 0.1, each read clean after it
        backoff.read_clean()
        backoff.mark_used()
        backoff.step(sched)
    backoff.read_clean()
    assert backoff.trusted == [0.1]
    backoff.mark_used()
    backoff.step(sched)  # the scheduler computes 100 for the next update
    assert backoff.lrs() == [pytest.approx(100.0)] and not told, "no hold before a restore: nothing to compare"
    backoff.load_state_dict({"unscaled": [100.0]})  # a restore of the state the scheduler holds
    backoff.hold()
    assert backoff.lrs() == [pytest.approx(0.1)], "the restored 1000x LR is held at the last healthy update's"
    assert "LambdaLR" in told[0][0] and "x1e+03" in told[0][0], told
    backoff.mark_used()
    backoff.step(sched)  # still 1000x: held, not journaled again
    assert backoff.lrs() == [pytest.approx(0.1)] and len(told) == 1
    backoff.set_scale(0.5)
    assert backoff.lrs() == [pytest.approx(0.05)], "a backoff applies on top of the hold"
    backoff.step(sched)  # the schedule is back at 0.1: the hold lifts
    assert backoff.ceiling is None and backoff.lrs() == [pytest.approx(0.05)] and "lifted" in told[-1][0]


def _set(backoff, lr):
    """The schedule sets ``lr`` (a scheduler step, as OneCycleLR's would)."""
    backoff.step_with(lambda: backoff.optimizer.param_groups[0].update(lr=lr), "OneCycleLR")


def test_a_hold_lifts_after_release_after_clean_reads_and_needs_a_trusted_lr():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    backoff = LRBackoff(opt, release_after=3)
    backoff.hold()  # nothing trusted yet: no hold
    assert backoff.ceiling is None
    backoff.mark_used()
    backoff.read_clean()  # the update at 0.1 read clean: trusted
    _set(backoff, 0.2)
    backoff.mark_used()  # the update at 0.2 leads into the fault
    backoff.load_state_dict({"unscaled": [0.1]})  # the restored scheduler's
    backoff.hold()
    assert backoff.failed == [pytest.approx(0.2)] and backoff.ceiling == [0.1]
    _set(backoff, 0.15)  # a warmup rising again, still below the LR that failed
    assert backoff.lrs() == [pytest.approx(0.1)], "held while the schedule rises above it"
    for _ in range(3):
        backoff.read_clean()
    assert backoff.ceiling is None and backoff.lrs() == [pytest.approx(0.15)], "lifted after 3 clean reads"


def test_a_hold_is_not_lifted_while_the_schedule_is_above_the_lr_that_failed():
    """Issue #32: a one-cycle schedule whose peak is too high diverged; after the restore the hold
    was lifted after 20 clean reads while the schedule was still rising, and the run diverged again
    (five restores, all to step 0). Clean reads lift a hold only once the schedule (under the LR
    scale in force) is back at or below the LR the failed update used."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    told = []
    backoff = LRBackoff(opt, release_after=3, journal=lambda cls, kind, action, message, detail: told.append(message))
    backoff.mark_used()
    backoff.read_clean()
    _set(backoff, 0.2)
    backoff.mark_used()
    backoff.load_state_dict({"unscaled": [0.1]})
    backoff.hold()
    _set(backoff, 0.4)  # the schedule rises past the LR that failed
    for _ in range(10):
        backoff.read_clean()
    assert backoff.ceiling == [0.1] and backoff.lrs() == [pytest.approx(0.1)], "kept: the schedule is above 0.2"
    assert sum("hold kept" in m for m in told) == 1 and "0.4" in told[-1] and "0.2" in told[-1], told
    _set(backoff, 0.3)
    backoff.set_scale(0.5)  # a backoff: the schedule at 0.3 runs at 0.15, below the LR that failed
    backoff.read_clean()
    assert backoff.ceiling is None and backoff.lrs() == [pytest.approx(0.15)], "lifted once below it"


def test_the_hold_is_part_of_the_state():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    backoff = LRBackoff(opt)
    backoff.mark_used()
    backoff.read_clean()
    backoff.hold()
    state = backoff.state_dict()
    assert state["trusted"] == [0.1] and state["ceiling"] == [0.1] and state["failed"] == [0.1]
    other = LRBackoff(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=5.0))
    other.load_state_dict(state)
    assert other.ceiling == [0.1] and other.lrs() == [pytest.approx(0.1)]
    other.load_state_dict({"scale": 1.0, "unscaled": [0.3]})  # an earlier snapshot: no keys, the hold kept
    assert other.ceiling == [0.1] and other.lrs() == [pytest.approx(0.1)]
