"""A loader that signals its own process at a chosen batch, and the trainer the signal tests stop with it."""

from __future__ import annotations

import os
import signal

import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from tests.helpers.models import mlp


class SignalAt:
    """Yields a loader's batches and sends this process ``sig`` before batch ``at`` (0-based).

    ``fit`` pulls a fresh run's first three batches before its first step (to measure the start,
    ``Guard.measure_start``): from ``at`` = 3 on, the signal comes during step ``at + 1``."""

    def __init__(self, loader, at, sig=signal.SIGTERM, times=1):
        self.loader, self.at, self.sig, self.times = loader, at, sig, times

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == self.at:
                for _ in range(self.times):
                    os.kill(os.getpid(), self.sig)
            yield batch


def signal_trainer(tmp_path, *overrides):
    """(model, trainer): the regression ``mlp`` under SGD, a safetensors snapshot every 100 steps, the
    journal in ``tmp_path``."""
    model = mlp()
    cfg = load_config(
        None,
        ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=100", f"log.dir={tmp_path}", *overrides],
    )
    return model, SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss)
