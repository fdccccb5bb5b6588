"""Spike detector: robust z-score over recent healthy losses."""

from __future__ import annotations

import random

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
