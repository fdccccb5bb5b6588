"""The generator of healthy runs (issue 23): small MLPs, three losses, offsets and scales, three
optimizers, schedules, accumulation, noisier batches; ``fit`` runs one, ``interventions`` lists
what the guard did to it (nothing, for a healthy run).

``test_healthy_runs.py`` and ``test_causes_property.py`` draw from it, and so does
``benchmarks/healthy_interventions.py``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, TrainingAborted, load_config

BASE = ["log.progress=false", "detect.replay.time_limit_s=10"]


ROWS, D = 32, 8


def data(task: str, n: int, noisy_every: int, seed: int) -> TensorDataset:
    """Regression or 4-class data; every ``noisy_every``-th batch has 3x the label noise (0: none)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    w = torch.randn(D, 1, generator=g)
    noise = torch.full((n, 1), 0.3)
    if noisy_every:
        for b in range(0, n // ROWS, noisy_every):
            noise[b * ROWS : (b + 1) * ROWS] *= 3.0
    y = x @ w + noise * torch.randn(n, 1, generator=g)
    if task == "ce":
        return TensorDataset(x, torch.bucketize(y[:, 0], torch.tensor([-1.0, 0.0, 1.0])))
    return TensorDataset(x, y)


def model_of(act: str, norm: str, out: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = {"tanh": torch.nn.Tanh, "relu": torch.nn.ReLU, "gelu": torch.nn.GELU}[act]
    normed = torch.nn.LayerNorm(32) if norm == "layer" else torch.nn.BatchNorm1d(32)
    return torch.nn.Sequential(torch.nn.Linear(D, 32), normed, layer(), torch.nn.Linear(32, out))


def loss_of(task: str, offset: float, scale: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if task == "mse":
            base = F.mse_loss(out, y)
        elif task == "ce":
            base = F.cross_entropy(out, y)
        else:  # a Gaussian NLL with learned variance: negative once the variance is small
            base = F.gaussian_nll_loss(out[:, :1], y, F.softplus(out[:, 1:]) + 1e-3)
        return scale * base + offset

    return loss_fn


def fit(
    task: str = "mse",
    act: str = "tanh",
    norm: str = "layer",
    optimizer: str = "adam",
    offset: float = 0.0,
    scale: float = 1.0,
    schedule: str = "none",
    accumulate: int = 1,
    noisy_every: int = 0,
    steps: int = 80,
    seed: int = 0,
    overrides: Tuple[str, ...] = (),
) -> Tuple[Any, List[float]]:
    """One run; returns (its FitResult, its trained losses)."""
    model = model_of(act, norm, {"mse": 1, "ce": 4, "nll": 2}[task], seed)
    params = model.parameters()
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    else:
        opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW)(params, lr=0.01)
    total = steps // accumulate
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
    elif schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=opt.param_groups[0]["lr"], total_steps=total + 1)
    cfg = load_config(None, [*BASE, f"guard.accumulate_steps={accumulate}", *overrides])
    base = loss_of(task, offset, scale)
    losses: List[float] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = base(out, y)
        if torch.is_grad_enabled():  # a trained loss (the start measurement runs without gradients)
            losses.append(loss.item())
        return loss

    loader = DataLoader(data(task, ROWS * steps, noisy_every, seed), batch_size=ROWS, shuffle=False)
    try:
        return SafeTrainer(model, opt, cfg, loss_fn=loss_fn, scheduler=sched).fit(loader), losses
    except TrainingAborted as e:
        return e.result, losses


def interventions(result: Any) -> List[str]:
    """The anomaly, restore and abort events of ``result``, one line each."""
    picked = [e for e in result.events if e.name in ("anomaly", "restored", "aborted")]
    return [f"step {e.step}: {e.name} {e.kind} {e.action}: {e.message[:200]}" for e in picked]
