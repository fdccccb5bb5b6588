"""Issue 32, as properties (hypothesis, cheap): each cause gets its own action, whatever step it comes at.

* data that changes (a new mixture, the loss x3-50 at a random step, or new classes): no restore,
  no abort, and the run ends below where the new level started;
* silent damage (finite garbage in a running normaliser's buffer at a random step): found within
  a few steps, and the run ends as good as the same run without it;
* one bad batch (targets x1000) at a random step: exactly one skipped batch, nothing else.

* healthy runs (the generator of ``tests/helpers/healthy.py``, drawn here under another name, so
  other examples): no skip, no restore, no event of any intervention.

Measured with ``benchmarks/healthy_interventions.py`` (the same generator, ``random.Random(i)``):
1 of 360 healthy runs intervened (i=197: a Gaussian NLL under SGD with momentum, seed 595), and
that one is no false alarm: unguarded, its loss jumps from 0.43 to 3.0 at step 43 and ends at 1.59;
guarded, the jump is skipped, then restored to the snapshot of step 40, and it ends at 0.47.
"""

from __future__ import annotations

import hypothesis
from hypothesis import strategies as st

from tests.helpers.causes import bad_batch, class_change, damaged, end_level, mixture_change, named
from tests.helpers.healthy import fit as healthy_fit
from tests.helpers.healthy import interventions

SETTINGS = hypothesis.settings(
    max_examples=4,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),  # a failure as drawn: no slow shrinking
)
FAST = ("snapshot.every=20",)  # a snapshot with a level before each random step


@SETTINGS
@hypothesis.given(
    seed=st.integers(0, 99),
    switch=st.integers(50, 110),
    jump=st.floats(3.0, 50.0),
    classes=st.booleans(),
)
def test_data_that_changes_is_learned_not_restored(seed, switch, jump, classes):
    if classes:
        result, losses = class_change(seed, steps=switch + 60, switch=switch, overrides=FAST)
    else:
        result, losses = mixture_change(seed, steps=switch + 60, switch=switch, jump=jump, overrides=FAST)
    events = named(result, "anomaly", "restored", "aborted")
    assert result.ended == "done" and result.restores == 0 and result.lr_backoffs == 0, events
    assert sum(e.kind == "level_shift" for e in events) <= 1, events
    new_start = max(losses[switch - 1 : switch + 3])
    assert end_level(losses) < new_start, (end_level(losses), new_start, events)


@SETTINGS
@hypothesis.given(seed=st.integers(0, 99), at=st.integers(50, 110), shift=st.floats(1.5, 3.0))
def test_silent_damage_is_found_within_a_few_steps(seed, at, shift):
    """Shifts from 1.5: near 1.0 the loss rises by about its own noise, and whether the rise is caught
    depended on what ran before in the same process (seed 64, step 110, shift 1.1: caught alone, not
    after other files in one pytest-xdist worker; not found why). ``test_causes.py`` keeps shift 1.0
    as a fixed case."""
    result, losses = damaged(seed, steps=at + 60, at=at, shift=shift, overrides=FAST)
    _, clean = damaged(seed, steps=at + 60, at=0, overrides=FAST)
    found = [e for e in named(result, "anomaly") if e.detail.get("cause") == "damage"]
    assert found and found[0].step <= at + 6, named(result, "anomaly", "restored")
    assert result.ended == "done"
    assert end_level(losses) < 1.2 * end_level(clean) + 0.02, (end_level(losses), end_level(clean))


@SETTINGS
@hypothesis.given(seed=st.integers(0, 99), at=st.integers(30, 110))
def test_one_bad_batch_costs_one_batch(seed, at):
    result, _ = bad_batch(seed, steps=at + 30, at=at, overrides=FAST)
    events = named(result, "anomaly", "restored", "aborted")
    assert (result.skipped_batches, result.restores, result.ended) == (1, 0, "done"), events


@SETTINGS
@hypothesis.given(
    task=st.sampled_from(("mse", "ce", "nll")),
    act=st.sampled_from(("tanh", "relu", "gelu")),
    norm=st.sampled_from(("layer", "batch")),
    optimizer=st.sampled_from(("sgd", "adam", "adamw")),
    offset=st.sampled_from((0.0, -1.0, -100.0, 100.0, 3.0)),
    schedule=st.sampled_from(("none", "cosine", "onecycle")),
    noisy_every=st.sampled_from((0, 7, 10)),
    seed=st.integers(100, 999),
)
def test_a_healthy_run_loses_no_batch(task, act, norm, optimizer, offset, schedule, noisy_every, seed):
    """Point 5 of the issue: of 1000 healthy runs about 6 lost one batch as a spike. Other draws of
    the healthy-run generator than its own property's: not one skip, restore or other event."""
    result, _ = healthy_fit(task, act, norm, optimizer, offset, 1.0, schedule, 1, noisy_every, 60, seed)
    found = interventions(result)
    assert (result.skipped_batches, result.restores, found, result.ended) == (0, 0, [], "done"), found
