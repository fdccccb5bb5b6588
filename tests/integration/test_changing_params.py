"""Parameters that change mid-run (issue 33): progressive unfreezing, ``add_param_group``.

Fine-tuning often trains the head first, then unfreezes the body: ``requires_grad_(True)`` on
parameters the optimizer already holds, or ``optimizer.add_param_group`` with them (ULMFiT-style
gradual unfreezing). A checkpoint from before the change then no longer fits the optimizer
(``ValueError: loaded state dict contains a parameter group that doesn't match the size of
optimizer's group``, technicolor-research/dsve-loc#16; ``loaded state dict has a different number
of parameter groups``, mks0601/ExAvatar_RELEASE#5).

What holds:

- a parameter unfrozen mid-run is checked from its first gradient (before: the gradient check
  was planned once, over the parameters that trained at the start, and a NaN in an unfrozen
  one went into the weights);
- a restore to a snapshot taken before ``add_param_group`` puts the model back whole (the
  snapshot holds every parameter, frozen ones too) and the optimizer's groups the snapshot has;
  the groups added since are kept, with their hyperparameters and their optimizer state reset,
  and the ``restored`` event says so (``changed_since``); ``requires_grad`` is left as it is now
  (the unfreezing schedule is the caller's). Before: the snapshot was refused and the run aborted;
- the same for a resume from a safetensors snapshot into an optimizer with more groups.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, load_config
from safetrain.testing import GradFault
from tests.helpers.models import finite_params

QUIET = ["log.progress=false", "snapshot.every=2", "detect.replay.enabled=false"]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batches(n: int = 10) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _frozen_body(how: str) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The body frozen; the optimizer holds the head only (``add_param_group``) or every parameter."""
    model = _net()
    model[0].requires_grad_(False)
    params = model[2].parameters() if how == "add_param_group" else model.parameters()
    return model, torch.optim.Adam(params, lr=0.01)


def _unfreeze(model: torch.nn.Module, opt: torch.optim.Optimizer, how: str) -> None:
    model[0].requires_grad_(True)
    if how == "add_param_group":
        opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.001})


@pytest.mark.parametrize("how", ["add_param_group", "requires_grad"])
def test_an_unfrozen_parameter_is_checked_from_its_first_gradient(how):
    """The body is unfrozen after step 3; at step 6 its weight's gradient is NaN: a ``gradient``
    anomaly naming ``0.weight``, and the body's weights stay finite."""
    model, opt = _frozen_body(how)
    fault = None
    events = []
    with Guard(model, opt, load_config(None, QUIET), loss_fn=F.mse_loss) as guard:
        for i, batch in enumerate(_batches(8)):
            if i == 3:
                _unfreeze(model, opt, how)
                fault = GradFault(model[0].weight, calls=[3], value=math.nan)  # its 3rd backward: step 6
            events += guard.step(batch).events
    fault.remove()
    tripped = [e for e in events if e.name == "anomaly"]
    assert [(e.step, e.kind) for e in tripped] == [(6, "gradient")], [(e.step, e.kind, e.message) for e in tripped]
    assert "0.weight" in tripped[0].message
    assert finite_params(model)


def test_a_restore_to_before_add_param_group_keeps_the_new_group():
    """Snapshots at steps 2 and 4; the body's group is added after step 4; a NaN gradient at step 6
    is restored (``recovery.actions.gradient: restore``): the model is the snapshot's (body
    included), the optimizer keeps both groups, the new one's state reset and its LR kept, the
    journal says so, and the run trains on (before: no usable snapshot, the run aborted)."""
    model, opt = _frozen_body("add_param_group")
    cfg = load_config(None, [*QUIET, "recovery.actions.gradient=restore"])
    states, events, fault = {}, [], None
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        for i, batch in enumerate(_batches(10)):
            if i == 4:
                _unfreeze(model, opt, "add_param_group")
                fault = GradFault(model[0].weight, calls=[2], value=math.nan)  # step 6
            result = guard.step(batch)
            events += result.events
            if result.restored:
                restored = next(e for e in result.events if e.name == "restored")
                step = restored.detail["snapshot_step"]
                assert step in (2, 4)
                for name, value in model.state_dict().items():
                    assert torch.equal(value, states[step][name]), name
                assert [g["lr"] for g in opt.param_groups] == [0.01, 0.001]
                assert all(not opt.state.get(p) for p in model[0].parameters()), "the new group's state is reset"
                assert any("added since the snapshot" in c for c in restored.detail["changed_since"]), restored.detail
            states[guard.steps] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    fault.remove()
    assert guard.counters.restores == 1
    assert finite_params(model)
    assert guard.counters.optimizer_steps >= 7  # trained on after the restore, both groups


def test_a_resume_into_an_optimizer_with_a_group_added(tmp_path):
    """A run of the head alone writes safetensors snapshots; the next stage builds its optimizer
    with the body's group added and resumes from them: the model and the head's optimizer state are
    the snapshot's, the body's group starts fresh, and the start event says so (before: the
    snapshot was refused, 'param groups of sizes [2] in the snapshot, [2, 2] in the live state')."""
    from safetrain.snapshot import SafetensorsStore, TrainState

    overrides = ["log.progress=false", "snapshot.store=safetensors", f"log.dir={tmp_path}", "snapshot.every=2"]
    model, opt = _frozen_body("add_param_group")
    SafeTrainer(model, opt, load_config(None, overrides), loss_fn=F.mse_loss).fit(_batches(4))
    head_state = {k: v.clone() for k, v in opt.state[model[2].weight].items()}
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}

    model, opt = _frozen_body("add_param_group")
    _unfreeze(model, opt, "add_param_group")
    state = TrainState(model, opt)
    with SafetensorsStore(tmp_path / "snapshots") as store:
        assert store.restore(state).step == 4
    for name, value in weights.items():
        assert torch.equal(model.state_dict()[name], value), name
    for key, value in head_state.items():
        assert torch.equal(opt.state[model[2].weight][key], value), key
    assert not opt.state.get(model[0].weight) and [g["lr"] for g in opt.param_groups] == [0.01, 0.001]
    assert any("added since the snapshot" in c for c in state.changed), state.changed

    model, opt = _frozen_body("add_param_group")
    _unfreeze(model, opt, "add_param_group")
    result = SafeTrainer(model, opt, load_config(None, overrides), loss_fn=F.mse_loss).fit(
        _batches(4), epochs=2, resume="auto"
    )
    start = next(e for e in result.events if e.name == "run_started")
    assert any("added since the snapshot" in c for c in start.detail["changed_since"]), start.detail
    assert result.restores == 0 and result.optimizer_steps == 8 and finite_params(model)  # (4 of each stage)
