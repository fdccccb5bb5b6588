"""Mixed precision: float16 with a GradScaler, and bfloat16, chosen with ``amp.dtype``.

With ``amp.dtype: float16`` the guard runs the forward pass under ``torch.autocast`` and makes a
``torch.amp.GradScaler`` (or uses the one you pass as ``scaler=``): gradients are unscaled
before the checks and clipping, and an overflow step the scaler skips is journaled as a normal
``scaler`` event, not a failure. ``amp.dtype: bfloat16`` has float32's exponent range and needs
no scaler. The same model is trained four ways on CPU autocast (CUDA when available); batch 20
of each epoch has its inputs multiplied by 1e4, which float32 and bfloat16 see as a loss spike and
float16 as gradient overflows (the scaler backs off) and finally as an Inf activation.

Run: python examples/mixed_precision.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class OverflowOnce:
    """Yields the loader's batches; batch ``at`` of each epoch has its inputs multiplied by 1e4."""

    def __init__(self, loader: DataLoader, at: int) -> None:
        self.loader, self.at = loader, at

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for i, (x, y) in enumerate(self.loader):
            x, y = x.to(DEVICE), y.to(DEVICE)
            yield (x * 1e4 if i == self.at else x), y


def train(config: Optional[str], scaler: Any = None) -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    y = (x[:, :8].sum(1) > 0).long() + (x[:, 8:16].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 3)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = load_config(CONFIGS / config if config else None, ["log.progress=false"])
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=F.cross_entropy, scaler=scaler)
    result = trainer.fit(OverflowOnce(loader, at=20), epochs=3)

    with torch.no_grad():
        accuracy = (model(x.to(DEVICE)).argmax(1) == y.to(DEVICE)).float().mean().item()
    name = cfg.amp.dtype or "float32"
    print(
        f"{name:>9}{' (own GradScaler)' if scaler is not None else ''}: {result.steps} steps, "
        f"{result.healthy_steps} healthy, {result.scaler_skips} fp16 overflow skips, {result.skipped_batches} "
        f"skipped in all, final loss {result.final_loss:.3f}, accuracy {accuracy:.1%}"
    )
    for event in result.events:
        if event.name == "anomaly":
            print(f"    step {event.step}: {event.message}")


def main() -> None:
    print(f"device: {DEVICE}")
    train(None)  # float32, for reference
    train("bf16.yaml")  # amp.dtype: bfloat16, no scaler
    train("fp16.yaml")  # amp.dtype: float16, the guard makes the GradScaler
    # Or bring your own scaler (its settings are yours; the guard only reads and steps it):
    train("fp16.yaml", scaler=torch.amp.GradScaler(DEVICE, init_scale=2.0**10, growth_interval=50))


if __name__ == "__main__":
    main()
