"""Spike detector: robust z-score over recent healthy losses."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from safetrain.spike import SpikeDetector


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


def test_flat_curve_uses_floor():
    d = SpikeDetector(window=32, min_history=5, min_ratio=1.0)
    for _ in range(20):
        d.add(1.0)
    assert d.check(1.05) is None, "5% above a flat loss is within the 1%-of-median floor x 6"
    assert d.check(1.2) is not None


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
def test_min_ratio_gate_uses_the_window_maximum(window, losses, split):
    """The cheap gate (``loss < min_ratio * max``) keeps the window's maximum incrementally; it
    must equal ``max()`` of the window after any sequence of adds, across a state round trip."""
    d = SpikeDetector(window=window, min_history=1, zscore=0.0, min_ratio=1.0)
    for x in losses[:split]:
        d.add(x)
    d2 = SpikeDetector(window=window, min_history=1, zscore=0.0, min_ratio=1.0)
    d2.load_state_dict(d.state_dict())
    for x in losses[split:]:
        d.add(x)
        d2.add(x)
    finite = [x for x in losses if x == x and abs(x) != float("inf")][-window:]
    if not finite:
        return
    top = max(finite)
    for det in (d, d2):
        # With zscore 0 and min_ratio 1, a loss above the median is a spike exactly when it is
        # at least the window's maximum.
        assert det.check(top + 1.0) is not None, f"a loss above the window max {top} was stopped by the gate"
        assert det.check(top - 1e-3 - abs(top) * 1e-3) is None, f"a loss below the window max {top} passed the gate"


def test_hard_ratio_catches_an_early_blow_up_from_the_4th_step_and_its_square_from_the_2nd():
    """Issue 18, class 3: targets in the wrong unit make one early loss x10^8; min_history is far off.
    Before the 4th step only hard_ratio squared counts: a loss growing 100x a step is divergence's."""
    d = SpikeDetector(min_history=20, hard_ratio=100.0)
    assert d.check(1e8) is None, "no healthy loss yet: nothing to compare with"
    d.add(2.0)
    assert d.check(1.9e4) is None, "9500x the first loss: under hard_ratio squared"
    assert d.check(2e4)["rule"] == "hard_ratio", "10^4 x the first loss at the 2nd step is a spike"
    d.add(1.5)
    assert d.check(1e3) is None, "two healthy losses: 500x is left to the divergence detector"
    d.add(1.2)
    evidence = d.check(1e8)
    assert evidence is not None and evidence["rule"] == "hard_ratio" and evidence["ratio"] == 1e8 / 2.0
    assert d.check(150.0) is None, "75x the run's largest loss is under the hard ratio"
    assert SpikeDetector(min_history=20).check(1e8) is None, "off unless given"


def test_hard_ratio_keeps_the_run_max_through_a_state_round_trip():
    d = SpikeDetector(window=4, min_history=20, hard_ratio=100.0)
    for x in (50.0, 1.0, 1.0, 1.0, 1.0):  # 50 left the window, still the run's largest
        d.add(x)
    e = SpikeDetector(window=4, min_history=20, hard_ratio=100.0)
    e.load_state_dict(d.state_dict())
    assert e.run_max == 50.0 and e.check(4000.0) is None and e.check(6000.0) is not None


@pytest.mark.parametrize("c,a", [(0.0, 1.0), (100.0, 1.0), (-100.0, 1.0), (0.0, 0.01), (-7.0, 100.0)])
def test_the_start_rule_judges_the_first_loss_the_same_for_any_offset_and_scale(c, a):
    """Before any healthy loss, a loss is judged against the start model's losses: a spike when its
    excess over the largest is 1e4 times their spread, whatever the loss's offset and scale."""

    def decide(first: float) -> bool:
        d = SpikeDetector(hard_ratio=100.0)
        d.begin([a * 0.8 + c, a * 0.9 + c])
        return d.check(a * first + c) is not None

    assert decide(0.9 + 0.1 * 2e4) and not decide(0.9 + 0.1 * 0.5e4) and not decide(0.7)


def test_the_start_losses_judge_until_the_first_healthy_loss_and_survive_a_round_trip():
    d = SpikeDetector()
    d.begin([1.0, 1.1])
    e = SpikeDetector()
    e.load_state_dict(d.state_dict())
    assert e.check(5000.0)["rule"] == "start" and e.check(1.2) is None
    e.add(1.2)
    assert e.start == () and e.check(5000.0) is None  # one healthy loss: the early rules' business
    d.begin([2.0, 2.0])  # identical start losses (a zero-initialized head): rounding is no spread
    assert d.check(2.0 + 1e-6) is None
