"""Closure optimizers: ``torch.optim.LBFGS`` (strong Wolfe line search) under ``fit`` and ``Guard.step``.

LBFGS evaluates the loss many times a step, in its iterations and its line search; a NaN in any
of them gives NaN parameters or poisons its curvature history. Reported again and again:
pytorch/pytorch#5953 ("LBFGS always give nan results": "when a NaN is detected, reset the
optimizer (no memory, and starting point = best visited point before nan)"), the forum thread it
cites (discuss.pytorch.org/t/nan-values-obtained-in-loss-data-0/1336), HavenFeng/
photometric_optimization#12 ("I tried torch.optim.lbfgs ... nan always appears in training"),
mjacar/pytorch-trpo#3 ("LBFGS optimization causes the value function model parameters to go to
NAN"). Before this change ``fit`` crashed: ``LBFGS.step() missing 1 required positional argument:
'closure'``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safetrain import Guard, SafeTrainer, TrainingAborted, load_config
from safetrain.optimizers import needs_closure

STEPS = 6


def _model() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5, line_search_fn="strong_wolfe")
    return model, opt


def _data() -> tuple:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, generator=g)
    return x, 2 * x[:, :1] + x[:, 1:].sin()


def _plain(x: torch.Tensor, y: torch.Tensor, loss_fn=F.mse_loss, steps: int = STEPS) -> tuple:
    model, opt = _model()
    for _ in range(steps):

        def closure():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    return model, opt


def _cfg(tmp_path, *more: str):
    return load_config(None, ["log.progress=false", f"log.dir={tmp_path}", *more])


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_lbfgs_is_found_by_its_signature():
    model, opt = _model()
    assert needs_closure(opt)
    assert not needs_closure(torch.optim.SGD(model.parameters(), lr=0.1))  # closure optional: stepped without


def test_healthy_full_batch_lbfgs_fit_is_bitwise_the_plain_loop(tmp_path):
    """Fails before: ``LBFGS.step() missing 1 required positional argument: 'closure'``."""
    x, y = _data()
    ref, ref_opt = _plain(x, y)
    model, opt = _model()
    result = SafeTrainer(model, opt, _cfg(tmp_path), loss_fn=F.mse_loss).fit([(x, y)] * STEPS)
    assert result.healthy_steps == STEPS and result.optimizer_steps == STEPS
    assert _same_params(model, ref)
    assert opt.state_dict()["state"][0]["n_iter"] == ref_opt.state_dict()["state"][0]["n_iter"]


def test_nan_points_are_dropped_and_lbfgs_fits_the_rest_bitwise(tmp_path):
    """A full batch with NaN points: the rows are dropped (sanitize.inputs: drop_rows) and every
    evaluation of the step, the line search's too, runs on the cleaned batch."""
    x, y = _data()
    bad = x.clone()
    bad[[3, 17]] = math.nan
    keep = [i for i in range(len(x)) if i not in (3, 17)]
    ref, _ = _plain(x[keep], y[keep])
    model, opt = _model()
    result = SafeTrainer(model, opt, _cfg(tmp_path), loss_fn=F.mse_loss).fit([(bad, y)] * STEPS)
    assert result.dropped_rows == 2 * STEPS and result.optimizer_steps == STEPS
    assert _same_params(model, ref)


class _NaNAt:
    """A loss that is NaN at chosen evaluations (counted over the run): a line-search trial point
    where the objective breaks (a log of a negative, a division by zero)."""

    def __init__(self, at: set) -> None:
        self.at, self.count = at, 0

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.count += 1
        loss = F.mse_loss(out, target)
        return loss * math.nan if self.count in self.at else loss


def test_a_nan_in_the_line_search_is_caught_and_restored(tmp_path):
    """Evaluation 9 is a trial inside step 2's iterations (the guard's judged evaluation, then 5
    more a step here): guarded, the step is not applied, a snapshot comes back (parameters AND
    LBFGS's history) and the run trains on from it exactly as a clean run from there."""
    x, y = _data()
    model, opt = _model()
    cfg = _cfg(tmp_path, "snapshot.every=1")
    with Guard(model, opt, cfg, loss_fn=_NaNAt({9})) as guard:
        results = [guard.step((x, y)) for _ in range(STEPS)]
    restored = [r for r in results if r.restored]
    assert len(restored) == 1 and not restored[0].trained and results.index(restored[0]) == 1
    found = next(e for e in restored[0].events if e.name == "anomaly")
    assert found.kind == "weights" and "line-search" in found.message and found.detail["evaluation"] > 1
    # From the snapshot on, the run is the plain loop's from there: the same parameters, bitwise
    # (LBFGS's history came back with the snapshot, none of the broken step's is left).
    back = next(e for e in restored[0].events if e.name == "restored").detail["snapshot_step"]
    ref, _ = _plain(x, y, steps=back + STEPS - 2)
    assert _same_params(model, ref)


class _Wall:
    """An objective undefined beyond a wall in parameter space (a square root of a negative, a
    log of zero): NaN wherever the head's weights pass ``limit``, which LBFGS's line search tries."""

    def __init__(self, model: nn.Module, limit: float = 1.0) -> None:
        self.model, self.limit = model, limit

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, target)
        over = self.model[2].weight.detach().abs().max() > self.limit
        return torch.where(over, torch.full_like(loss, math.nan), loss)


def test_a_nan_wall_in_the_line_search_crashes_plain_lbfgs_and_aborts_guarded_at_a_good_state(tmp_path):
    """Plain LBFGS with strong Wolfe meets NaN trial points and crashes inside ``_strong_wolfe``
    (``IndexError: list index out of range``, torch 2.13); guarded, every step that meets the wall
    is caught, restored and backed off, and the run ends with ``TrainingAborted`` naming the cause,
    the model at its last good snapshot (finite, where the run started or better)."""
    x, y = _data()
    model, opt = _model()
    wall = _Wall(model)
    with pytest.raises(IndexError):
        for _ in range(STEPS):

            def closure():
                opt.zero_grad()
                loss = wall(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    model, opt = _model()
    start = F.mse_loss(model(x), y).item()
    with pytest.raises(TrainingAborted, match="weights"):
        SafeTrainer(model, opt, _cfg(tmp_path), loss_fn=_Wall(model)).fit([(x, y)] * 12)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert F.mse_loss(model(x), y).item() <= start


def test_the_restore_puts_lbfgs_history_back_exactly(tmp_path):
    """Right after the restore, the parameters and LBFGS's whole state (direction, step, curvature
    pairs, counters) are the snapshot's, bitwise: the poisoned history is gone."""
    x, y = _data()
    model, opt = _model()
    cfg = _cfg(tmp_path, "snapshot.every=1")
    with Guard(model, opt, cfg, loss_fn=_NaNAt({9})) as guard:
        for _ in range(3):
            result = guard.step((x, y))
            if result.restored:
                break
    step = next(e for e in result.events if e.name == "restored").detail["snapshot_step"]
    ref_model, ref_opt = _plain(x, y, steps=step)
    assert _same_params(model, ref_model)
    mine, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert mine.keys() == ref.keys()
    for key, value in ref.get(0, {}).items():
        got = mine[0][key]
        if torch.is_tensor(value):
            assert torch.equal(got, value), key
        elif isinstance(value, list):
            assert len(got) == len(value) and all(torch.equal(a, b) for a, b in zip(got, value)), key
        else:
            assert got == value, key


def test_a_closure_optimizer_with_a_grad_scaler_is_refused(tmp_path):
    model, opt = _model()
    with pytest.raises(ValueError, match="needs a closure"):
        Guard(model, opt, _cfg(tmp_path), loss_fn=F.mse_loss, scaler=torch.amp.GradScaler("cpu"))
