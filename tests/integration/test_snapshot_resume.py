"""Stop and resume from the latest safetensors snapshot: the same final weights, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safetrain.snapshot import SafetensorsStore, TrainState, load_snapshot

STEPS, EVERY = 30, 4  # 7 batches per epoch: snapshots at steps 4, 8, 12... fall anywhere in an epoch


def _build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters()},
            {"params": list(model[1].parameters()) + list(model[4].parameters()), "lr": 5e-3},
        ],
        lr=1e-2,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2, 1e-2], total_steps=STEPS)
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(60, 6, generator=g), torch.randn(60, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, drop_last=True)  # 7 batches
    return TrainState(model, opt, sched), loader


def _run(state: TrainState, loader: DataLoader, store=None, stop_at=None, start=None) -> None:
    """A hand-written loop: snapshots every EVERY steps with counters and the epoch's RNG state."""
    step, epoch, skip, epoch_rng = 0, 0, 0, None
    if start is not None:
        step, epoch, skip = start.step, start.epoch, start.batch
        epoch_rng = start.extra_tensors["epoch_rng"]
    while step < STEPS:
        resumed_rng = None
        if epoch_rng is None:
            epoch_rng = torch.get_rng_state()
        else:  # resuming mid-epoch: replay the epoch's shuffle, then continue the snapshot's stream
            resumed_rng = torch.get_rng_state()
            torch.set_rng_state(epoch_rng)
        batches = iter(loader)
        for _ in range(skip):
            next(batches)
        if resumed_rng is not None:
            torch.set_rng_state(resumed_rng)
        for batch, (x, y) in enumerate(batches, start=skip):
            loss = nn.functional.mse_loss(state.model(x), y)
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            state.scheduler.step()
            step += 1
            if store is not None and step % EVERY == 0:
                store.save(
                    state, {"step": step, "epoch": epoch, "batch": batch + 1}, extra_tensors={"epoch_rng": epoch_rng}
                )
            if step == stop_at or step == STEPS:
                return
        epoch, skip, epoch_rng = epoch + 1, 0, None


# stop at step -> the snapshot resumed from: (step, epoch, batches of that epoch already done)
RESUMES = [(10, (8, 1, 1)), (15, (12, 1, 5)), (29, (28, 3, 7))]


@pytest.mark.parametrize("stop_at,expected", RESUMES, ids=["epoch-start", "mid-epoch", "epoch-end"])
def test_resume_matches_an_uninterrupted_run(stop_at, expected, tmp_path):
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        state, loader = _build(seed=0)
        _run(state, loader)
        reference = {k: v.clone() for k, v in state.model.state_dict().items()}

        state, loader = _build(seed=0)
        with SafetensorsStore(tmp_path, keep=2) as store:
            _run(state, loader, store=store, stop_at=stop_at)
        # "The process dies": build everything afresh, differently seeded, and resume.
        state, loader = _build(seed=99)
        info = load_snapshot(tmp_path, state)
        assert (info.step, info.epoch, info.batch) == expected, f"stop at {stop_at}: the latest snapshot is used"
        _run(state, loader, start=info)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, reference[k]), f"stop at {stop_at}: {k} differs from the uninterrupted run"
