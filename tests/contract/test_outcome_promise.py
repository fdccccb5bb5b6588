"""Issue 18's outcome promise, over random fault schedules: every ``fit`` ends either with a model
no worse than where it started (finite parameters, a full-data loss no higher than before), or
with ``TrainingAborted``. Never "finished" with a broken or untrained model.

A small regression MLP (8 -> 16 -> 1, tanh), SGD with momentum or Adam, 30-48 steps of 16 rows;
hypothesis draws one to four faults, each of any kind the library injects (``safetrain.testing``)
plus a batch whose targets are in the wrong unit (the spike of issue 18, class 3), at a random
step, once or from that step on (persistent). The loss is measured on the clean data set in eval
mode before and after the run. Derandomized and bounded (40 schedules), so CI sees the same
schedules every run; a failure prints the shrunk schedule and the run's journal.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

import pytest

from tests.helpers.outcome import Fault, run

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

#: A finite fault (a batch in the wrong unit, a finite blow-up of an output, gradient, weight or
#: LR) is drawn from step 1 too: ``fit`` measures the start model's loss on the batches ahead first
#: (``Guard.measure_start``), so even the first step's loss has a sound level to be judged against.
EARLIEST_FINITE = 1
#: Faults are drawn up to this many steps before the end: a run that ends on an anomaly puts back
#: its last good snapshot and the end-of-run checks catch non-finite weights, but a finite blow-up
#: of the very last update (the LR x1000 for update 30 of 30) is read by no step, a known limit.
TAIL = 1
#: Every fault is drawn once or persistent. Before issue 23 a persistent finite blow-up of an
#: output, gradient, weight or LR was not drawn: after the backoffs it could leave the loss up to
#: guard.end_loss_ratio (3) times its start, which the end-of-run check allowed (a persistent LR
#: x1000 from step 19 ended at 2.8x). The end check now measures the end against the start in the
#: run's own noise (guard.end_margin).
KINDS = ("inputs", "targets", "wrong_unit", "output", "grad", "weight", "lr")
#: A unit mix-up is drawn once only: every batch from step k on in other units is no fault but the
#: data (issue 32: data that changed is learned, not restored), and the clean data's loss this test
#: measures is no longer the run's objective (drawn since the cause test: SGD, every batch from step
#: 1 on x1e4, 30 healthy steps, "finished" at the clean loss 6e7; the same on the tree before).


VALUES = {
    "inputs": (math.nan, math.inf),
    "targets": (math.nan, -math.inf),
    "wrong_unit": (1e4,),
    "output": (math.nan, math.inf, 1e6),
    "grad": (math.nan, math.inf, 1e8),
    "weight": (math.nan, math.inf, 1e12),
    "lr": (1e3, math.inf),
}


@st.composite
def faults(draw: Any, steps: int) -> Fault:
    kind = draw(st.sampled_from(KINDS))
    value = draw(st.sampled_from(VALUES[kind]))
    return Fault(
        kind=kind,
        step=draw(st.integers(1 if not math.isfinite(value) else EARLIEST_FINITE, steps - TAIL)),
        persistent=draw(st.booleans()) and kind != "wrong_unit",
        value=value,
        where=draw(st.integers(0, 3)),
    )


@st.composite
def schedules(draw: Any) -> Tuple[str, int, List[Fault]]:
    steps = draw(st.integers(30, 48))
    schedule = draw(st.lists(faults(steps), min_size=1, max_size=4))
    # A known limit, not drawn: the start's level is the median of the first three batches' losses
    # (the first trained and two measured ahead), so two of them in other units are the level, and a
    # run wrecked by them reads as no worse than it started (SGD, x1e4 at steps 1 and 2: 30 healthy
    # steps, "finished" at the clean loss 3.3e6; the same before this session's changes).
    hypothesis.assume(sum(f.kind == "wrong_unit" and f.step <= 3 for f in schedule) < 2)
    return draw(st.sampled_from(("sgd", "adam"))), steps, schedule


@hypothesis.settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(schedules())
def test_every_fit_aborts_or_ends_no_worse_than_it_started(case):
    """Issue 18's acceptance: "every `fit` either aborts or ends with a finite final loss no worse
    than its initial loss and finite parameters", over random fault schedules."""
    optimizer, steps, schedule = case
    ended, before, after, finite, journal = run(optimizer, steps, schedule)
    if ended.startswith("aborted"):
        return
    what = f"{optimizer}, {steps} steps, faults: {', '.join(map(str, schedule))}\n" + "\n".join(journal)
    assert finite, f"finished with non-finite parameters\n{what}"
    assert math.isfinite(after) and after <= before * (1 + 1e-6), f"finished at loss {after:.4g} > {before:.4g}\n{what}"


FIRST_STEPS = [
    pytest.param("sgd", Fault("wrong_unit", 1, False, 1e4, 0), id="wrong_unit@1"),
    pytest.param("adam", Fault("wrong_unit", 1, False, 1e4, 0), id="adam_wrong_unit@1"),
    pytest.param("sgd", Fault("wrong_unit", 2, False, 1e4, 0), id="wrong_unit@2"),
    pytest.param("sgd", Fault("wrong_unit", 3, False, 1e4, 0), id="wrong_unit@3"),
    pytest.param("adam", Fault("lr", 1, False, 1e3, 0), id="adam_lr_x1000@1"),
]


@pytest.mark.parametrize("optimizer,fault", FIRST_STEPS)
def test_a_finite_blow_up_in_the_first_steps_ends_trained_or_aborted(optimizer, fault):
    """The shrunk failures of the property above when finite faults were drawn from step 1 (each
    also failed alone): SGD, 30 steps, one batch's targets x1e4 at step 1, 2 or 3: no anomaly,
    'finished', full-data loss 0.861 -> 1.41e6, 6.4e5, 5.5e6 (from step 4 on the same batch is a
    hard spike and skipped: 0.861 -> 0.059). Adam with the LR x1000 for the update of step 1 and one
    NaN input row at step 1 (dropped, the step re-run): the loss of step 2 is ~580x step 1's, no
    anomaly, 'finished' at 504 (without the NaN row the climb is caught as divergence at step 5).
    Now (issue 23) the start model's losses on the batches ahead are the first steps' reference:
    wrong_unit@1 and @2 are spikes, skipped, and the runs end trained (@3 by the run's own range);
    and adam_lr_x1000@1 (the loss after the first update ~580x, its noise grown with it) aborts at the
    end: the end check's start is the start model's level and spread, from three of its losses."""
    faults = [fault] if optimizer == "sgd" else [Fault("inputs", 1, False, math.nan, 0), fault]
    ended, before, after, finite, journal = run(optimizer, 30, faults)
    assert ended != "finished" or (finite and after <= before), "\n".join(journal)


def test_a_weight_broken_after_the_last_update_ends_in_an_abort():
    """A shrunk failure of the property above when faults were drawn up to the last step (one NaN
    input row at step 1, dropped): SGD, 30 steps, a NaN written into a weight after the 30th update.
    It used to end 'finished' with a NaN parameter (no step reads it); the end-of-run check aborts."""
    fault = Fault("weight", 30, False, math.nan, 0)
    ended, before, after, finite, journal = run("sgd", 30, [Fault("inputs", 1, False, math.nan, 0), fault])
    assert ended.startswith("aborted: weights: the run ended with non-finite parameters"), "\n".join(journal)


def test_a_run_ending_on_a_skipped_spike_puts_back_the_last_good_snapshot():
    """The shrunk failure of the property above when faults were drawn up to the last step (one NaN
    input row at step 1, dropped): SGD, 30 steps, the LR x1000 for the 29th update: step 30's loss
    (2951, 17500x the median) is a spike, skipped; the run ended there, 'finished', full-data loss
    0.861 -> 1853. A run whose last step is an anomaly on the ladder now puts back the last good
    snapshot before it finishes, and says so."""
    fault = Fault("lr", 29, False, 1e3, 0)
    ended, before, after, finite, journal = run("sgd", 30, [Fault("inputs", 1, False, math.nan, 0), fault])
    assert ended != "finished" or (finite and after <= before), "\n".join(journal)
    assert any("the run ended on an anomalous step" in line for line in journal), "\n".join(journal)


def test_a_persistent_lr_blow_up_aborts_at_the_end():
    """The shrunk failure of the property above when finite faults could be persistent: Adam, 30
    steps, one NaN input row at step 1 (dropped), the LR x1000 for every update from the 4th on:
    spike skip (5), restore (6), scale_lr (8, 10), divergence scale_lr (13), then 17 steps with no
    anomaly; it used to end 'finished', full-data loss 0.861 -> 4.80: the end-of-run check aborts it."""
    ended, before, after, finite, journal = run(
        "adam", 30, [Fault("inputs", 1, False, math.nan, 0), Fault("lr", 4, True, 1e3, 0)]
    )
    assert ended != "finished" or (finite and after <= before), "\n".join(journal)
