"""Issue 23: every judgment on the loss is invariant to its offset and scale. Pure, no torch.

The spike and divergence detectors and the end-of-run check see random loss sequences (healthy
noisy decays, plateaus, converged heavy-tailed runs, runs crossing zero, and the same with an
injected blow-up or a geometric climb) as ``L``, ``L + c`` and ``a * L`` and must decide the same at
the same steps. The losses are dyadic (multiples of 2**-20 below 2**30) and ``c``, ``a`` are
powers of two or integers, so every difference, median and ratio the rules take is exact in
float64 and "the same" is equality, not a tolerance: float rounding, the one difference the
rules allow, cannot blur the test. (The spreads are kept well above float32 resolution after the
shift, ``1e-6 x |loss|``, the floor the rules put on a spread: a converged curve around 1e-4
shifted by 100 would be below what a float32 loss can even hold.) ``a`` = 0.01 and 100 are exercised end to end in
tests/integration/test_fit_loss_invariance.py.
"""

from __future__ import annotations

import math
import random
from typing import List, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from safetrain import ConfigError, load_config
from safetrain.config import RecoveryConfig
from safetrain.guard.state import RecoveryState
from safetrain.stats.divergence import DivergenceDetector
from safetrain.stats.spike import SpikeDetector

SHAPES = ("decay", "plateau", "heavy_tail", "negative", "crossing")
FAULTS = (None, "blow_up", "climb")
#: (offset, scale): the transforms every decision must be invariant to.
TRANSFORMS = [(100.0, 1.0), (-100.0, 1.0), (0.0, 1 / 128), (0.0, 128.0), (-3.0, 4.0)]


def dyadic(x: float) -> float:
    return round(x * 2**20) / 2**20


def losses(shape: str, fault, n: int, seed: int) -> List[float]:
    """A loss curve of ``shape``; ``fault``: one blow-up, or a geometric climb, two thirds in."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if shape == "decay":
            x = (2.0 * 0.98**i + 0.1) * rng.uniform(0.7, 1.3)
        elif shape == "plateau":
            x = 2.3 + rng.gauss(0, 0.05)
        elif shape == "heavy_tail":  # converged: lognormal batches, one in ~16 misclassified, 500x the median
            tail = i % 16 == 0 or rng.random() < 1 / 32
            x = 50.0 * rng.uniform(0.8, 1.2) if tail else 0.1 * rng.lognormvariate(0, 1)
        elif shape == "negative":  # a Gaussian NLL with learned variance: falls from -2 to -5
            x = -2.0 - 3.0 * (1 - 0.97**i) + rng.gauss(0, 0.1)
        else:  # mse - 1: crosses zero
            x = 1.5 * 0.97**i - 1.0 + rng.gauss(0, 0.05)
        out.append(x)
    at = 2 * n // 3
    if fault == "blow_up":
        out[at] = out[at] + 1e4 * (1.0 + abs(out[at]))
    elif fault == "climb":
        for k in range(at, n):
            out[k] = out[at - 1] + 0.5 * (1.0 + abs(out[at - 1])) * 4.0 ** (k - at)
    return [dyadic(x) for x in out]


def judge(seq: List[float], hard_ratio=100.0) -> List[Tuple[int, str, str]]:
    """Feed ``seq`` as the guard's judge does: divergence first, then spike; an anomaly joins no window."""
    spike = SpikeDetector(window=128, min_history=20, zscore=6.0, min_ratio=2.0, hard_ratio=hard_ratio)
    div = DivergenceDetector(recover_after=20)
    out = []
    for i, x in enumerate(seq):
        found = div.check(x)
        if found is not None:
            div.fault(found)
            out.append((i, "divergence", found.rule))
            continue
        evidence = spike.check(x)
        if evidence is not None:
            out.append((i, "spike", evidence["rule"]))
            continue
        spike.add(x)
        div.add(x)
        out.append((i, "climbing" if div.climbing else "", ""))
    return out


def ended_worse(seq: List[float], margin: float = 4.0) -> bool:
    state = RecoveryState(RecoveryConfig())
    for x in seq:
        state.count_loss(x)
    return state.ended_worse(margin) is not None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    shape=st.sampled_from(SHAPES),
    fault=st.sampled_from(FAULTS),
    n=st.integers(3, 260),
    seed=st.integers(0, 2**16),
)
def test_decisions_are_invariant_to_offset_and_scale(shape, fault, n, seed):
    seq = losses(shape, fault, n, seed)
    base, end = judge(seq), ended_worse(seq)
    for c, a in TRANSFORMS:
        moved = [a * x + c for x in seq]
        assert judge(moved) == base, (c, a)
        assert ended_worse(moved) == end, (c, a)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(shape=st.sampled_from(SHAPES), n=st.integers(3, 400), seed=st.integers(0, 2**16))
def test_healthy_curves_get_no_decision_and_finish(shape, n, seed):
    """The dual: a healthy curve of any sign and shape is never a spike or a divergence, and does
    not end worse than it started."""
    seq = losses(shape, None, n, seed)
    assert [d for d in judge(seq) if d[1] in ("spike", "divergence")] == []
    assert not ended_worse(seq)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fault", ["blow_up", "climb"])
def test_an_injected_fault_is_caught_in_every_shape(shape, fault):
    """A blow-up is a spike; a climb that starts with a jump (x4 a step) is caught at its first
    step, a spike (the z-score, before the climb has the steps a divergence needs)."""
    seq = losses(shape, fault, 120, seed=1)
    found = [d for d in judge(seq) if d[1] in ("spike", "divergence")]
    assert found and 80 <= found[0][0] <= 84, found


@pytest.mark.parametrize("offset,scale", [(0.0, 1.0), *TRANSFORMS])
def test_a_climb_from_the_first_step_is_divergence(offset, scale):
    """An LR ~10x too high: the loss grows ~100x a step from the first (669, 9.2e4, 2.4e7, 3.2e9 in
    tests/integration/test_divergence.py). With no spread known yet the first increment is the
    scale; the 4th loss completes two increment ratios >= growth squared: divergence."""
    seq = [offset + scale * x for x in (669.0, 92032.0, 23609344.0, 3248488448.0)]
    found = [d for d in judge(seq) if d[1] in ("spike", "divergence")]
    assert found == [(3, "divergence", "geometric")], found


def test_a_noisier_batch_in_a_negative_loss_run_is_no_spike():
    """Issue 23: with ``mse - 1`` (negative) one ordinary noisier batch in ten became 7 "spikes" in
    a row: ``hard_ratio x`` a negative loss is below every loss."""
    rng = random.Random(0)
    seq = [0.5 * 0.97**i - 1.0 + rng.gauss(0, 0.02) * (3 if i % 10 == 0 else 1) for i in range(200)]
    assert [d for d in judge(seq) if d[1] in ("spike", "divergence")] == []
    assert not ended_worse(seq)


@pytest.mark.parametrize("offset", [-100.0, 0.0, 100.0])
def test_the_end_check_reads_a_falling_loss_of_any_sign_as_trained(offset):
    """Issue 23: a loss falling from -2 to -5 (or ``mse - 1`` ending below zero) was aborted at its
    end as "worse than it started" (its last losses 1.07x its first); ``loss + 100`` passed and
    ``loss - 100`` failed. Now all three finish."""
    rng = random.Random(3)
    seq = [offset - 2.0 - 3.0 * (1 - 0.95**i) + rng.gauss(0, 0.05) for i in range(100)]
    assert not ended_worse(seq)


def test_a_run_ending_above_its_start_is_worse_though_it_fell_first():
    """Issue 23, point 7: the LR-x1000-schedule case of the issue, started at 3.9, at 2.0 before
    the fault, ended at 5.5: ``guard.end_loss_ratio`` (3x the start) let it finish "done". In the
    run's own noise (a spread of ~0.1) it ends ~16 standard deviations above its start."""
    rng = random.Random(4)
    seq = [2.0 + 1.9 * 0.95**i + rng.gauss(0, 0.1) for i in range(60)]
    seq += [5.5 + rng.gauss(0, 0.1) for _ in range(40)]
    assert ended_worse(seq)
    assert ended_worse([x - 10.0 for x in seq]) and ended_worse([x * 0.01 for x in seq])
    state = RecoveryState(RecoveryConfig())
    for x in seq:
        state.count_loss(x)
    assert "standard deviations" in state.ended_worse(4.0) and state.ended_worse(None) is None


def test_an_early_blow_up_is_no_start_and_a_run_it_ruined_ends_worse():
    """A batch in the wrong unit at the 2nd step (one healthy loss before it: no scale, no spike)
    ruins the weights: the first 5 losses are 0.86, 1e8, then ~7e5. Their median (7e5) is no start;
    the first loss is, and the run, ending at ~6.7e5, is worse."""
    rng = random.Random(5)
    seq = [0.86, 1e8] + [6.7e5 * rng.uniform(0.9, 1.1) for _ in range(28)]
    assert ended_worse(seq)


def test_end_check_needs_five_losses_at_both_ends_and_loads_old_snapshots():
    state = RecoveryState(RecoveryConfig())
    for x in (1.0, 2.0, 3.0, 4.0):
        state.count_loss(x)
    assert state.ended_worse(4.0) is None
    old = {**state.state_dict(), "losses": {"first": [1.0, 1.1, 0.9, 1.0, 1.2], "last": [9.0, 9.1, 8.9, 9.0, 9.2]}}
    state.load_state_dict(old)  # a snapshot before issue 23 kept the last 5 losses only
    assert state.ended_worse(4.0) is not None and len(state.last_losses) == 5
    assert math.isfinite(state.epoch_loss[0])


@pytest.mark.parametrize("where", ["override", "yaml"])
def test_the_old_end_loss_ratio_key_says_what_replaced_it(where, tmp_path):
    """A ratio to the first loss means nothing for a negative or offset loss: a config that still
    sets guard.end_loss_ratio is refused, naming guard.end_margin, not "unknown key"."""
    with pytest.raises(ConfigError, match=r"guard\.end_loss_ratio.*replaced by guard\.end_margin"):
        if where == "override":
            load_config(None, ["guard.end_loss_ratio=3"])
        else:
            path = tmp_path / "old.yaml"
            path.write_text("guard:\n  end_loss_ratio: 3.0\n")
            load_config(path)
    assert load_config(None, ["guard.end_margin=null"]).guard.end_margin is None
