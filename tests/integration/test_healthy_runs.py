"""Issue 23, the dual of the outcome promise: a healthy run of any shape gets no intervention.

Random healthy runs (small MLPs, tanh/ReLU/GELU with LayerNorm or BatchNorm; MSE, cross-entropy,
or a Gaussian NLL with learned variance, which goes negative; constant offsets of either sign and,
under Adam/AdamW, scales; SGD with momentum, Adam, AdamW at LRs that train; cosine or one-cycle
schedules; gradient accumulation; an ordinary noisier batch now and then) must finish with zero
anomaly events. Before, 71 of 200 such runs were interrupted: 70 aborted at their very end as
"worse than they started" (every one ending below zero) and 1 by a spike alarm. Negative
log-likelihood objectives going below zero are ordinary: "Negative loss values for
GaussianNLLLoss" (https://discuss.pytorch.org/t/negative-loss-values-for-gaussiannllloss/150823)
and "Is it normal for the NLL loss to be negative?" (PyTorch forums, the same pattern).
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import hypothesis
import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
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
    picked = [e for e in result.events if e.name in ("anomaly", "restored", "aborted")]
    return [f"step {e.step}: {e.name} {e.kind} {e.action}: {e.message[:200]}" for e in picked]


@hypothesis.settings(max_examples=14, derandomize=True, deadline=None, database=None, print_blob=False)
@hypothesis.given(
    task=st.sampled_from(("mse", "ce", "nll")),
    act=st.sampled_from(("tanh", "relu", "gelu")),
    norm=st.sampled_from(("layer", "batch")),
    optimizer=st.sampled_from(("sgd", "adam", "adamw")),
    offset=st.sampled_from((0.0, -1.0, -100.0, 100.0, 3.0)),
    scale=st.sampled_from((1.0, 0.01, 100.0)),
    schedule=st.sampled_from(("none", "cosine", "onecycle")),
    accumulate=st.sampled_from((1, 1, 2, 4)),
    noisy_every=st.sampled_from((0, 7, 10)),
    seed=st.integers(0, 3),
)
def test_a_healthy_run_of_any_shape_gets_no_intervention_and_finishes(
    task, act, norm, optimizer, offset, scale, schedule, accumulate, noisy_every, seed
):
    scale = scale if optimizer != "sgd" else 1.0  # SGD's step is not scale-invariant: a x loss is a x the LR
    result, losses = fit(task, act, norm, optimizer, offset, scale, schedule, accumulate, noisy_every, 80, seed)
    assert interventions(result) == [] and result.ended == "done", (interventions(result), losses[:3], losses[-3:])


@pytest.mark.parametrize("offset", [-1.0, -100.0, 100.0])
def test_mse_with_an_offset_finishes_with_a_noisier_batch_in_ten(offset):
    """Issue 23: ``mse - 1`` trained well and was aborted at its end ("its last trained losses
    (median -0.91) are 1.07x its first"); with one noisier batch in ten it was aborted mid-run as 7
    spikes in a row. ``loss + 100`` passed, ``loss - 100`` failed. Now all finish, untouched."""
    result, losses = fit("mse", offset=offset, noisy_every=10, steps=96)
    assert interventions(result) == [] and result.ended == "done", interventions(result)
    assert losses[-1] < losses[0] and (offset > 0 or losses[-1] < 0)


def test_a_hand_written_loss_falling_from_minus_2_to_minus_5_finishes():
    """Issue 23: a hand-written objective whose values fall from -2 to -5 was aborted at its end
    (here 0.9 x MSE - 5 under Adam)."""
    result, losses = fit("mse", offset=-5.0, scale=0.9, steps=96)
    assert result.ended == "done" and interventions(result) == [], interventions(result)
    assert -2.5 < losses[0] < -1.5 and losses[-1] < -4.5, (losses[0], losses[-1])
