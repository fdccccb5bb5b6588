"""Spike detector: robust z-score over recent healthy losses."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from safetrain.stats.spike import SpikeDetector


def warmed(n=40, seed=0, **kw):
    rng = random.Random(seed)
    d = SpikeDetector(**kw)
    for i in range(n):
        d.add(2.0 * 0.99**i + rng.gauss(0, 0.02))
    return d


def test_no_judgement_before_min_history():
    d = SpikeDetector(window=16, min_history=10)
    for _ in range(9):
        d.add(1.0)
    assert d.check(1000.0) is None


def test_spike_caught_and_normal_noise_not():
    d = warmed()
    assert d.check(1.5) is None, "a loss near the median is not a spike"
    evidence = d.check(6.0)
    assert evidence is not None and evidence["z"] > 6
    assert d.check(-10.0) is None, "a loss falling sharply is not a spike"


def test_a_flat_curve_has_no_spread_but_float_rounding():
    """A window of equal losses has no spread: a rise above it is judged at float resolution
    (``RESOLUTION`` x the median), the only place where zero matters, and the min_ratio gate (the
    window's range is 0) lets it through. Before, 1% of the median was the floor: a rule that
    called 1.05 above 1.0 a wiggle but 101.05 above 101.0 nothing at all (issue 23)."""
    d = SpikeDetector(window=32, min_history=5, min_ratio=1.0)
    for _ in range(20):
        d.add(1.0)
    assert d.check(1.0 + 1e-7) is None, "a few float32 ulps above a flat loss are rounding"
    assert d.check(1.05) is not None


def test_disabled_and_state_round_trip():
    d = warmed(enabled=False)
    assert d.check(1e9) is None
    d = warmed()
    e = SpikeDetector()
    e.load_state_dict(d.state_dict())
    assert e.check(6.0) == d.check(6.0)


def test_converged_heavy_tailed_losses_are_not_spikes():
    """Near a loss of 0.005, one misclassified sample makes a batch 0.05: a tail, not a blow-up."""
    rng = random.Random(1)
    d = SpikeDetector(window=64, min_history=20, zscore=6)
    for i in range(64):
        d.add(0.05 if i % 16 == 0 else 0.005 + abs(rng.gauss(0, 0.0005)))  # heavy tail seen before
    assert d.check(0.08) is None, "many sigmas out, but under 2x the largest recent loss"
    assert d.check(0.5) is not None, "10x the largest recent loss: a spike"


@given(
    window=st.integers(1, 12),
    losses=st.lists(st.one_of(st.floats(-5, 5), st.just(float("nan")), st.just(float("inf"))), max_size=60),
    split=st.integers(0, 60),
)
def test_min_ratio_gate_uses_the_largest_excess_of_the_window(window, losses, split):
    """The cheap gate (``loss - floor < min_ratio * largest excess``) keeps the window's floor and
    largest excess incrementally; they must equal a direct computation over the window after any
    sequence of adds, across a state round trip."""
    d = SpikeDetector(window=window, min_history=1, zscore=0.0, min_ratio=1.0)
    for x in losses[:split]:
        d.add(x)
    d2 = SpikeDetector(window=window, min_history=1, zscore=0.0, min_ratio=1.0)
    d2.load_state_dict(d.state_dict())
    for x in losses[split:]:
        d.add(x)
        d2.add(x)
    finite = [x for x in losses if x == x and abs(x) != float("inf")]
    if not finite:
        return
    over = [max(x - min(finite[max(0, i - window) : i]), 0.0) if i else 0.0 for i, x in enumerate(finite)]
    floor, top = min(finite[-window:]), max(over[-window:])
    for det in (d, d2):
        # With zscore 0 and min_ratio 1, a loss above the median is a spike exactly when its
        # excess over the floor is at least the window's largest excess.
        above = max(floor + top, max(finite[-window:])) + 1.0
        assert det.check(above) is not None, f"a loss above floor {floor} + excess {top} was stopped by the gate"
        if top > 1e-3:
            below = floor + top - 1e-3 - abs(floor + top) * 1e-3
            assert det.check(below) is None, f"a loss under floor {floor} + excess {top} passed the gate"


def test_hard_ratio_catches_an_early_blow_up_from_the_4th_step_and_its_square_from_the_3rd():
    """Issue 18, class 3: targets in the wrong unit make one early loss x10^8; min_history is far off.
    The rule is invariant (issue 23): the excess over the run's lowest loss, in units of the run's
    range. With one healthy loss there is no range (no scale at all); with two it is their
    difference and hard_ratio squared counts; from three on hard_ratio."""
    d = SpikeDetector(min_history=20, hard_ratio=100.0)
    assert d.check(1e8) is None, "no healthy loss yet: nothing to compare with"
    d.add(2.0)
    assert d.check(1e8) is None, "one healthy loss: no scale, nothing judged"
    d.add(1.5)
    assert d.check(1.5 + 0.5 * 9999) is None, "9999 x the range above the lowest: under hard_ratio squared"
    assert d.check(1.5 + 0.5 * 1e4)["rule"] == "hard_ratio", "10^4 x the range at the 3rd step is a spike"
    d.add(1.2)
    evidence = d.check(1e8)
    assert evidence is not None and evidence["rule"] == "hard_ratio"
    assert evidence["ratio"] == (1e8 - 1.2) / (2.0 - 1.2) and evidence["run_min"] == 1.2
    assert d.check(1.2 + 0.8 * 99) is None, "99 x the run's range above its lowest is under the hard ratio"
    assert d.check(1.2 + 0.8 * 100) is not None
    assert SpikeDetector(min_history=20).check(1e8) is None, "off unless given"


def test_hard_ratio_keeps_the_run_range_through_a_state_round_trip():
    d = SpikeDetector(window=4, min_history=20, hard_ratio=100.0)
    for x in (50.0, 1.0, 1.0, 1.0, 1.0):  # 50 left the window, still the run's highest
        d.add(x)
    e = SpikeDetector(window=4, min_history=20, hard_ratio=100.0)
    e.load_state_dict(d.state_dict())
    assert e.run_max == 50.0 and e.run_min == 1.0
    assert e.check(1.0 + 49 * 99) is None and e.check(1.0 + 49 * 101) is not None


def test_a_snapshot_of_an_earlier_version_loads_without_run_min():
    """Snapshots before issue 23 hold ``losses`` and ``run_max`` only: the window's lowest stands in."""
    e = SpikeDetector(window=4, min_history=20, hard_ratio=100.0)
    e.load_state_dict({"losses": [3.0, 2.0, 2.5], "run_max": 9.0})
    assert e.run_min == 2.0 and e.run_max == 9.0


def test_a_jump_back_above_the_start_of_a_falling_run_is_a_spike():
    """Issue 23, point 7: a run fell from ~3.9 to ~2.0; an LR blow-up sends one loss to 5.5. The
    window still holds the early losses (max 3.9): ``2 x window max`` (7.8) let it through. Its
    excess over the window's lowest (~1.9) is measured against the window's range instead."""
    rng = random.Random(0)
    d = SpikeDetector(window=128, min_history=20)
    for i in range(60):
        d.add(2.0 + 1.9 * 0.9**i + rng.gauss(0, 0.01))
    assert d.check(5.5) is not None
    assert d.check(2.3) is None


def test_a_run_of_exact_zeros_has_the_smallest_spread_not_none():
    """A loss that is exactly 0 at every step (a hinge loss with every margin met) has no range:
    the hard rule measures a rise in the absolute floor (1e-12), and 0 again is no spike."""
    d = SpikeDetector(min_history=20, hard_ratio=100.0)
    for _ in range(5):
        d.add(0.0)
    assert d.check(0.0) is None
    assert d.check(1.0)["rule"] == "hard_ratio"


@pytest.mark.parametrize("c,a", [(0.0, 1.0), (100.0, 1.0), (-100.0, 1.0), (0.0, 0.01), (-7.0, 100.0)])
def test_the_start_losses_judge_the_first_loss_the_same_for_any_offset_and_scale(c, a):
    """Before any healthy loss, a loss is judged against the start model's losses: a spike when its
    excess over the lowest is hard_ratio squared times their range, whatever the loss's offset and scale."""

    def decide(first: float) -> bool:
        d = SpikeDetector(hard_ratio=100.0)
        d.begin([a * 0.8 + c, a * 0.9 + c])
        return d.check(a * first + c) is not None

    assert decide(0.8 + 0.1 * 1.01e4) and not decide(0.8 + 0.1 * 0.99e4) and not decide(0.7)


def test_the_start_losses_judge_until_the_history_is_long_enough_and_survive_a_round_trip():
    """The start losses stand in for a history until HARD_MIN_HISTORY healthy losses are known (the
    2nd and 3rd steps are judged against them and the trained ones), then the run's own range judges."""
    d = SpikeDetector(hard_ratio=100.0)
    d.begin([1.0, 1.1])
    e = SpikeDetector(hard_ratio=100.0)
    e.load_state_dict(d.state_dict())
    assert e.check(5000.0)["rule"] == "start" and e.check(1.2) is None
    e.add(1.2)
    assert e.check(5000.0)["rule"] == "start"  # 2 start + 1 trained: range 0.2, 1e4 x 0.2 = 2000
    e.add(1.15)
    e.add(1.05)
    assert e.start == () and e.check(5000.0)["rule"] == "hard_ratio"  # the run's own range now
    d.begin([2.0, 2.0])  # identical start losses (a zero-initialized head): rounding is no spread
    assert d.check(2.0 + 1e-6) is None
    d.begin([2.0])  # one start loss is no spread at all
    assert d.start == () and d.check(1e9) is None


def test_a_start_batch_in_the_wrong_unit_is_left_out_of_the_reference():
    """One of the batches measured ahead is itself in the wrong unit (x1e8): the first step's
    healthy loss is not a spike, and once it is known the bad start loss is left out, so the same
    batch trained at the 2nd step is one."""
    d = SpikeDetector(hard_ratio=100.0)
    d.begin([0.9e8, 0.95])
    assert d.check(0.9) is None
    d.add(0.9)
    assert d.check(0.92e8)["rule"] == "start" and d.check(1.2) is None
