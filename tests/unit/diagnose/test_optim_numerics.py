"""Known optimizer numerics: an ``eps`` the update's dtype cannot hold (issue 18, class 4)."""

from __future__ import annotations

import pytest
import torch

from safetrain.diagnose.optim_numerics import explain_optimizer


def _param(dtype=torch.float32):
    return torch.nn.Parameter(torch.zeros(3, dtype=dtype))


@pytest.mark.parametrize(
    "cls",
    [
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.RAdam,
        torch.optim.NAdam,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
    ],
)
def test_eps_zero_is_named_with_the_fix_for_the_adam_and_adagrad_families(cls):
    text = explain_optimizer(cls([_param()], eps=0.0))
    assert text.startswith(f"{cls.__name__} eps=0: ") and "0 / (sqrt(0) + 0) = NaN" in text, text
    assert "fix: a positive eps" in text, text


def test_eps_that_rounds_to_zero_in_float16_is_named():
    assert float(torch.tensor(1e-8, dtype=torch.float16)) == 0.0
    text = explain_optimizer(torch.optim.Adam([_param(torch.float16)]))  # the default eps=1e-8
    assert "Adam eps=1e-08 rounds to 0 in float16" in text and "float32" in text and "1e-4" in text, text


def test_float16_optimizer_state_counts_too():
    p = _param()
    opt = torch.optim.Adam([p])
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg_sq": torch.zeros(3, dtype=torch.float16)}
    assert "rounds to 0 in float16" in explain_optimizer(opt, [p])


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.Adam([p]),  # eps=1e-8 in float32 is held
        lambda p: torch.optim.Adam([torch.nn.Parameter(p.detach().to(torch.bfloat16))]),  # float32's range
        lambda p: torch.optim.SGD([p], lr=0.1),  # no eps: other optimizers keep today's naming
    ],
    ids=["adam float32", "adam bfloat16", "sgd"],
)
def test_nothing_is_named_when_the_eps_is_held_or_there_is_none(make):
    assert explain_optimizer(make(_param())) == ""


def test_only_the_groups_of_the_broken_parameters_are_looked_at():
    good, bad = _param(), _param()
    opt = torch.optim.Adam([{"params": [good]}, {"params": [bad], "eps": 0.0}])
    assert explain_optimizer(opt, [good]) == ""
    assert "Adam eps=0 (param_groups[1])" in explain_optimizer(opt, [bad])
