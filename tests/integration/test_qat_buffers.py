"""Buffers that change shape (issue 33): a model prepared with ``torch.ao.quantization.prepare_qat``.

A per-channel weight observer starts with empty ``min_val``/``max_val`` and a one-element
``scale``/``zero_point``, and takes one value per channel at the first forward; an activation
observer starts at ``min_val=+inf``, ``max_val=-inf`` ("Per-channel observers are always
initialized with empty scale and zero_point tensors, and those tensors are resized to the correct
size after the first forward", facebookresearch/fvcore#52; PyTorch's own loader special-cases
them, pytorch/pytorch#33830). Before, a fresh QAT model crashed in the start measurement
(``RuntimeError: The size of tensor a (8) must match the size of tensor b (0)``), and a restore
to a snapshot of the empty observers was refused as from another model.

Now: a healthy run is bitwise a plain loop (observers included); a skipped step puts the observers
back as they were, their shapes included; a restore puts them back as the snapshot holds them; an
observer going from +-inf to the data's range is no fault.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, load_config
from safetrain.testing import OutputFault

QUIET = ["log.progress=false", "snapshot.every=2"]


def qat_model(engine: str = "fbgemm") -> torch.nn.Module:
    """A tiny conv + linear model prepared for quantization-aware training (per-channel weight observers)."""
    import torch.ao.quantization as q

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        q.QuantStub(),
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 1),
        q.DeQuantStub(),
    )
    model.qconfig = q.get_default_qat_qconfig(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (eager-mode quantization's deprecation notice)
        return q.prepare_qat(model.train())


def _batches(n: int = 8) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 4, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> List[str]:
    """The names whose tensors differ (shape, dtype or value; NaN never equal)."""
    return [n for n in a if a[n].shape != b[n].shape or a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("engine", ["fbgemm", "qnnpack"])
def test_a_healthy_qat_run_is_the_plain_loop_bitwise(engine):
    """fit on a fresh QAT model (start measurement, snapshots of empty and +-inf observers, the
    weight check each step): the weights and every observer end as the plain loop's, with no
    anomaly and no refused snapshot (before: the observers' going finite refused every snapshot)."""
    data = _batches()
    plain = qat_model(engine)
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(plain(x), y).backward()
        opt.step()
    model = qat_model(engine)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = load_config(None, [*QUIET, "detect.check_weights_every=1"])  # (the observers' patterns each step)
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(data)
    assert [(e.kind, e.action) for e in result.events if e.name == "anomaly"] == []
    assert not [e for e in result.events if e.kind == "snapshot" and e.action == "refused"]
    assert _same(_state(model), _state(plain)) == []


def test_a_skipped_first_step_puts_the_observers_back_with_their_shapes():
    """The first batch holds a NaN row and is skipped (``sanitize.inputs: skip_batch``): its
    forward ran (the observers took one value per channel) but the observers go back to empty
    and +-inf, as before it; the next steps train."""
    model = qat_model()
    fresh = _state(model)
    data = _batches(4)
    data[0][0][2, 0, 0, 0] = float("nan")
    cfg = load_config(None, [*QUIET, "sanitize.inputs=skip_batch"])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, loss_fn=F.mse_loss) as guard:
        first = guard.step(data[0])
        assert not first.trained and first.action == "skip_batch", first
        assert _same(_state(model), fresh) == []
        for batch in data[1:]:
            assert guard.step(batch).trained
    assert model[1].weight_fake_quant.activation_post_process.min_val.shape == (4,)


def test_a_nan_activation_step_leaves_the_observers_as_before():
    """A NaN activation at step 3 (after the observers have their shapes), skipped: every buffer
    is as before the step."""
    model = qat_model()
    cfg = load_config(None, [*QUIET, "recovery.actions.forward=skip_batch", "detect.replay.enabled=false"])
    fault = OutputFault(model[1], calls=[3])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, loss_fn=F.mse_loss) as guard:
        for i, batch in enumerate(_batches(5)):
            before = _state(model)
            result = guard.step(batch)
            if i == 2:
                assert result.action == "skip_batch", result
                assert _same(_state(model), before) == []
    fault.remove()


@pytest.mark.parametrize("every", [2, 100])
def test_a_restore_puts_the_observers_back_as_the_snapshot_holds_them(every):
    """A NaN activation at step 5 restored (``recovery.actions.forward: restore``): the model's
    state, observers included, is the snapshot's: a periodic one, or with ``snapshot.every: 100``
    the forced one of step 0, whose observers are still empty and at +-inf (before: refused
    as 'from another model', and the run aborted)."""
    model = qat_model()
    overrides = [f"snapshot.every={every}", "recovery.actions.forward=restore", "detect.replay.enabled=false"]
    cfg = load_config(None, ["log.progress=false", *overrides])
    fault = OutputFault(model[4], calls=[5])
    states = {0: _state(model)}
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), cfg, loss_fn=F.mse_loss) as guard:
        for i, batch in enumerate(_batches(6)):
            result = guard.step(batch)
            if i == 4:
                restored = [e for e in result.events if e.name == "restored"]
                assert restored, result
                step = restored[0].detail["snapshot_step"]
                assert step > 0 if every == 2 else step == 0  # (the newest may be passed over: unvouched)
                assert _same(_state(model), states[step]) == []
                break
            states[guard.steps] = _state(model)
    fault.remove()


def test_a_fresh_qat_model_resumes_from_a_safetensors_snapshot(tmp_path):
    """A run's safetensors snapshot, loaded into a freshly prepared QAT model (observers empty and
    at +-inf): every buffer takes the snapshot's shape and values, and the run goes on (before:
    refused, 'model tensor ... is [4] in the snapshot, [1] in the live model')."""
    overrides = ["log.progress=false", "snapshot.store=safetensors", f"log.dir={tmp_path}", "snapshot.every=2"]
    model = qat_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    SafeTrainer(model, opt, load_config(None, overrides), loss_fn=F.mse_loss).fit(_batches(4))
    trained = _state(model)
    fresh = qat_model()
    result = SafeTrainer(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    ).fit(_batches(4), max_steps=4, resume="auto")
    assert result.optimizer_steps == 4 and _same(_state(fresh), trained) == []
    start = next(e for e in result.events if e.name == "run_started")
    assert any("shape or dtype" in c for c in start.detail["changed_since"]), start.detail


class Counting(torch.nn.Module):
    """A layer whose first forward registers a buffer (``seen``) and turns another from float32
    into float64 (``total``): buffers that appear and change dtype during training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
        self.register_buffer("total", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.zeros(4))
            self.total = self.total.double()
        with torch.no_grad():
            self.seen += x.detach().abs().mean(0)
            self.total += 1
        return self.fc(x)


def test_a_restore_takes_back_a_dtype_and_leaves_a_buffer_that_appeared():
    """A restore to the forced first snapshot (taken before the first forward): ``total`` goes back
    to float32 and its value then; ``seen``, which appeared since, is left as it is; the journal
    says both; training goes on."""
    torch.manual_seed(0)
    model = Counting()
    overrides = ["snapshot.every=100", "recovery.actions.forward=restore", "detect.replay.enabled=false"]
    fault = OutputFault(model.fc, calls=[3])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(5)]
    with Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        load_config(None, QUIET[:1] + overrides),
        loss_fn=F.mse_loss,
    ) as guard:
        for i, batch in enumerate(data):
            result = guard.step(batch)
            if i == 2:
                restored = next(e for e in result.events if e.name == "restored")
                changed = " ".join(restored.detail["changed_since"])
                assert "'total'" in changed and "appeared" in changed and "'seen'" in changed, changed
                assert model.total.dtype == torch.float32 and float(model.total) == 0.0
                assert model.seen.shape == (4,)
    fault.remove()
    assert guard.counters.optimizer_steps >= 3
