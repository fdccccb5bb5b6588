"""Small runs whose loss does one particular thing (flat noise), shared by the tests that check it."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config


def flat_run(seed: int, batch: int, steps: int = 40, loss_fn: Callable[..., torch.Tensor] = F.mse_loss):
    """A zero-initialised linear model on pure-noise targets under SGD: a flat, noisy loss (``loss_fn``)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    data = [(torch.randn(batch, 8), torch.randn(batch, 1)) for _ in range(steps)]
    cfg = load_config(None, ["log.progress=false", "snapshot.every=10"])
    return SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=1e-3), cfg, loss_fn=loss_fn).fit(data)
