"""Names through torch.compile wrappers: only a wrapper's own ``_orig_mod`` segment is dropped."""

from __future__ import annotations

import torch
from torch import nn

from safetrain.adapters.compiled import is_compiled, plain_namer, unwrap_compiled
from safetrain.detect import ActivationMonitor


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Net(nn.Module):
    """A root that is not a Sequential (its own hook is kept), a regionally compiled block, and a
    submodule of the user's that happens to be called ``_orig_mod``."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.compile(Block(), backend="eager")
        self._orig_mod = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._orig_mod(self.block(x))


def test_only_the_segments_of_compile_wrappers_are_dropped():
    net = torch.compile(Net(), backend="eager")
    plain = plain_namer(net)
    names = [plain(n) for n, _ in net.named_parameters()]
    assert names == ["block.fc.weight", "block.fc.bias", "_orig_mod.weight", "_orig_mod.bias"], names
    assert plain("_orig_mod") == "" and plain("_orig_mod.block._orig_mod") == "block"
    assert is_compiled(net) and not is_compiled(unwrap_compiled(net))
    assert plain_namer(nn.Linear(2, 2))("weight") == "weight"


def test_the_monitor_names_a_regionally_compiled_block_as_the_user_does():
    monitor = ActivationMonitor(torch.compile(Net(), backend="eager"), nan_only=["block"])
    assert monitor.names == ("", "block", "block.fc", "_orig_mod"), monitor.names
    assert [nan_only for name, _, nan_only in monitor._modules if name == "block"] == [True]


def test_a_compiled_block_reused_in_several_places_is_named_plainly_everywhere():
    block = Block()
    net = nn.Sequential(torch.compile(block, backend="eager"), nn.ReLU())
    net.append(net[0])  # the same compiled block under a second name
    plain = plain_namer(net)
    assert [plain(k) for k in net.state_dict()] == list(nn.Sequential(block, nn.ReLU(), block).state_dict())


def test_run_eagerly_can_be_called_from_compiled_code():
    """A user's compiled train step that reaches the guard's replay: dynamo must not trace the
    stance switch (it refuses to, with an AssertionError)."""
    from safetrain.adapters.compiled import run_eagerly

    step = torch.compile(lambda x: run_eagerly(lambda: x * 2) + 1, backend="eager")
    assert step(torch.ones(2)).tolist() == [3.0, 3.0]
