"""PyTorch Lightning: SafeTrainingCallback on a small CNN with BatchNorm, faults injected.

A Lightning user adds one callback; the LightningModule, the optimizer, the LR schedule and the
Trainer's loop stay as they are. Three faults are injected into a run on synthetic images:

* a NaN pixel in one training image (each epoch its row is dropped, the rest of the batch trains;
  BatchNorm's running statistics never see the NaN);
* the conv layer emitting NaN at one forward (replayed from the same state, found transient,
  the step retried through ``training_step``);
* Inf gradients on the classifier's weights at two backward passes in a row (the bad gradients
  zeroed or the step retried, as the replay finds).

Then it prints the journal's anomalies, the counters, and that the parameters are finite.

Run: python examples/lightning_callback.py [run_dir]
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain.integrations.lightning import SafeTrainingCallback
from safetrain.testing import GradFault, OutputFault


class SmallCNN(pl.LightningModule):
    """Two conv blocks with BatchNorm on 1x16x16 images, 4 classes; SGD with a per-step cosine schedule."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1),
            torch.nn.BatchNorm2d(16),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def images(n: int = 1024, seed: int = 0) -> TensorDataset:
    """Class = which quadrant of the image is brightest."""
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.randn(n, 1, 16, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    for k in range(4):
        r, c = divmod(k, 2)
        x[y == k, :, 8 * r : 8 * r + 8, 8 * c : 8 * c + 8] += 1.0
    return TensorDataset(x, y)


def main() -> None:
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="safetrain-lightning-"))
    torch.manual_seed(0)
    data = images()
    data.tensors[0][100, 0, 3, 5] = float("nan")  # a poisoned sample (batch 3 of the first epoch)
    loader = DataLoader(data, batch_size=32, shuffle=False)
    steps = 64  # 2 epochs
    model = SmallCNN(steps)
    OutputFault(model.features[0], calls=[40])  # the conv layer emits NaN at its 40th forward
    GradFault(model.classifier.weight, calls=[50, 51])  # Inf gradients at 2 backward passes in a row

    # What a user adds: one callback (a config path, dict or None for the defaults).
    safe = SafeTrainingCallback({"snapshot": {"every": 10}, "log": {"level": "ERROR"}}, run_dir=str(run_dir))
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[safe],
        accelerator="cpu",
        devices=1,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(run_dir),
    )
    trainer.fit(model, loader)

    print("what safetrain did:")
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") in ("anomaly", "restored", "run_ended"):
            print(f"  step {e['step']:>3} {e['event']:<8} {e['kind']:<9} {e['action']:<10} {e['message'][:110]}")
    c = safe.guard.counts
    print(
        f"steps {c.steps}, optimizer steps applied {c.optimizer_steps}, rows dropped {c.dropped_rows}, "
        f"retries {c.retries}, skipped {c.skipped_batches}, restores {c.restores}"
    )
    model.eval()
    with torch.no_grad():
        x, y = images(512, seed=1).tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    params_finite = all(math.isfinite(v) for p in model.parameters() for v in p.detach().flatten().tolist())
    print(f"parameters finite: {params_finite}; held-out accuracy {accuracy:.0%}")
    print(f"journal: {run_dir / 'events.jsonl'}")


if __name__ == "__main__":
    main()
