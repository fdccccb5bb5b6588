"""Bitwise round trips of the whole training state through both stores."""

from __future__ import annotations

import copy
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

from safetrain.errors import SnapshotError
from safetrain.snapshot import MemoryStore, SafetensorsStore, SnapshotInfo, TrainState
from safetrain.snapshot import memory as snapshot_memory
from safetrain.snapshot import tensors as snapshot_tensors

OPTIMIZERS = {
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, betas=(0.8, 0.99)),
    "adamw_amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2, lr_decay=1e-3),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))


def _setup(opt_name: str, scheduler: bool, scaler: str):
    model = _model()
    groups = [
        {"params": list(model[0].parameters()) + list(model[1].parameters())},
        {"params": list(model[4].parameters()), "lr": 3e-3, "weight_decay": 0.0},
    ]
    opt = OPTIMIZERS[opt_name](groups)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    scl = (
        None
        if scaler == "none"
        else torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1, enabled=scaler == "on")
    )
    return TrainState(model, opt, sched, scl)


def _train(state: TrainState, steps: int) -> None:
    for _ in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        loss = nn.functional.mse_loss(state.model(x), y) * (1 + random.random() + np.random.rand())
        state.optimizer.zero_grad()
        if state.scaler is not None:
            state.scaler.scale(loss).backward()
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            loss.backward()
            state.optimizer.step()
        if state.scheduler is not None:
            state.scheduler.step()


def _record(state: TrainState) -> dict:
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optim": copy.deepcopy(state.optimizer.state_dict()),
        "sched": copy.deepcopy(state.scheduler.state_dict()) if state.scheduler else None,
        "scaler": state.scaler.state_dict() if state.scaler else None,
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "python_rng": random.getstate(),
    }


def assert_state_equal(state: TrainState, rec: dict, msg: str) -> None:
    """Every tensor bitwise (torch.equal), every hyperparameter and counter with ==."""
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, rec["model"][k]), f"{msg}: model {k}"
    live = state.optimizer.state_dict()
    assert live["param_groups"] == rec["optim"]["param_groups"], f"{msg}: param groups"
    assert live["state"].keys() == rec["optim"]["state"].keys(), f"{msg}: optimizer state keys"
    for i, s in rec["optim"]["state"].items():
        assert live["state"][i].keys() == s.keys(), f"{msg}: optimizer state {i} keys"
        for key, v in s.items():
            got = live["state"][i][key]
            if isinstance(v, torch.Tensor):
                assert torch.equal(got, v) and got.dtype == v.dtype, f"{msg}: optim state {i}/{key}"
            else:
                assert got == v, f"{msg}: optim state {i}/{key}"
    if rec["sched"] is not None:
        assert state.scheduler.state_dict() == rec["sched"], f"{msg}: scheduler"
    if rec["scaler"] is not None:
        assert state.scaler.state_dict() == rec["scaler"], f"{msg}: scaler"
    assert torch.equal(torch.get_rng_state(), rec["torch_rng"]), f"{msg}: torch RNG"
    np_now, np_rec = np.random.get_state(), rec["numpy_rng"]
    assert np_now[0] == np_rec[0] and (np_now[1] == np_rec[1]).all() and np_now[2:] == np_rec[2:], f"{msg}: numpy RNG"
    assert random.getstate() == rec["python_rng"], f"{msg}: python RNG"


def _store(kind: str, tmp_path):
    return MemoryStore(keep=2) if kind == "memory" else SafetensorsStore(tmp_path / "snaps", keep=2)


@pytest.mark.parametrize("store_kind", ["memory", "safetensors"])
@pytest.mark.parametrize("scaler", ["none", "on", "off"])
@pytest.mark.parametrize("scheduler", [False, True], ids=["nosched", "steplr"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_roundtrip_bitwise(opt_name, scheduler, scaler, store_kind, tmp_path):
    msg = f"{opt_name}/{'steplr' if scheduler else 'nosched'}/scaler={scaler}/{store_kind}"
    state = _setup(opt_name, scheduler, scaler)
    _train(state, 3)
    with _store(store_kind, tmp_path) as store:
        info = store.save(
            state,
            {"step": 3, "epoch": 0, "batch": 3},
            extra={"lr_scale": 0.5, "policy": {"n": (1, 2)}},
            extra_tensors={"epoch_rng": torch.get_rng_state()},
        )
        assert isinstance(info, SnapshotInfo) and info.step == 3, msg
        rec = _record(state)
        _train(state, 3)  # move everything on: weights, moments, scheduler, scaler, RNGs
        got = store.restore(state)
    assert_state_equal(state, rec, msg)
    assert (got.step, got.epoch, got.batch) == (3, 0, 3), msg
    assert got.extra == {"lr_scale": 0.5, "policy": {"n": (1, 2)}}, msg
    assert torch.equal(got.extra_tensors["epoch_rng"], rec["torch_rng"]), msg
    assert (got.path is None) == (store_kind == "memory"), msg


@pytest.mark.parametrize("store_kind", ["memory", "safetensors"])
def test_restore_before_lazy_state_existed(store_kind, tmp_path):
    """A snapshot from before Adam's first step restores into an optimizer that has state since."""
    state = _setup("adam", True, "none")
    with _store(store_kind, tmp_path) as store:
        store.save(state, {"step": 0})
        rec = _record(state)
        _train(state, 2)
        store.restore(state)
        assert_state_equal(state, rec, store_kind)
        _train(state, 1)  # and training goes on from the restored state
        assert state.optimizer.state_dict()["state"][0]["step"] == 1, "step counts from the restored 0"


def test_memory_store_reuses_buffers():
    """No allocation after a slot's first use, even as Adam's state appears after step 1."""
    state = _setup("adam", False, "none")
    store = MemoryStore(keep=2)
    ptrs = []
    for step in range(8):
        store.save(state, {"step": step})
        _train(state, 1)
        ptrs.append({n: b.data_ptr() for s in store._slots for n, b in s.buffers.items() if not n.startswith("rng/")})
    # saves 0 (no Adam state) and 1 fill the slots; Adam state appears in the save of step 1 and 2.
    assert ptrs[3] == ptrs[7], "buffers are reused once every slot holds the full state"
    assert len(store) == 2


def test_memory_store_reads_a_live_tensor_where_it_is_now():
    """The one-pass copy keeps its plan while the layout holds; a parameter given new memory of
    the same layout (``.data =``) is then copied and checked from its new memory, not the old."""
    state = _setup("adam", False, "none")
    _train(state, 1)
    weight = state.model[0].weight
    with MemoryStore(keep=2) as store:
        for step in range(4):  # both slots copied in one pass at least once: their plans are kept
            store.save(state, {"step": step})
            _train(state, 1)
        old = weight.data
        weight.data = old.clone() + 1.0  # same shape and strides, other memory
        old.fill_(float("nan"))  # what a stale read would copy
        rec = _record(state)
        assert store.save(state, {"step": 4}) is not None, "the old memory is not read"
        _train(state, 1)
        assert store.restore(state).step == 4
        assert_state_equal(state, rec, "restored from the moved weight")
        weight.data = weight.data.clone()
        _poison_at(weight, "last", float("nan"))
        assert store.save(state, {"step": 5}) is None, "a NaN in the moved weight is found"


def test_memory_store_device_model_keeps_copies_on_the_model_device():
    state = _setup("sgd_momentum", False, "none")
    store = MemoryStore(keep=1, device="model")
    store.save(state, {"step": 0})
    assert all(b.device == torch.device("cpu") for b in store._slots[0].buffers.values())
    assert store.nbytes() > 0


def test_tied_weights_are_stored_once(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with SafetensorsStore(tmp_path, keep=1) as store:
        store.save(state, {"step": 1})
        rec = model[0].weight.detach().clone()
        with torch.no_grad():
            model[0].weight.add_(1)
        store.restore(state)
    assert torch.equal(model[1].weight, rec) and model[1].weight is model[0].weight


# -- refusal of non-finite state -------------------------------------------------------------

POISON = [
    ("NaN in a weight", lambda s: s.model[0].weight.data.__setitem__((0, 0), float("nan")), "model/0.weight"),
    ("Inf in a BatchNorm buffer", lambda s: s.model[1].running_var.__setitem__(0, float("inf")), "model/1.running_var"),
    ("NaN in Adam exp_avg", lambda s: _adam_state(s, "exp_avg").__setitem__(0, float("nan")), "optim/state/2/exp_avg"),
    (
        "-Inf in Adam exp_avg_sq",
        lambda s: _adam_state(s, "exp_avg_sq").__setitem__(0, -float("inf")),
        "optim/state/2/exp_avg_sq",
    ),
]


def _adam_state(state: TrainState, key: str) -> torch.Tensor:
    p = state.optimizer.param_groups[0]["params"][2]  # BatchNorm weight: state index 2
    return state.optimizer.state[p][key].view(-1)


@pytest.mark.parametrize("store_kind", ["memory", "safetensors"])
@pytest.mark.parametrize("what,poison,name", POISON, ids=[p[0] for p in POISON])
def test_nonfinite_state_is_refused(what, poison, name, store_kind, tmp_path, caplog):
    state = _setup("adam", False, "none")
    _train(state, 1)
    with _store(store_kind, tmp_path) as store:
        store.save(state, {"step": 1})
        rec = _record(state)
        poison(state)
        with caplog.at_level(logging.WARNING, logger="safetrain"):
            assert store.save(state, {"step": 2}) is None, f"{what}: snapshot refused"
        assert name in caplog.text and "refused" in caplog.text, f"{what}: the warning names {name}: {caplog.text}"
        assert len(store) == 1 and store.latest().step == 1, f"{what}: the previous snapshot is kept"
        if store_kind == "safetensors":
            assert os.listdir(tmp_path / "snaps") == ["snapshot-0000000001.safetensors"], f"{what}: nothing left over"
        assert store.restore(state).step == 1
    assert_state_equal(state, rec, what)


def test_huge_finite_values_are_not_refused():
    """The fast probe (a sum of squares) overflows on 1e30; the exact re-check must clear it."""
    state = _setup("sgd_momentum", False, "none")
    with torch.no_grad():
        state.model[0].weight.fill_(1e30)
        state.model[0].bias.fill_(-6e4)
    assert MemoryStore(keep=1).save(state, {"step": 0}) is not None


# -- one-pass copy and check (memory store with another snapshot to fall back on) ------------


def _poison_at(t: torch.Tensor, where: str, value: float) -> None:
    flat = t.detach().view(-1)
    flat[{"first": 0, "middle": flat.numel() // 2, "last": -1}[where]] = value


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_copy_checked_finds_every_nonfinite_value(value, where, threads, monkeypatch):
    monkeypatch.setattr(snapshot_tensors, "_CHUNK_BYTES", 64)  # 16 floats: many chunks per tensor
    monkeypatch.setattr(snapshot_tensors, "_BYTES_PER_THREAD", 64)  # ...shared by every thread asked for
    torch.manual_seed(0)
    src = [torch.randn(100), torch.randn(7, 9, dtype=torch.float64), torch.randn(0), torch.randn(33)]
    _poison_at(src[1], where, value)
    _poison_at(src[3], where, value)
    dst = [torch.full_like(t, 7.0) for t in src]
    with ThreadPoolExecutor(2) as pool:
        bad = snapshot_tensors.copy_checked_(list(zip("abcd", dst, src)), pool, threads)
    assert bad == ["b", "d"], f"{value} at the {where} element, {threads} threads"
    for d, t in zip(dst, src):
        assert torch.equal(d.view(torch.uint8), t.view(torch.uint8)), "copied bitwise, poisoned or not"


def test_copy_checked_keeps_small_copies_on_the_calling_thread():
    """A pool thread's hand-off costs more than copying a small model's state: below
    ``_BYTES_PER_THREAD`` per thread the caller does all of it."""
    src = [torch.randn(1000), torch.randn(64, 64)]

    class NoPool:
        def submit(self, *args):
            raise AssertionError("a small copy was handed to the pool")

    assert snapshot_tensors.copy_checked_([(n, torch.empty_like(t), t) for n, t in zip("ab", src)], NoPool(), 4) == []


def test_copy_checked_does_not_flag_huge_finite_values():
    src = torch.full((1000,), 1e30)  # the dot of a chunk overflows to inf; the exact re-check clears it
    assert snapshot_tensors.copy_checked_([("w", torch.empty_like(src), src)]) == []


@pytest.mark.parametrize("what", ["a weight's last element", "exp_avg_sq's last element"])
def test_refused_one_pass_snapshot_keeps_the_newer_one(what, monkeypatch, caplog):
    """keep=2 with both slots full: the oldest slot is overwritten while checked; a refusal drops
    it, never makes the poisoned copy restorable, and the newer snapshot restores exactly."""
    monkeypatch.setattr(snapshot_tensors, "_CHUNK_BYTES", 64)
    state = _setup("adam", False, "none")
    _train(state, 1)
    with MemoryStore(keep=2) as store:
        store.save(state, {"step": 1})
        _train(state, 1)
        store.save(state, {"step": 2})
        rec = _record(state)
        _train(state, 1)
        if what.startswith("a weight"):
            _poison_at(state.model[4].weight, "last", float("nan"))
        else:
            _poison_at(_adam_state(state, "exp_avg_sq"), "last", float("inf"))
        with caplog.at_level(logging.WARNING, logger="safetrain"):
            assert store.save(state, {"step": 3}) is None, what
        assert "refused" in caplog.text and "step 1 (slot 0) was being overwritten" in caplog.text, caplog.text
        assert len(store) == 1 and store.latest().step == 2, "the poisoned copy is not a snapshot"
        assert store.restore(state).step == 2
        assert_state_equal(state, rec, what)
        assert store.save(state, {"step": 4}) is not None, "the emptied slot is used again"
        assert store.latest().step == 4 and len(store) == 2
        assert store.restore(state, older=1).step == 2


@pytest.mark.parametrize("keep,saves", [(1, 1), (2, 0)])
def test_without_a_fallback_the_check_comes_before_the_copy(keep, saves, monkeypatch):
    """keep=1, or the first save: nothing else would survive, so nothing is overwritten."""
    monkeypatch.setattr(snapshot_memory, "copy_chunks_checked_", None)  # this path must not use it
    state = _setup("adam", False, "none")
    _train(state, 1)
    with MemoryStore(keep=keep) as store:
        for step in range(saves):
            store.save(state, {"step": step})
        rec = _record(state)
        _poison_at(state.model[0].weight, "last", float("nan"))
        assert store.save(state, {"step": 9}) is None
        assert len(store) == saves
        if saves:
            assert store.restore(state).step == 0
            assert_state_equal(state, rec, f"keep={keep}")


# -- misuse ----------------------------------------------------------------------------------


def test_counters_need_an_int_step():
    state = _setup("adam", False, "none")
    store = MemoryStore()
    with pytest.raises(SnapshotError, match="'step' is required"):
        store.save(state, {"epoch": 0})
    with pytest.raises(SnapshotError, match="expected an int"):
        store.save(state, {"step": 1.5})


def test_closed_store_refuses_use():
    store = MemoryStore()
    store.close()
    store.close()  # idempotent
    with pytest.raises(SnapshotError, match="closed"):
        store.save(_setup("adam", False, "none"), {"step": 0})


def test_restore_with_nothing_saved():
    with pytest.raises(SnapshotError, match="none taken yet"):
        MemoryStore().restore(_setup("adam", False, "none"))
    assert MemoryStore().latest() is None


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_a_positive_int(keep):
    with pytest.raises(SnapshotError, match="snapshot.keep"):
        MemoryStore(keep=keep)
