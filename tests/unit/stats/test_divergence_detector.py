"""Divergence detector: a loss growing geometrically, judged from the first steps. No torch."""

from __future__ import annotations

import random

import pytest

from safetrain.stats.divergence import DivergenceDetector


def fed(*losses, **kw):
    d = DivergenceDetector(**kw)
    for x in losses:
        d.add(x)
    return d


NOISY = (1.0, 0.875, 1.125, 1.0)  # a spread is known (3 losses or more before the climb); dyadic: exact

# (history, loss, expected rule or None, msg)
TABLE = [
    ((), 1e6, None, "nothing to judge against before the first healthy loss"),
    ((1.0,), 100.0, None, "one jump is no climb (a spike's business)"),
    ((1.0, 100.0), 1e4, None, "from the first loss the first increment is the only scale: one ratio is not enough"),
    ((1.0, 100.0, 1e4), 1e6, "geometric", "~100x per step from step 0: caught at the 4th step"),
    ((1.0, 2.1, 4.5), 9.5, None, "increments doubling from the first loss: growth squared needed (an early wobble up)"),
    ((*NOISY, 1.25, 1.75, 2.75), 4.75, "geometric", "three increments doubling, 3.6 above the level: >= 8 scales"),
    ((*NOISY, 1.25, 1.75), 2.75, None, "increments doubling, but only 1.7 above the level: < 8 scales (0.25)"),
    ((*NOISY, 1.25, 1.75, 2.75), 4.0, None, "the third increment grew less than 2x"),
    ((*NOISY, 1.5), 60.0, "climb", "a climb begun before this step, 59 above where it began: >= 100 scales (0.5)"),
    ((*NOISY, 1.5), 40.0, None, "the same climb short of 100 scales"),
    ((1.0, 1.05), 1e4, None, "a jump after a noisy wiggle is a spike, not a climb"),
    ((5.0, 1.0, 2.1, 4.5), 4.9, None, "no new high of the recent losses"),
    ((1.0, 100.0), float("inf"), None, "a non-finite loss is the loss kind's"),
]


@pytest.mark.parametrize("history,loss,rule,msg", TABLE, ids=[r[3] for r in TABLE])
@pytest.mark.parametrize("offset,scale", [(0.0, 1.0), (-102.0, 1.0), (0.0, 64.0), (3.0, 1 / 64)])
def test_rules(history, loss, rule, msg, offset, scale):
    """Each row decides the same for the losses moved by ``offset`` and scaled by ``scale`` (issue 23:
    a loss that is negative or offset diverges like any other)."""
    found = fed(*(offset + scale * x for x in history)).check(offset + scale * loss)
    assert (found.rule if found else None) == rule, msg


def test_disabled_is_a_no_op():
    assert fed(1.0, 100.0, 1e4, enabled=False).check(1e6) is None


def test_fault_drops_the_climb_and_a_climb_back_is_the_same_episode():
    d = fed(1.0, 100.0, 1e4)
    found = d.check(1e6)
    assert found.episode == 1 and found.rises == 2 and found.start == 1.0 and found.scale == 99.0
    d.fault(found)
    assert d.state_dict()["losses"] == [1.0] and d.reference == 1.0 and d.reference_scale == 99.0
    for x in (1.1, 5.0, 25.0, 125.0, 625.0):  # after the restore, a slower climb: 5x per step
        again = d.check(x)
        if again is not None:
            break
        d.add(x)
    assert again is not None and again.episode == 2 and again.reference == 1.0, again
    assert "climbed back" in again.describe()


def test_an_episode_closes_once_the_run_is_back_for_recover_after_steps():
    d = fed(1.0, 100.0, 1e4, recover_after=5)
    d.fault(d.check(1e6))
    for x in (1.0, 0.9, 0.8, 0.7, 0.6):
        d.add(x)
    assert d.reference is None and d.episode == 0


def test_state_round_trip():
    d = fed(1.0, 100.0, 1e4)
    d.fault(d.check(1e6))
    e = DivergenceDetector()
    e.load_state_dict(d.state_dict())
    assert e.state_dict() == d.state_dict()
    assert e.check(1.5e4) == d.check(1.5e4)


def test_a_snapshot_of_an_earlier_version_loads_without_reference_scale():
    e = DivergenceDetector()
    e.load_state_dict({"losses": [1.0, 2.0], "reference": 2.0, "episode": 1, "since": 3})
    assert e.reference == 2.0 and e.reference_scale == 2.0 and e.episode == 1


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(ValueError, match="growth > 1"):
        DivergenceDetector(growth=1.0)


@pytest.mark.parametrize("seed", range(5))
def test_noisy_and_heavy_tailed_healthy_curves_never_trip(seed):
    """A decaying, noisy curve (a factor up to 3 between batches), then a converged heavy-tailed
    one (most batches lognormal around 1e-4, one in 16 up to 0.05, 500x the median, as a
    misclassified sample in a converged classifier): 6000 steps, no divergence."""
    rng = random.Random(seed)
    d = DivergenceDetector()
    for i in range(6000):
        if i < 3000:
            loss = (2.0 * 0.995**i + 0.01) * rng.uniform(0.5, 1.5)
        else:
            loss = 0.05 * rng.random() if rng.random() < 1 / 16 else 1e-4 * rng.lognormvariate(0, 1)
        assert d.check(loss) is None, (i, loss)
        d.add(loss)


# (healthy losses, climbing?, msg)
CLIMBING = [
    ((), False, "nothing seen"),
    ((1.0,), False, "one loss is no climb"),
    ((1.0, 100.0), True, "the first loss and a new high after it"),
    ((1.0, 100.0, 1e4), True, "~100x a step: the increments grow 100x"),
    ((5.0, 1.0, 2.0), False, "2.0 is no new high of the window (5.0 is in it)"),
    ((5.0, 1.0, 6.0, 17.0), True, "two new highs in a row, the second's increment >= growth x the first's"),
    ((5.0, 1.0, 6.0, 13.0), False, "two new highs in a row, but the increment 7 is < 2x 5: noise, not a climb"),
    ((1.0, 1.5), True, "the second loss has no increment before it: any rise may be a climb (no vouching)"),
    ((1.0, 1.5, 1.6), False, "from the third the increments must grow: 0.1 < growth x 0.5"),
    ((1.0, 2.0, 4.0, 5.0, 11.0), True, "a slower new high starts the count again; the next doubling climbs"),
    ((1.0, 100.0, 50.0), False, "a climb that stopped"),
    ((1.0, 1.0), False, "an equal loss is no new high"),
]


@pytest.mark.parametrize("losses,climbing,msg", CLIMBING, ids=[r[2] for r in CLIMBING])
def test_climbing(losses, climbing, msg):
    assert fed(*losses).climbing is climbing, msg


def test_climbing_after_a_fault_and_a_reload_counts_from_the_kept_window():
    d = fed(1.0, 100.0, 1e4)
    assert d.climbing
    d.fault(d.check(1e6))  # the climb leaves the window: [1.0]
    assert not d.climbing
    e = DivergenceDetector()
    e.load_state_dict(fed(5.0, 6.0, 13.0).state_dict())
    assert e.climbing
    d.add(0.5)
    assert not d.climbing


def test_climbing_forgets_a_high_that_left_the_window():
    d = fed(9.0, 1.0, 2.0, 3.0, window=2, steps=2)  # 2.0 met 9.0 in its window of 2; 3.0 did not
    assert not d.climbing
    d.add(6.0)
    assert d.climbing
