"""``detect.granularity: block``: repeated blocks found by structure, one hot hook each, the layer
inside named by the exact re-run, and no second reduction of a tensor already reduced."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from safetrain.detect import ActivationMonitor
from safetrain.detect.blocks import block_of, repeated_blocks
from safetrain.testing import OutputFault, count_host_syncs


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Stack(nn.Module):
    """Embedding-free stand-in of a transformer: input projection, 3 blocks, a final norm, a head."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def forward(monitor: ActivationMonitor, model: nn.Module, x: torch.Tensor, rerun: bool = False, **kw: Any):
    with monitor.attach():
        monitor.reset()
        model(x)
        values = monitor.values().tolist()
        return monitor.locate(values, rerun=(lambda: model(x)) if rerun else None, **kw)


def test_blocks_are_found_by_structure():
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    assert list(repeated_blocks(list(encoder.named_modules()))) == ["layers.0", "layers.1"]
    assert list(repeated_blocks(list(Stack().named_modules()))) == ["blocks.0", "blocks.1", "blocks.2"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert repeated_blocks(list(mlp.named_modules())) == {}, "leaves are their own finest granularity"
    lone = nn.Sequential(Block(), nn.Linear(8, 2))
    assert repeated_blocks(list(lone.named_modules())) == {}, "one block of its class is no repetition"
    nested = nn.Sequential(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block()))
    blocks = repeated_blocks(list(nested.named_modules()))
    assert list(blocks) == ["0", "1"], "only the outermost repeated blocks"
    assert (block_of("0.1.fc1", blocks), block_of("1", blocks), block_of("", blocks)) == ("0", "1", "")


def test_block_granularity_hooks_the_blocks_in_place_of_their_insides():
    model = Stack()
    module = ActivationMonitor(model, skip_passthrough=True)
    block = ActivationMonitor(model, skip_passthrough=True, granularity="block")
    assert module.blocks == () and block.blocks == ("blocks.0", "blocks.1", "blocks.2")
    assert block.names == ("", "inp", "blocks", "blocks.0", "blocks.1", "blocks.2", "norm", "head")
    x = torch.randn(3, 4)
    forward(module, model, x)
    forward(block, model, x)
    assert (len(module.calls), len(block.calls)) == (16, 6), "the root repeats head's output: not reduced again"


@pytest.mark.parametrize("layer", ["inp", "blocks.0.norm", "blocks.1.fc1", "blocks.2.fc2", "norm", "head"])
def test_the_exact_rerun_names_the_layer_inside_a_block(layer):
    torch.manual_seed(0)
    model = Stack()
    OutputFault(model.get_submodule(layer), value=math.inf)
    x = torch.randn(3, 4)
    per_module = forward(ActivationMonitor(model), model, x, rerun=True, step=3)
    by_block = forward(ActivationMonitor(model, granularity="block"), model, x, rerun=True, step=3)
    assert (per_module.module, per_module.confirmed) == (layer, True)
    assert (by_block.module, by_block.module_type, by_block.step) == (layer, per_module.module_type, 3)
    cheap = forward(ActivationMonitor(model, granularity="block"), model, x)
    assert cheap.module == (block_of(layer, {f"blocks.{i}": None for i in range(3)}) or layer), "no re-run: the block"


def test_a_flag_inside_a_block_that_the_rerun_does_not_reproduce_is_cleared():
    """As in module granularity: an unconfirmed flag (a cheap sum's overflow, or a transient
    fault) is no finding; the guard asks for a re-run only when the loss did not trip."""
    torch.manual_seed(0)
    model = Stack()
    OutputFault(model.blocks[1].fc1, calls=[1])  # the step's forward only
    monitor = ActivationMonitor(model, granularity="block")
    x = torch.randn(3, 4)
    assert forward(monitor, model, x, rerun=True) is None
    OutputFault(model.blocks[1].fc1, calls=[1])  # a new fault: its first call is the next forward
    assert forward(monitor, model, x).module == "blocks.1", "without a re-run: the block"


class InPlaceParent(nn.Module):
    """A container that changes its child's output in place after the child's hook ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y[0, 0] = math.nan
        return y


class WithBlocks(nn.Module):
    """``inner`` run under a root that also holds (unused) repeated blocks: block granularity applies."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.blocks = nn.ModuleList(Block(4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_tensor_changed_in_place_after_its_reduction_is_reduced_again():
    model = WithBlocks(InPlaceParent())
    found = forward(ActivationMonitor(model, granularity="block"), model, torch.randn(2, 4))
    assert found is not None and found.module == "inner", "same object, new version: the parent reduces it"


class Returning(nn.Module):
    """A container returning its child's output as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("make", [Returning, InPlaceParent])
def test_a_model_without_blocks_is_hooked_as_in_module_granularity(make):
    model = make()
    for granularity in ("module", "block"):
        monitor = ActivationMonitor(model, granularity=granularity)
        forward(monitor, model, torch.randn(2, 4))
        assert [name for name, _ in monitor.calls] == ["fc", ""], granularity


class Reshaping(nn.Module):
    """A container returning its child's output reshaped (whole) or sliced (part of it)."""

    def __init__(self, part: bool) -> None:
        super().__init__()
        self.fc, self.part = nn.Linear(4, 4), part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y[:, :2] if self.part else y.view(-1)


@pytest.mark.parametrize("part, recorded", [(False, ["inner.fc"]), (True, ["inner.fc", "inner"])])
def test_a_whole_view_of_a_reduced_tensor_is_not_reduced_again(part, recorded):
    model = WithBlocks(Reshaping(part))
    monitor = ActivationMonitor(model, granularity="block")
    forward(monitor, model, torch.randn(2, 4))
    assert [name for name, _ in monitor.calls] == recorded


def test_a_block_holding_a_nan_only_module_is_nan_only():
    model = Stack()
    with_mask = ActivationMonitor(model, nan_only=["blocks.1.fc1"], granularity="block")
    assert [n for n, _, nan_only in with_mask._modules if nan_only] == ["blocks.1"]
    assert [n for n, _, nan_only in with_mask._exact if nan_only] == ["blocks.1.fc1"]


def test_excluded_block_keeps_its_insides_and_granularity_is_checked():
    model = Stack()
    monitor = ActivationMonitor(model, exclude=["blocks.1"], granularity="block")
    assert "blocks.1" not in monitor.names and "blocks.1.fc1" in monitor.names
    assert "blocks.0.fc1" not in monitor.names
    with pytest.raises(ValueError, match="granularity='layer'; expected one of"):
        ActivationMonitor(model, granularity="layer")


def test_healthy_block_forward_makes_no_host_sync():
    model = Stack()
    monitor = ActivationMonitor(model, granularity="block")
    x = torch.randn(3, 4)
    with monitor.attach():
        model(x)
        monitor.reset()
        with count_host_syncs() as syncs:
            model(x)
            monitor.values()
    assert syncs.count == 0, syncs
