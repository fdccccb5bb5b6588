"""Gradient norms that overflow float32: the true norm on the slow path, ``grad_norm`` not ``gradient``.

Issue #18, class 2: the total norm of finite gradients overflows float32 once elements pass about
1.8e19 (the sum of squares is Inf); such a step was called a non-finite ``gradient`` fault, its
journal line said ``total norm inf``, and clipping with that norm zeroed the gradients.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from safetrain.detect import HUGE_NORM, GradCheck, StepFlags, true_norm, true_norms
from tests.helpers.models import model_with_grads


def reference(t: torch.Tensor) -> float:
    return torch.linalg.vector_norm(t.double()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_true_norm_of_elements_whose_float32_squares_overflow(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(1000, generator=g) * 1e20).to(dtype)
    assert not math.isfinite(torch.linalg.vector_norm(t.float()).item()), "float32's own norm overflows"
    assert true_norm(t) == pytest.approx(reference(t), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_true_norm_of_ordinary_values_matches_the_float64_norm(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(4, 300, generator=g) * 7).to(dtype)
    assert true_norm(t) == pytest.approx(reference(t), rel=1e-5)
    assert true_norm(t.t()) == pytest.approx(reference(t), rel=1e-5), "a non-contiguous view"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_true_norm_is_non_finite_exactly_when_an_element_is(dtype, value):
    t = torch.ones(50, dtype=dtype)
    t[7] = value
    got = true_norm(t)
    assert not math.isfinite(got), got
    assert math.isnan(got) == math.isnan(value)


def test_true_norm_of_zeros_empty_and_sparse():
    assert true_norm(torch.zeros(5)) == 0.0, "no 0/0"
    assert true_norm(torch.zeros(0)) == 0.0
    sparse = torch.sparse_coo_tensor([[0, 3]], torch.tensor([3e20, 4e20]), (5,), check_invariants=True)
    assert true_norm(sparse) == pytest.approx(5e20, rel=1e-6)


def test_true_norms_works_out_only_the_non_finite_norms_again():
    tensors = [torch.full((4,), 1e20), torch.ones(4)]
    assert true_norms(tensors, [math.inf, 12.5]) == [pytest.approx(2e20, rel=1e-6), 12.5], "a finite norm is kept"
    assert true_norms(tensors) == [pytest.approx(2e20, rel=1e-6), 2.0]


def test_finite_gradients_whose_norm_overflows_are_grad_norm_with_the_true_norm():
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(1e20)  # 32 elements: true norm sqrt(32) * 1e20, float32 norm Inf
    check = GradCheck(model)
    flags = StepFlags()
    flags.put("grad_norms", check.run().norm_list)
    read = flags.read()
    assert read.gradient, "the fast read trips: the float32 norm is Inf"
    finding = check.finding(read.grad_norms, threshold=None, step=4)
    expected = math.hypot(math.sqrt(32) * 1e20, *[p.grad.norm().item() for p in list(model.parameters())[1:]])
    assert (finding.kind, finding.nonfinite, finding.overflowing) == ("grad_norm", (), ("0.weight",))
    assert finding.total_norm == pytest.approx(expected, rel=1e-6) and finding.total_norm >= HUGE_NORM
    assert finding.norms == (("0.weight", pytest.approx(math.sqrt(32) * 1e20, rel=1e-6)),)
    line = finding.describe()
    assert "overflows float32" in line and f"{expected:.4g}" in line, line
    assert json.loads(json.dumps(finding.to_dict(), allow_nan=False))["total_norm"] == pytest.approx(expected)


def test_a_nan_gradient_beside_a_huge_finite_one_is_still_gradient():
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(1e20)
        model[2].bias.grad[0] = math.nan
    check = GradCheck(model)
    finding = check.finding(check.run())
    assert (finding.kind, finding.nonfinite, finding.overflowing) == ("gradient", ("2.bias",), ("0.weight",))
    assert math.isnan(finding.total_norm)


def test_clipping_with_an_overflowed_host_norm_clips_with_the_true_norm():
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(1e20)
    check = GradCheck(model)
    check.clip_(1.0, math.inf)  # the read's total: the float32 squares overflowed
    grads = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads), "no NaN written"
    assert torch.nn.utils.get_total_norm(grads).item() == pytest.approx(1.0, rel=1e-4), "clipped, not zeroed"


@pytest.mark.parametrize("total", [math.inf, math.nan])
def test_clipping_with_a_non_finite_device_norm_leaves_the_gradients_alone(total):
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(1e20)
    before = [p.grad.clone() for p in model.parameters()]
    GradCheck(model).clip_(1.0, torch.tensor(total))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "not zeroed, no NaN"


def test_clipping_non_finite_gradients_writes_no_new_nan():
    model = model_with_grads()
    with torch.no_grad():
        model[2].bias.grad[0] = math.inf
    before = [p.grad.clone() for p in model.parameters()]
    GradCheck(model).clip_(1.0, math.inf)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters())), "Inf * 0 would be NaN"
