"""safetrain.testing's fault injectors: each fires exactly at the chosen calls and removes cleanly."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from safetrain.testing import GradFault, LRFault, OutputFault, PoisonRows, WeightFault


def _data() -> TensorDataset:
    return TensorDataset(torch.ones(4, 3), torch.ones(4, 1))


@pytest.mark.parametrize(
    "where, value, row, expect_x, expect_y",
    [
        ("inputs", math.nan, 1, [math.nan, 1.0, 1.0], [1.0]),
        ("inputs", math.inf, 2, [math.inf, 1.0, 1.0], [1.0]),
        ("targets", math.nan, 1, [1.0, 1.0, 1.0], [math.nan]),
        ("targets", 300.0, 2, [1.0, 1.0, 1.0], [300.0]),
    ],
)
def test_poison_rows_changes_only_the_chosen_rows_and_part(where, value, row, expect_x, expect_y):
    base = _data()
    data = PoisonRows(base, indices=[row], where=where, value=value)
    assert len(data) == 4
    x, y = data[row]
    torch.testing.assert_close(x, torch.tensor(expect_x), equal_nan=True, msg=f"{where} row {row}")
    torch.testing.assert_close(y, torch.tensor(expect_y), equal_nan=True, msg=f"{where} row {row}")
    for i in set(range(4)) - {row}:
        assert torch.equal(data[i][0], base[i][0]) and torch.equal(data[i][1], base[i][1]), i
    assert torch.equal(base.tensors[0], torch.ones(4, 3)), "the base dataset is not changed"


def test_poison_rows_rejects_an_unknown_part():
    with pytest.raises(ValueError, match="where='labels'"):
        PoisonRows(_data(), indices=[0], where="labels")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "calls, value, bad_calls",
    [
        ([2], math.nan, [2]),
        (range(3, 100), math.nan, [3, 4]),
        (None, math.nan, [1, 2, 3, 4]),
        ([1, 4], math.inf, [1, 4]),
    ],
)
def test_output_fault_fires_at_the_chosen_calls(calls, value, bad_calls):
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        layer.weight.fill_(1.0)
        layer.bias.fill_(0.0)
    fault = OutputFault(layer, calls=calls, value=value)
    bad = [i for i in range(1, 5) if not torch.isfinite(layer(torch.ones(1, 2))).all()]
    assert bad == bad_calls, (calls, value)
    assert fault.count == 4
    fault.remove()
    fault.remove()  # idempotent
    assert torch.isfinite(layer(torch.ones(1, 2))).all() and fault.count == 4, "removed: no longer called"


def test_output_fault_scales_by_a_finite_factor_and_removes_as_a_context_manager():
    layer = torch.nn.Identity()
    with OutputFault(layer, calls=[1], value=10.0):
        assert layer(torch.ones(2)).tolist() == [10.0, 10.0]
        assert layer(torch.ones(2)).tolist() == [1.0, 1.0]
    assert not layer._forward_hooks


@pytest.mark.parametrize(
    "calls, value, expect",
    [
        ([2], math.inf, [[2.0, 2.0], [math.inf, math.inf], [2.0, 2.0]]),
        ([1, 3], math.nan, [[math.nan, math.nan], [2.0, 2.0], [math.nan, math.nan]]),
        ([2], 1e4, [[2.0, 2.0], [2e4, 2e4], [2.0, 2.0]]),
    ],
)
def test_grad_fault_spoils_the_chosen_backward_calls(calls, value, expect):
    w = torch.ones(2, requires_grad=True)
    fault = GradFault(w, calls=calls, value=value)
    seen = []
    for _ in range(3):
        w.grad = None
        (w * 2).sum().backward()
        seen.append(w.grad.tolist())
    torch.testing.assert_close(torch.tensor(seen), torch.tensor(expect), equal_nan=True, msg=str(calls))
    assert fault.count == 3
    fault.remove()
    w.grad = None
    (w * 2).sum().backward()
    assert w.grad.tolist() == [2.0, 2.0]


def test_weight_fault_writes_the_entry_after_the_chosen_step_only():
    layer = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    before = layer.weight.detach().clone()
    with WeightFault(opt, layer.weight, (0, 1), steps=[2], value=math.inf) as fault:
        opt.step()
        assert torch.equal(layer.weight, before), "step 1: untouched"
        opt.step()
        assert layer.weight[0, 1].item() == math.inf and layer.weight[0, 0] == before[0, 0]
    assert fault.count == 2
    with torch.no_grad():
        layer.weight.copy_(before)
    opt.step()
    assert torch.equal(layer.weight, before), "removed: no longer writes"


def test_lr_fault_multiplies_the_rate_during_the_chosen_updates_only():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: None)  # a hook of the user's own stays untouched
    fault = LRFault(opt, steps=[2, 3], factor=1000.0)
    for _ in range(4):
        w.grad = torch.ones(1)
        before = w.item()
        opt.step()
        seen.append(before - w.item())  # the update's size: lr * grad
    assert seen == pytest.approx([0.1, 100.0, 100.0, 0.1], rel=1e-4), seen
    assert opt.param_groups[0]["lr"] == 0.1
    fault.remove()
    w.grad = torch.ones(1)
    before = w.item()
    opt.step()
    assert before - w.item() == pytest.approx(0.1, rel=1e-4)


def test_a_range_of_calls_is_kept_as_a_range():
    """``range(k, 10**9)`` ("from the k-th call on", as the docstrings say) used to be turned into a
    set of a billion numbers; it is kept as a range, whose membership test is O(1)."""
    from safetrain.testing import LRFault, OutputFault

    layer = torch.nn.Linear(2, 2)
    fault = OutputFault(layer, calls=range(3, 10**9))
    assert isinstance(fault.calls, range)
    fault.remove()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    lr_fault = LRFault(opt, steps=range(2, 10**12), factor=1000.0)
    assert isinstance(lr_fault.steps, range)
    lr_fault.remove()
