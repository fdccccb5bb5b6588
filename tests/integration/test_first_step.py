"""Issue 23, point 5: the first step has a reference. Before a fresh run's first step, ``fit``
measures the start model's loss on the two batches after the first step's
(:meth:`Guard.measure_start`), so a first batch in the wrong unit is a spike judged against the
start level instead of being taken as the run's level (the update it makes would ruin the next
ones). The pattern is the familiar one of targets not normalized like the rest of the data, whose
MSE is orders of magnitude above the run's (PyTorch forums, "Data Normalization, Learning Rate,
and Loss Relationship", 2020: a loss of 5.0 unnormalized against 0.01 normalized).

The measurement changes nothing (RNG, BatchNorm statistics, monitor records put back: a run with it
is bitwise a run without it), and the rule holds for a loss of any offset and positive scale.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from safetrain import Guard, SafeTrainer, load_config
from tests.helpers.models import finite_params, regression_data

ROWS = 16


class WrongUnitBatch(Dataset):
    """Rows ``lo..hi`` have their targets multiplied by ``factor`` (one batch in the wrong unit)."""

    def __init__(self, base: Dataset, lo: int, hi: int, factor: float = 1e4) -> None:
        self.base, self.lo, self.hi, self.factor = base, lo, hi, factor

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return (x, y * self.factor) if self.lo <= i < self.hi else (x, y)


def _net(norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = [torch.nn.Linear(8, 16)]
    if norm:
        layers += [torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2)]
    return torch.nn.Sequential(*layers, torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _full_loss(model: torch.nn.Module, data: Any) -> float:
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    model.train()
    return loss


def _fit(
    data: Dataset, loss_fn: Callable[..., torch.Tensor], adam: bool, *overrides: str, norm: bool = False
) -> Tuple[torch.nn.Module, Any]:
    model = _net(norm)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.05, momentum=0.9)
    cfg = load_config(None, ["log.progress=false", "detect.replay.enabled=false", *overrides])
    result = SafeTrainer(model, opt, cfg, loss_fn=loss_fn).fit(DataLoader(data, batch_size=ROWS, shuffle=False))
    return model, result


def _shifted(c: float, a: float) -> Callable[..., torch.Tensor]:
    return lambda out, y: a * F.mse_loss(out, y) + c


CASES = [(0.0, 1.0, False), (100.0, 1.0, False), (-100.0, 1.0, False), (0.0, 1.0, True), (-1.0, 0.01, True)]
CASES += [(5.0, 100.0, True)]


@pytest.mark.parametrize("c,a,adam", CASES)
def test_a_first_batch_in_the_wrong_unit_is_a_spike_for_any_offset_and_scale(c, a, adam):
    """Batch 1's targets x1e4 (its MSE x1e8): before, SGD 'finished' at a full-data loss of 6.4e5
    from 0.86 (the strict xfail of issue 18); now the first step is a spike, skipped, for the loss
    shifted by +-100 or scaled by 0.01 and 100 (under Adam, whose update ignores the scale) alike,
    and the run ends trained."""
    clean = regression_data(n=ROWS * 30)
    before = _full_loss(_net(), clean)
    model, result = _fit(WrongUnitBatch(clean, 0, ROWS), _shifted(c, a), adam)
    anomalies = [(e.step, e.kind, e.action, e.detail.get("rule")) for e in result.events if e.name == "anomaly"]
    assert anomalies == [(1, "spike", "skip_batch", "start")], anomalies
    assert finite_params(model) and _full_loss(model, clean) < before


@pytest.mark.parametrize("c,a", [(0.0, 1.0), (100.0, 1.0), (-100.0, 1.0), (-3.0, 0.01)])
def test_a_healthy_start_calls_nothing_for_any_offset_and_scale(c, a):
    """The dual: the same runs without the bad batch have no anomaly (BatchNorm and dropout
    included), for the loss shifted and scaled."""
    clean = regression_data(n=ROWS * 30)
    _, result = _fit(clean, _shifted(c, a), True, norm=True)
    assert [e for e in result.events if e.name == "anomaly"] == []


def test_a_zero_initialized_head_gives_identical_start_losses_and_no_alarm():
    """A classifier whose last layer starts at zero gives every batch the same loss, log(C) up to
    rounding: the start losses have no spread, and the first step must not be called a spike for
    a last-bit difference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS * 20, 8, generator=g)
    y = torch.randint(0, 5, (ROWS * 20,), generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = load_config(None, ["log.progress=false"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.cross_entropy).fit(DataLoader(data, batch_size=ROWS))
    assert [e for e in result.events if e.name == "anomaly"] == []


def test_measuring_the_start_changes_nothing(monkeypatch):
    """A run with the measurement is bitwise the run without it: parameters, BatchNorm's running
    statistics (the measuring forwards run in train mode) and dropout's RNG stream. Fails when
    the forwards' RNG draws or buffer updates are not put back."""
    clean = regression_data(n=ROWS * 12)
    calls: List[int] = []
    real = Guard.measure_start
    monkeypatch.setattr(Guard, "measure_start", lambda self, batches: calls.append(1) or real(self, batches))
    measured, _ = _fit(clean, F.mse_loss, True, norm=True)
    assert calls == [1]
    monkeypatch.setattr(Guard, "measure_start", lambda self, batches: [])
    plain, _ = _fit(clean, F.mse_loss, True, norm=True)
    for (name, a), b in zip(measured.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name


def test_measure_start_is_a_no_op_after_the_first_step_and_needs_two_losses():
    """In a loop of one's own: measured before the first step only; one finite loss is no spread."""
    data = regression_data(n=64)
    model = _net()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), {"log": {"progress": False}}, loss_fn=F.mse_loss)
    batches = [data[i : i + ROWS] for i in range(0, 64, ROWS)]
    nan_batch = (batches[2][0].clone().fill_(float("nan")), batches[2][1])
    assert len(guard.measure_start([batches[1], nan_batch])) == 1
    assert guard.spike.start == ()  # one finite loss: no spread to judge against
    losses = guard.measure_start(batches[1:3])
    assert len(losses) == 2 and guard.spike.start == tuple(losses)
    guard.step(batches[0])
    assert guard.measure_start(batches[1:3]) == [] and guard.spike.start == tuple(losses)  # not measured again
    guard.step(batches[1])
    guard.step(batches[2])
    assert guard.spike.start == ()  # three trained losses: the run's own range judges from here
    guard.close()
