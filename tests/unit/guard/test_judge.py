"""The judge as a table: one step's read (and its micro-batches) -> the most upstream anomaly. No fit, no Guard.

Each row runs one real step of a tiny MLP by hand (forward on the zero-filled batch as the guard's
scan leaves it, backward, the fused gradient norms) and reads it through ``detect.StepFlags``; a
row may then poison a parameter or a gradient, or force a flag, as a fault or a sum overflow would.
"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safetrain import detect, load_config
from safetrain.distributed import LocalSync
from safetrain.guard.context import Context, Detectors
from safetrain.guard.judge import Judge
from safetrain.guard.plumbing import Plumbing
from safetrain.kinds import Kind
from safetrain.stats.divergence import DivergenceDetector
from safetrain.stats.gradclip import NormStats
from safetrain.stats.spike import SpikeDetector
from safetrain.steps import Counters, Pending
from safetrain.testing import OutputFault

BASE = ["log.progress=false", "guard.spike.min_history=4"]
ROWS = 4


class Bench:
    """A Judge built from real parts of a ``Linear(4, 3) -> Tanh -> Linear(3, 2)`` model."""

    def __init__(self, overrides=(), fault_calls=None):
        self.cfg = cfg = load_config(None, [*BASE, *overrides])
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
        # a fault on module "0" at these forward calls, hooked before the monitor (as in a user's setup)
        self.fault = OutputFault(self.model[0], calls=fault_calls) if fault_calls else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.params = dict(self.model.named_parameters())
        self.counters = Counters(steps=7, epoch=1, batch=3)
        self.monitor = detect.ActivationMonitor.from_config(self.model, cfg.detect)
        self.monitor.attach()
        self.grads = detect.GradCheck(list(self.params.items()))
        self.periodic = detect.WeightCheck(list(self.params.items()), 1)  # the step's periodic check
        sp = cfg.guard.spike
        self.spike = SpikeDetector(sp.window, sp.min_history, sp.zscore, sp.enabled, sp.min_ratio)
        self.plumbing = Plumbing(self.model, self.opt, cfg.amp)
        self.reruns = []
        detectors = Detectors(
            monitor=self.monitor,
            grads=self.grads,
            weights=self.periodic,
            all_weights=detect.WeightCheck(list(self.params.items()), 0),
            spike=self.spike,
            divergence=DivergenceDetector(enabled=False),
            norm_stats=NormStats(),
        )
        context = Context(self.counters, journal=None, sync=LocalSync())
        self.judge = Judge(cfg, context, detectors, self.plumbing, types.SimpleNamespace(confirm=self.rerun))

    def rerun(self, micro):
        """What ``Forward.rerun`` does: the step's forwards again (on the zero-filled batch)."""
        self.reruns.append(len(micro))
        with torch.no_grad():
            for x, _ in micro:
                self.model(torch.nan_to_num(x, 0.0, 0.0, 0.0))

    def step(
        self,
        x_rows=(),
        y_rows=(),
        y_scale=1.0,
        nan_weight_before=None,
        nan_weight_after=None,
        nan_loss=False,
        bad_grad=None,
        periodic=False,
        force=None,
    ):
        """One step by hand, read in one go; returns ``(read, pending, loss)`` for the judge.

        Args:
            x_rows / y_rows: input / target rows holding a NaN in the micro-batch.
            y_scale: targets scaled (a finite outlier batch: a loss spike, large gradients).
            nan_weight_before / nan_weight_after: a parameter whose first entry is NaN before the
                forward (every forward trips) / after the backward (the update broke it).
            nan_loss: the loss function returns NaN (the model's outputs are finite).
            bad_grad: ``(name, value)``: that parameter's gradient set to ``value`` after the backward.
            periodic: the periodic weight check is put on the read.
            force: fields of the read replaced afterwards (a flag that a finite sum overflowed).
        """
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g) * y_scale
        for r in x_rows:
            x[r, 0] = math.nan
        for r in y_rows:
            y[r] = math.nan
        pending = Pending(micro=[(x, y)], indices=[list(range(ROWS))])
        if nan_weight_before is not None:
            self._poison(nan_weight_before)
        self.monitor.reset()
        self.plumbing.free_grads()
        out = self.model(torch.nan_to_num(x, 0.0, 0.0, 0.0))  # the scan zero-fills bad values
        loss = F.mse_loss(out, torch.nan_to_num(y, 0.0, 0.0, 0.0)) * (math.nan if nan_loss else 1.0)
        self.plumbing.scale(loss).backward()
        if bad_grad is not None:
            name, value = bad_grad
            self.params[name].grad.fill_(value)
        if nan_weight_after is not None:
            self._poison(nan_weight_after)
        self.plumbing.unscale_()
        flags = detect.StepFlags()
        found_inf, scale = self.plumbing.scaler_values()
        flags.put("found_inf", found_inf)
        flags.put("scale", scale)
        flags.put("loss", loss.detach())
        flags.put("grad_norms", self.grads.run().norm_list)
        flags.put("input", torch.tensor(bool(x_rows)))
        flags.put("target", torch.tensor(bool(y_rows)))
        flags.put("forward", self.monitor.records)
        flags.put("weights", self.periodic.run() if periodic else None)
        read = flags.read()
        if force:
            read = dataclasses.replace(read, **force)
        return read, pending, read.loss

    def _poison(self, name):
        with torch.no_grad():
            self.params[name].view(-1)[0] = math.nan


def forward_nan_at(module):
    """A read's ``forward`` values, finite but for the first call of ``module``: the hooks' cheap
    sum tripped there while the loss stayed finite (a sum overflow, or a fault the re-run sees)."""

    def force(bench):
        calls = bench.monitor.calls
        return tuple(math.nan if call == (module, 0) else 1.0 for call in calls)

    return force


def rows_of(*rows):
    return lambda a: [(f.kind, f.path, f.rows) for f in a.detail["rows"]] == list(rows)


def finding(**expected):
    return lambda a: all(getattr(a.detail["finding"], k) == v for k, v in expected.items())


# (id, overrides, step kwargs, spike history, fault calls on module "0", expected kind, check on the anomaly, msg)
TABLE = [
    ("healthy", [], {}, 0, None, None, None, "a clean read is healthy"),
    ("healthy after a history", [], {}, 6, None, None, None, "a usual loss after a history is no spike"),
    (
        "input rows",
        [],
        {"x_rows": (1,)},
        0,
        None,
        Kind.INPUT,
        rows_of(("input", "batch[0]", (1,))),
        "a NaN input row in the pending micro-batch is INPUT, with its rows",
    ),
    (
        "input flag, every row finite",
        [],
        {"force": {"input": True}},
        0,
        None,
        None,
        None,
        "an input flag whose rows are all finite (a sum overflow) is judged on as if clean",
    ),
    (
        "target rows",
        [],
        {"y_rows": (0, 2)},
        0,
        None,
        Kind.TARGET,
        rows_of(("target", "batch[1]", (0, 2))),
        "NaN target rows are TARGET, with their rows",
    ),
    (
        "forward",
        [],
        {},
        0,
        [1],
        Kind.FORWARD,
        finding(module="0", kind="forward"),
        "a module's NaN output (loss NaN: no re-run needed) is FORWARD, naming the module",
    ),
    (
        "loss",
        [],
        {"nan_loss": True},
        0,
        None,
        Kind.LOSS,
        lambda a: math.isnan(a.detail["finding"].value),
        "a NaN loss from finite outputs is LOSS",
    ),
    (
        "gradient",
        [],
        {"bad_grad": ("2.bias", math.inf)},
        0,
        None,
        Kind.GRADIENT,
        finding(kind="gradient", nonfinite=("2.bias",)),
        "an Inf gradient is GRADIENT, naming the parameter",
    ),
    (
        "grad_norm",
        ["guard.grad_norm_threshold=0.001"],
        {},
        0,
        None,
        Kind.GRAD_NORM,
        finding(kind="grad_norm", threshold=0.001),
        "a finite total norm above guard.grad_norm_threshold is GRAD_NORM",
    ),
    (
        "grad_norm below the threshold",
        ["guard.grad_norm_threshold=1e9"],
        {},
        0,
        None,
        None,
        None,
        "a total norm below the threshold is healthy",
    ),
    (
        "grad_norm: finite gradients whose float32 norm overflows",
        [],
        {"bad_grad": ("0.weight", 1e20)},
        0,
        None,
        Kind.GRAD_NORM,
        lambda a: (
            a.detail["finding"].overflowing == ("0.weight",)
            and a.detail["finding"].total_norm == pytest.approx(math.sqrt(12) * 1e20, rel=1e-6)
        ),
        "finite elements whose squares overflow float32 are GRAD_NORM with the true norm, no threshold needed",
    ),
    (
        "grad_norm: a finite total above float32's range",
        [],
        {"force": {"grad_norms": (1.5e19, 1.5e19, 0.0, 0.0), "total_norm": math.hypot(1.5e19, 1.5e19)}},
        0,
        None,
        Kind.GRAD_NORM,
        lambda a: a.detail["finding"].total_norm == pytest.approx(math.hypot(1.5e19, 1.5e19)),
        "a total norm whose square overflows float32 is GRAD_NORM even with every norm finite",
    ),
    (
        "spike",
        [],
        {"y_scale": 1000.0},
        6,
        None,
        Kind.SPIKE,
        lambda a: a.detail["z"] > a.detail["threshold"],
        "a finite outlier loss after a history of losses is SPIKE",
    ),
    (
        "no spike before min_history",
        [],
        {"y_scale": 1000.0},
        3,
        None,
        None,
        None,
        "no spike is called before guard.spike.min_history losses",
    ),
    (
        "weights, periodic check",
        [],
        {"nan_weight_after": "0.weight", "periodic": True},
        0,
        None,
        Kind.WEIGHTS,
        finding(kind="weights", nonfinite=("0.weight",)),
        "the periodic check with a parameter really NaN is WEIGHTS",
    ),
    (
        "weights flag, every parameter finite",
        [],
        {"periodic": True, "force": {"weights": True}},
        0,
        None,
        None,
        None,
        "a weight flag with finite parameters (the norms overflowed) is judged on as if clean",
    ),
    (
        "weights found when the forward trips",
        [],
        {"nan_weight_before": "0.weight"},
        0,
        None,
        Kind.WEIGHTS,
        finding(nonfinite=("0.weight",)),
        "NaN parameters make the forward and the loss trip: WEIGHTS, not FORWARD/LOSS",
    ),
    (
        "weights found when the loss trips",
        ["detect.mode=lazy"],
        {"nan_weight_before": "2.weight"},
        0,
        None,
        Kind.WEIGHTS,
        finding(nonfinite=("2.weight",)),
        "lazy mode (no activation hooks): NaN parameters make the loss trip: WEIGHTS, not LOSS",
    ),
    (
        "weights found when a gradient trips",
        [],
        {"nan_weight_after": "2.bias", "bad_grad": ("0.bias", math.nan)},
        0,
        None,
        Kind.WEIGHTS,
        finding(nonfinite=("2.bias",)),
        "NaN parameters seen when a gradient trips: WEIGHTS, not GRADIENT",
    ),
    # precedence: the most upstream kind wins
    (
        "weights over input",
        [],
        {"x_rows": (1,), "nan_weight_after": "0.bias", "periodic": True},
        0,
        None,
        Kind.WEIGHTS,
        None,
        "weights flagged by the periodic check come before input rows",
    ),
    (
        "input over target",
        [],
        {"x_rows": (1,), "y_rows": (2,)},
        0,
        None,
        Kind.INPUT,
        rows_of(("input", "batch[0]", (1,))),
        "input rows come before target rows",
    ),
    (
        "target over forward",
        [],
        {"y_rows": (2,)},
        0,
        [1],
        Kind.TARGET,
        None,
        "target rows come before a module's NaN output",
    ),
    (
        "forward over loss",
        [],
        {"nan_loss": True},
        0,
        [1],
        Kind.FORWARD,
        None,
        "a module's NaN output comes before the NaN loss it causes",
    ),
    (
        "loss over gradient",
        [],
        {"nan_loss": True, "bad_grad": ("2.bias", math.inf)},
        0,
        None,
        Kind.LOSS,
        None,
        "a NaN loss comes before non-finite gradients",
    ),
    (
        "gradient over grad_norm",
        ["guard.grad_norm_threshold=0.001"],
        {"bad_grad": ("2.bias", math.inf)},
        0,
        None,
        Kind.GRADIENT,
        None,
        "non-finite gradients come before a norm above the threshold",
    ),
    (
        "grad_norm over spike",
        ["guard.grad_norm_threshold=0.001"],
        {"y_scale": 1000.0},
        6,
        None,
        Kind.GRAD_NORM,
        None,
        "a norm above the threshold comes before a loss spike",
    ),
    # the forward flag with a finite loss is confirmed by an exact re-run
    (
        "forward flag confirmed by the re-run",
        [],
        {"force_forward": "0"},
        0,
        [2],
        Kind.FORWARD,
        finding(module="0"),
        "a forward flag with a finite loss is FORWARD when the exact re-run sees the NaN",
    ),
    (
        "forward flag not confirmed",
        [],
        {"force_forward": "0"},
        0,
        None,
        None,
        None,
        "a forward flag with a finite loss and a clean exact re-run (a sum overflow) is judged on as if clean",
    ),
    # detect.mode=off: the weights are never looked at
    (
        "mode off: weights flag",
        ["detect.mode=off"],
        {"nan_weight_after": "0.weight", "force": {"weights": True}},
        0,
        None,
        None,
        None,
        "detect.mode=off never reports weights, flagged or not",
    ),
    (
        "mode off: loss with NaN weights",
        ["detect.mode=off"],
        {"nan_weight_before": "0.weight"},
        0,
        None,
        Kind.LOSS,
        None,
        "detect.mode=off: NaN parameters leave a LOSS anomaly, never WEIGHTS",
    ),
]


@pytest.mark.parametrize("name,overrides,kw,history,fault_calls,expected,check,msg", TABLE, ids=[r[0] for r in TABLE])
def test_judge(name, overrides, kw, history, fault_calls, expected, check, msg):
    bench = Bench(overrides)
    usual = bench.step()[2]  # a clean step's loss: the history is made of losses like it
    bench = Bench(overrides, fault_calls)
    for i in range(history):
        bench.spike.add(usual * (0.9 + 0.05 * i))
    kw = dict(kw)
    force_forward = kw.pop("force_forward", None)
    read, pending, loss = bench.step(**kw)
    if force_forward is not None:
        read = dataclasses.replace(read, forward=forward_nan_at(force_forward)(bench))
    anomaly = bench.judge(read, pending, loss)
    got = anomaly.kind if anomaly is not None else None
    assert got == expected, f"{msg}: got {got} ({anomaly})"
    if check is not None:
        assert check(anomaly), f"{msg}: detail {dict(anomaly.detail)}"
    if anomaly is not None and "finding" in anomaly.detail and anomaly.detail["finding"] is not None:
        where = anomaly.detail["finding"]
        assert (where.step, where.epoch, where.batch_index) == (7, 1, 2), f"{msg}: the finding says where: {where}"


@pytest.mark.parametrize("loss_nan", [True, False], ids=["loss NaN: no re-run", "loss finite: one re-run"])
def test_forward_flag_reruns_only_when_the_loss_is_finite(loss_nan):
    bench = Bench(fault_calls=[1, 2])
    read, pending, _ = bench.step()
    if not loss_nan:  # the hooks' sum tripped, the loss did not
        read = dataclasses.replace(read, loss=1.0)
    anomaly = bench.judge(read, pending, read.loss)
    assert anomaly is not None and anomaly.kind is Kind.FORWARD, anomaly
    assert bench.reruns == ([] if loss_nan else [1]), f"re-runs: {bench.reruns}"


def test_fp16_overflow_needs_the_scaler():
    """A real CPU GradScaler (amp.dtype=float16): an Inf gradient is the scaler's overflow, with the
    scale as read and the scale after its backoff; without a scaler it is a GRADIENT anomaly."""
    bench = Bench(["amp.dtype=float16", "amp.init_scale=1024"])
    assert bench.plumbing.scaler.enabled, "float16 makes a GradScaler"
    read, pending, loss = bench.step(bad_grad=("2.bias", math.inf))
    assert read.extra["found_inf"][0] == 1.0 and read.extra["scale"] == (1024.0,), read.extra
    anomaly = bench.judge(read, pending, loss)
    assert anomaly is not None and anomaly.kind is Kind.OVERFLOW, anomaly
    assert dict(anomaly.detail) == {"scale": 1024.0, "new_scale": 512.0}, anomaly.detail


class _FakeScalerPlumbing:
    """A plumbing whose scaler is on (what the judge reads of it: ``scaler.enabled`` and ``backoff_factor``)."""

    scaler = types.SimpleNamespace(enabled=True)

    @staticmethod
    def backoff_factor():
        return 0.25


OVERFLOW = [
    # (id, read fields, NaN weights, expected kind, msg)
    ("overflow", {"gradient": True}, False, Kind.OVERFLOW, "found_inf with an Inf gradient is OVERFLOW"),
    (
        "overflow, weights not looked at",
        {"gradient": True},
        True,
        Kind.OVERFLOW,
        "the scaler explains the gradient trip: OVERFLOW, no exact weight check is paid",
    ),
    (
        "loss over overflow",
        {"gradient": True, "loss": math.nan},
        False,
        Kind.LOSS,
        "a NaN loss comes before the overflow",
    ),
    (
        "weights over overflow when the loss trips",
        {"gradient": True, "loss": math.nan},
        True,
        Kind.WEIGHTS,
        "a NaN loss checks the weights: NaN parameters come first",
    ),
    ("no overflow", {}, False, None, "found_inf = 0 is healthy"),
]


@pytest.mark.parametrize("name,fields,nan_weights,expected,msg", OVERFLOW, ids=[r[0] for r in OVERFLOW])
def test_overflow_rows_with_a_fake_scaler(name, fields, nan_weights, expected, msg):
    bench = Bench(["detect.mode=lazy"])
    bench.judge.plumbing = _FakeScalerPlumbing()
    found = 1.0 if fields.get("gradient") else 0.0
    read = detect.StepRead(
        loss=fields.get("loss", 0.5),
        total_norm=1.0,
        gradient=fields.get("gradient", False),
        extra={"found_inf": (found,), "scale": (64.0,)},
    )
    if nan_weights:
        with torch.no_grad():
            bench.params["0.weight"].view(-1)[0] = math.nan
    anomaly = bench.judge(read, Pending(micro=[(torch.zeros(2, 4), torch.zeros(2, 2))]), read.loss)
    got = anomaly.kind if anomaly is not None else None
    assert got == expected, f"{msg}: got {got}"
    if got is Kind.OVERFLOW:
        assert dict(anomaly.detail) == {"scale": 64.0, "new_scale": 16.0}, f"{msg}: {anomaly.detail}"
