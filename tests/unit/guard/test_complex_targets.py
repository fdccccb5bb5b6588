"""Complex targets given as a bare tensor are scanned like floating ones (issue 16, bad batches)."""

from __future__ import annotations

import math

import pytest
import torch

from safetrain import load_config
from safetrain.guard import Guard
from tests.helpers.models import mlp


def complex_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().pow(2).mean()


@pytest.mark.parametrize("part", ["real", "imag"])
def test_a_complex_target_with_a_nan_or_inf_is_a_target_anomaly(part):
    """Issue 16: the pair path skipped every non-floating target tensor, complex ones too, so a NaN
    in a complex target went unscanned and surfaced as a loss anomaly. Fails before: the events are
    [('loss', ...)], not [('target', 'skip_batch')]."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 1, dtype=torch.complex64)
    y[2, 0] = complex(math.nan, 0.0) if part == "real" else complex(0.0, math.inf)
    model = mlp()
    cfg = load_config(None, ["log.progress=false"])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=complex_mse) as guard:
        result = guard.step((x, y))
        assert [(e.kind, e.action) for e in result.events] == [("target", "skip_batch")]
        assert "batch[1]" in result.events[0].message and "rows [2]" in result.events[0].message
        assert not result.trained
        y[2, 0] = 0.5 + 0.5j
        assert guard.step((x, y)).trained, "a healthy complex target trains"


def test_integer_targets_are_still_not_scanned():
    model = mlp()
    cfg = load_config(None, ["log.progress=false"])

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.expand(-1, 3), y)

    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=loss_fn) as guard:
        result = guard.step((torch.randn(8, 8), torch.zeros(8, dtype=torch.long)))
        assert result.trained and result.events == ()
