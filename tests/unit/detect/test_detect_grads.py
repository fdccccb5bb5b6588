"""Gradient and weight checks: one fused pass, device values, names only on the slow path."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from safetrain.detect import GradCheck, StepFlags, WeightCheck, fused_norms
from safetrain.testing import count_host_syncs
from tests.helpers.models import model_with_grads


def test_norms_match_torch_reference_without_sync():
    model = model_with_grads()
    check = GradCheck(model)
    with count_host_syncs() as syncs:
        result = check.run()
        norms, total, bad = result
    assert syncs.count == 0, str(syncs)
    grads = [p.grad for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads)
    assert torch.allclose(total, expected), "total norm equals torch's"
    assert torch.allclose(norms, torch.stack([g.norm() for g in grads]))
    assert not bool(bad)
    assert check.names == ("0.weight", "0.bias", "2.weight", "2.bias")


@pytest.mark.parametrize("as_host_float", [True, False], ids=["host-float", "device-tensor"])
def test_clip_reuses_the_total_norm(as_host_float):
    model, reference = model_with_grads(), model_with_grads()
    check = GradCheck(model)
    result = check.run()
    total = result.total_norm.item() if as_host_float else result.total_norm
    check.clip_(0.1, total)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7), "clipping equals clip_grad_norm_"


def test_clip_below_max_leaves_gradients_alone():
    model = model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    check = GradCheck(model)
    check.clip_(1e6, check.run().total_norm.item())
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))


def test_inf_gradient_in_one_parameter_is_named():
    model = model_with_grads()
    model[2].bias.grad[1] = math.inf
    check = GradCheck(model)
    flags = StepFlags()
    flags.put("grad_norms", check.run().norm_list)
    read = flags.read()
    assert read.gradient and read.tripped() == ("gradient",)
    finding = check.finding(read.grad_norms, threshold=None, step=3)
    assert (finding.kind, finding.nonfinite, finding.step) == ("gradient", ("2.bias",), 3)
    assert finding.norms[0][0] == "2.bias" and math.isinf(finding.norms[0][1])
    assert check.finding(check.run()).nonfinite == ("2.bias",), "the device result works too"


def test_parameters_above_threshold_are_named_largest_first():
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.mul_(1000)
        model[2].weight.grad.mul_(100)
    check = GradCheck(model)
    norms = check.run().norms.tolist()
    threshold = sorted(norms)[-3]  # the two largest are above it
    finding = check.finding(norms, threshold)
    assert finding.kind == "grad_norm" and finding.nonfinite == ()
    assert set(finding.above_threshold) == {"0.weight", "2.weight"}
    assert [n for n, _ in finding.norms] == ["0.weight", "2.weight"], "largest first"
    assert finding.total_norm == pytest.approx(math.hypot(*norms))


def test_huge_finite_gradient_is_not_called_nonfinite():
    model = model_with_grads()
    with torch.no_grad():
        model[0].weight.grad.fill_(1e30)  # the squares overflow float32: the norm is inf
    check = GradCheck(model)
    finding = check.finding(check.run())
    assert finding.nonfinite == () and finding.kind == "grad_norm", "exact check on the slow path"


def test_parameters_without_gradient_are_left_out():
    model = model_with_grads()
    model[0].bias.grad = None
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    check = GradCheck(list(model.named_parameters()) + [("frozen", frozen)])
    result = check.run()
    assert check.names == ("0.weight", "2.weight", "2.bias") and result.norms.shape == (3,)
    for p in model.parameters():
        p.grad = None
    assert check.run() is None
    assert GradCheck(model, enabled=False).run() is None


def test_low_precision_norms_are_taken_in_float32():
    grads = [torch.full((1000,), 100.0, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)]
    norms = fused_norms(grads)
    assert norms[0].dtype == torch.float32 and math.isfinite(norms[0].item()), "fp16 norm 3162 would fit, 1e5 sums not"
    assert norms[0].item() == pytest.approx(100.0 * math.sqrt(1000), rel=1e-3)
    mixed = fused_norms([torch.ones(4), torch.ones(4, dtype=torch.float64), torch.ones(4).to_sparse()])
    assert [round(n.item(), 4) for n in mixed] == [2.0, 2.0, 2.0]


def big_model_with_grads() -> nn.Module:
    """Two weights above the dot threshold (65536 elements), biases and a small head below it."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 256), nn.Tanh(), nn.Linear(256, 3))
    model(torch.randn(7, 300)).pow(2).sum().backward()
    return model


def test_large_cpu_gradients_take_the_dot_path_with_the_same_norms():
    model = big_model_with_grads()
    check = GradCheck(model)
    assert check._dots.big == (0, 2), "only the large weights go through BLAS dot"
    with count_host_syncs() as syncs:
        result = check.run()
    assert syncs.count == 0, str(syncs)
    expected = torch.stack([p.grad.norm() for p in model.parameters()])
    assert torch.allclose(result.norms, expected, rtol=1e-5), "norms in parameter order, each as torch computes it"
    assert torch.allclose(
        result.total_norm, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]), rtol=1e-5
    )


def test_the_fused_norm_gets_only_the_small_gradients_and_a_failed_dot_path_is_not_retried(monkeypatch):
    model = big_model_with_grads()
    seen = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: seen.append(len(ts)) or real(ts, *a, **k))
    check = GradCheck(model)
    check.run()
    assert seen == [4], "the two large weights went through dot, the 4 others through one _foreach_norm"
    weight = model[0].weight
    weight.grad = weight.grad.t().contiguous().t()  # no flat view: the dot path raises
    seen.clear()
    check.run()
    check.run()
    assert seen == [6, 6] and check._dots.big == (), "one fused pass over all, without trying the dots again"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_value_in_a_large_gradient_is_named(value):
    model = big_model_with_grads()
    model[2].weight.grad[17, 5] = value
    check = GradCheck(model)
    flags = StepFlags()
    flags.put("grad_norms", check.run().norm_list)
    read = flags.read()
    assert read.gradient, "the dot's sum of squares is NaN/Inf like the norm"
    assert check.finding(read.grad_norms).nonfinite == ("2.weight",)


def test_gradient_laid_out_unlike_its_parameter_falls_back_to_foreach_norm():
    model = big_model_with_grads()
    expected = [p.grad.norm() for p in model.parameters()]
    weight = model[0].weight
    weight.grad = weight.grad.t().contiguous().t()  # same values, transposed strides: no flat view
    assert not weight.grad.is_contiguous()
    norms = GradCheck(model).run().norms
    assert torch.allclose(norms, torch.stack(expected), rtol=1e-5)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_weight_check_of_large_weights_takes_the_dot_path_and_catches_poison(value):
    model = big_model_with_grads()
    check = WeightCheck(model, every=1)
    assert check._dots.big == (0, 2)
    assert math.isfinite(check.run().item())
    with torch.no_grad():
        model[2].weight[255, 299] = value
    assert not math.isfinite(check.run().item())
    assert check.finding().nonfinite == ("2.weight",)


def test_weight_check_every_n_steps_catches_poisoned_weights():
    model = model_with_grads()
    check = WeightCheck(model, every=3)
    flags = StepFlags()
    seen = []
    for step in range(1, 8):
        if step == 4:
            with torch.no_grad():
                model[2].weight[0, 0] = math.nan
        flags.put("weights", check.maybe_run(step))
        seen.append(flags.read().weights)
    assert seen == [False, False, False, False, False, True, False], "caught at the next due step (6)"
    finding = check.finding(step=6)
    assert finding.nonfinite == ("2.weight",) and finding.counts == (("2.weight", 1, 0),)
    assert WeightCheck(model, every=0).maybe_run(0) is None, "0: never"
    assert WeightCheck(model_with_grads(), every=1).finding() is None
