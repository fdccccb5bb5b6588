"""The cause test's rules (issue 32): a table of witnesses -> the cause, and the ranks' agreement."""

from __future__ import annotations

import pytest

from safetrain import load_config
from safetrain.kinds import CAUSE_ACTIONS, Action, Cause
from safetrain.policy import Anomaly, History, Rules, decide
from safetrain.policy.causes import Verdict, Witness, agree, cause_of, level_of

W = Witness

# (current loss on the batch, level before the jump, witnesses newest first) -> (cause, snapshot to restore)
TABLE = [
    # the snapshot does as well as it did when taken: the model changed -> damage, restore it
    (10.0, 1.0, [W(0, 100, 1.1, 1.0)], Cause.DAMAGE, 0),
    # the newest snapshot is damaged too (it does as badly), the older one is sound -> the older
    (10.0, 1.0, [W(0, 150, 9.5, 1.0), W(1, 100, 1.2, 1.1)], Cause.DAMAGE, 1),
    # every snapshot does badly on the batch too -> the data changed
    (10.0, 1.0, [W(0, 150, 9.0, 1.0), W(1, 100, 8.0, 1.2)], Cause.DATA_CHANGE, 0),
    # in between (a rise of a third of the jump) -> the ladder decides
    (10.0, 1.0, [W(0, 100, 4.0, 1.0)], Cause.UNKNOWN, 0),
    # no witness with a level (the run's first snapshot, untrained) -> unknown, never damage
    (10.0, 1.0, [W(0, 0, 2.0, None)], Cause.UNKNOWN, 0),
    (10.0, 1.0, [], Cause.UNKNOWN, 0),
    # the current model's loss is not above the level when run again -> unknown
    (0.9, 1.0, [W(0, 100, 0.9, 1.0)], Cause.UNKNOWN, 0),
    # a negative, offset loss (a Gaussian NLL): the same verdicts
    (-1.0, -10.0, [W(0, 100, -9.9, -10.0)], Cause.DAMAGE, 0),
    (-1.0, -10.0, [W(0, 100, -2.0, -10.0)], Cause.DATA_CHANGE, 0),
]


@pytest.mark.parametrize("current, level, witnesses, cause, older", TABLE)
def test_the_cause_of_a_jump(current, level, witnesses, cause, older):
    verdict = cause_of(current, level, witnesses)
    assert verdict.cause is cause, f"{current=} {level=} {witnesses=}: {verdict}"
    assert verdict.older == older


@pytest.mark.parametrize("a, c", [(1.0, 0.0), (3.0, 5.0), (0.01, -2.0)])
@pytest.mark.parametrize("current, level, witnesses, cause, older", TABLE)
def test_the_verdict_is_invariant_to_offset_and_scale(current, level, witnesses, cause, older, a, c):
    moved = [W(w.older, w.step, a * w.loss + c, None if w.level is None else a * w.level + c) for w in witnesses]
    assert cause_of(a * current + c, a * level + c, moved).cause is cause


def test_level_of_needs_a_few_losses():
    assert level_of([]) is None and level_of([1.0, 2.0]) is None
    assert level_of([5.0] * 100 + [1.0, 2.0, 3.0]) == 5.0  # the last 16


@pytest.mark.parametrize(
    "causes, agreed",
    [
        ([Cause.DAMAGE, Cause.UNKNOWN], Cause.DAMAGE),
        ([Cause.DATA_CHANGE, Cause.DATA_CHANGE], Cause.DATA_CHANGE),
        ([Cause.DATA_CHANGE, Cause.UNKNOWN], Cause.UNKNOWN),
        ([Cause.DATA_CHANGE, Cause.DAMAGE], Cause.DAMAGE),
        ([Cause.UNKNOWN], Cause.UNKNOWN),
    ],
)
def test_the_ranks_agree(causes, agreed):
    assert agree([Verdict(c) for c in causes]).cause is agreed


def test_damage_on_several_ranks_goes_back_as_far_as_any_needs():
    assert agree([Verdict(Cause.DAMAGE, 0, 150), Verdict(Cause.DAMAGE, 1, 100)]).older == 1


def test_each_cause_has_its_action():
    assert set(CAUSE_ACTIONS) == {Cause.BAD_BATCH, Cause.DAMAGE, Cause.DATA_CHANGE}
    assert CAUSE_ACTIONS[Cause.DATA_CHANGE] is Action.WARN


RULES = Rules.of(load_config())
AFTER_A_SKIP = History(consecutive=1, recent=(0, 0, 1))


def test_policy_a_data_change_trains_and_clears_the_ladder():
    verdict = Verdict(Cause.DATA_CHANGE, current=10.0, level=1.0)
    d, h = decide(Anomaly("spike", {"median": 1.0}, cause=verdict), AFTER_A_SKIP, RULES)
    assert (d.action, d.trains, d.restore, h.consecutive, h.recent[-1]) == (Action.WARN, True, False, 0, 0)


def test_policy_damage_restores_the_sound_snapshot_whatever_the_rung():
    verdict = Verdict(Cause.DAMAGE, older=1, step=100, current=10.0, level=1.0)
    d, h = decide(Anomaly("spike", {"median": 1.0}, cause=verdict), History(consecutive=2, unverified=2), RULES)
    assert (d.action, d.restore, d.older, d.pass_over_newest) == (Action.RESTORE, True, 1, False)
    assert "step 100" in d.reason and "damage" in d.reason


def test_policy_an_unknown_cause_climbs_the_ladder_as_before():
    verdict = Verdict(Cause.UNKNOWN, current=10.0, level=1.0)
    with_test, _ = decide(Anomaly("spike", {"median": 1.0}, cause=verdict), AFTER_A_SKIP, RULES)
    without, _ = decide(Anomaly("spike", {"median": 1.0}), AFTER_A_SKIP, RULES)
    assert with_test == without


def _detector_after(losses):
    from safetrain.stats.spike import SpikeDetector

    d = SpikeDetector(window=128, min_history=20, zscore=6.0)
    found = []
    for x in losses:
        found.append(d.check(x) or d.level(x))
        if found[-1] is None:
            d.add(x)
    return found


def test_a_plateau_no_step_of_which_is_a_spike_is_a_level_rise_at_its_4th_loss():
    import random

    rng = random.Random(0)
    noise = [1.0 + 0.1 * rng.gauss(0, 1) for _ in range(60)]
    plateau = [1.5 + 0.1 * rng.gauss(0, 1) for _ in range(6)]  # 5 sigmas up: no spike (z 6)
    found = _detector_after(noise + plateau)
    assert all(f is None for f in found[:63]), [f for f in found[:63] if f]
    assert found[63] is not None and found[63]["rule"] == "level" and found[63]["steps"] == 4
    assert all(f is None for f in found[64:])  # judged once; the gate moved to the new level


def test_noise_makes_no_level_rise():
    import random

    rng = random.Random(1)
    found = _detector_after([1.0 + 0.1 * rng.gauss(0, 1) for _ in range(3000)])
    assert [f for f in found if f is not None] == []


def test_a_snapshot_from_early_training_is_no_witness():
    """Found when ``snapshot.every: auto`` took a snapshot at step 5: on new classes that barely
    trained model stays near its own high level (it never learned the old classes), which read as
    "does well": a class change was restored as damage. A witness must be of the run's regime."""
    early = Witness(0, 5, 2.5, 2.0)  # level 2.0, where the run stands at 0.18 with sigma 0.08
    assert cause_of(13.6, 0.18, [early]).cause is Cause.DAMAGE, "without the spread: the old reading"
    assert cause_of(13.6, 0.18, [early], spread=0.08).cause is Cause.UNKNOWN
    trained = Witness(1, 100, 13.0, 0.2)
    assert cause_of(13.6, 0.18, [trained, early], spread=0.08).cause is Cause.DATA_CHANGE
    sound = Witness(1, 100, 0.25, 0.2)
    assert cause_of(13.6, 0.18, [sound, early], spread=0.08).cause is Cause.DAMAGE
    assert cause_of(13.6 * 3 + 1, 0.18 * 3 + 1, [Witness(0, 5, 8.5, 7.0)], spread=0.24).cause is Cause.UNKNOWN


def test_a_rise_counts_from_the_lower_of_the_witness_level_and_the_runs():
    """A snapshot whose own level was high does not do well merely by staying near it."""
    assert cause_of(10.0, 1.0, [Witness(0, 50, 4.0, 3.9)]).cause is not Cause.DAMAGE  # (4.0 - 3.9 read as well)
