"""Quickstart: SafeTrainer.fit on a small model with a NaN row and a NaN-producing batch.

Run: python examples/quickstart.py
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, load_config


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(1024, 16)
    labels = (x[:, :4].sum(1) > 0).long() + (x[:, 4:8].sum(1) > 0).long()
    x[17, 0] = float("nan")  # a poisoned sample
    loader = DataLoader(TensorDataset(x, labels), batch_size=64, shuffle=True)

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    configs = Path(__file__).resolve().parent.parent / "configs"
    cfg = load_config(configs / "default.yaml", ["log.progress=false"])
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=F.cross_entropy)
    result = trainer.fit(loader, epochs=3)

    print(
        f"steps {result.steps}, healthy {result.healthy_steps}, rows dropped {result.dropped_rows}, "
        f"restores {result.restores}, final loss {result.final_loss:.4f}"
    )
    for event in result.events:
        if event.name == "anomaly":
            print(f"  step {event.step}: {event.message}")


if __name__ == "__main__":
    main()
