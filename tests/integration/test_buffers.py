"""A step that is not applied leaves the model's buffers as they were before it (issue 18, class 7).

A forward in train mode updates BatchNorm's running statistics before the step is judged. The
reports this reproduces (torchvision and Hugging Face models under ``skip_batch``): a NaN
activation inside the model left NaN running statistics behind, so eval outputs were NaN and
every later snapshot was refused; ``drop_rows`` ran the forward twice and counted the step twice
(``num_batches_tracked`` 31 after 30 steps).
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, load_config
from safetrain.testing import OutputFault
from tests.helpers.models import finite_params

QUIET = ["log.progress=false", "snapshot.every=2"]


class BasicBlock(torch.nn.Module):
    """torchvision's ResNet ``BasicBlock``, built here (no download): conv-BN-ReLU-conv-BN + identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        BasicBlock(8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 1),
    )


def bn_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def batches(model_name: str, n: int = 8) -> List[tuple]:
    g = torch.Generator().manual_seed(1)
    shape = (16, 3, 6, 6) if model_name == "resnet" else (16, 8)
    return [(torch.randn(*shape, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def inner_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The layer whose output the fault spoils: upstream of a BatchNorm, inside the model."""
    return model[3].conv1 if isinstance(model[3], BasicBlock) else model[0]


@pytest.mark.parametrize("model_name", ["mlp", "resnet"])
@pytest.mark.parametrize("first", ["skip_batch", "retry"])
def test_a_nan_activation_leaves_no_batchnorm_statistics_behind(model_name, first):
    """A NaN activation inside the model at step 4: skipped (``recovery.actions.forward:
    skip_batch``) or found transient and retried (the default). After the step the running
    statistics are those before it (skip) or updated once (retry, ``num_batches_tracked`` equals
    the applied steps); eval outputs are finite; later snapshots are taken, not refused."""
    model = bn_mlp() if model_name == "mlp" else resnet()
    data = batches(model_name)
    overrides = QUIET + (
        ["recovery.actions.forward=skip_batch", "detect.replay.enabled=false"] if first == "skip_batch" else []
    )
    fault = OutputFault(inner_layer(model), calls=[4])
    events = []
    with Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    ) as guard:
        for i, batch in enumerate(data):
            before = buffers(model)
            result = guard.step(batch)
            events += result.events
            if i == 3:
                assert result.action == first, result
                tripped = next(e for e in result.events if e.kind == "forward")
                assert tripped.detail.get("buffers_put_back"), "the journal says the buffers were put back"
                after = buffers(model)
                if first == "skip_batch":
                    assert not result.trained
                    for name, value in before.items():
                        assert torch.equal(after[name], value), f"{name} changed by a skipped step"
                assert all(torch.isfinite(b).all() for b in after.values() if b.is_floating_point())
    fault.remove()
    trained = guard.counters.optimizer_steps
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            assert int(m.num_batches_tracked) == trained, "BatchNorm counts each applied step once"
    refused = [e for e in events if e.kind == "snapshot" and e.action == "refused"]
    saved_after = [e for e in events if e.kind == "snapshot" and e.action == "saved" and e.step > 4]
    assert not refused and saved_after, [(e.step, e.action) for e in events if e.kind == "snapshot"]
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(data[0][0])).all(), "eval output finite"
    assert finite_params(model)


def test_drop_rows_counts_the_step_once_and_matches_the_batch_without_the_bad_row():
    """One NaN input row on a BatchNorm model under ``sanitize.inputs: drop_rows``: the step runs
    again on the kept rows, so BatchNorm counts it once and its running statistics equal those of
    a run whose batch had the bad row removed beforehand (``num_batches_tracked`` was 31 after 30)."""
    data = batches("mlp", 6)
    poisoned = [(x.clone(), y) for x, y in data]
    poisoned[2][0][5, 3] = math.nan
    removed = [(x, y) for x, y in data]
    keep = [i for i in range(16) if i != 5]
    removed[2] = (data[2][0][keep], data[2][1][keep])

    def run(steps):
        model = bn_mlp()
        with Guard(
            model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, QUIET), loss_fn=F.mse_loss
        ) as guard:
            actions = [guard.step(b).action for b in steps]
        return model, actions, guard.counters.optimizer_steps

    model, actions, applied = run(poisoned)
    reference, _, _ = run(removed)
    assert actions[2] == "drop_rows", actions
    assert int(model[1].num_batches_tracked) == applied == len(data)
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(got, want), f"{name}: {got} != {want}"
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("how", ["periodic", "trip"])
def test_buffers_poisoned_from_outside_are_a_weights_fault(how):
    """Running statistics made NaN between steps (code outside the step) are found by the weight
    check as ``weights`` and restored: by the periodic check, or by the exact check after a trip."""
    model = bn_mlp()
    data = batches("mlp", 6)
    overrides = QUIET + (["detect.check_weights_every=1"] if how == "periodic" else [])
    with Guard(
        model, torch.optim.SGD(model.parameters(), lr=0.05), load_config(None, overrides), loss_fn=F.mse_loss
    ) as guard:
        for batch in data[:3]:
            assert guard.step(batch).trained
        model[1].running_var[2] = math.nan
        fault = OutputFault(model[0], calls=[1]) if how == "trip" else None
        result = guard.step(data[3])
        if fault is not None:
            fault.remove()
        kinds = [(e.kind, e.action) for e in result.events]
        assert ("weights", "restore") in kinds, kinds
        finding = next(e for e in result.events if e.kind == "weights").detail["finding"]
        assert "1.running_var" in finding["nonfinite"], finding
        assert torch.isfinite(model[1].running_var).all(), "restored from the snapshot"
        for batch in data[4:]:
            guard.step(batch)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(data[0][0])).all()
