"""Issue 18, classes 1 and 3: a loss that diverges from the first steps, and a spike early in a run."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from safetrain import SafeTrainer, TrainingAborted, load_config
from safetrain.guard import Guard
from tests.helpers.models import finite_params, loader, mlp, regression_data, unscaled_regression

BASE = ["log.progress=false"]


def diverging_fit(overrides=(), epochs=5):
    """Plain SGD at 5.5x the stable LR of a linear model on unscaled data: the MSE grows ~100x per step."""
    data = unscaled_regression()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=5.5 / 10.0**2)
    x, y = data.tensors
    with torch.no_grad():
        before = F.mse_loss(model(x), y).item()
    trainer = SafeTrainer(model, opt, load_config(None, [*BASE, *overrides]), loss_fn=F.mse_loss)
    return trainer, model, opt, before, lambda: trainer.fit(loader(data, batch_size=32), epochs=epochs)


def full_loss(model, data):
    x, y = data.tensors
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def test_divergence_from_the_first_steps_backs_the_lr_off_until_the_run_recovers():
    """Issue 18, class 1: an LR ~10x too high for unscaled regression data. The loss grows ~100x
    per step from step 0; before, the spike detector was silent (no history), the overflowing
    gradient norm was called transient, and the run ended "finished" ~1e10x above its start
    (final loss 1.8e12 from 971). Public reports of the same: "How to know correct learning rate
    for GradientDescentOptimizer" (https://stackoverflow.com/questions/48335501: x in 5..40, lr
    0.01, the weights go to 1e12, 1e22, 1e33, then nan) and "Why is learning rate causing my
    neural network's weights to skyrocket?" (https://datascience.stackexchange.com/questions/15962:
    "the loss could jump from a number in the thousands to a trillion and then to infinity").
    Now: divergence at the 4th step, restore and halve the LR while it climbs back, then trains.
    (The 4th, not the 3rd: the rules are invariant to the loss's offset and scale, and a climb from
    the very first loss has no spread to be measured in, only its own increments; issue 23.)"""
    _, model, opt, before, run = diverging_fit()
    result = run()
    found = [(e.step, e.kind, e.action) for e in result.events if e.name == "anomaly"]
    assert [k for _, k, _ in found] == ["divergence"] * 3, found
    assert [a for _, _, a in found] == ["scale_lr"] * 3, "every rung backs the LR off (a restore alone climbs again)"
    assert found[0][0] <= 4, f"judged from the first steps, with no warm-up: {found}"
    restored = [e for e in result.events if e.name == "restored"]
    assert len(restored) == 3 and all(e.detail["snapshot_step"] == 0 for e in restored)
    episodes = [e.detail["episode"] for e in result.events if e.name == "anomaly"]
    assert episodes == [1, 2, 3], "each climb back is the same anomaly again, not a fresh start"
    assert result.lr_scale == 0.125 and opt.param_groups[0]["lr"] == pytest.approx(0.055 / 8)
    assert not result.aborted and finite_params(model)
    assert full_loss(model, unscaled_regression()) <= before, (full_loss(model, unscaled_regression()), before)


def test_a_restore_after_divergence_lands_before_the_climb_with_a_snapshot_every_step():
    """The same run with snapshot.every=1: the snapshot of step 1 holds the weights whose loss
    (step 2's) was already climbing. Before, the restore landed there ("restored the snapshot of
    step 1", three times) and the snapshot of step 2 pushed step 0's out of the store (keep=2).
    Now a step whose loss is a second new high in a row (DivergenceDetector.climbing) vouches for
    no snapshot and takes none, so the restore passes over step 1's and lands on step 0's."""
    _, model, _, before, run = diverging_fit(["snapshot.every=1"])
    result = run()
    restored = [e.detail["snapshot_step"] for e in result.events if e.name == "restored"]
    assert restored == [0, 0, 0], restored
    saved = [e.step for e in result.events if e.name == "snapshot" and e.action == "saved"]
    assert saved[:2] == [0, 1] and 2 not in saved, f"step 2's loss was a second new high: no snapshot: {saved}"
    assert [e.kind for e in result.events if e.name == "anomaly"] == ["divergence"] * 3
    assert not result.aborted and finite_params(model)
    assert full_loss(model, unscaled_regression()) <= before


def test_divergence_aborts_naming_the_lr_when_min_lr_is_reached():
    """The same run with recovery.min_lr=0.02: the second backoff would take the LR (0.0275)
    below it, so the run aborts at once, the message naming divergence, the LR and the fix."""
    trainer, model, _, before, run = diverging_fit(["recovery.min_lr=0.02"])
    with pytest.raises(TrainingAborted) as info:
        run()
    message = str(info.value)
    assert "divergence" in message and "lr 0.0275" in message and "recovery.min_lr=0.02" in message, message
    assert "smaller learning rate" in message, message
    result = info.value.result
    found = [(e.step, e.kind, e.action) for e in result.events if e.name in ("anomaly", "aborted")]
    assert found == [(4, "divergence", "scale_lr"), (7, "divergence", "abort"), (7, "divergence", "abort")], found
    assert result.steps <= 8, "aborted within a bounded number of steps"
    assert finite_params(model)
    assert full_loss(model, unscaled_regression()) <= before, "left at the last good snapshot (step 0)"


def test_divergence_aborts_after_max_retries_naming_the_lr():
    """recovery.max_retries=1: two backoffs (0.055 -> 0.0275 -> 0.01375), the loss still climbs
    back, and the third divergence aborts, naming the LR it still grew at and a smaller one to try."""
    _, _, _, _, run = diverging_fit(["recovery.max_retries=1"])
    pattern = (
        r"divergence: 3 anomalous steps.*still grows geometrically at lr 0\.0138 after 2 LR backoffs.*below 0\.00688"
    )
    with pytest.raises(TrainingAborted, match=pattern) as info:
        run()
    assert info.value.result.steps <= 12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_noisy_run_never_diverges(seed):
    """A small MLP on regression data, SGD with momentum, 128 steps of batch 8 (noisy): no divergence, no spike."""
    model = mlp(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = SafeTrainer(model, opt, load_config(None, BASE), loss_fn=F.mse_loss)
    result = trainer.fit(loader(regression_data(seed=seed), batch_size=8, seed=seed), epochs=4)
    assert result.steps == 128
    assert [e for e in result.events if e.name == "anomaly"] == []


def wrong_unit_batches(bad_step=None, steps=48, seed=0):
    """``steps`` batches of 16 rows; at ``bad_step`` the targets are in the wrong unit (x10^4)."""
    x, y = regression_data(n=16 * steps, seed=seed).tensors
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    if bad_step is not None:
        bx, by = batches[bad_step]
        batches[bad_step] = (bx, by * 1e4)
    return batches


def train_on(batches, overrides=()):
    model = mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    result = SafeTrainer(model, opt, load_config(None, [*BASE, *overrides]), loss_fn=F.mse_loss).fit(batches)
    return result, full_loss(model, regression_data(n=16 * 48))


def test_an_early_batch_in_the_wrong_unit_is_a_spike_and_skipped():
    """Issue 18, class 3: one batch whose targets are x10^4 at step 6 (loss x10^8, finite). Before,
    min_history=20 left it unjudged and the run never recovered (final loss 15x the clean run's).
    Now it is >= guard.spike.hard_ratio x the run's largest healthy loss from the 4th step on."""
    clean = wrong_unit_batches()
    result, loss = train_on(wrong_unit_batches(bad_step=6))
    found = [(e.step, e.kind, e.action, e.detail.get("rule")) for e in result.events if e.name == "anomaly"]
    assert found == [(7, "spike", "skip_batch", "hard_ratio")], found
    _, clean_loss = train_on(clean[:6] + clean[7:])
    assert abs(loss - clean_loss) <= 0.1 * clean_loss, (loss, clean_loss)


def test_hard_ratio_null_leaves_early_spikes_to_the_zscore():
    result, _ = train_on(wrong_unit_batches(bad_step=6), ["guard.spike.hard_ratio=null", "guard.end_margin=null"])
    assert not [e for e in result.events if e.kind == "spike"], "off: min_history=20 is not reached at step 7"


def test_divergence_state_round_trips_through_a_snapshot(tmp_path):
    """The detector's window and open episode go into every snapshot (Guard.state_dict) and come
    back on resume: a climb back after the resume is still the same episode."""
    data = unscaled_regression()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=5.5 / 10.0**2)
    cfg = load_config(None, [*BASE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=1"])
    guard = Guard(model, opt, cfg, loss_fn=F.mse_loss)
    batches = list(DataLoader(data, batch_size=32))
    for batch in batches[:5]:
        guard.step(batch)
    state = guard.divergence.state_dict()
    assert state["episode"] >= 1 and state["reference"] is not None, state
    snap = json.loads(json.dumps(guard.state_dict()))  # what a snapshot holds, JSON-ready
    guard.close()
    fresh = Guard(torch.nn.Linear(8, 1), torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=F.mse_loss)
    fresh.load_state_dict(snap)
    assert fresh.divergence.state_dict() == state
    assert fresh.spike.state_dict() == guard.spike.state_dict()
    fresh.close()
    assert math.isfinite(state["losses"][-1])
