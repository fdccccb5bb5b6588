"""Odd batches and misuse (issue 16): named-tuple and dataclass pairs, complex inputs, empty
batches, meta tensors, and losses that cannot be trained on."""

from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from safetrain import load_config
from safetrain.detect import scan_batch
from safetrain.errors import BatchError
from safetrain.guard import Guard
from safetrain.guard.batches import batch_rows, compute_loss, row_findings, split_batch
from tests.helpers.models import mlp

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class DataPair:
    feats: torch.Tensor
    answer: torch.Tensor


@dataclasses.dataclass
class Labelled:
    pixels: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor


def make_guard(*overrides: str, **kw):
    model = mlp()
    cfg = load_config(None, ["log.progress=false", *overrides])
    kw.setdefault("loss_fn", F.mse_loss)
    return Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, **kw), model


def data(bad: str = "", n: int = 8):
    torch.manual_seed(1)
    x, y = torch.randn(n, 8), torch.randn(n, 1)
    if bad == "input":
        x[2, 0] = math.nan
    elif bad == "target":
        y[2] = math.nan
    return x, y


# ------------------------------------------------------------------ named-tuple and dataclass pairs
def test_a_namedtuple_pair_has_its_targets_treated_as_targets():
    """Issue 16: a namedtuple (x, y) with a NaN target was dropped row-wise as an input (drop_rows)
    instead of following sanitize.targets (skip_batch). Fails before: kind 'input', action drop_rows."""
    guard, _ = make_guard()
    with guard:
        result = guard.step(Pair(*data("target")))
    assert result.action == "skip_batch" and not result.trained
    assert [(e.kind, e.action) for e in result.events] == [("target", "skip_batch")]
    assert "batch[1]" in result.events[0].message


def test_a_namedtuple_pair_keeps_its_type_through_drop_rows():
    seen = []

    def step_fn(model, batch):
        seen.append(type(batch))
        return F.mse_loss(model(batch.x), batch.y)

    guard, _ = make_guard(step_fn=step_fn)
    with guard:
        result = guard.step(Pair(*data("input")))
    assert result.action == "drop_rows" and result.trained
    assert set(seen) == {Pair}, "the cleaned and the re-run batch are still the user's named tuple"
    assert guard.counters.dropped_rows == 1


def test_a_dataclass_pair_follows_the_pair_rules_and_trains_with_loss_fn():
    """Fails before: the dataclass's second field was scanned as an input (drop_rows), and with
    loss_fn alone the batch was refused ('cannot train on a batch of type DataPair')."""
    guard, _ = make_guard()
    with guard:
        result = guard.step(DataPair(*data("target")))
        assert [(e.kind, e.action) for e in result.events] == [("target", "skip_batch")]
        assert "batch.answer" in result.events[0].message
        assert guard.step(DataPair(*data())).trained
    parts = split_batch(DataPair(*data()))
    assert parts.style == "pair" and parts.names == ("feats", "answer")
    rebuilt = parts.join(parts.inputs * 0, parts.targets)
    assert isinstance(rebuilt, DataPair) and float(rebuilt.feats.abs().sum()) == 0.0


def test_a_dataclass_with_target_named_fields_reports_them_as_targets():
    x, y = data()
    y = y.clone()
    y[4] = math.inf
    batch = Labelled(x, torch.ones(8, dtype=torch.bool), y)
    parts = split_batch(batch)
    assert parts.style == "fields" and set(parts.targets) == {"labels"}
    found = row_findings(batch, load_config().sanitize)
    assert [(f.kind, f.path, f.rows) for f in found] == [("target", "batch.labels", (4,))]
    assert isinstance(parts.join(parts.inputs, parts.targets), Labelled)


# ------------------------------------------------------------------ complex inputs
@pytest.mark.parametrize("part", ["real", "imag"])
def test_a_complex_input_with_a_nan_or_inf_is_scanned(part):
    """Issue 16: a complex input with a NaN was not scanned and showed up later as a forward anomaly.
    Fails before: the anomaly is kind 'forward', not an input row dropped."""
    z = torch.randn(8, 4, dtype=torch.complex64)
    z[3, 1] = complex(math.nan, 0.0) if part == "real" else complex(0.0, math.inf)
    scan = scan_batch(z)
    assert scan.values[0].dtype == torch.float32 and not math.isfinite(float(scan.values[0]))
    assert scan.row_bad.tolist() == [i == 3 for i in range(8)]
    assert bool(torch.isfinite(scan.batch).all())

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, z):
            return self.lin(torch.cat([z.real, z.imag], 1))

    model = Model()
    with Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        load_config(None, ["log.progress=false"]),
        loss_fn=F.mse_loss,
    ) as guard:
        result = guard.step((z, torch.randn(8, 1)))
    assert [(e.kind, e.action) for e in result.events] == [("input", "drop_rows")]
    assert "rows [3]" in result.events[0].message and "complex64" in result.events[0].message


# ------------------------------------------------------------------ empty batches
def test_batch_rows():
    assert batch_rows((torch.zeros(0, 3), torch.zeros(0))) == 0
    assert batch_rows({"ids": [1, 2], "x": torch.zeros(5, 2)}) == 5
    assert batch_rows(Labelled(torch.zeros(0, 2), torch.zeros(0), torch.zeros(0))) == 0
    assert batch_rows((torch.tensor(1.0), "a")) is None


def test_empty_batches_are_data_events_that_never_climb_the_ladder():
    """Issue 16: 4 empty batches in a row became loss anomalies (NaN mean) that restored the model
    and halved the LR twice. Fails before: kind 'loss', then restores and scale_lr."""
    guard, model = make_guard("snapshot.every=1")
    empty = (torch.zeros(0, 8), torch.zeros(0, 1))
    with guard:
        for _ in range(3):
            assert guard.step(data()).trained
        before = [p.detach().clone() for p in model.parameters()]
        lrs = [g["lr"] for g in guard.optimizer.param_groups]
        results = [guard.step(empty) for _ in range(6)]
        assert all(r.action == "skip_batch" and not r.trained for r in results)
        kinds = [(e.kind, e.action, e.message.split(":")[0]) for r in results for e in r.events]
        assert kinds == [("input", "skip_batch", "empty batch (0 rows)")] * 6
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the model was not touched"
        assert [g["lr"] for g in guard.optimizer.param_groups] == lrs
        assert guard.counters.restores == 0 and guard.counters.skipped_batches == 6
        assert guard.step(data()).trained and guard.step(data()).action == ""


def test_an_empty_micro_batch_is_left_out_of_the_accumulated_step():
    guard, _ = make_guard("guard.accumulate_steps=2")
    with guard:
        assert guard.step(data()) is None
        assert guard.step((torch.zeros(0, 8), torch.zeros(0, 1))) is None
        result = guard.step(data())
    assert result.trained and result.action == "" and len(guard.pending.micro) == 2


# ------------------------------------------------------------------ misuse: meta batches and bad losses
def test_a_meta_device_batch_is_a_batch_error():
    """Issue 16: a raw torch RuntimeError before."""
    guard, _ = make_guard()
    with guard, pytest.raises(BatchError, match=r"batch\[0\], batch\[1\] are on the 'meta' device .* expected"):
        guard.step((torch.empty(8, 8, device="meta"), torch.empty(8, 1, device="meta")))
    meta_model = torch.nn.Linear(8, 1, device="meta")
    with pytest.raises(BatchError, match=r"the loss is on the 'meta' device .* to_empty\(\)"):
        compute_loss(meta_model, (torch.empty(8, 8, device="meta"), torch.empty(8, 1, device="meta")), F.mse_loss)


LOSSES = [
    ("no grad", lambda m, b: torch.tensor(1.0), r"the loss does not require grad .* expected a loss computed"),
    ("detached", lambda m, b: F.mse_loss(m(b[0]), b[1]).detach(), r"the loss does not require grad"),
    ("integer", lambda m, b: torch.tensor(3), r"the loss has dtype int64; expected a floating-point scalar"),
    ("bool", lambda m, b: m(b[0]).sum() > 0, r"the loss has dtype bool; expected a floating-point scalar"),
]


@pytest.mark.parametrize("name,step_fn,message", LOSSES, ids=[x[0] for x in LOSSES])
def test_a_loss_that_cannot_be_trained_on_is_a_batch_error(name, step_fn, message):
    """Issue 16: each was a raw 'element 0 of tensors does not require grad' RuntimeError before."""
    guard, _ = make_guard(step_fn=step_fn)
    with guard, pytest.raises(BatchError, match=message):
        guard.step(data())


def test_a_loss_without_grad_is_fine_when_autograd_is_off():
    """A replay's forward under no_grad computes the loss without grad on purpose."""
    model = mlp()
    with torch.no_grad():
        loss = compute_loss(model, data(), F.mse_loss)
    assert loss.dim() == 0 and not loss.requires_grad
