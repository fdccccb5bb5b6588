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
    d = SpikeDetector(window=32, min_history=5)
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
