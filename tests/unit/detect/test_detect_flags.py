"""StepFlags (one read), findings (frozen, JSON-ready) and the host-sync counter."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from safetrain.detect import (
    GradFinding,
    LossFinding,
    ModuleFinding,
    RowFinding,
    StepFlags,
    StepRead,
    WeightFinding,
    tensor_stats,
)
from safetrain.testing import count_host_syncs

T = torch.tensor


@pytest.mark.parametrize(
    "puts, tripped",
    [
        ({"loss": T(1.5), "grad_norms": [T(3.0), T(4.0)], "input": [T(2.0)], "forward": [T(1.0), T(-2.0)]}, ()),
        ({"loss": T(math.nan)}, ("loss",)),
        ({"loss": T(1.0), "input": [T(1.0), T(math.inf)]}, ("input",)),
        ({"target": [T(math.nan)]}, ("target",)),
        ({"forward": [T(1.0), T(math.inf), T(math.nan)]}, ("forward",)),
        ({"grad_norms": [T(1.0), T(math.inf)]}, ("gradient",)),
        ({"total_norm": T(math.nan)}, ("gradient",)),
        ({"weights": T(math.inf), "input": T(True)}, ("input", "weights")),
        ({"gradient": T(False), "weights": T(False), "input": None}, ()),
        ({"scaler_bad": T(True)}, ("scaler_bad",)),
    ],
)
def test_step_read_judges_bool_and_float_values(puts, tripped):
    flags = StepFlags()
    for name, value in puts.items():
        flags.put(name, value)
    read = flags.read()
    assert read.tripped() == tripped, f"puts {list(puts)}"
    assert read.healthy is (not tripped)


def test_one_read_is_one_host_sync_and_gives_numbers():
    flags = StepFlags()
    loss = torch.tensor(0.25, requires_grad=True) * 2
    with count_host_syncs() as syncs:
        flags.put("loss", loss)
        flags.put("grad_norms", [T(3.0), T(4.0)])
        flags.put("forward", [T(1.0, dtype=torch.bfloat16), T(2.0)])
        flags.put("input_rows", T([False, True, False]))
        flags.put("found_inf", T(0.0))
        flags.put("scale", T(65536.0))
        read = flags.read()
    assert syncs.count == 1, str(syncs)
    assert read.loss == 0.5 and read.total_norm == 5.0 and read.grad_norms == (3.0, 4.0)
    assert read.forward == (1.0, 2.0)
    assert read.input and read.rows("input") == (1,)
    assert read.extra == {"found_inf": (0.0,), "scale": (65536.0,)} and read.extra_tripped == ()
    assert flags.read() == StepRead(), "read() clears the flags"


def test_step_read_is_frozen_and_replaceable():
    read = StepRead(loss=1.0, input=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.loss = 2.0  # type: ignore[misc]
    assert dataclasses.replace(read, input=False).healthy


def test_findings_are_frozen_and_serialize_to_strict_json():
    stats = tensor_stats(torch.tensor([1.0, math.nan, math.inf, -3.0]))
    assert (stats.nan_count, stats.inf_count, stats.finite_min, stats.finite_max) == (1, 1, -3.0, 1.0)
    findings = [
        RowFinding(
            kind="input", step=1, path='batch["x"]', rows=(2,), nan_count=1, inf_count=0, shape=(4, 3), dtype="float32"
        ),
        ModuleFinding(kind="forward", module="enc.layers.0", module_type="Linear", value=math.nan, output=stats),
        LossFinding(kind="loss", value=math.inf, epoch=2),
        GradFinding(kind="gradient", total_norm=math.inf, nonfinite=("w",), norms=(("w", math.inf),)),
        WeightFinding(kind="weights", nonfinite=("w",), counts=(("w", 1, 0),)),
    ]
    for f in findings:
        data = json.loads(f.to_json())  # allow_nan=False: non-finite floats must be strings
        assert data["type"] == type(f).__name__ and data["kind"] == f.kind
        with pytest.raises(dataclasses.FrozenInstanceError):
            f.kind = "x"  # type: ignore[misc]
        assert f.describe()
    assert json.loads(findings[1].to_json())["output"]["head"] == [1.0, "nan", "inf", -3.0]
    assert json.loads(findings[3].to_json())["norms"] == {"w": "inf"}
    assert findings[2].with_context(step=9).to_dict()["step"] == 9
    assert tensor_stats(torch.full((2,), math.nan)).finite_min is None


def test_count_host_syncs_counts_each_kind_once_and_restores():
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__")}
    t = torch.tensor([1.0, 2.0])
    with count_host_syncs() as syncs:
        t.sum().item()
        t.tolist()
        bool(t[0])
        float(t[1])
        int(t[0])
        t.numpy()
        repr(t)  # repr reads values: one sync, not one per element
        t.cpu()  # already on the host: not a sync
        torch.nonzero(t)
    assert [what for what, _ in syncs.calls] == [
        "Tensor.item",
        "Tensor.tolist",
        "Tensor.__bool__",
        "Tensor.__float__",
        "Tensor.__int__",
        "Tensor.numpy",
        "Tensor.__repr__",
        "torch.nonzero",
    ]
    assert all("test_detect_flags.py" in where for _, where in syncs.calls)
    for name, fn in originals.items():
        assert getattr(torch.Tensor, name) is fn, f"{name} restored"


def test_values_on_the_host_and_an_accelerator_are_gathered_on_the_accelerator():
    """A non_blocking copy to the host is not waited for by the host's read of it, so a step whose
    values sit on the CPU and a GPU (a CPU batch scanned, a CUDA loss) must gather on the GPU."""
    from safetrain.detect.flags import gather_device

    meta = torch.device("meta")  # an accelerator stand-in
    host, device = torch.zeros(()), torch.zeros((), device=meta)
    assert gather_device([host, device]) == meta
    assert gather_device([device, host]) == meta
    assert gather_device([host, host]) == torch.device("cpu")
