"""Lazy modules (issue 33): ``nn.LazyLinear`` / ``nn.LazyConv2d``, parameters made by the first forward.

``torch.optim`` takes a lazy model's ``UninitializedParameter``s (pytorch/pytorch#44538 tests every
optimizer on them), so a model and its optimizer can both be built before any data is seen; the
``LazyModuleMixin`` docs then ask for a "dry run" before the parameters are used (its example,
pytorch/pytorch#150404). A guard built on such a model crashed before training (``ValueError:
Attempted to use an uninitialized parameter``, planning its gradient check). Now the guard makes
them with its own dry run (:mod:`safetrain.guard.lazy`) before the first snapshot, and from then on
they are checked like any parameter; a run is bitwise the plain loop's.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, SafetrainError, load_config
from safetrain.testing import GradFault
from tests.helpers.models import finite_params

QUIET = ["log.progress=false", "snapshot.every=2"]


def lazy_net(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "conv":
        return torch.nn.Sequential(
            torch.nn.LazyConv2d(4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(1)
        )
    return torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.Tanh(), torch.nn.LazyLinear(1))


def _batches(kind: str, n: int = 8) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (8, 3, 5, 5) if kind == "conv" else (8, 6)
    return [(torch.randn(*shape, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _plain(kind: str, data: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.nn.Module:
    model = lazy_net(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # on the uninitialized parameters
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return model


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("driver", ["fit", "step"])
def test_a_lazy_model_trains_as_the_plain_loop(kind, driver):
    """The optimizer built on the uninitialized parameters; ``fit`` (start measurement first) or
    ``Guard.step``: no crash, no snapshot refused, weights bitwise the plain loop's (the restore
    test below shows the first snapshot holds the parameters made)."""
    data = _batches(kind)
    model = lazy_net(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = load_config(None, QUIET)
    if driver == "fit":
        events = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(data).events
    else:
        with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
            events = [e for batch in data for e in guard.step(batch).events]
    assert [e for e in events if e.name == "anomaly"] == []
    assert not [e for e in events if e.kind == "snapshot" and e.action == "refused"]
    for mine, theirs in zip(model.parameters(), _plain(kind, data).parameters()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("dry_run_first", [False, True])
def test_lazy_parameters_are_guarded_once_made(dry_run_first):
    """A NaN gradient in the first lazy layer's weight at step 3 is a ``gradient`` anomaly naming
    ``0.weight``, restored (``recovery.actions.gradient: restore``, ``snapshot.every: 100``) to
    the first snapshot, which holds the weights the dry run made. Also when the user ran the dry
    run before building the optimizer (the documented way)."""
    data = _batches("mlp")
    made = lazy_net("mlp")
    made(data[0][0])  # the weights a dry run makes (the same draws from the same seed)
    model = lazy_net("mlp")
    if dry_run_first:
        model(data[0][0])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    overrides = ["log.progress=false", "snapshot.every=100", "recovery.actions.gradient=restore"]
    events, fault = [], None
    with Guard(model, opt, load_config(None, [*overrides, "detect.replay.enabled=false"]), loss_fn=F.mse_loss) as g:
        for i, batch in enumerate(data[:5]):
            result = g.step(batch)
            events += result.events
            if i == 0:
                fault = GradFault(model[0].weight, calls=[2], value=math.nan)  # step 3
            if result.restored:
                break
    fault.remove()
    tripped = [e for e in events if e.name == "anomaly"]
    assert [(e.step, e.kind) for e in tripped] == [(3, "gradient")], [(e.step, e.message) for e in tripped]
    assert "0.weight" in tripped[0].message
    restored = [e for e in events if e.name == "restored"]
    assert [e.detail["snapshot_step"] for e in restored] == [0]
    for mine, first in zip(model.parameters(), made.parameters()):
        assert torch.equal(mine, first), "the first snapshot holds the parameters the dry run made"
    assert finite_params(model)


def test_a_caller_loop_without_a_loss_function_is_told_to_dry_run():
    """The caller's loop runs the forward and gave no ``loss_fn``/``step_fn``: the guard cannot make
    the parameters before its first snapshot, and says what to do instead of a ValueError."""
    model = lazy_net("mlp")
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), load_config(None, QUIET))
    with pytest.raises(SafetrainError, match="dry run"):
        guard.begin_batch(_batches("mlp", 1)[0])
    guard.close()


def test_a_resume_before_the_parameters_exist_says_to_dry_run(tmp_path):
    """Resuming a lazy model whose parameters are not made yet: a ``SafetrainError`` saying to run
    a dry run first, not torch's RuntimeError from inside the shape check, and not a silent fresh
    start under ``resume='auto'`` (the snapshots are there)."""
    overrides = ["log.progress=false", "snapshot.store=safetensors", f"log.dir={tmp_path}"]
    model = lazy_net("mlp")
    SafeTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    ).fit(_batches("mlp", 4))
    model = lazy_net("mlp")
    trainer = SafeTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    )
    with pytest.raises(SafetrainError, match="dry run"):
        trainer.fit(_batches("mlp", 4), epochs=2, resume="auto")
    model(_batches("mlp", 1)[0][0])  # the dry run: now it resumes
    trainer = SafeTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    )
    assert trainer.fit(_batches("mlp", 4), epochs=2, resume="auto").optimizer_steps == 8
