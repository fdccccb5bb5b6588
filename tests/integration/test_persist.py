"""Issue 18 classes 4 and 5: a fault the ladder cannot fix, and a run that never trains, end in
``TrainingAborted`` naming the cause and the fix, never in a "finished" broken or untrained model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.errors import TrainingAborted
from tests.helpers.models import finite_params

BASE = ["log.progress=false"]


class BagOfWords(torch.nn.Module):
    """Embeddings whose padding row 0 (looked up, gradient always zero) or rows 10..19 (never looked
    up) get a zero gradient every step."""

    def __init__(self, padding_idx=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, 4, padding_idx=padding_idx)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1)).squeeze(-1)


def _bags(n=40):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 10, (8, 5), generator=g), torch.randn(8, generator=g)) for _ in range(n)]


def _fit(model, opt, overrides, batches, max_steps=None):
    try:
        result = SafeTrainer(model, opt, load_config(None, [*BASE, *overrides]), loss_fn=F.mse_loss).fit(
            batches, max_steps=max_steps
        )
        return result, None
    except TrainingAborted as exc:
        return exc.result, exc  # type: ignore[attr-defined]


def _mean_loss(model, batches):
    with torch.no_grad():
        return sum(float(F.mse_loss(model(x), y)) for x, y in batches) / len(batches)


@pytest.mark.parametrize("padding_idx", [0, None], ids=["padding row looked up", "rows never looked up"])
def test_adam_eps_zero_aborts_promptly_naming_eps_and_the_fix(padding_idx):
    """Issue 18 class 4: Adam(eps=0) and rows whose gradient is always zero: ``0 / (sqrt(0) + 0)``
    = NaN in the update, again after every restore. Before: restore, step once (breaking the weights
    again), restore, three LR halvings, the run's end mid-ladder (or, with the rows never read
    and the default weight check every 100 steps, "finished" with NaN weights)."""
    batches = _bags()
    model = BagOfWords(padding_idx)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    checks = ["detect.check_weights_every=5"] if padding_idx is None else []
    result, exc = _fit(model, opt, ["snapshot.every=5", *checks], batches)
    assert exc is not None, "aborts"
    message = str(exc)
    assert "Adam eps=0" in message and "fix: a positive eps" in message, message
    assert "persistent fault: weights in embed.weight by aten.addcdiv_" in message, message
    anomalous = [e for e in result.events if e.name == "anomaly"]
    assert [e.action for e in anomalous] == ["restore", "abort"], [e.message for e in anomalous]
    assert len(anomalous) <= 6 and result.steps <= 12, result.summary()
    assert finite_params(model), "left at the last good snapshot"
    assert all(torch.equal(v, start[k]) for k, v in model.state_dict().items()), "the only snapshot: the start"


def test_adam_eps_zero_caught_by_no_check_still_aborts_at_the_end_of_fit():
    """Issue 18 class 4 / 5: rows never looked up, the weight check every 100 steps, a 40-step run:
    nothing trips on the way, and before the run ended "done" with NaN in ``embed.weight``."""
    model = BagOfWords()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    result, exc = _fit(model, opt, ["snapshot.every=10"], _bags())
    assert exc is not None and result.ended == "aborted", result.summary()
    message = str(exc)
    assert "the run ended with non-finite parameters (embed.weight)" in message, message
    assert "Adam eps=0" in message and "fix: a positive eps" in message, message
    assert finite_params(model), "left at the last good snapshot"


def test_a_valid_eps_trains_the_same_model_normally():
    batches = _bags()
    model = BagOfWords(0)
    before = _mean_loss(model, batches)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-8)
    result, exc = _fit(model, opt, ["snapshot.every=5"], batches)
    assert exc is None and result.ended == "done" and result.healthy_steps == 40, result.summary()
    assert finite_params(model) and _mean_loss(model, batches) < before


def _masked_mse(pred, target):
    """NaN targets mean "missing": masked out of the loss (finite), but torch.where's gradient is NaN."""
    mask = ~torch.isnan(target)
    return torch.where(mask, (pred - target) ** 2, torch.zeros_like(pred)).sum() / mask.sum()


def _missing_targets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 8, generator=g)
    y = x @ (torch.randn(8, 1, generator=g) / 8**0.5)
    for i in range(0, 640, 16):  # every batch of 16 has 1..3 missing targets
        y[i + torch.randperm(16, generator=g)[: 1 + i % 3]] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _regressor():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _masked_fit(overrides):
    model = _regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = SafeTrainer(model, opt, load_config(None, [*BASE, *overrides]), loss_fn=_masked_mse)
    try:
        return model, trainer.fit(_missing_targets(), max_steps=40), None
    except TrainingAborted as exc:
        return model, exc.result, exc  # type: ignore[attr-defined]


def test_nan_targets_a_loss_masks_abort_naming_the_missing_value_reading():
    """Issue 18 class 5: every batch has NaN targets that the loss masks; ``sanitize.targets:
    skip_batch`` skipped them all and, ``max_skip_fraction`` dividing by the whole window of 100,
    the 40-step run "finished" with 0 trained steps and a NaN final loss."""
    model, result, exc = _masked_fit([])
    assert exc is not None and result.ended == "aborted", result.summary()
    message = str(exc)
    assert "8 of the first 8 steps were not trained" in message, message
    assert "missing-value marker the loss masks" in message and "sanitize.targets: replace" in message, message
    assert result.steps == 8 and result.optimizer_steps == 0
    assert finite_params(model)


def test_nan_targets_replaced_train():
    _, result, exc = _masked_fit(["sanitize.targets=replace"])
    assert exc is None and result.ended == "done" and result.optimizer_steps == 40, result.summary()
    assert result.final_loss < 1.0


def test_fit_never_returns_with_zero_trained_steps():
    """Issue 18 class 5: with ``max_skip_fraction=1`` nothing stops the skipping on the way; the end
    of ``fit`` does (it used to return "done" with 0 trained steps and a NaN final loss)."""
    model, result, exc = _masked_fit(["recovery.max_skip_fraction=1.0"])
    assert exc is not None and result.ended == "aborted", result.summary()
    message = str(exc)
    assert "none of the 40 steps trained (40 skipped" in message, message
    assert "sanitize.targets: replace" in message, message
    assert finite_params(model)
