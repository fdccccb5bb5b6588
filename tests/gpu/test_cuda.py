"""The engine on a CUDA device: the one-sync promise checked by CUDA itself, batches moved from a
pinned CPU loader, and snapshots on the device.

Skipped where no GPU is present (CI); run on a lent GPU with ``python -m pytest tests/gpu
tests/integration/test_engine.py tests/integration/test_replay.py``: the engine's fault-injection
tests and the replay's layer naming take the ``device`` fixture (tests/conftest.py), which adds
``"cuda"`` wherever a CUDA device is present.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from safetrain import SafeTrainer, load_config, safe_div, safe_log
from safetrain.guard import Guard
from safetrain.snapshot import MemoryStore, SafetensorsStore, TrainState
from safetrain.testing import count_host_syncs
from tests.helpers.engine import BASE, full_loss
from tests.helpers.models import loader, mlp, regression_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_syncs_in(fn) -> list:
    """The synchronizing CUDA calls made inside ``fn()``, as CUDA's sync debug mode reports them."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    # (setting the mode also warns once that it is a prototype: not a sync)
    return [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("amp", ["null", "float16", "bfloat16"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_healthy_step_synchronizes_with_the_gpu_exactly_once(mode, amp, optimizer):
    """CUDA's own sync debug mode sees every device-to-host wait, including ones inside torch ops
    that the Tensor-method count of the CPU tests cannot: a healthy guarded step makes one."""
    model = mlp().cuda()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=1e-3)
    )
    cfg = load_config(
        None,
        [
            *BASE,
            f"detect.mode={mode}",
            f"amp.dtype={amp}",
            "guard.clip_grad_norm=1.0",
            "detect.check_weights_every=2",
            "snapshot.every=1000",
            "amp.init_scale=16",
        ],
    )
    data = DataLoader(regression_data(), batch_size=16, pin_memory=True)
    batches = list(data)
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.step(batches[0])  # the first step also takes the initial snapshot (its own sync)
        for batch in batches[1:6]:
            results = []
            with count_host_syncs() as host:
                syncs = _cuda_syncs_in(lambda results=results, batch=batch: results.append(guard.step(batch)))
            assert results[0] is not None and results[0].action == "", results[0]
            assert len(syncs) == 1, syncs
            ours = [c for c in host.calls if "torch/optim/" not in c[1]]
            assert len(ours) == 1, ours


def test_batches_from_a_pinned_cpu_loader_train_on_the_gpu_like_on_the_cpu():
    """``guard.to_device`` (default) moves each batch to the model's device: the same run on the
    GPU ends at the CPU run's loss (within float32 reordering), its parameters still on the GPU."""
    losses = {}
    for device in ("cpu", "cuda"):
        model = mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        data = DataLoader(
            regression_data(),
            batch_size=16,
            shuffle=True,
            pin_memory=device == "cuda",
            generator=torch.Generator().manual_seed(0),
        )
        result = SafeTrainer(model, opt, load_config(None, BASE), loss_fn=F.mse_loss).fit(data, epochs=2)
        assert result.healthy_steps == result.steps == 32
        assert all(p.device.type == device for p in model.parameters())
        losses[device] = full_loss(model)
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3), losses


def test_to_device_off_leaves_the_batch_where_the_loader_put_it():
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(None, [*BASE, "guard.to_device=false"])
    batch = next(iter(loader(regression_data())))
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard, pytest.raises(RuntimeError, match="device"):
        guard.step(batch)


@pytest.mark.parametrize("store", ["memory_cpu", "memory_model", "safetensors"])
def test_snapshot_of_a_cuda_run_restores_bitwise_with_its_cuda_rng(store, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState(model, opt)
    stores = {
        "memory_cpu": lambda: MemoryStore(device="cpu"),
        "memory_model": lambda: MemoryStore(device="model"),
        "safetensors": lambda: SafetensorsStore(tmp_path),
    }
    snaps = stores[store]()
    x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 1, device="cuda")

    def train(steps: int) -> list:
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)  # dropout draws from the CUDA RNG
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    train(3)
    snaps.save(state, counters={"step": 3, "epoch": 0, "batch": 3})
    expected = train(4)
    params = [p.detach().clone() for p in model.parameters()]
    snaps.restore(state)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(
        t.device.type == "cuda" for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
    )
    assert train(4) == expected  # parameters, optimizer state and the CUDA RNG all came back
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    snaps.close()


def test_memory_snapshots_of_a_cuda_model_are_kept_in_pinned_host_memory():
    """``snapshot.device: cpu`` keeps a CUDA model's copy in pinned host memory (asynchronous
    copies both ways), not in pageable memory and not on the GPU."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(model(torch.randn(4, 8, device="cuda")), torch.zeros(4, 1, device="cuda")).backward()
    opt.step()  # momentum buffers on the GPU too
    snaps = MemoryStore(device="cpu")
    snaps.save(TrainState(model, opt), counters={"step": 1, "epoch": 0, "batch": 1})
    slot = next(s for s in snaps._slots if s.meta_json is not None)
    from_gpu = [name for name, home in slot.homes.items() if home.type == "cuda"]
    assert len(from_gpu) == 8, slot.homes  # 4 parameters, 4 momentum buffers
    for name in from_gpu:
        assert slot.buffers[name].device.type == "cpu" and slot.buffers[name].is_pinned(), name
    snaps.close()


def test_safe_ops_keep_values_and_gradients_finite_on_cuda():
    x = torch.tensor([0.0, -1.0, 1e-30, 2.0], device="cuda", requires_grad=True)
    d = torch.tensor([0.0, 1e-30, -0.0, 4.0], device="cuda", requires_grad=True)
    out = safe_log(x).sum() + safe_div(x, d).sum()
    out.backward()
    assert math.isfinite(out.item())
    assert torch.isfinite(x.grad).all() and torch.isfinite(d.grad).all()


def test_a_step_fn_gets_the_moved_batch_unless_to_device_is_off_and_pageable_batches_are_noted(caplog):
    model = mlp().cuda()
    seen = []

    def step_fn(m, batch):
        x, y = batch
        seen.append(x.device.type)  # a packed sequence's lengths, say, must stay on the CPU
        return F.mse_loss(m(x.cuda(non_blocking=True)), y.cuda(non_blocking=True))

    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for overrides, device in (([], "cuda"), (["guard.to_device=false"], "cpu")):
        seen.clear()
        cfg = load_config(None, [*BASE, *overrides])
        SafeTrainer(model, opt, cfg, step_fn=step_fn).fit(loader(regression_data()), epochs=1)
        assert seen and set(seen) == {device}, (overrides, set(seen))
    caplog.clear()  # only this run's records
    with caplog.at_level("INFO", logger="safetrain"):
        SafeTrainer(model, opt, load_config(None, BASE), loss_fn=F.mse_loss).fit(
            loader(regression_data()), epochs=1
        )  # not pinned
    notes = [r.getMessage() for r in caplog.records if "pageable host memory" in r.getMessage()]
    assert len(notes) == 1 and "batch[0]" in notes[0], notes


def test_a_read_of_values_on_the_host_and_the_gpu_waits_for_the_gpu():
    """A batch scanned on the CPU (``guard.to_device: false``) and a loss on the GPU: the read must
    gather on the GPU. Gathered on the host, the loss's ``non_blocking`` copy would be read before
    it lands, behind the queue of kernels that computes it."""
    from safetrain.detect import StepFlags

    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # a long queue of kernels before the loss is known
        a = torch.tanh(a @ a)
    loss = a.sum() * 0 + 3.0
    flags = StepFlags()
    flags.put("input", [torch.zeros(())])  # on the host, and first
    flags.put("loss", loss)
    assert flags.read().loss == 3.0
