"""A loop the caller owns (issue #19): the framework's forward, backward and ``optimizer.step()``,
the guard only told through its four verbs. Shared by the tests of caller-owned steps."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from safetrain import Guard
from tests.helpers.models import loader, mlp, regression_data

CFG = {"snapshot": {"every": 5}, "detect": {"check_weights_every": 0}}


def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The MSE of ``model`` on an (x, y) batch."""
    x, y = batch
    return F.mse_loss(model(x), y)


def caller_loop(
    guard: Guard,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: List[Any],
    sched: Any = None,
    accumulate: int = 1,
) -> List[Any]:
    """The caller's loop, as a framework runs it: the guard is only told."""
    results = []
    for i, batch in enumerate(batches):
        batch = guard.begin_batch(batch)
        loss = loss_of(model, batch)
        (loss / accumulate).backward()
        guard.record_loss(loss)
        if (i + 1) % accumulate:
            continue
        decided = guard.decide()
        opt.step()  # called whatever the guard decided: dropped gradients leave the parameters alone
        if sched is not None:
            sched.step()
        final = guard.finish_step()
        opt.zero_grad()
        results.append((decided, final))
    return results


def make(cfg: Optional[dict] = None, sched: Callable[[Any], Any] = None, **kw: Any):
    """The regression ``mlp``, SGD with momentum, its scheduler (``sched(opt)``) and a ``Guard`` on
    ``CFG`` updated with ``cfg``: (model, optimizer, scheduler, guard)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = sched(opt) if sched is not None else None
    guard = Guard(model, opt, {**CFG, **(cfg or {})}, scheduler=scheduler, **kw)
    return model, opt, scheduler, guard


def batches(data: Any = None, n: int = 16) -> List[Any]:
    """The first ``n`` batches of ``data`` (the regression set), in order."""
    return list(loader(data if data is not None else regression_data(), shuffle=False))[:n]
