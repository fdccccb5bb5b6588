"""The healthy step's Python, counted: calls per step of ``fit`` over a plain AdamW loop (issue #34).

Counted exactly with cProfile, the way ``benchmarks/step_calls.py`` counts them (its functions
are used here, so the test and the benchmark's table cannot drift apart): the marginal calls of a
400-step run over a 200-step run on a tiny MLP, so that set-up cancels. Calls are deterministic,
unlike time; a change that adds work to every healthy step shows here as a number.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "step_calls.py"

#: Extra calls per healthy step over the plain loop, at most: what the code reaches now. The
#: issue's target is 100 (eager) and 80 (lazy); lower these as the healthy path gets cheaper.
BUDGET = {"fit": 87, "fit_lazy": 59}


@pytest.fixture(scope="module")
def step_calls():
    spec = importlib.util.spec_from_file_location("step_calls", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("step_calls", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plain_calls(step_calls):
    return step_calls.calls_per_step("plain")


@pytest.mark.parametrize("variant", sorted(BUDGET), ids=["eager", "lazy"])
def test_a_healthy_step_stays_within_its_call_budget(step_calls, plain_calls, variant):
    extra = step_calls.calls_per_step(variant) - plain_calls
    assert extra <= BUDGET[variant], (
        f"{variant}: {extra:.1f} Python calls a healthy step over the plain loop's {plain_calls:.1f}, "
        f"budget {BUDGET[variant]}; see where they go: python benchmarks/step_calls.py --profile {variant}"
    )
    assert extra > BUDGET[variant] - 20, f"{variant}: {extra:.1f}; lower BUDGET to lock the gain in"
