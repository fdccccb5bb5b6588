"""A step whose finite gradients overflow the float32 norm, through ``fit`` and the step replay.

Issue #18, class 2: plain SGD diverging until its gradients pass ~1.8e19 made the fp32 total norm
Inf; the step was called a non-finite ``gradient`` fault, replayed, found "transient" (no element
was NaN/Inf) and retried. Here the huge gradient is injected (``GradFault`` with a finite factor).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from safetrain import load_config
from safetrain.detect import HUGE_NORM
from safetrain.guard import Guard
from safetrain.testing import GradFault
from tests.helpers.engine import anomalies, fit
from tests.helpers.models import finite_params, loader, mlp, regression_data

FACTOR = 1e25  # gradient entries ~1e23..1e24: finite, their squares overflow float32


def test_finite_gradients_with_an_overflowing_norm_are_grad_norm_with_the_true_norm_and_no_retry():
    def poison(model, opt):
        GradFault(model[2].weight, calls=(5,), value=FACTOR)  # the 5th backward only

    result, model, _ = fit(setup=poison, epochs=1)
    assert anomalies(result) == [("grad_norm", "skip_batch")], "not a transient gradient fault"
    event = next(e for e in result.events if e.name == "anomaly")
    total = event.detail["finding"]["total_norm"]
    assert isinstance(total, float) and HUGE_NORM <= total < math.inf, event.detail
    assert event.detail["finding"]["overflowing"] == ["2.weight"], event.detail
    assert "overflows float32" in event.message and f"{total:.4g}" in event.message, event.message
    assert result.retries == 0 and result.skipped_batches == 1
    assert finite_params(model)


def test_inf_elements_are_still_a_gradient_fault():
    def poison(model, opt):
        GradFault(model[2].weight, calls=(5, 6), value=math.inf)  # the step and its replay

    result, _, _ = fit(setup=poison, epochs=1)
    assert anomalies(result) == [("gradient", "zero_grads")]


def _diagnose_first_micro(calls):
    """A two-micro-batch step whose first backward scales one gradient by FACTOR at ``calls``;
    ``Guard.diagnose()`` replays that micro-batch from the same state."""
    model = mlp()
    GradFault(model[2].weight, calls=calls, value=FACTOR)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(None, ["log.progress=false", "guard.accumulate_steps=2"])
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.step(next(iter(loader(regression_data()))))
        return guard.diagnose()


@pytest.mark.parametrize("calls, reproducible", [(None, True), ((1,), False)], ids=["same", "different"])
def test_a_replay_with_the_same_huge_gradients_is_reproducible_else_transient(calls, reproducible):
    diagnosis = _diagnose_first_micro(calls)
    assert diagnosis.reproducible is reproducible, diagnosis
    if reproducible:
        assert diagnosis.nonfinite_grads == () and "overflows float32 again" in diagnosis.note, diagnosis
        assert "transient" not in diagnosis.describe() and "overflows float32" in diagnosis.describe()
    else:
        assert diagnosis.describe().startswith("transient")
