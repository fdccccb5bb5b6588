"""safetrain.diagnose's pure pieces: row bisection with its limits, the Diagnoser's routing and budget, the step RNG."""

from __future__ import annotations

import contextlib
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from safetrain import distributed
from safetrain.diagnose import Diagnoser, Diagnosis
from safetrain.diagnose.bisect import Bisection, bisect_rows, isolate_rows
from safetrain.diagnose.rng import LOOK_EVERY, StepRNG
from safetrain.distributed import LocalSync

NEVER = math.inf


# ---------------------------------------------------------------- bisection (no torch)
@pytest.mark.parametrize(
    "size, bad, expected",
    [
        (1, set(), Bisection((), 0, "batch has no row dimension to bisect")),
        (None, set(), Bisection((), 0, "batch has no row dimension to bisect")),
        (8, {3}, Bisection((3,), 4, "")),
        (8, {0, 7}, Bisection((0, 7), 7, "")),  # within 2 log2 B + 2
        (64, {5, 41}, Bisection((5, 41), 14, "")),  # 2 log2 B + 2: the two-row case
        (8, set(), Bisection((), 4, "the loss is not per-sample separable: no subset of rows is non-finite alone")),
    ],
)
def test_isolate_rows_table(size, bad, expected):
    found = isolate_rows(size, lambda rows: bool(bad & set(rows)), NEVER, 60.0)
    assert found == expected, f"size {size}, bad rows {sorted(bad)}"


def test_isolate_rows_stops_at_the_deadline_with_the_passes_spent():
    ticks = iter(range(100))
    found = isolate_rows(64, lambda rows: 5 in rows, deadline=2.5, time_limit_s=7.0, clock=lambda: next(ticks))
    assert found == Bisection((), 3, "bisection stopped at detect.replay.time_limit_s=7.0")


def test_isolate_rows_names_a_model_that_cannot_run_on_a_subset():
    def is_bad(rows):
        raise RuntimeError("shape mismatch")

    expected = Bisection((), 1, "bisection not possible: RuntimeError: shape mismatch")
    assert isolate_rows(4, is_bad, NEVER, 60.0) == expected


def test_bisect_rows_never_tests_the_whole_batch_again():
    tested = []
    assert bisect_rows(16, lambda rows: tested.append(len(rows)) or 9 in rows) == [9]
    assert 16 not in tested, tested


def test_bisection_imports_no_torch():
    import importlib

    saved = {k: v for k, v in sys.modules.items() if k == "torch" or k.startswith("torch.")}
    module = sys.modules.pop("safetrain.diagnose.bisect")
    try:
        for k in saved:
            sys.modules[k] = None  # type: ignore[assignment]  # an import of torch would fail
        importlib.import_module("safetrain.diagnose.bisect")
    finally:
        sys.modules.update(saved)
        sys.modules["safetrain.diagnose.bisect"] = module


# ---------------------------------------------------------------- the Diagnoser: one entry point, one budget
class FakeStepReplay:
    def __init__(self):
        self.calls = []

    def replay(self, micro, indices=None):
        self.calls.append((list(micro), indices))
        return Diagnosis(reproducible=True)


def diagnoser(max_per_run=3, enabled=True, why_not=""):
    cfg = SimpleNamespace(enabled=enabled, max_per_run=max_per_run, time_limit_s=60.0, keep_steps=4, keep_mb=1.0)
    model = torch.nn.Linear(4, 2)
    d = Diagnoser(
        model,
        None,
        cfg,
        state=None,
        params=list(model.named_parameters()),
        loss_of=lambda b: b,
        autocast=contextlib.nullcontext,
        prepare=lambda b: b,
        sync=LocalSync(),
    )
    step = FakeStepReplay()
    d.wrap_step_replay(lambda inner: step)
    weights = []
    d.weight_replay.why_not = lambda store: why_not
    d.weight_replay.replay = lambda store, rng_moved=False: (
        weights.append(("replay", rng_moved)) or Diagnosis(reproducible=False, kind="weights")
    )
    d.weight_replay.not_replayed = lambda why: (
        weights.append(("not_replayed", why)) or Diagnosis(reproducible=True, kind="weights", note=why)
    )
    return d, step, weights


@pytest.mark.parametrize(
    "kind, why_not, used, step_calls, weight_calls",
    [
        ("forward", "", 1, 1, []),
        ("loss", "", 1, 1, []),
        ("gradient", "", 1, 1, []),
        (None, "", 1, 1, []),  # Guard.diagnose(): a look at a step that did not trip
        ("weights", "", 1, 0, [("replay", False)]),
        ("weights", "no snapshot to replay from", 0, 0, [("not_replayed", "no snapshot to replay from")]),
    ],
)
def test_explain_routes_by_kind_and_spends_the_one_budget(kind, why_not, used, step_calls, weight_calls):
    d, step, weights = diagnoser(why_not=why_not)
    diagnosis = d.explain(kind, micro=["batch"], indices=[[7]], store=object())
    assert isinstance(diagnosis, Diagnosis)
    assert (d.used, len(step.calls), weights) == (used, step_calls, weight_calls), f"kind {kind!r}"
    if step_calls:
        assert step.calls == [(["batch"], [[7]])]


def test_the_replays_keep_no_budget_of_their_own():
    cfg = SimpleNamespace(enabled=True, max_per_run=1, time_limit_s=60.0, keep_steps=4, keep_mb=1.0)
    model = torch.nn.Linear(4, 2)
    d = Diagnoser(
        model,
        None,
        cfg,
        state=None,
        params=list(model.named_parameters()),
        loss_of=lambda b: b,
        autocast=contextlib.nullcontext,
        prepare=lambda b: b,
        sync=LocalSync(),
    )
    for part in (d.step_replay, d.weight_replay, d.rng):
        assert not any(hasattr(part, name) for name in ("used", "replayer", "max_per_run")), type(part).__name__


def test_enabled_until_the_budget_is_spent_by_either_replay():
    d, _, _ = diagnoser(max_per_run=2)
    assert d.enabled
    d.explain("loss", micro=["b"])
    assert d.enabled
    d.explain("weights", store=object())
    assert not d.enabled and d.used == 2, "the weight replay spent the Diagnoser's budget"
    off, _, _ = diagnoser(enabled=False)
    assert not off.enabled


@pytest.mark.parametrize("steps_alone", [True, False])
def test_the_weight_replay_asks_the_guards_sync_not_the_process(monkeypatch, steps_alone):
    """A plain model in a process whose default group was made for another reason (issue 25) has a
    :class:`LocalSync`: its weight replay runs, on its own; only ranks that step together (DDP,
    FSDP2: ``steps_alone`` false) skip it with a note. The process's group is never asked."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert distributed.active(), "the process has a group of 2 ranks"
    cfg = SimpleNamespace(enabled=True, max_per_run=3, time_limit_s=60.0, keep_steps=4, keep_mb=1.0)
    model = torch.nn.Linear(4, 2)
    sync = LocalSync() if steps_alone else SimpleNamespace(steps_alone=False, rank=0, world=2)
    d = Diagnoser(
        model,
        None,
        cfg,
        state=SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1)),
        params=list(model.named_parameters()),
        loss_of=lambda b: b,
        autocast=contextlib.nullcontext,
        prepare=lambda b: b,
        sync=sync,
    )
    d.clear(step=0)  # a snapshot of step 0 to replay from
    d.record_update(1, [torch.ones(2, 4)], None)
    why_not = d.weight_replay.why_not(store=["snapshot of step 0"])
    if steps_alone:
        assert why_not == "", "a rank stepping alone replays its own updates"
    else:
        assert "every rank would have to replay together" in why_not


@pytest.mark.parametrize(
    "kind, kwargs, match",
    [
        ("spike", {}, "no replay explains a 'spike' anomaly"),
        ("input", {}, "no replay explains a 'input' anomaly"),
        ("weights", {}, "needs the snapshot store"),
    ],
)
def test_explain_refuses_what_no_replay_explains(kind, kwargs, match):
    d, step, weights = diagnoser()
    with pytest.raises(ValueError, match=match):
        d.explain(kind, **kwargs)
    assert (d.used, step.calls, weights) == (0, [], [])


def test_record_update_keeps_the_step_rng_state_and_clear_lets_go():
    d, _, _ = diagnoser()
    d.weight_replay.state = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"lr": 0.1}]))
    d.rng.begin_step()
    d.record_update(1, [torch.ones(2, 4)], total=0.5)
    assert d.weight_replay.kept == 1
    d.clear(1)
    assert d.weight_replay.kept == 0
    recorded = []
    d.weight_replay.record = lambda step, micro, total, rng: recorded.append((step, total, rng))
    d.record_update(2, [], total=None)
    assert recorded == [(2, None, d.rng.state)], "the update is kept with the RNG state its step started from"


# ---------------------------------------------------------------- step RNG bookkeeping
def test_step_rng_stops_copying_while_nothing_draws_and_notices_a_draw():
    rng = StepRNG(enabled=True, cuda=False)
    for _ in range(2 * LOOK_EVERY):
        rng.begin_step()
    assert rng.idle, "a whole window between two looks drew nothing"
    assert rng.moved() is False
    torch.rand(1)
    assert rng.moved() is True and not rng.idle, "a draw since the kept state: copies resume"


def test_step_rng_off_keeps_nothing_and_step_start_puts_the_rng_back():
    off = StepRNG(enabled=False, cuda=False)
    off.begin_step()
    assert off.state is None
    rng = StepRNG(enabled=True, cuda=False)
    rng.begin_step()
    first = torch.rand(3)
    after = torch.get_rng_state()
    with rng.step_start():
        assert torch.equal(torch.rand(3), first), "the replay draws what the step drew"
    assert torch.equal(torch.get_rng_state(), after), "the RNG is put back"
