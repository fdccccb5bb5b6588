"""LBFGS under SafeTrainer: a full-batch fit whose objective breaks at some trial points.

``torch.optim.LBFGS`` evaluates the loss many times a step (its iterations and its strong-Wolfe
line search) through a closure. ``fit`` hands it one: the closure re-runs the guarded forward and
backward on the same cleaned batch, and a NaN in any evaluation (a trial point where the
objective is undefined) is caught: the step is not applied, the last good snapshot comes back
with LBFGS's history, and the fit goes on (pytorch/pytorch#5953: "when a NaN is detected, reset
... starting point = best visited point before nan"). Data with NaN points is cleaned first as
for any step (``sanitize.inputs: drop_rows``), and every evaluation of the step sees the cleaned batch.

Run: python examples/lbfgs.py
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from safetrain import SafeTrainer, load_config


class FlakyObjective:
    """The mean squared error, NaN at two evaluations of the run (a trial point the line search
    tries where the objective is undefined: a log of zero, a root of a negative)."""

    def __init__(self, nan_at: set) -> None:
        self.nan_at, self.calls = nan_at, 0

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = F.mse_loss(out, target)
        return loss * math.nan if self.calls in self.nan_at else loss


def main() -> None:
    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 200).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=6, line_search_fn="strong_wolfe")
    cfg = load_config(None, ["log.progress=false", "snapshot.every=1"])
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=FlakyObjective(nan_at={5, 30}))
    result = trainer.fit([(x, y)] * 10)  # full batch: one LBFGS step per "batch"
    for event in result.events:
        if event.name in ("anomaly", "restored"):  # what was caught, and what came back
            print(f"step {event.step}: {event.message}")
    print(
        f"{result.steps} steps, {result.optimizer_steps} applied, {result.restores} restores, "
        f"final loss {result.final_loss:.4f}"
    )


if __name__ == "__main__":
    main()
