"""The end-of-run check never puts back a snapshot taken after the damage (issue #32).

Damage that leaves nothing non-finite: a calibration constant kept in a buffer (an output offset, as a
running target mean or a quantization observer keeps one) is overwritten with garbage by code outside
the step, mid-run. Nothing is NaN; with the loss detectors off (as in a loop that cannot re-run a step,
or a user's config), nothing is seen until the end, which finds the run worse than it started. Before:
the check put back the newest snapshot, taken after the damage (the garbage offset still in it), and
said "a smaller learning rate". The pattern of the reports: a model "fine in training, broken after
resuming" because a buffer (BatchNorm's running statistics, an observer's range) was corrupted by one
batch and then checkpointed (https://discuss.pytorch.org/t/model-eval-gives-incorrect-loss-for-model-with-batchnorm-layers/7561).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, TrainingAborted, load_config


class Offset(torch.nn.Module):
    """The output plus a constant kept in a buffer (not a parameter: training does not undo it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def _run(store: str, tmp_path, at: int) -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 * 120, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1), Offset())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    seen = []

    def step_fn(m, batch):
        loss = F.mse_loss(m(batch[0]), batch[1])
        seen.append(loss.item())
        if torch.is_grad_enabled() and trainer.guard.counters.steps == at:  # garbage into the buffer (finite)
            with torch.no_grad():
                m[3].offset.fill_(30.0)
        return loss

    over = ["log.progress=false", "snapshot.every=10", "guard.spike.enabled=false", "guard.divergence.enabled=false"]
    if store == "disk":
        over += [f"snapshot.dir={tmp_path / 'snaps'}", "snapshot.keep=20"]
    else:
        over += ["snapshot.keep=20"]
    trainer = SafeTrainer(model, opt, load_config(None, over), step_fn=step_fn)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    with pytest.raises(TrainingAborted) as info:
        trainer.fit(data)
    return model, str(info.value), trainer


@pytest.mark.parametrize("store, at", [("memory", 58), ("memory", 59), ("disk", 59)])
def test_the_end_check_passes_over_snapshots_taken_after_the_damage(store, at, tmp_path):
    """``at``: the step counter when the garbage is written, in the step whose end takes the
    snapshot of step 60 (59: that snapshot holds the damage, its own loss still sound; 58: the loss
    has already risen by then and no snapshot is taken). Before: the snapshot of step 60 was put
    back with the garbage offset in it (59), and every message said "a smaller learning rate"."""
    model, message, trainer = _run(store, tmp_path, at)
    assert model[3].offset.item() == 0.0, f"the snapshot put back holds the damage: {message}"
    assert "worse than it started" in message and "smaller learning rate" not in message, message
    left = int(message.split("damaged by step ")[1].split(":")[0])
    assert at + 1 <= left <= at + 3, message
    if at == 59:
        assert "the snapshot of step 50 was put back, passing over those from step 60 on" in message, message
    assert [e.action for e in trainer.guard.bus.events][-1] == "aborted", "journaled as an abort"
    assert all(torch.isfinite(p).all() for p in model.parameters())
