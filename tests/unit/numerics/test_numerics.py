"""safetrain.numerics: finite values and gradients on every finite input, torch agreement elsewhere.

Property tests (hypothesis) run every helper in float32, float16 and bfloat16, with and without
``torch.autocast("cpu", dtype=torch.bfloat16)``, on inputs that include 0, -0, negatives,
subnormals and values near ``finfo.max``. Reference tests compare against the plain torch op,
evaluated in float64 on the same (rounded) inputs, on well-conditioned inputs. Edge tests pin
down each documented edge value in a table.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import safetrain.numerics as N

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),  # 2 ulps: bf16 keeps 8 significant bits
}
PROPERTY = settings(max_examples=25, deadline=None, database=None)
INF = float("inf")


def _autocast(on: bool) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type="cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _specials(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps  # smallest positive subnormal
    return [0.0, -0.0, sub, -sub, fi.tiny, -fi.tiny, fi.eps, 1.0, -1.0, fi.max, -fi.max]


def _finite_floats(dtype: torch.dtype) -> st.SearchStrategy[float]:
    """Any finite value of ``dtype`` (bfloat16 via width-32 floats, rounded when cast)."""
    fmax = torch.finfo(dtype).max
    width = 16 if dtype == torch.float16 else 32
    floats = st.floats(-fmax, fmax, width=width, allow_nan=False, allow_infinity=False, allow_subnormal=True)
    return st.one_of(st.sampled_from(_specials(dtype)), floats)


def _range(lo: float, hi: float, signed: bool = False) -> st.SearchStrategy[float]:
    """Well-conditioned values: ``[lo, hi]``, or ``+-[lo, hi]`` when ``signed``."""
    mags = st.floats(lo, hi)
    return st.tuples(mags, st.booleans()).map(lambda t: -t[0] if t[1] else t[0]) if signed else mags


def _tensor(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(dtype).requires_grad_()


def _keep(x: torch.Tensor) -> torch.Tensor:
    """A fixed mask for masked_softmax cases: drops every third entry, never the first."""
    return torch.arange(x.shape[-1]) % 3 != 1


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    domains: list[st.SearchStrategy[float]] = field(default_factory=lambda: [_range(-10, 10, True)])


CASES = [
    Case("safe_log", N.safe_log, torch.log, [_range(1e-2, 1e3)]),
    Case("safe_div", N.safe_div, torch.div, [_range(-100, 100), _range(0.5, 100, True)]),
    Case("safe_sqrt", N.safe_sqrt, torch.sqrt, [_range(1e-2, 1e3)]),
    Case("safe_exp", N.safe_exp, torch.exp, [_range(-10, 5)]),
    Case("safe_pow", N.safe_pow, torch.pow, [_range(0.1, 10), _range(-2, 2)]),
    Case("safe_pow_int", lambda x: N.safe_pow(x, 3), lambda x: x**3, [_range(0.1, 5, True)]),
    Case("safe_pow_neg", lambda x: N.safe_pow(x, -1.5), lambda x: x**-1.5, [_range(0.1, 10)]),
    Case("safe_norm", N.safe_norm, torch.linalg.vector_norm, [_range(0.1, 100, True)]),
    Case("safe_acos", N.safe_acos, torch.acos, [_range(-0.9, 0.9)]),
    Case("safe_asin", N.safe_asin, torch.asin, [_range(-0.9, 0.9)]),
    Case("stable_softmax", N.stable_softmax, lambda x: torch.softmax(x, -1)),
    Case("stable_log_softmax", N.stable_log_softmax, lambda x: torch.log_softmax(x, -1)),
    Case(
        "masked_softmax",
        lambda x: N.masked_softmax(x, _keep(x)),
        lambda x: torch.softmax(x.masked_fill(~_keep(x), -INF), -1),
    ),
    Case("safe_logsumexp", N.safe_logsumexp, lambda x: torch.logsumexp(x, -1)),
    Case("sanitize", N.sanitize, torch.nan_to_num),
]
IDS = [c.name for c in CASES]


def _draw_inputs(data: st.DataObject, domains: list, dtype: torch.dtype) -> list[torch.Tensor]:
    n = data.draw(st.integers(1, 6), label="n")
    return [_tensor(data.draw(st.lists(d, min_size=n, max_size=n)), dtype) for d in domains]


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "autocast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
@PROPERTY
@given(data=st.data())
def test_finite_value_and_gradient_on_every_finite_input(case, dtype, autocast, data):
    xs = _draw_inputs(data, [_finite_floats(dtype)] * len(case.domains), dtype)
    with _autocast(autocast):
        out = case.fn(*xs)
    assert out.dtype == dtype, f"{case.name}: output dtype {out.dtype}, expected {dtype}"
    assert torch.isfinite(out).all(), f"{case.name}({xs}) = {out}"
    grads = torch.autograd.grad(out, xs, torch.ones_like(out), allow_unused=True)
    for x, g in zip(xs, grads):
        assert g is None or torch.isfinite(g).all(), f"{case.name}: grad {g} at {x}"


@pytest.mark.parametrize("autocast", [False, True], ids=["eager", "autocast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
@PROPERTY
@given(data=st.data())
def test_matches_torch_on_well_conditioned_inputs(case, dtype, autocast, data):
    xs = _draw_inputs(data, case.domains, dtype)
    refs = [x.detach().double().requires_grad_() for x in xs]
    with _autocast(autocast):
        out = case.fn(*xs)
    ref = case.ref(*refs)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype], msg=lambda m: f"{case.name} value: {m}")
    grads = torch.autograd.grad(out, xs, torch.ones_like(out))
    ref_grads = torch.autograd.grad(ref, refs, torch.ones_like(ref))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg, **TOL[dtype], msg=lambda m: f"{case.name} grad: {m}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_under_autocast_after_a_linear_layer(case):
    """Under CPU bf16 autocast a Linear emits bf16; the helper must work in that dtype, extremes included."""
    values = _specials(torch.bfloat16)
    lin = torch.nn.Linear(len(values), len(values), bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(len(values)))
    x = torch.tensor(values, dtype=torch.bfloat16).float()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        hs = [lin(x) for _ in case.domains]
        out = case.fn(*hs)
    assert hs[0].dtype == torch.bfloat16 and out.dtype == torch.bfloat16, (hs[0].dtype, out.dtype)
    assert torch.isfinite(out).all(), f"{case.name}: {out}"
    for g in torch.autograd.grad(out, hs, torch.ones_like(out), allow_unused=True):
        assert g is None or (g.dtype == torch.bfloat16 and torch.isfinite(g).all()), f"{case.name}: grad {g}"


def test_no_helper_synchronizes_the_host(monkeypatch):
    """Every helper, forward and backward, with the host-sync entry points made to raise."""
    xs = [torch.tensor([0.0, -0.0, 1.0, -2.0, 3e38], requires_grad=True) for _ in range(2)]

    def sync(*_args, **_kwargs):
        raise AssertionError("host sync")

    for name in ("item", "__bool__", "tolist", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for case in CASES:
        out = case.fn(*xs[: len(case.domains)])
        torch.autograd.grad(out, xs[: len(case.domains)], torch.ones_like(out), allow_unused=True)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        (torch.float64, 2.0**-104),
        (torch.float32, 2.0**-46),
        (torch.bfloat16, 2.0**-14),
        (torch.float16, 2.0**-14),
    ],
    ids=str,
)
def test_default_eps_table(dtype, expected):
    eps = N.default_eps(dtype)
    assert eps == expected, f"default_eps({dtype}) = {eps}, expected {expected}"
    assert torch.tensor(eps, dtype=dtype).item() == eps, "eps must be exactly representable"
    assert eps >= torch.finfo(dtype).tiny, "eps must not be subnormal"
    assert torch.isfinite(1 / torch.tensor(eps, dtype=dtype)), "1 / eps must be finite"


def test_fixed_eps_that_underflows_in_float16_is_rejected():
    """A fixed 1e-8 is 0 in float16, so the guard vanishes under fp16 autocast.

    https://github.com/rwightman/efficientdet-pytorch/issues/291 (log(1e-8) NaN/Inf under AMP).
    """
    x = torch.zeros(2, dtype=torch.float16)
    assert torch.isinf(torch.log(x.clamp(min=1e-8))).all(), "the bug this guards against"
    with pytest.raises(ValueError, match=r"eps=1e-08 .*float16"):
        N.safe_log(x, eps=1e-8)
    assert torch.isfinite(N.safe_log(x)).all()
    assert N.safe_log(x, eps=1e-3)[0].item() == pytest.approx(math.log(1e-3), rel=1e-3)


def test_safe_div_edge_values():
    """``torch.where(b == 0, 0, a / b)`` still gives NaN gradients.

    https://github.com/pytorch/pytorch/issues/16317 (NaN gradients even after removing 0/0 with where).
    """
    a = torch.tensor([1.0, 0.0], requires_grad=True)
    b = torch.tensor([0.0, 0.0], requires_grad=True)
    torch.where(b == 0, 0.0, a / b).sum().backward()
    assert torch.isnan(a.grad).any() or torch.isnan(b.grad).any(), "the bug this guards against"

    e = N.default_eps(torch.float32)
    rows = [  # a, b, expected value, expected grad wrt a, expected grad wrt b
        (1.0, 0.0, 1 / e, 1 / e, 0.0),
        (1.0, -0.0, 1 / e, 1 / e, 0.0),  # sign(-0) = +1
        (-1.0, 0.0, -1 / e, 1 / e, 0.0),
        (0.0, 0.0, 0.0, 1 / e, 0.0),
        (1.0, -e / 2, -1 / e, -1 / e, 0.0),
        (6.0, 2.0, 3.0, 0.5, -1.5),
        (3e38, 1e-3, 3.4028234663852886e38, 0.0, 0.0),  # saturated: clamped, zero gradient
    ]
    for av, bv, value, ga, gb in rows:
        a = torch.tensor(av, requires_grad=True)
        b = torch.tensor(bv, requires_grad=True)
        out = N.safe_div(a, b)
        out.backward()
        msg = f"safe_div({av}, {bv})"
        assert out.item() == pytest.approx(value, rel=1e-6), msg
        assert a.grad.item() == pytest.approx(ga, rel=1e-6), msg
        assert b.grad.item() == pytest.approx(gb, rel=1e-6), msg


def test_safe_div_broadcasts_and_keeps_each_input_dtype():
    a = torch.full((3, 1), 60000.0, dtype=torch.float16, requires_grad=True)
    b = torch.tensor([0.5, 2.0, 0.0], requires_grad=True)  # float32: the quotient is float32
    out = N.safe_div(a, b)
    assert out.shape == (3, 3) and out.dtype == torch.float32
    ga, gb = torch.autograd.grad(out, (a, b), torch.ones_like(out))
    assert ga.dtype == torch.float16 and gb.shape == (3,)
    assert torch.isfinite(ga).all() and torch.isfinite(gb).all(), (ga, gb)
    assert N.safe_div(torch.tensor([4.0]), 2).tolist() == [2.0]


def test_sqrt_and_norm_gradients_at_zero():
    """sqrt has an infinite slope at 0, so the norm of a zero vector has a NaN gradient.

    https://github.com/pytorch/pytorch/issues/2421 (gradient of zero norm is nan).
    """
    x = torch.zeros(3, requires_grad=True)
    torch.sqrt(x).sum().backward()
    assert torch.isinf(x.grad).all(), "the bug this guards against"

    for dtype in DTYPES:
        x = torch.tensor([0.0, N.default_eps(dtype) / 4, 4.0], dtype=dtype, requires_grad=True)
        N.safe_sqrt(x).sum().backward()
        cap = 0.5 / math.sqrt(N.default_eps(dtype))
        assert x.grad[0].item() == 0.0, dtype
        assert x.grad[1].item() == pytest.approx(cap, rel=1e-2), f"{dtype}: slope capped at 0.5/sqrt(eps)"
        z = torch.zeros(2, 3, dtype=dtype, requires_grad=True)
        (g,) = torch.autograd.grad(N.safe_norm(z, dim=-1).sum(), z)
        assert (g == 0).all(), f"{dtype}: subgradient at the zero vector is 0, got {g}"


@pytest.mark.parametrize(
    "dtype, values, expected",
    [
        (torch.float32, [1e38, 1e38], 1.4142135e38),  # squares overflow in the plain op
        (torch.float32, [3e38, 3e38], torch.finfo(torch.float32).max),  # true norm out of range
        (torch.float16, [60000.0, 60000.0], 65504.0),
        (torch.float32, [1e-45, 0.0], 1e-45),  # subnormal: no 1/m overflow in the gradient
    ],
)
def test_safe_norm_never_overflows(dtype, values, expected):
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    out = N.safe_norm(x)
    out.backward()
    assert out.item() == pytest.approx(expected, rel=1e-3), f"safe_norm({values})"
    assert torch.isfinite(x.grad).all() and (x.grad.abs() <= 1).all(), x.grad


@pytest.mark.parametrize("fn, edge", [(N.safe_acos, (0.0, math.pi)), (N.safe_asin, (math.pi / 2, -math.pi / 2))])
def test_acos_asin_at_and_beyond_one(fn, edge):
    x = torch.tensor([1.0, -1.0, 1.0000001, -1.0000001], requires_grad=True)
    out = fn(x)
    out.sum().backward()
    assert out.tolist() == pytest.approx([*edge, *edge], abs=1e-6), out
    cap = 1 / math.sqrt(N.default_eps(torch.float32))
    assert x.grad[:2].abs().tolist() == pytest.approx([cap, cap], rel=1e-3), x.grad
    assert x.grad[2:].tolist() == [0.0, 0.0], "outside [-1, 1] the clamp has zero gradient"


def test_safe_exp_saturates_with_zero_gradient():
    for dtype in DTYPES:
        x = torch.tensor([0.0, 1e4, torch.finfo(dtype).max], dtype=dtype, requires_grad=True)
        out = N.safe_exp(x)
        out.sum().backward()
        assert torch.isfinite(out).all() and out[0].item() == 1.0, (dtype, out)
        assert x.grad.tolist() == [1.0, 0.0, 0.0], (dtype, x.grad)


@pytest.mark.parametrize(
    "base, exponent, value, grad",
    [
        (-2.0, 3.0, -8.0, 12.0),  # integer exponent: negative base allowed
        (-2.0, 2.0, 4.0, -4.0),
        (-2.0, 0.5, 0.0, 0.0),  # fractional exponent: the base is taken as 0
        (0.0, 0.5, 0.0, 0.5 * 2.0**23),  # slope p * eps**(p-1), finite
        (0.0, 2.0, 0.0, 0.0),
        (0.0, 1.0, 0.0, 1.0),
        (0.0, 0.0, 1.0, 0.0),
        (0.0, -1.0, 2.0**46, 0.0),  # 0 ** -1 = 1 / eps, base floored: zero gradient
        (4.0, 0.5, 2.0, 0.25),
    ],
)
def test_safe_pow_domain(base, exponent, value, grad):
    x = torch.tensor(base, requires_grad=True)
    p = torch.tensor(exponent, requires_grad=True)
    out = N.safe_pow(x, p)
    gx, gp = torch.autograd.grad(out, (x, p))
    assert out.item() == pytest.approx(value, rel=1e-6), f"safe_pow({base}, {exponent})"
    assert gx.item() == pytest.approx(grad, rel=1e-6), f"d/dx safe_pow({base}, {exponent})"
    assert math.isfinite(gp.item()), f"d/dp safe_pow({base}, {exponent}) = {gp}"


def test_masked_softmax_fully_masked_row_is_zero():
    """A fully masked attention row is all -inf and softmax gives 0/0 = NaN.

    https://github.com/pytorch/pytorch/issues/25110 (softmax of all -inf returns NaN);
    https://github.com/pytorch/pytorch/issues/55056 (feature request: a safe softmax).
    """
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[True, True, False, True], [False] * 4, [True] * 4])
    assert torch.isnan(torch.softmax(x.masked_fill(~mask, -INF), -1)).any(), "the bug this guards against"
    out = N.masked_softmax(x, mask)
    w = torch.randn(3, 4)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    assert (out[1] == 0).all() and (g[1] == 0).all(), (out, g)
    assert g[0, 2] == 0, "masked entries get no gradient"
    ref = torch.softmax(x.masked_fill(~mask, -INF), -1)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]])
    with pytest.raises(TypeError, match="bool"):
        N.masked_softmax(x, mask.float())


def test_all_minus_inf_rows_in_softmax_family():
    x = torch.tensor([[0.0, 1.0], [-INF, -INF], [-INF, 2.0]], requires_grad=True)
    rows = [  # fn, value of the dead row
        (N.stable_softmax, [0.0, 0.0]),
        (N.stable_log_softmax, [0.0, 0.0]),
        (lambda t: N.safe_logsumexp(t, keepdim=True), [-INF]),
    ]
    for fn, dead in rows:
        out = fn(x)
        (g,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert out[1].tolist() == dead, (fn, out)
        assert torch.isfinite(g).all() and (g[1] == 0).all(), (fn, g)
    torch.testing.assert_close(N.safe_logsumexp(x[[0, 2]]), torch.logsumexp(x[[0, 2]], -1))


def test_stable_log_softmax_equals_torch_and_not_the_naive_formula():
    x = torch.tensor([[1.0, 2.0, 3.0], [-5.0, 0.0, 40.0]])
    naive = x - x.amax(-1, keepdim=True) - torch.log((x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True))
    assert torch.isnan(naive).any() or not torch.allclose(naive, torch.log_softmax(x, -1)), "naive is wrong"
    torch.testing.assert_close(N.stable_log_softmax(x), torch.log_softmax(x, -1))
    for dtype in DTYPES:  # finite logits whose difference overflows: clamped, not -inf
        fmax = torch.finfo(dtype).max
        out = N.stable_log_softmax(torch.tensor([fmax, -fmax], dtype=dtype))
        assert out.tolist() == [0.0, -fmax], (dtype, out)


def test_sanitize():
    x = torch.tensor([1.0, float("nan"), INF, -INF], dtype=torch.float16, requires_grad=True)
    out = N.sanitize(x, nan=-1.0, posinf=1e6)
    assert out.tolist() == [1.0, -1.0, 65504.0, -65504.0], out
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.tolist() == [1.0, 0.0, 0.0, 0.0], "replaced entries get zero gradient"
    ints = torch.arange(3)
    assert N.sanitize(ints) is ints
    with pytest.raises(ValueError, match="nan=nan"):
        N.sanitize(x, nan=float("nan"))
