"""The decision loop's bookkeeping: the guard is ready after any ending, empty batches are data
events counted once, and a re-run that reads clean ends an fp16 overflow run (found in review)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import TrainingAborted, load_config
from safetrain.guard import Guard, Phase
from safetrain.policy import History, read_clean
from safetrain.testing import OutputFault
from tests.helpers.engine import BASE
from tests.helpers.models import loader, mlp, regression_data


def test_an_abort_leaves_the_guard_ready_and_flush_decides_nothing():
    """With accumulation, an abort used to leave the phase ACCUMULATING: a later flush() judged
    and restored a phantom step."""
    model = mlp()
    cfg = load_config(
        None, [*BASE, "guard.accumulate_steps=2", "recovery.actions.forward=abort", "detect.replay.enabled=false"]
    )
    batches = list(loader(regression_data()))
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.02), cfg, loss_fn=F.mse_loss) as guard:
        OutputFault(model[0], calls=[5])  # the 6th forward: the 3rd step's first micro-batch
        with pytest.raises(TrainingAborted):
            for batch in batches[:8]:
                guard.step(batch)
        steps = guard.counters.steps
        assert guard.phase is Phase.READY
        assert guard.flush() is None and guard.counters.steps == steps


@pytest.mark.parametrize("accumulate", [1, 2])
def test_an_empty_batch_is_one_skipped_step_or_one_micro_batch_less(accumulate):
    """k = 1: an empty batch is a skipped step with one policy entry (it counts toward
    max_skip_fraction); k > 1: an empty micro-batch is left out of the step being accumulated."""
    model = mlp()
    cfg = load_config(None, [*BASE, f"guard.accumulate_steps={accumulate}"])
    batches = list(loader(regression_data()))[:4]
    empty = (batches[0][0][:0], batches[0][1][:0])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.02), cfg, loss_fn=F.mse_loss) as guard:
        results = [guard.step(b) for b in [empty, *batches]]
        decided = [r for r in results if r is not None]
        assert guard.counters.steps == len(decided) == (5 if accumulate == 1 else 2), results
        assert len(guard.history.recent) == guard.counters.steps, "one policy entry per step"
        assert guard.counters.skipped_batches == (1 if accumulate == 1 else 0)
        assert all(r.trained for r in decided[accumulate == 1 :])
        assert sum(1 for e in guard.bus.events if "empty batch" in e.message) == 1


def test_a_clean_re_run_ends_an_overflow_run():
    history = History(overflows=3, unverified=1)
    assert read_clean(history) == History(overflows=0, unverified=1), "vouching is the guard's clean reads"


def test_a_step_re_run_after_a_fault_keeps_one_policy_entry():
    """A transient fault is retried; when the retry trips again the step is decided once more, and
    its entry in the recent window is replaced, not doubled (found in review: 6 entries for 5 steps)."""
    model = mlp()
    cfg = load_config(None, [*BASE, "detect.mode=eager"])
    batches = list(loader(regression_data()))[:5]
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.02), cfg, loss_fn=F.mse_loss) as guard:
        OutputFault(model[0], calls=[3, 5])  # the 4th step trips, its replay and retry: the retry trips again
        results = [guard.step(b) for b in batches]
        actions = [e.action for e in guard.bus.events if e.name == "anomaly"]
        assert actions[0] == "retry" and len(actions) == 2, actions
        assert len(guard.history.recent) == guard.counters.steps == 5, guard.history.recent
        assert guard.history.recent[3] == int(not results[3].trained)
