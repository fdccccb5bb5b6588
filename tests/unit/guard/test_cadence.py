"""``snapshot.every: auto`` (issue #32): the interval from the measured cost of a snapshot and of a
healthy step, within ``snapshot.overhead``; bounded; a fixed integer honoured; the config's errors."""

from __future__ import annotations

import pytest

from safetrain import ConfigError, load_config
from safetrain.guard.cadence import Cadence


class Clock:
    """A clock a test moves by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize(
    "snapshot_s,step_s,expected",
    [
        (50e-6, 1e-3, 5),  # a tiny model: 5 steps pay for a snapshot, the floor
        (1e-6, 1e-3, 5),  # ...cheaper still: never below min_every
        (0.02, 0.1, 20),  # 20 ms a snapshot, 100 ms a step: 1% is one every 20 steps
        (0.5, 0.2, 250),
        (30.0, 1.0, 1000),  # a huge model: still one every max_every
    ],
)
def test_the_interval_comes_from_the_costs_within_the_budget_and_the_bounds(snapshot_s, step_s, expected):
    c = Cadence("auto", overhead=0.01, min_every=5, max_every=1000)
    every = c.plan(snapshot_s=snapshot_s, step_s=step_s)
    assert every == expected, (snapshot_s, step_s, every)
    if 5 < every < 1000:
        assert snapshot_s / (every * step_s) <= 0.01 < snapshot_s / ((every - 1) * step_s), "the fewest within 1%"


def test_the_costs_are_measured_with_the_host_clock_and_replanned_at_each_snapshot():
    clock = Clock()
    c = Cadence("auto", overhead=0.01, min_every=2, max_every=1000, clock=clock)
    assert c.every == 2 and c.plan() == 2, "nothing measured yet: min_every"
    for _ in range(5):  # healthy steps of 10 ms
        clock.now += 0.010
        c.healthy()
    clock.now += 5.0  # an anomaly's slow path: not a healthy step's time
    c.interrupted()
    c.healthy()

    def save():
        clock.now += 0.004  # a snapshot of 4 ms
        return "info"

    assert c.timed(save) == "info"
    assert c.step_s == pytest.approx(0.010) and c.snapshot_s == pytest.approx(0.004)
    assert c.replan() == 40 == c.every, "4 ms / (1% x 10 ms)"
    assert c.replan(lambda every: 3 * every) == 120, "the interval the ranks agree on"


def test_a_fixed_interval_is_honoured_and_measures_nothing():
    clock = Clock()
    c = Cadence(7, clock=clock)
    c.healthy()
    clock.now += 100.0
    assert c.timed(lambda: 1) == 1 and c.replan() == 7 and c.plan(snapshot_s=9.0, step_s=1e-3) == 7
    assert c.every == 7 and c.snapshot_s is None


def test_the_config_takes_auto_or_an_integer_and_says_what_is_wrong():
    assert load_config().snapshot.every == "auto"
    assert load_config(None, ["snapshot.every=25"]).snapshot.every == 25
    for bad, said in [
        ("snapshot.every=0", r"snapshot\.every: got 0; expected an integer or one of 'auto' \(>= 1\)"),
        ("snapshot.every=often", r"snapshot\.every: got 'often'; expected an integer or one of 'auto'"),
        ("snapshot.every=2.5", r"snapshot\.every: got 2\.5; expected an integer or one of 'auto'"),
        ("snapshot.overhead=0", r"snapshot\.overhead: got 0"),
        ("snapshot.min_every=50", r"snapshot\.min_every: got 50; expected at most snapshot\.max_every"),
    ]:
        overrides = [bad, "snapshot.max_every=10"] if "min_every" in bad else [bad]
        with pytest.raises(ConfigError, match=said):
            load_config(None, overrides)
