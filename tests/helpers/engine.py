"""The engine's fault-injection scenarios: ``fit`` the regression ``mlp`` under SGD with momentum,
a config on top of ``BASE``, on a device (the loader stays on the CPU and the guard moves each batch)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from tests.helpers.models import loader, mlp, regression_data

BASE = ["log.progress=false", "snapshot.every=4", "guard.spike.min_history=8"]


def fit(
    overrides=(), model=None, dataset=None, epochs=2, seed=0, setup=None, scheduler=None, lr=0.02, device="cpu", **kw
):
    """``SafeTrainer.fit`` of ``model`` (``mlp(seed=seed)``) on ``device``: (its result, the model, the optimizer).
    ``setup(model, opt)`` runs first (to plant a fault); ``kw`` goes to ``SafeTrainer``."""
    model = (model or mlp(seed=seed)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if setup is not None:
        setup(model, opt)
    cfg = load_config(None, [*BASE, *overrides])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=scheduler(opt) if scheduler else None, **kw)
    result = trainer.fit(loader(dataset or regression_data(), seed=seed), epochs=epochs)
    return result, model, opt


def full_loss(model, dataset=None):
    """The MSE of ``model`` over the whole regression set."""
    x, y = (dataset or regression_data()).tensors
    device = next(model.parameters()).device
    with torch.no_grad():
        return F.mse_loss(model(x.to(device)), y.to(device)).item()


def anomalies(result, kind=None):
    """(kind, action) of each anomaly event of ``result`` (of ``kind`` only, when given)."""
    return [(e.kind, e.action) for e in result.events if e.name == "anomaly" and (kind is None or e.kind == kind)]
