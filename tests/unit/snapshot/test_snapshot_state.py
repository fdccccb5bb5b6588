"""Schedulers, compatibility checks and what TrainState refuses to capture."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler as L

from safetrain.errors import SnapshotError
from safetrain.snapshot import MemoryStore, SafetensorsStore, TrainState, load_snapshot

SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: L.LambdaLR(o, lambda e: 0.9**e),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=20),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=3), L.CosineAnnealingLR(o, T_max=10)], milestones=[3]
    ),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1, factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.StepLR(o, 2), L.ExponentialLR(o, 0.9)]),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3),
}


def _state(sched_name=None, model=None, opt_cls=torch.optim.SGD):
    torch.manual_seed(0)
    model = model or nn.Linear(4, 2)
    opt = (
        opt_cls(model.parameters(), lr=0.1, momentum=0.9) if opt_cls is torch.optim.SGD else opt_cls(model.parameters())
    )
    sched = SCHEDULERS[sched_name](opt) if sched_name else None
    return TrainState(model, opt, sched)


def _step(state: TrainState, i: int) -> None:
    loss = state.model(torch.randn(8, 4)).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    if isinstance(state.scheduler, L.ReduceLROnPlateau):
        state.scheduler.step(1.0 + (i % 3 == 0))  # plateaus: the LR drops
    else:
        state.scheduler.step()


@pytest.mark.parametrize("store_kind", ["memory", "safetensors"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_continues_exactly(name, store_kind, tmp_path):
    state = _state(name)
    for i in range(5):
        _step(state, i)
    store = MemoryStore(keep=1) if store_kind == "memory" else SafetensorsStore(tmp_path, keep=1)
    store.save(state, {"step": 5})
    expected = []
    for i in range(5, 12):
        _step(state, i)
        expected.append([g["lr"] for g in state.optimizer.param_groups])
    store.restore(state)
    got = []
    for i in range(5, 12):
        _step(state, i)
        got.append([g["lr"] for g in state.optimizer.param_groups])
    assert got == expected, f"{name}/{store_kind}: LRs after restore follow the same schedule"
    store.close()


class _Schedule:
    """A callable object whose state holds a function: its state_dict cannot be stored without pickle."""

    def __init__(self) -> None:
        self.fn = lambda e: 0.5

    def __call__(self, epoch: int) -> float:
        return self.fn(epoch)


def test_unrepresentable_scheduler_state_is_refused():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model, opt, L.LambdaLR(opt, _Schedule()))
    with pytest.raises(SnapshotError, match=r"sched/lr_lambdas/0/fn.*without pickle"):
        MemoryStore().save(state, {"step": 0})


def test_non_tensor_model_state_is_refused():
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return {"note": "x"}

        def set_extra_state(self, state):
            pass

    model = WithExtra(4, 2)
    with pytest.raises(SnapshotError, match="_extra_state.*not a tensor"):
        MemoryStore().save(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), {"step": 0})


# -- a snapshot that does not fit the live state ------------------------------------------------


def _saved(tmp_path, state: TrainState) -> str:
    with SafetensorsStore(tmp_path, keep=1) as store:
        return store.save(state, {"step": 1}).path


MISMATCHES = [
    ("another model", lambda: _state(model=nn.Linear(4, 3)), "does not match the model|is \\[2, 4\\]"),
    ("renamed layers", lambda: _state(model=nn.Sequential(nn.Linear(4, 2))), "missing '0.bias'"),
    ("another dtype", lambda: _state(model=nn.Linear(4, 2).double()), "torch.float32 in the snapshot"),
    ("another optimizer", lambda: _state(opt_cls=torch.optim.Adam), "optimizer is torch.optim.sgd.SGD"),
    ("a scheduler appeared", lambda: _state("StepLR"), "no scheduler state"),
    ("no RNG state wanted", None, "no RNG state"),
]


@pytest.mark.parametrize("what,make,message", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_mismatch_is_refused_before_anything_changes(what, make, message, tmp_path):
    src = _state()
    if make is None:  # saved without RNG, loaded by a state that wants it
        src.rng = False
        path = _saved(tmp_path, src)
        live = _state()
    else:
        path = _saved(tmp_path, src)
        live = make()
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    with pytest.raises(SnapshotError, match=message) as err:
        load_snapshot(path, live)
    assert path in str(err.value), f"{what}: the error names the file"
    for k, v in live.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{what}: the live model is untouched"


def test_scaler_enabled_mismatch(tmp_path):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = _saved(tmp_path, TrainState(model, opt, scaler=torch.amp.GradScaler("cpu", enabled=True)))
    with pytest.raises(SnapshotError, match="GradScaler enabled=True in the snapshot"):
        load_snapshot(path, TrainState(model, opt, scaler=torch.amp.GradScaler("cpu", enabled=False)))


def test_optimizer_group_layout_mismatch(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    one = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    two = TrainState(
        model, torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    )
    with pytest.raises(SnapshotError, match=r"param groups of sizes \[4\] in the snapshot, \[2, 2\]"):
        load_snapshot(_saved(tmp_path, one), two)


@pytest.mark.parametrize("store_kind", ["memory", "safetensors"])
def test_tensor_hyperparameters_roundtrip(store_kind, tmp_path):
    """Adam with a tensor lr: the group value is stored as a tensor and copied back in place."""
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    state = TrainState(model, opt)
    _step_plain(state)
    store = MemoryStore(keep=1) if store_kind == "memory" else SafetensorsStore(tmp_path, keep=1)
    store.save(state, {"step": 1})
    lr = opt.param_groups[0]["lr"]
    with torch.no_grad():
        lr.fill_(0.5)
    store.restore(state)
    restored = opt.param_groups[0]["lr"]
    assert isinstance(restored, torch.Tensor) and torch.equal(restored, torch.tensor(0.01)), store_kind
    store.close()


def _step_plain(state: TrainState) -> None:
    state.model(torch.randn(8, 4)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
