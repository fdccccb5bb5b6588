"""The replay's RNG copy: made every step only while the model draws random numbers.

Copying the 5 KB RNG state costs about 10 us inside a training step; a model without dropout
never changes it, and the replay needs it only to reproduce random draws. These tests pin that
the copy stops for a model that draws nothing, continues for one that does, that a replay of
an idle model is still exact, and that a model which begins to draw is noticed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safetrain import load_config
from safetrain.diagnose.rng import LOOK_EVERY
from safetrain.guard import Guard
from safetrain.testing import OutputFault

CFG = [
    "log.progress=false",
    "detect.mode=lazy",
    "snapshot.every=100000",
    "detect.check_weights_every=0",
    "guard.spike.enabled=false",
    "recovery.actions.loss=skip_batch",
    "recovery.escalate=[skip_batch]",
    "recovery.max_retries=50",
]


def model_with(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(dropout), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def count_copies(monkeypatch) -> list:
    calls = []
    original = torch.get_rng_state

    def counting():
        calls.append(1)
        return original()

    monkeypatch.setattr(torch, "get_rng_state", counting)
    return calls


def test_the_copy_stops_while_the_model_draws_nothing_and_goes_on_while_it_draws(monkeypatch):
    steps = 4 * LOOK_EVERY
    # No copies once a whole window between two looks drew nothing (from the second look on).
    for dropout, expected in ((0.0, (2 * LOOK_EVERY, 2 * LOOK_EVERY + 5)), (0.3, (steps, steps))):
        model = model_with(dropout)
        with Guard(
            model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, CFG), loss_fn=F.mse_loss
        ) as guard:
            guard.step(batches(1)[0])  # the first step takes the initial snapshot (its own RNG read)
            calls = count_copies(monkeypatch)
            for batch in batches(steps):
                assert guard.step(batch).action == ""
            monkeypatch.undo()
        low, high = expected
        assert low <= len(calls) <= high, f"dropout {dropout}: {len(calls)} RNG copies in {steps} steps"


def test_a_replay_of_a_model_that_draws_nothing_is_exact_without_the_copy():
    """Long after the copies stopped, a NaN made by a layer is replayed and named."""
    model = model_with(0.0)
    n = 3 * LOOK_EVERY
    OutputFault(model[0], calls=range(n, 10**6))  # the first Linear's output is NaN from the n-th forward on
    with Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, CFG), loss_fn=F.mse_loss
    ) as guard:
        for batch in batches(n):
            result = guard.step(batch)
        assert guard.diagnoser.rng.idle, "the RNG copy had stopped"
    event = next(e for e in result.events if e.name == "anomaly")
    diagnosis = event.detail["diagnosis"]
    assert diagnosis["module"] == "0" and diagnosis["reproducible"], diagnosis
    assert "random numbers" not in diagnosis["note"]


def test_a_model_that_begins_to_draw_is_noticed_by_the_replay_and_copied_again(monkeypatch):
    """Dropout switched on late (after the copies stopped): the next replay cannot be exact. It
    says so, does not call a fault that did not reproduce transient (no retry: the ladder acts),
    and the RNG is copied at every step again."""
    model = model_with(0.0)
    n = 2 * LOOK_EVERY + 3
    fault = OutputFault(model[0], calls=[n])  # one NaN output, at the n-th forward only
    with Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, CFG), loss_fn=F.mse_loss
    ) as guard:
        for batch in batches(n - 2):
            guard.step(batch)
        assert guard.diagnoser.rng.idle
        model[1].p = 0.5  # dropout switched on between looks: the kept state is no longer the step's
        guard.step(batches(n)[-2])
        result = guard.step(batches(n)[-1])
        assert fault.count > n, "the replay ran the forward again, without the fault"
        event = next(e for e in result.events if e.name == "anomaly")
        diagnosis = event.detail["diagnosis"]
        assert "random numbers were drawn since the RNG state was last kept" in diagnosis["note"], diagnosis
        assert "not treated as transient" in diagnosis["note"] and event.action == "skip_batch", event
        calls = count_copies(monkeypatch)
        for batch in batches(5):
            guard.step(batch)
        assert len(calls) == 5, "after the replay noticed, the RNG is copied at every step again"
