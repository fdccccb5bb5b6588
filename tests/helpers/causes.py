"""The cause scenarios (issue 32): a change of classes, a damaged normaliser, a moved mixture, one bad batch.

Each trains a small model with ``SafeTrainer.fit`` and returns (its FitResult, its trained losses);
``test_causes.py`` runs them at fixed steps, ``test_causes_property.py`` at random ones.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, TrainingAborted, load_config

# A fixed cadence: under snapshot.every: auto which steps get snapshots depends on timing, and the
# cause test needs a trained witness at a known step.
BASE = ["log.progress=false", "snapshot.every=25"]


ROWS = 32


class RunningNorm(torch.nn.Module):
    """Inputs minus a running mean kept in a buffer, read in the forward (train mode too)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x - self.mean)
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return out


def fit_recorded(model: torch.nn.Module, x, y, loss_fn, overrides=()) -> Tuple[Any, List[float]]:
    """``fit`` of ``model`` with Adam on (x, y) in batches of ``ROWS``; its result and trained losses."""
    losses: List[float] = []

    def recorded(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(out, target)
        if torch.is_grad_enabled():
            losses.append(loss.item())
        return loss

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = load_config(None, [*BASE, *overrides])
    try:
        result = SafeTrainer(model, opt, cfg, loss_fn=recorded).fit(DataLoader(TensorDataset(x, y), batch_size=ROWS))
    except TrainingAborted as e:
        result = e.result
    return result, losses


def class_change(seed: int = 0, steps: int = 220, switch: int = 150, overrides=()) -> Tuple[Any, List[float]]:
    """4 classes, then 4 new ones from batch ``switch`` on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * steps, 8, generator=g)
    old, new = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    y = (x @ old).argmax(1)
    y[switch * ROWS :] = (x[switch * ROWS :] @ new).argmax(1) + 4
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return fit_recorded(model, x, y, F.cross_entropy, overrides)


def damaged(
    seed: int = 0, steps: int = 220, at: int = 150, shift: float = 3.0, overrides=()
) -> Tuple[Any, List[float]]:
    """Regression through a running normaliser; at trained step ``at`` (0: never) a calibration pass
    on a garbage batch leaves ``shift`` in its buffer: finite, and no batch's own loss shows it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * steps, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(ROWS * steps, 1, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(RunningNorm(8), torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    calls = [0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, target)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == at:
                with torch.no_grad():
                    model[0].mean.add_(shift)
        return loss

    return fit_recorded(model, x, y, loss_fn, overrides)


def mixture_change(
    seed: int = 0, steps: int = 160, switch: int = 100, jump: float = 10.0, overrides=()
) -> Tuple[Any, List[float]]:
    """Regression whose mapping moves at batch ``switch`` so that the loss jumps about ``jump`` x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * steps, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    u = torch.randn(8, 1, generator=g)
    moved = w + u / u.norm() * ((jump - 1.0) * 0.1) ** 0.5  # the extra MSE is the shift's squared norm
    y = torch.cat([x[: switch * ROWS] @ w, x[switch * ROWS :] @ moved]) + 0.3 * torch.randn(
        ROWS * steps, 1, generator=g
    )
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return fit_recorded(model, x, y, F.mse_loss, overrides)


def bad_batch(seed: int = 0, steps: int = 160, at: int = 100, overrides=()) -> Tuple[Any, List[float]]:
    """Regression; the targets of batch ``at`` are x1000 (finite)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * steps, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(ROWS * steps, 1, generator=g)
    y[at * ROWS : (at + 1) * ROWS] *= 1000.0
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return fit_recorded(model, x, y, F.mse_loss, overrides)


def named(result: Any, *names: str) -> List[Any]:
    """The events of ``result`` with one of ``names``."""
    return [e for e in result.events if e.name in names]


def end_level(losses: List[float]) -> float:
    """Where a run ended: the lower quartile of its last 16 trained losses."""
    tail = sorted(losses[-16:])
    return tail[len(tail) // 4]
