"""The activation monitor: hooks on every module that runs, device-side values, attribution."""

from __future__ import annotations

import json
import math
from collections import namedtuple
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from safetrain.detect import ActivationMonitor, ModuleFinding
from safetrain.testing import count_host_syncs

NAN, INF = math.nan, math.inf


def inject(value: float, at_call: Optional[int] = 0) -> Callable:
    """A forward hook that puts ``value`` into the output on call ``at_call`` (every call: ``None``);
    registered before the monitor's, so the monitor sees the poisoned output."""
    calls = {"n": -1}

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        calls["n"] += 1
        if at_call is not None and calls["n"] != at_call:
            return None
        first = out[0] if isinstance(out, tuple) else out
        poisoned = first.clone(memory_format=torch.contiguous_format)
        poisoned.view(-1)[0] = value
        return (poisoned,) + tuple(out[1:]) if isinstance(out, tuple) else poisoned

    return hook


def run(
    model: nn.Module, *args: Any, monitor: Optional[ActivationMonitor] = None, **kw: Any
) -> Optional[ModuleFinding]:
    """One monitored forward; the values are read once and the first non-finite call located."""
    monitor = monitor or ActivationMonitor(model)
    with monitor.attach():
        monitor.reset()
        model(*args, **kw)
        values = monitor.values()
        return monitor.locate(values.tolist() if values is not None else [])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.encoder(x, src_key_padding_mask=pad).mean(1))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def relu_mlp() -> nn.Module:
    """A 4-8-8-2 ReLU MLP (five modules to name; not the regression ``mlp`` of tests.helpers)."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


MODELS = {
    "mlp": (relu_mlp, lambda: torch.randn(3, 4)),
    "cnn": (cnn, lambda: torch.randn(2, 3, 6, 6)),
    "transformer": (Encoder, lambda: torch.randn(2, 5, 8)),
    "lstm": (Recurrent, lambda: torch.randn(2, 5, 4)),
}


@pytest.mark.parametrize(
    "model_name, layer, value, expected_type",
    [
        ("mlp", "0", NAN, "Linear"),
        ("mlp", "2", INF, "Linear"),
        ("mlp", "4", -INF, "Linear"),
        ("cnn", "0", NAN, "Conv2d"),
        ("cnn", "1", INF, "BatchNorm2d"),
        ("cnn", "3", NAN, "Conv2d"),
        ("cnn", "8", NAN, "Linear"),
        ("transformer", "encoder.layers.0.self_attn", NAN, "MultiheadAttention"),
        ("transformer", "encoder.layers.1.linear1", INF, "Linear"),
        ("transformer", "encoder.layers.1.norm2", NAN, "LayerNorm"),
        ("transformer", "head", NAN, "Linear"),
        ("lstm", "lstm", NAN, "LSTM"),
        ("lstm", "head", INF, "Linear"),
    ],
)
def test_fault_injected_at_a_layer_is_attributed_to_it(model_name, layer, value, expected_type):
    torch.manual_seed(0)
    make, inputs = MODELS[model_name]
    model = make()
    model.get_submodule(layer).register_forward_hook(inject(value))
    finding = run(model, inputs())
    assert finding is not None, f"{model_name}: {value} at {layer} not seen"
    assert (finding.module, finding.module_type, finding.call_index) == (layer, expected_type, 0), (
        f"{model_name}: {value} injected at {layer}"
    )


@pytest.mark.parametrize(
    "model_name, parameter, expected",
    [
        ("transformer", "encoder.layers.0.self_attn.out_proj.weight", "encoder.layers.0.self_attn"),
        ("transformer", "encoder.layers.1.linear2.bias", "encoder.layers.1.linear2"),
        ("lstm", "lstm.weight_hh_l0", "lstm"),
        ("cnn", "4.weight", "4"),
    ],
)
def test_poisoned_weight_blames_the_module_whose_forward_ran(model_name, parameter, expected):
    """``out_proj`` never runs its own forward (MultiheadAttention reads its weight): a leaf-only
    monitor would blame the next leaf (dropout or norm); every-module hooks name the attention."""
    torch.manual_seed(0)
    make, inputs = MODELS[model_name]
    model = make()
    with torch.no_grad():
        model.get_parameter(parameter).view(-1)[0] = NAN
    finding = run(model, inputs())
    assert finding is not None and finding.module == expected, f"{parameter} -> {finding}"


def test_multihead_attention_fully_padded_sample():
    """Rebuilt small from https://github.com/pytorch/pytorch/issues/40932: a sample whose
    ``key_padding_mask`` is all True gives NaN from ``nn.MultiheadAttention`` (need_weights=True,
    its default); the monitor names the attention module, not its unused ``out_proj``."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            h, _ = self.attn(h, h, h, key_padding_mask=pad)
            return self.head(h)

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 5, 4)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[2, 3:] = True
    assert run(model, x, pad) is None, "partial padding is fine"
    pad[1] = True  # the whole second sample is padding
    finding = run(model, x, pad)
    assert finding is not None and (finding.module, finding.module_type) == ("attn", "MultiheadAttention")


class CausalMask(nn.Module):
    """Builds an additive float mask: -inf above the diagonal (legitimate infinities)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -INF)


class MaskedEncoder(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.mask = CausalMask()

    def forward(self, x: torch.Tensor, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.encoder(x, mask=self.mask(x), src_key_padding_mask=pad).mean(1))


def test_nan_only_allows_legitimate_infinities():
    torch.manual_seed(0)
    model, x = MaskedEncoder(), torch.randn(2, 5, 8)
    pad = torch.zeros(2, 5).masked_fill(torch.tensor([[False] * 4 + [True], [False] * 5]), -INF)
    strict = run(model, x, pad)
    assert strict is not None and strict.module == "mask", "without nan_only the -inf mask trips"
    assert run(model, x, pad, monitor=ActivationMonitor(model, nan_only=["mask"])) is None, "no false alarm"
    model.mask.register_forward_hook(inject(NAN, at_call=0))
    finding = run(model, x, pad, monitor=ActivationMonitor(model, nan_only=["mask"]))
    assert finding is not None and finding.module == "mask", "NaN still trips a nan_only module"


def test_passthrough_modules_are_skipped_only_when_asked():
    """A ReLU cannot make NaN/Inf from finite inputs; with ``skip_passthrough`` it carries no hook,
    and a fault forced into its output (only a test can do that) is first seen by the next module."""
    model = relu_mlp()
    model[1].register_forward_hook(inject(NAN))
    assert run(model, torch.randn(2, 4)).module == "1"
    model = relu_mlp()
    model[1].register_forward_hook(inject(NAN))
    assert run(model, torch.randn(2, 4), monitor=ActivationMonitor(model, skip_passthrough=True)).module == "2"


def test_shared_module_is_named_with_its_call_index():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.act = nn.Tanh()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.act(self.shared(x)))

    model = Shared()
    model.shared.register_forward_hook(inject(NAN, at_call=1))
    monitor = ActivationMonitor(model)
    finding = run(model, torch.randn(2, 4), monitor=monitor)
    assert (finding.module, finding.call_index, finding.position) == ("shared", 1, 2)
    assert monitor.order == ("shared", "act", ""), "order: first firing of each module, children first"


def test_recurrent_cell_overflow_is_named_at_its_time_step():
    """Rebuilt small from https://github.com/muditbhargava66/PyxLSTM/issues/27 (NaN in an mLSTM
    cell's output): an exponential input gate overflows at one time step; the monitor names the
    cell and the call (time step) where its output first went non-finite."""

    class ExpGateCell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gates = nn.Linear(4 + 3, 3 * 3)

        def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, n: torch.Tensor) -> tuple:
            i, f, o = self.gates(torch.cat([x, h], 1)).chunk(3, 1)
            i = torch.exp(i)  # exponential gating, unstabilized: overflows for large inputs
            c = torch.sigmoid(f) * c + i * torch.tanh(x[:, :3])
            n = torch.sigmoid(f) * n + i
            h = torch.sigmoid(o) * c / n
            return h, c, n

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = ExpGateCell()
            self.head = nn.Linear(3, 1)

        def forward(self, seq: torch.Tensor) -> torch.Tensor:
            h = c = n = torch.zeros(seq.shape[0], 3)
            for t in range(seq.shape[1]):
                h, c, n = self.cell(seq[:, t], h, c, n)
            return self.head(h)

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        model.cell.gates.weight.abs_()
    seq = torch.rand(2, 6, 4)
    seq[:, 3] = 500.0  # one time step with a huge input: exp() overflows there
    finding = run(model, seq)
    assert (finding.module, finding.module_type, finding.call_index) == ("cell", "ExpGateCell", 3)


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    "make_output, expect_trip",
    [
        (lambda h: (h, torch.arange(3)), True),
        (lambda h: [h.detach().clone(), h], True),
        (lambda h: {"ids": torch.arange(3), "emb": h}, True),
        (lambda h: Pair(h.sum(), h), True),
        (lambda h: torch.arange(3), False),
        (lambda h: {"ids": torch.arange(3)}, False),
    ],
)
def test_tuple_list_dict_namedtuple_and_integer_outputs(make_output, expect_trip):
    class Out(nn.Module):
        def forward(self, h: torch.Tensor) -> Any:
            return make_output(h)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = Out()

        def forward(self, x: torch.Tensor) -> Any:
            self.out(x)
            return torch.zeros(())

    finding = run(Model(), torch.tensor([1.0, NAN, 2.0]))
    assert (finding is not None and finding.module == "out") is expect_trip


def test_healthy_forward_makes_no_host_sync():
    torch.manual_seed(0)
    for name, (make, inputs) in MODELS.items():
        model, x = make(), inputs()
        monitor = ActivationMonitor(model)
        with monitor.attach():
            model(x)  # first call: lazy init in torch, outside the count
            monitor.reset()
            with count_host_syncs() as syncs:
                model(x)
                monitor.values()
            assert syncs.count == 0, f"{name}: {syncs}"
            assert len(monitor.records) == len(monitor.calls) > 0, name


def test_hooks_are_removed_by_handle_exit_and_exception():
    model = relu_mlp()
    monitor = ActivationMonitor(model)

    def hook_count() -> int:
        return sum(len(m._forward_hooks) for m in model.modules())

    handle = monitor.attach()
    assert hook_count() == len(monitor.names) == 5 and monitor.attached, "the root Sequential repeats '4'"
    with pytest.raises(RuntimeError, match="already attached"):
        monitor.attach()
    handle.remove()
    handle.remove()  # idempotent
    assert hook_count() == 0 and not monitor.attached
    with monitor.attach():
        assert hook_count() == 5
    assert hook_count() == 0
    with pytest.raises(ValueError, match="boom"):
        with monitor:
            assert hook_count() == 5
            raise ValueError("boom")
    assert hook_count() == 0, "hooks removed on exception"
    monitor.detach()  # no-op when not attached


def test_include_exclude_and_disabled():
    model = relu_mlp()
    assert ActivationMonitor(model, exclude=["0"]).names == ("1", "2", "3", "4")
    assert ActivationMonitor(model, exclude=["4"]).names == ("", "0", "1", "2", "3"), "the root covers '4' now"
    assert ActivationMonitor(model, exclude=["0"], skip_passthrough=True).names == ("2", "4")
    assert ActivationMonitor(model, include=["2", "4"]).names == ("2", "4")
    assert ActivationMonitor(model, include=["*"], exclude=["*"]).names == ()
    off = ActivationMonitor(model, enabled=False)
    with off.attach():
        model(torch.randn(2, 4))
    assert off.records == [] and off.values() is None and off.flag is None
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_sequential_repeating_a_monitored_child_gets_no_hook():
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Sequential())
    assert ActivationMonitor(model).names == ("0", "1.0", "1.1", "2"), "an empty Sequential is itself hooked"
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    assert ActivationMonitor(model).names == ("0", "1.0", "1.1"), "nested: both containers repeat '1.1'"
    assert ActivationMonitor(model, exclude=["1.1"]).names == ("0", "1", "1.0"), "the inner one is needed, the root not"
    model[1][1].register_forward_hook(inject(NAN))
    assert run(model, torch.randn(2, 4)).module == "1.1"


def test_order_is_recorded_once():
    model = relu_mlp()
    monitor = ActivationMonitor(model)
    with monitor.attach():
        model(torch.randn(2, 4))
        monitor.reset()
        model[0](torch.randn(2, 4))  # a partial forward later does not change the recorded order
        assert monitor.order == ("0", "1", "2", "3", "4")
        assert monitor.calls == (("0", 0),)


def test_inspect_confirms_with_statistics_and_restores_buffers():
    torch.manual_seed(0)
    model = cnn()
    model[3].register_forward_hook(inject(INF, at_call=None))
    x = torch.randn(2, 3, 6, 6)
    monitor = ActivationMonitor(model)
    with monitor.attach():
        model(x)
        stats = model[1].running_mean.clone()
        n = len(monitor.records)
        with torch.no_grad(), monitor.inspect() as seen:
            model(x)
        assert len(monitor.records) == n, "the re-run's fast records are discarded"
        located = monitor.locate(monitor.values().tolist(), rerun=lambda: model(x), step=7, epoch=1, batch_index=3)
    f = seen.finding
    assert (f.module, f.module_type, f.confirmed) == ("3", "Conv2d", True)
    assert f.output.inf_count == 1 and f.output.nan_count == 0 and f.output.shape == (2, 4, 6, 6)
    assert f.input is not None and f.input.inf_count == 0 and f.input.finite_max is not None
    assert len(f.output.head) == 8 and math.isinf(f.output.head[0])
    assert (located.module, located.confirmed, located.step, located.epoch, located.batch_index) == ("3", True, 7, 1, 3)
    assert torch.equal(model[1].running_mean, stats), "re-runs under inspect() put BatchNorm statistics back"
    data = json.loads(located.to_json())
    assert data["type"] == "ModuleFinding" and data["output"]["head"][0] == "inf"


def test_overflowing_sum_is_a_false_alarm_cleared_by_rerun():
    class Big(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3e38  # finite values whose float32 sum overflows

    model = nn.Sequential(Big())
    x = torch.ones(4)
    monitor = ActivationMonitor(model)
    with monitor.attach():
        model(x)
        values = monitor.values().tolist()
        cheap = monitor.locate(values)
        assert cheap is not None and cheap.module == "0" and not cheap.confirmed, "the cheap sum overflowed"
        assert monitor.locate(values, rerun=lambda: model(x)) is None, "an exact re-run clears it"
        with pytest.raises(ValueError, match="before reset"):
            monitor.locate(values + [1.0])
