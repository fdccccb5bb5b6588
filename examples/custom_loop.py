"""Guard in a hand-written loop: the same protection as SafeTrainer.fit, your loop stays yours.

Run: python examples/custom_loop.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import Guard, TrainingAborted, load_config


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = x @ torch.randn(8, 1)
    x[100, 3] = float("nan")  # one poisoned input row
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = load_config(None, ["log.progress=false", "guard.clip_grad_norm=1.0"])

    with Guard(model, optimizer, cfg, loss_fn=F.mse_loss) as guard:
        try:
            for epoch in range(3):
                guard.begin_epoch(epoch)
                for batch in loader:
                    result = guard.step(batch)  # forward, backward, checks, ONE sync, step or recover
                    if result is not None and result.action:
                        print(f"epoch {epoch} step {result.step}: {result.action}")
                print(f"epoch {epoch}: loss {guard.last_loss:.4f}")
        except TrainingAborted as exc:
            print(f"aborted: {exc}")
    c = guard.counts
    print(f"{c.steps} steps, {c.healthy_steps} healthy, {c.dropped_rows} rows dropped, {c.restores} restores")


if __name__ == "__main__":
    main()
