"""The recovery executor as a table: (anomaly, the policy's decision) -> outcome, events, counters, state. No fit.

Each row builds a ``Linear(4, 2)`` with SGD, a real ``MemoryStore`` holding a snapshot of it, the
``LRBackoff``, the ``RecoveryState`` and the ``Counters``; the policy decides as the protocol has
it (``decide`` on the state's history) and ``Recovery.carry_out`` carries the decision out.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safetrain import TrainingAborted, detect, load_config
from safetrain.diagnose import Diagnosis
from safetrain.distributed import LocalSync
from safetrain.guard.batches import row_findings
from safetrain.guard.context import Context
from safetrain.guard.lr import LRBackoff
from safetrain.guard.recovery import Recovery, Rerun
from safetrain.guard.state import RecoveryState
from safetrain.kinds import Kind
from safetrain.policy import Anomaly, History, Rules, decide
from safetrain.snapshot import MemoryStore, TrainState
from safetrain.stats.gradclip import NormStats
from safetrain.stats.spike import SpikeDetector
from safetrain.steps import Counters, Pending

BASE = ["log.progress=false"]
LR = 0.1
ROWS = 4


class Rig:
    """A Recovery over real parts; the journal (``emit``), the updates' ``not_applied`` and the
    replays told of a restore (``restored``) record their calls."""

    def __init__(self, overrides=(), nan_rows=(), snapshots=(2,)):
        self.cfg = cfg = load_config(None, [*BASE, *overrides])
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.params = dict(self.model.named_parameters())
        self.counters = Counters(steps=5, epoch=0, batch=5)
        self.state = RecoveryState(cfg.recovery)
        self.store = MemoryStore(keep=2)
        self.train_state = TrainState(self.model, self.opt)
        self.backoff = LRBackoff(self.opt, cfg.recovery.min_lr)
        self.grads = detect.GradCheck(list(self.params.items()))
        self.events, self.not_applied, self.restored = [], [], []
        self.saved = {}  # snapshot step -> parameters then
        for step in snapshots:  # each snapshot's parameters differ: a restore says which came back
            with torch.no_grad():
                self.model.weight.add_(1.0)
            self.store.save(
                self.train_state, {"step": step, "epoch": 0, "batch": step}, extra={"lr": self.backoff.state_dict()}
            )
            self.saved[step] = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():  # the live parameters moved on since
            self.model.weight.add_(1.0)
        self.before = {n: p.detach().clone() for n, p in self.params.items()}
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)
        for r in nan_rows:
            x[r, 0] = math.nan
        self.batch = (x, y)
        self.pending = Pending(micro=[self.batch], indices=[[10, 11, 12, 13]])
        F.mse_loss(self.model(torch.nan_to_num(x, 0.0)), y).backward()
        detectors = types.SimpleNamespace(grads=self.grads, norm_stats=NormStats(), spike=SpikeDetector())
        self.scheduled = []  # the losses a scheduler following batches was stepped on
        updates = types.SimpleNamespace(
            not_applied=lambda loss: self.not_applied.append(True), skipped_data=self._skipped_data
        )
        diagnoser = types.SimpleNamespace(rng_reset=lambda: None, clear=self.restored.append)
        self.recovery = Recovery(
            cfg,
            Context(self.counters, self.emit, LocalSync()),
            self.state,
            types.SimpleNamespace(store=self.store, state=self.train_state),
            detectors,
            self.backoff,
            updates,
            types.SimpleNamespace(put_back=tuple),
            diagnoser,
            self.params,
        )

    def _skipped_data(self, loss):
        """What ``Updates.skipped_data`` does: a skipped step counted, the scheduler told its loss."""
        self.counters.skipped_batches += 1
        self.scheduled.append(loss)

    def emit(self, cls, kind, action, message, detail, at=None):
        epoch, batch = at if at is not None else (0, 4)
        event = cls(
            step=self.counters.steps,
            epoch=epoch,
            batch=batch,
            kind=str(kind),
            action=str(action),
            message=message,
            detail=detail,
        )
        self.events.append(event)
        return event

    def read(self):
        return detect.StepRead(loss=0.5, total_norm=self.total_norm(), grad_norms=())

    def total_norm(self, skip=()):
        return math.hypot(*(float(p.grad.norm()) for n, p in self.params.items() if n not in skip))

    def carry_out(self, anomaly, history=None, diagnosis=None):
        """Decide as the protocol does (the state's history moves), then carry the decision out."""
        if history is not None:
            self.state.history = history
        decision, self.state.history = decide(anomaly, self.state.history, Rules.of(self.cfg), diagnosis)
        return self.recovery.carry_out(anomaly, decision, self.read(), self.pending, diagnosis, loss=0.5)

    def params_equal(self, reference):
        return all(torch.equal(p, reference[n]) for n, p in self.params.items())


def loss_anomaly(rig):
    return Anomaly(Kind.LOSS, {"finding": detect.LossFinding(kind="loss", value=math.nan, step=5)})


def gradient_anomaly(rig):
    with torch.no_grad():
        rig.model.bias.grad[0] = math.inf
    return Anomaly(Kind.GRADIENT, {"finding": rig.grads.finding(rig.grads.run(), step=5)})


def input_anomaly(rig):
    rows = [f for f in row_findings(rig.batch, rig.cfg.sanitize) if f.kind == "input"]
    return Anomaly(Kind.INPUT, {"rows": rows})


def overflow_anomaly(rig):
    return Anomaly(Kind.OVERFLOW, {"scale": 1024.0, "new_scale": 512.0})


def transient(rig):
    return Diagnosis(reproducible=False, module="0")


# What each row checks beyond the table's columns.
def zeroed_exactly_the_bias(rig, outcome):
    return (
        torch.equal(rig.model.bias.grad, torch.zeros(2))
        and bool(rig.model.weight.grad.abs().sum() > 0)
        and outcome.total_norm == pytest.approx(rig.total_norm())
    )


def restored_step(step):
    def check(rig, outcome):
        return (
            rig.params_equal(rig.saved[step])
            and rig.restored == [step]
            and next(e for e in rig.events if e.name == "restored").detail["snapshot_step"] == step
        )

    return check


def not_restored(rig, outcome):
    return rig.params_equal(rig.before) and rig.restored == [] and len(rig.store) == len(rig.saved)


def retried_the_same_batches(rig, outcome):
    rerun = outcome.rerun
    return (
        len(rerun.batches) == 1
        and rerun.batches[0] is rig.batch
        and rerun.indices == [[10, 11, 12, 13]]
        and rig.events[0].detail["diagnosis"]["reproducible"] is False
    )


def kept_rows(n):
    def check(rig, outcome):
        ((x, y),) = outcome.rerun.batches
        return x.shape[0] == y.shape[0] == n and bool(torch.isfinite(x).all())

    return check


def marked_skipped(rig, outcome):
    return rig.state.history.recent[-1] == 1 and "every row is bad" in rig.events[0].message


def scaled_lr(rig, outcome):
    return rig.opt.param_groups[0]["lr"] == pytest.approx(LR * 0.5) and rig.backoff.scale == 0.5


def overflow_detail(rig, outcome):
    return dict(rig.events[0].detail) == {"scale": 512.0, "overflows_in_a_row": 1, "rung": 1}


ANOMALY = "anomaly"
TABLE = [
    # (id, overrides, rig kwargs, anomaly, history, diagnosis,
    #  action, apply, rerun, counters moved, events (name, kind, action), not_applied calls, check, msg)
    (
        "skip_batch",
        [],
        {},
        loss_anomaly,
        None,
        None,
        "skip_batch",
        False,
        None,
        {},
        [(ANOMALY, "loss", "skip_batch")],
        1,
        not_restored,
        "skip_batch: the step is not applied, nothing restored",
    ),
    (
        "warn",
        ["recovery.actions.loss=warn"],
        {},
        loss_anomaly,
        None,
        None,
        "warn",
        True,
        None,
        {"warnings": 1},
        [(ANOMALY, "loss", "warn")],
        0,
        lambda rig, o: o.total_norm == pytest.approx(rig.total_norm()) and not_restored(rig, o),
        "warn: applied with the read's norm",
    ),
    (
        "zero_grads",
        [],
        {},
        gradient_anomaly,
        None,
        None,
        "zero_grads",
        True,
        None,
        {"zeroed_grads": 1},
        [(ANOMALY, "gradient", "zero_grads")],
        0,
        zeroed_exactly_the_bias,
        "zero_grads: exactly the named non-finite gradients are zeroed; the norm of the rest is returned",
    ),
    (
        "restore",
        ["recovery.actions.loss=restore", "recovery.skip_batches_after_restore=2"],
        {},
        loss_anomaly,
        None,
        None,
        "restore",
        False,
        None,
        {"restores": 1},
        [(ANOMALY, "loss", "restore"), ("restored", "loss", "restore")],
        1,
        lambda rig, o: restored_step(2)(rig, o) and rig.state.skip_after_restore == 2 and rig.state.since_snapshot == 0,
        "restore: parameters back to the snapshot, data after it to skip",
    ),
    (
        "restore passes over an unverified newest",
        ["recovery.actions.loss=restore"],
        {"snapshots": (2, 4)},
        loss_anomaly,
        History(unverified=True),
        None,
        "restore",
        False,
        None,
        {"restores": 1},
        [(ANOMALY, "loss", "restore"), ("restored", "loss", "restore")],
        1,
        lambda rig, o: restored_step(2)(rig, o) and len(rig.store) == 1,
        "restore with pass_over_newest: the newest snapshot is dropped, the older one comes back",
    ),
    (
        "restore takes a vouched newest",
        ["recovery.actions.loss=restore"],
        {"snapshots": (2, 4)},
        loss_anomaly,
        History(unverified=False),
        None,
        "restore",
        False,
        None,
        {"restores": 1},
        [(ANOMALY, "loss", "restore"), ("restored", "loss", "restore")],
        1,
        lambda rig, o: restored_step(4)(rig, o) and len(rig.store) == 2,
        "restore without pass_over_newest: the newest snapshot comes back",
    ),
    (
        "scale_lr",
        ["recovery.actions.loss=scale_lr"],
        {},
        loss_anomaly,
        None,
        None,
        "scale_lr",
        False,
        None,
        {"restores": 1, "lr_backoffs": 1},
        [(ANOMALY, "loss", "scale_lr"), ("restored", "loss", "scale_lr"), ("lr_changed", "lr", "scale_lr")],
        1,
        lambda rig, o: restored_step(2)(rig, o) and scaled_lr(rig, o),
        "scale_lr: restores, then scales the LR by recovery.lr_factor",
    ),
    (
        "retry",
        [],
        {},
        loss_anomaly,
        None,
        transient,
        "retry",
        False,
        Rerun,
        {"retries": 1},
        [(ANOMALY, "loss", "retry")],
        0,
        retried_the_same_batches,
        "retry: a transient fault runs the same micro-batches again",
    ),
    (
        "drop_rows",
        [],
        {"nan_rows": (1,)},
        input_anomaly,
        None,
        None,
        "drop_rows",
        False,
        Rerun,
        {"dropped_rows": 1},
        [(ANOMALY, "input", "drop_rows")],
        0,
        kept_rows(3),
        "drop_rows: the step runs again on the rows kept",
    ),
    (
        "drop_rows, every row bad",
        [],
        {"nan_rows": range(ROWS)},
        input_anomaly,
        None,
        None,
        "skip_batch",
        False,
        None,
        {},
        [(ANOMALY, "input", "skip_batch")],
        1,
        marked_skipped,
        "drop_rows with every row bad is a skip_batch; the history's last step is marked skipped",
    ),
    (
        "skip_batch for input rows",
        ["sanitize.inputs=skip_batch"],
        {"nan_rows": (0, 2)},
        input_anomaly,
        None,
        None,
        "skip_batch",
        False,
        None,
        {},
        [(ANOMALY, "input", "skip_batch")],
        1,
        not_restored,
        "sanitize.inputs=skip_batch: the step is not applied",
    ),
    (
        "replace",
        ["sanitize.inputs=replace"],
        {"nan_rows": (1, 3)},
        input_anomaly,
        None,
        None,
        "replace",
        False,
        Rerun,
        {"replaced_rows": 2},
        [(ANOMALY, "input", "replace")],
        0,
        lambda rig, o: o.rerun == Rerun() and rig.events[0].detail["count"] == 2,
        "replace: judged again with no batch run (the values were replaced before the forward)",
    ),
    (
        "fp16 overflow",
        ["amp.dtype=float16"],
        {},
        overflow_anomaly,
        None,
        None,
        "skip_batch",
        False,
        None,
        {"scaler_skips": 1},
        [(ANOMALY, "scaler", "skip_batch")],
        1,
        not_restored,
        "an fp16 overflow is the scaler's skip: counted in scaler_skips, journaled as scaler/skip_batch",
    ),
    (
        "fp16 overflows too many",
        ["amp.dtype=float16", "amp.max_overflows=1"],
        {},
        overflow_anomaly,
        None,
        None,
        "restore",
        False,
        None,
        {"restores": 1},
        [(ANOMALY, "scaler", "restore"), ("restored", "scaler", "restore")],
        1,
        lambda rig, o: restored_step(2)(rig, o) and overflow_detail(rig, o),
        "overflows past amp.max_overflows are a scaler anomaly: its first action (restore)",
    ),
]


@pytest.mark.parametrize(
    "name,overrides,rig_kw,anomaly,history,diagnosis,action,apply,rerun,moved,events,skips,check,msg",
    TABLE,
    ids=[r[0] for r in TABLE],
)
def test_carry_out(
    name, overrides, rig_kw, anomaly, history, diagnosis, action, apply, rerun, moved, events, skips, check, msg
):
    rig = Rig(overrides, **rig_kw)
    outcome = rig.carry_out(anomaly(rig), history, diagnosis(rig) if diagnosis else None)
    assert outcome.action == action, f"{msg}: action {outcome.action}"
    assert outcome.apply is apply, f"{msg}: apply {outcome.apply}"
    assert (outcome.rerun is None) if rerun is None else isinstance(outcome.rerun, Rerun), f"{msg}: {outcome.rerun}"
    expected = {**vars(Counters(steps=5, epoch=0, batch=5)), **moved}
    assert vars(rig.counters) == expected, f"{msg}: counters {vars(rig.counters)}"
    got = [(e.name, e.kind, e.action) for e in rig.events]
    assert got == events, f"{msg}: events {got}"
    assert tuple(outcome.events) == tuple(rig.events), f"{msg}: the outcome lists the events it emitted"
    assert len(rig.not_applied) == skips, f"{msg}: not_applied called {len(rig.not_applied)} times"
    assert check(rig, outcome), msg


@pytest.mark.parametrize(
    "overrides,history",
    [(["recovery.actions.loss=abort"], None), (["recovery.max_retries=0"], History(consecutive=1))],
    ids=["first action abort", "past recovery.max_retries"],
)
def test_abort_restores_then_raises(overrides, history):
    """abort restores the last good snapshot, journals it, then raises TrainingAborted with the event."""
    rig = Rig(overrides)
    with pytest.raises(TrainingAborted) as info:
        rig.carry_out(loss_anomaly(rig), history)
    got = [(e.name, e.kind, e.action) for e in rig.events]
    assert got == [(ANOMALY, "loss", "abort"), ("restored", "loss", "abort"), ("aborted", "loss", "abort")], got
    assert info.value.event is rig.events[-1] and info.value.result is None
    assert rig.params_equal(rig.saved[2]) and rig.restored == [2], "abort leaves the state at the last snapshot"
    assert rig.counters.restores == 1 and len(rig.not_applied) == 1, vars(rig.counters)


def test_restore_puts_the_snapshot_lr_back_under_the_scale_in_force():
    """The snapshot's unscaled LR comes back, with the scale in force now (a later backoff is kept)."""
    rig = Rig(["recovery.actions.loss=restore"])
    rig.backoff.set_scale(0.25)
    for group in rig.opt.param_groups:
        group["lr"] = 7.0  # what a scheduler did since the snapshot
    rig.backoff.unscaled = [7.0]
    rig.carry_out(loss_anomaly(rig))
    assert rig.backoff.unscaled == [LR] and rig.opt.param_groups[0]["lr"] == pytest.approx(LR * 0.25)


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one micro-batch a step", "two micro-batches a step"])
def test_skip_data_after_a_restore_skips_a_whole_step_each_time(accumulate):
    """The guard calls it once a window (its micro-batches counted by the step's verbs, the step
    itself by the protocol, the one writer of ``counters.steps``)."""
    rig = Rig([f"guard.accumulate_steps={accumulate}", "guard.scheduler_follows=batch"])
    rig.state.skip_after_restore = 2
    event = rig.recovery.skip_data(0.25)
    assert rig.counters.skipped_batches == 1 and rig.counters.steps == 5, vars(rig.counters)
    assert rig.state.skip_after_restore == 1 and rig.scheduled == [0.25], "the scheduler steps on the step's loss"
    assert (event.name, event.kind, event.action) == ("restored", "restore", "skip_batch")
    assert rig.state.history.recent[-1] == 1, "the skipped step counts toward max_skip_fraction"


def _two_inputs(style):
    g = torch.Generator().manual_seed(2)
    x, z, y = torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 2, generator=g)
    x[1, 0] = z[1, 2] = math.nan  # one row, bad in both input tensors
    return ((x, z), y) if style == "tuple" else {"x": x, "z": z, "y": y}


ROW_COUNTS = [
    # (id, batch style, action, counter, msg)
    ("tuple, replace", "tuple", "replace", "replaced_rows", "one bad row of a tuple of inputs counts once"),
    ("tuple, drop_rows", "tuple", "drop_rows", "dropped_rows", "one bad row of a tuple of inputs is dropped once"),
    ("mapping, drop_rows", "mapping", "drop_rows", "dropped_rows", "one bad row of a mapping is dropped once"),
    ("mapping, replace", "mapping", "replace", "replaced_rows", "one bad row of a mapping counts once"),
]


@pytest.mark.parametrize("name,style,action,counter,msg", ROW_COUNTS, ids=[r[0] for r in ROW_COUNTS])
def test_a_row_bad_in_two_input_tensors_counts_once(name, style, action, counter, msg):
    """A row bad in two tensors of a dict batch is one row (it counted once per tensor before)."""
    rig = Rig([f"sanitize.inputs={action}"])
    rig.batch = _two_inputs(style)
    rig.pending = Pending(micro=[rig.batch], indices=[[]])
    outcome = rig.carry_out(input_anomaly(rig))
    assert outcome.action == action, msg
    assert getattr(rig.counters, counter) == 1, f"{msg}: {counter}={getattr(rig.counters, counter)}"
    assert rig.events[0].detail["count"] == 1, f"{msg}: event count {rig.events[0].detail['count']}"


def _noisy(level: float, spread: float, n: int = 16) -> list:
    """``n`` losses around ``level``, a fixed wiggle of +-``spread``."""
    return [level + spread * ((i * 7) % 5 - 2) / 2 for i in range(n)]


@pytest.mark.parametrize(
    "first, last, worse",
    [
        ([1.0, 0.9, 0.8, 0.7, 0.6], _noisy(0.3, 0.02), False),  # fell
        ([1.0, 1.1, 0.9, 1.0, 1.05], _noisy(1.0, 0.05), False),  # flat, within its noise
        ([1.0, 1.1, 0.9, 1.0, 1.05], _noisy(2.0, 0.05), True),  # ends ~20 noise units above its start
        ([1.0, 580.0, 500.0, 510.0, 505.0], _noisy(500.0, 5.0), True),  # an early blow-up is no start
        ([1e8, 1e6, 1e6, 1e6, 1e6], _noisy(1e6, 1e4), False),  # the first loss itself always counts
        ([-1.0, -1.1, -1.2, -1.3, -1.4], _noisy(-2.0, 0.02), False),  # negative and falling (issue 23)
    ],
)
def test_the_end_of_run_reference_leaves_out_an_early_blow_up(first, last, worse):
    """Issue #18: Adam with the LR x1000 for its first update: step 2's loss is ~580x step 1's and
    stays there; the largest of the first 5 was that blown-up loss, so the run 'finished' 575x
    worse than it started. Losses far above the first (2 x guard.end_margin of the run's noise)
    are left out of the start; issue 23: judged in the run's own noise, whatever the loss's sign,
    offset and scale."""
    for offset, scale in [(0.0, 1.0), (-100.0, 1.0), (0.0, 1 / 64)]:
        state = RecoveryState(load_config().recovery)
        for x in first + last:
            state.count_loss(offset + scale * x)
        assert (state.ended_worse(4.0) is not None) is worse, (offset, scale)
