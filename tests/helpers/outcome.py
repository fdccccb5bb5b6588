"""Issue 18's outcome promise as a function: ``run`` trains the regression ``mlp`` with a fault
schedule injected and reports how it ended, its clean loss before and after, and its journal.

``tests/contract/test_outcome_promise.py`` draws the schedules; ``test_fit_loss_invariance.py`` runs
some again with the loss shifted or scaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from safetrain import SafeTrainer, TrainingAborted, load_config
from safetrain.testing import GradFault, LRFault, OutputFault, PoisonRows, WeightFault
from tests.helpers.models import finite_params, mlp, regression_data

ROWS = 16  # rows per batch


FOREVER = 2000  # "from step k on": k..k+2000 (replays count as calls); the injectors make a set of it


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` at optimizer step ``step`` (1-based), or from it on when ``persistent``.

    ``value`` is NaN, Inf or a finite factor (output, grad, lr) or value (weight); ``where`` picks
    the layer (``0`` or ``2``) or parameter (an index into ``model.parameters()``)."""

    kind: str
    step: int
    persistent: bool
    value: float
    where: int

    def __str__(self) -> str:
        when = f"from step {self.step} on" if self.persistent else f"at step {self.step}"
        return f"{self.kind}({self.value:g}, where={self.where}) {when}"


class WrongUnit(Dataset):
    """A dataset whose rows in ``indices`` have their targets multiplied by ``factor`` (a unit mix-up)."""

    def __init__(self, base: Dataset, indices: set, factor: float = 1e4) -> None:
        self.base, self.indices, self.factor = base, indices, factor

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return (x, y * self.factor) if i in self.indices else (x, y)


def rows_of(fault: Fault, steps: int) -> List[int]:
    """Dataset rows the fault spoils: one row (``where``) of its step's batch, or of every batch from it on."""
    last = steps if fault.persistent else fault.step
    return [(s - 1) * ROWS + fault.where for s in range(fault.step, last + 1)]


def full_loss(model: torch.nn.Module, data: TensorDataset) -> float:
    """The MSE of ``model`` over ``data`` in eval mode."""
    x, y = data.tensors
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    model.train(was)
    return loss


def run(
    optimizer: str, steps: int, schedule: List[Fault], loss_fn: Callable[..., torch.Tensor] = F.mse_loss
) -> Tuple[str, float, float, bool, List[str]]:
    """Train on ``loss_fn`` with the schedule injected; returns (how it ended, the clean MSE before,
    after, finite parameters, the journal as lines)."""
    clean = regression_data(n=ROWS * steps)
    model = mlp(seed=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(params, lr=0.01)
    before = full_loss(model, clean)  # before the injectors: a forward is a call an OutputFault counts
    data: Dataset = clean
    hooks: List[Any] = []
    for f in schedule:
        calls = range(f.step, f.step + FOREVER) if f.persistent else [f.step]
        if f.kind in ("inputs", "targets"):
            data = PoisonRows(data, rows_of(f, steps), where=f.kind, value=f.value)
        elif f.kind == "wrong_unit":  # the whole batch's targets, as a unit mix-up would
            data = WrongUnit(data, {r - f.where + i for r in rows_of(f, steps) for i in range(ROWS)}, f.value)
        elif f.kind == "output":
            hooks.append(OutputFault(model[0] if f.where % 2 == 0 else model[2], calls=calls, value=f.value))
        elif f.kind == "grad":
            hooks.append(GradFault(params[f.where], calls=calls, value=f.value))
        elif f.kind == "weight":
            p = params[f.where]
            hooks.append(WeightFault(opt, p, (0,) * p.dim(), steps=calls, value=f.value))
        else:
            hooks.append(LRFault(opt, steps=calls, factor=f.value))
    cfg = load_config(None, ["log.progress=false", "detect.replay.time_limit_s=10"])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=loss_fn)
    try:
        result = trainer.fit(DataLoader(data, batch_size=ROWS, shuffle=False))
        ended = "finished"
    except TrainingAborted as e:
        result, ended = e.result, f"aborted: {str(e).splitlines()[0][:300]}"
    finally:
        for h in hooks:
            h.remove()
    journal = [
        f"step {e.step}: {e.name} {e.kind} {e.action}: {e.message[:160]}"
        for e in (result.events if result is not None else ())
        if e.name not in ("snapshot", "run_started")
    ]
    summary = (
        f"steps {result.steps}, healthy {result.healthy_steps}, skipped {result.skipped_batches}, "
        f"restores {result.restores}, lr scale {result.lr_scale}, final loss {result.final_loss}"
        if result is not None
        else "no result"
    )
    return ended, before, full_loss(model, clean), finite_params(model), [*journal, summary]
