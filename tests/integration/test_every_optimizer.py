"""A property over ``torch.optim``: every optimizer class torch ships, under ``fit``.

For each class (with parameters it accepts): a healthy ``fit`` is bitwise the plain loop; a NaN
batch is skipped with the parameters and the optimizer state untouched; a snapshot restores the
model and the optimizer state bitwise; a run resumed from a safetensors snapshot ends bitwise
where the uninterrupted one does. Tiny models, four steps each; hypothesis varies the learning
rate of a few, with few examples. The list is checked against ``torch.optim`` itself, so a class
a new torch adds fails here until it is covered.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from safetrain import Guard, SafeTrainer, load_config

#: Each class with hyperparameters it accepts (small LRs: four steps stay finite).
KWARGS: Dict[str, Dict[str, Any]] = {
    "ASGD": {"lr": 0.01},
    "Adadelta": {"lr": 1.0},
    "Adafactor": {"lr": 0.01},
    "Adagrad": {"lr": 0.1},
    "Adam": {"lr": 0.01},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "Adamax": {"lr": 0.01},
    "LBFGS": {"lr": 1.0, "max_iter": 3, "line_search_fn": "strong_wolfe"},
    "Muon": {"lr": 0.02},
    "NAdam": {"lr": 0.01},
    "RAdam": {"lr": 0.01},
    "RMSprop": {"lr": 0.01},
    "Rprop": {"lr": 0.01},
    "SGD": {"lr": 0.1, "momentum": 0.9},
    "SparseAdam": {"lr": 0.01},
}
STEPS = 4


def _classes() -> List[str]:
    return sorted(
        n
        for n, c in vars(torch.optim).items()
        if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    )


def test_every_class_torch_ships_is_covered():
    assert _classes() == sorted(KWARGS), "a torch.optim class without a case here (or a case for none)"


def _setup(name: str, lr: float = math.nan) -> Tuple[nn.Module, Any, List[Any], Callable[..., torch.Tensor]]:
    """The class's model (Muon: 2-D weights only; SparseAdam: a sparse embedding), optimizer,
    batches and loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    kwargs = dict(KWARGS[name], **({} if math.isnan(lr) else {"lr": lr}))
    if name == "SparseAdam":
        model: nn.Module = nn.Embedding(10, 2, sparse=True)
        idx = torch.randint(0, 10, (8 * STEPS, 3), generator=g)
        batches = [(idx[i : i + 8], torch.randn(8, 2, generator=g)) for i in range(0, 8 * STEPS, 8)]
        return model, torch.optim.SparseAdam(model.parameters(), **kwargs), batches, _embedding_loss
    model = nn.Linear(4, 2, bias=name != "Muon")
    x = torch.randn(8 * STEPS, 4, generator=g)
    batches = [(x[i : i + 8], x[i : i + 8, :2] * 2 + 1) for i in range(0, 8 * STEPS, 8)]
    return model, getattr(torch.optim, name)(model.parameters(), **kwargs), batches, _pair_loss


def _pair_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _embedding_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    idx, y = batch
    return F.mse_loss(model(idx).sum(1), y)


def _plain(name: str, lr: float = math.nan, steps: int = STEPS) -> Tuple[nn.Module, Any]:
    model, opt, batches, loss_of = _setup(name, lr)
    for batch in batches[:steps]:

        def closure(batch: Any = batch) -> torch.Tensor:
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            return loss

        if name == "LBFGS":
            opt.step(closure)
        else:
            closure()
            opt.step()
    return model, opt


def _state(model: nn.Module, opt: Any) -> List[Any]:
    out: List[Any] = [p.detach().clone() for p in model.parameters()]
    for s in opt.state_dict()["state"].values():
        for _, v in sorted(s.items()):
            if isinstance(v, list):
                out += [t.clone() if torch.is_tensor(t) else t for t in v]
            else:
                out.append(v.clone() if torch.is_tensor(v) else v)
    return out


def _same(a: List[Any], b: List[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if torch.is_tensor(x) and torch.is_tensor(y):
            return x.shape == y.shape and bool(torch.equal(x, y))
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b))


def _cfg(tmp_path, *more: str):
    return load_config(None, ["log.progress=false", f"log.dir={tmp_path}", *more])


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_healthy_fit_is_bitwise_the_plain_loop(tmp_path, name):
    ref = _state(*_plain(name))
    model, opt, batches, loss_of = _setup(name)
    result = SafeTrainer(model, opt, _cfg(tmp_path), step_fn=loss_of).fit(batches)
    assert result.healthy_steps == STEPS, result
    assert _same(_state(model, opt), ref)


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_a_nan_batch_is_skipped_untouched_and_a_restore_is_bitwise(tmp_path, name):
    """A NaN batch leaves the parameters and the optimizer state exactly as they were; a restore
    after more training puts both back exactly as the snapshot took them."""
    model, opt, batches, loss_of = _setup(name)
    x, y = batches[2]
    poisoned = (x, y * math.nan)  # NaN targets: the loss is NaN, every gradient too
    with Guard(model, opt, _cfg(tmp_path, "sanitize.targets=off"), step_fn=loss_of) as guard:
        for batch in batches[:2]:
            assert guard.step(batch).trained
        guard.snapshot(force=True)
        at_snapshot = _state(model, opt)
        result = guard.step(poisoned)
        assert not result.trained and result.action == "skip_batch", result
        assert _same(_state(model, opt), at_snapshot), "the skipped step changed the model or the optimizer"
        assert guard.step(batches[3]).trained
        assert not _same(_state(model, opt), at_snapshot)
        guard.store.restore(guard.state)
    assert _same(_state(model, opt), at_snapshot), "the restore is not the snapshot, bitwise"


@pytest.mark.parametrize("name", sorted(KWARGS))
def test_resume_from_safetensors_is_bitwise(tmp_path, name):
    ref = _state(*_plain(name))
    model, opt, batches, loss_of = _setup(name)
    cfg = _cfg(tmp_path, "snapshot.store=safetensors", "snapshot.every=1", "snapshot.keep=8")
    SafeTrainer(model, opt, cfg, step_fn=loss_of).fit(batches)
    model, opt, batches, loss_of = _setup(name)
    snaps = sorted((tmp_path / "snapshots").glob("snapshot-*.safetensors"))
    snap = [p for p in snaps if 0 < int(p.stem.split("-")[1]) < STEPS][-1]  # mid-run: steps left to train
    SafeTrainer(model, opt, _cfg(tmp_path / "again"), step_fn=loss_of).fit(batches, resume=snap)
    assert _same(_state(model, opt), ref)


@settings(max_examples=5, deadline=None)
@given(name=st.sampled_from(["Adam", "SGD", "RMSprop", "Adafactor", "Muon"]), lr=st.floats(1e-4, 0.05))
def test_healthy_fit_is_bitwise_for_any_learning_rate(tmp_path_factory, name, lr):
    ref = _state(*_plain(name, lr))
    model, opt, batches, loss_of = _setup(name, lr)
    SafeTrainer(model, opt, _cfg(tmp_path_factory.mktemp("run")), step_fn=loss_of).fit(batches)
    assert _same(_state(model, opt), ref)
