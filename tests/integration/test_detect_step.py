"""A training step composed from the detectors as the guard composes them: one host sync per
healthy step (eager and lazy), and every fault found where it was put."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from safetrain.detect import ActivationMonitor, GradCheck, StepFlags, StepRead, WeightCheck, describe_rows, scan_batch
from safetrain.testing import count_host_syncs

NAN, INF = math.nan, math.inf


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), (4, 4)),
    "cnn": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
        ),
        (4, 2, 4, 4),
    ),
    "transformer": (Encoder, (4, 5, 8)),
    "lstm": (Recurrent, (4, 5, 4)),
}


class Step:
    """scan -> forward (hooks in eager mode) -> loss -> backward -> grad check -> ONE read -> update."""

    def __init__(self, model: nn.Module, mode: str, weights_every: int = 2) -> None:
        self.model = model
        self.monitor = ActivationMonitor(model, enabled=mode == "eager")
        self.handle = self.monitor.attach()
        self.grads = GradCheck(model)
        self.weights = WeightCheck(model, every=weights_every)
        self.flags = StepFlags()
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        self.step = 0

    def __call__(self, x: Any, y: torch.Tensor) -> StepRead:
        self.step += 1
        self.opt.zero_grad(set_to_none=True)
        self.monitor.reset()
        sx = scan_batch(x)
        sy = scan_batch(y, batch_size=sx.batch_size)
        loss = nn.functional.cross_entropy(self.model(sx.batch), sy.batch)
        loss.backward()
        grads = self.grads.run()
        flags = self.flags
        flags.put("input", sx.values)
        flags.put("target", sy.values)
        flags.put("forward", self.monitor.records)
        flags.put("loss", loss)
        flags.put("grad_norms", grads.norm_list)
        flags.put("weights", self.weights.maybe_run(self.step))
        read = flags.read()  # host sync: the one per step
        if read.healthy:
            self.grads.clip_(1.0, read.total_norm)
            self.opt.step()
        return read


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("name", list(MODELS))
def test_exactly_one_host_sync_per_healthy_step(name, mode):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make()
    step = Step(model, mode)
    x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    for i in range(4):  # step 2 and 4 also run the weight check
        with count_host_syncs() as syncs:
            read = step(x, y)
        assert syncs.count == 1, f"{name}/{mode} step {i + 1}: {syncs}"
        assert read.healthy, f"{name}/{mode} step {i + 1}: {read.tripped()}"
        assert math.isfinite(read.loss) and math.isfinite(read.total_norm)
        assert bool(read.forward) is (mode == "eager"), "per-call values only in eager mode"
    step.handle.remove()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_poisoned_input_row_is_found_and_batchnorm_stats_stay_finite(mode):
    torch.manual_seed(0)
    make, shape = MODELS["cnn"]
    model = make()
    step = Step(model, mode)
    x, y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    x[2, 1, 0, 3] = NAN
    read = step(x, y)
    assert read.tripped() == ("input",), "the zero-filled batch keeps the rest of the step finite"
    (finding,) = describe_rows((x, y))
    assert (finding.path, finding.rows, finding.nan_count) == ("batch[0]", (2,), 1)
    assert torch.isfinite(model[1].running_mean).all() and torch.isfinite(model[1].running_var).all()


def test_poisoned_target_is_its_own_flag():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    step = Step(model, "lazy")
    y = torch.tensor([[0.5], [NAN], [1.0]])
    step.flags.put("target", scan_batch(y).values)
    assert step.flags.read().tripped() == ("target",)


@pytest.mark.parametrize(
    "name, layer", [("mlp", "2"), ("cnn", "1"), ("transformer", "encoder.layers.1.linear2"), ("lstm", "lstm")]
)
def test_forward_fault_is_located_from_the_single_read(name, layer):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make()

    def poison(module: nn.Module, args: Any, out: Any) -> Any:
        first = (out[0] if isinstance(out, tuple) else out).clone(memory_format=torch.contiguous_format)
        first.view(-1)[0] = INF
        return (first,) + tuple(out[1:]) if isinstance(out, tuple) else first

    model.get_submodule(layer).register_forward_hook(poison)
    step = Step(model, "eager")
    read = step(torch.randn(*shape), torch.randint(0, 3, (shape[0],)))
    assert "forward" in read.tripped()
    finding = step.monitor.locate(read.forward, step=step.step)
    assert (finding.module, finding.step) == (layer, 1), f"{name}: injected at {layer}"


def test_inf_gradient_in_one_parameter_names_it():
    torch.manual_seed(0)
    model = MODELS["mlp"][0]()
    model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), INF))
    step = Step(model, "lazy")
    before = [p.detach().clone() for p in model.parameters()]
    read = step(torch.randn(4, 4), torch.randint(0, 3, (4,)))
    assert read.tripped() == ("gradient",)
    finding = step.grads.finding(read.grad_norms, threshold=None)
    assert finding.nonfinite == ("2.weight",)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "no update on a tripped step"


def test_poisoned_weights_are_caught_at_the_next_check():
    torch.manual_seed(0)
    model = MODELS["mlp"][0]()
    step = Step(model, "lazy", weights_every=3)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    assert step(x, y).healthy
    with torch.no_grad():
        model[0].bias[0] = INF  # poisoned after step 1's update, before step 2 ...
    step.monitor.enabled = False
    reads = [step(x, y) for _ in range(2)]  # ... the forward trips at once; the weight check at step 3
    assert "weights" not in reads[0].tripped() and "weights" in reads[1].tripped()
    assert step.weights.finding().nonfinite == ("0.bias",)
