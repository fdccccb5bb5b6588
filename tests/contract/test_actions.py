"""The action contract: every ``Action`` is journaled, counted in ``FitResult``, and survives a snapshot round trip.

One small ``fit`` per action (an 8-step epoch of a tiny MLP, a fault injected at step 3, safetensors
snapshots every 2 healthy steps in the run directory). Parametrized over ``Action`` itself: a new
member without a scenario here fails.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from safetrain import BatchError, SafeTrainer, TrainingAborted, load_config
from safetrain.guard import Guard
from safetrain.kinds import Action
from safetrain.snapshot import SafetensorsStore, TrainState, load_snapshot
from safetrain.steps import COUNTED_BY, Counters
from safetrain.testing import GradFault, OutputFault, PoisonRows, WeightFault
from tests.helpers.models import loader, mlp, regression_data

BASE = ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=2", "detect.replay.enabled=false"]
BAD_ROW = 20  # in the third batch of 8 (the loader does not shuffle): step 3
#: Actions that end ``fit``: no snapshot can follow them in the same run.
TERMINAL = {Action.ABORT: TrainingAborted, Action.RAISE: BatchError}


def poisoned(where):
    return lambda data: PoisonRows(data, indices=[BAD_ROW], where=where)


# action -> (config overrides, dataset wrapper, setup(model, opt) installing a fault)
SCENARIOS = {
    Action.WARN: (
        ["guard.grad_norm_threshold=20", "recovery.actions.grad_norm=warn", "guard.clip_grad_norm=1.0"],
        None,
        lambda m, o: GradFault(m[2].bias, calls=[3], value=1000.0),
    ),
    Action.SKIP_BATCH: ([], poisoned("targets"), None),
    Action.DROP_ROWS: (["sanitize.inputs=drop_rows"], poisoned("inputs"), None),
    Action.REPLACE: (["sanitize.inputs=replace"], poisoned("inputs"), None),
    Action.ZERO_GRADS: ([], None, lambda m, o: GradFault(m[2].bias, calls=[3], value=math.inf)),
    Action.RESTORE: (["detect.check_weights_every=1"], None, lambda m, o: WeightFault(o, m[0].weight, (0, 0), [3])),
    Action.SCALE_LR: (["recovery.actions.forward=scale_lr"], None, lambda m, o: OutputFault(m[0], calls=[3])),
    Action.ABORT: (["recovery.actions.forward=abort"], None, lambda m, o: OutputFault(m[0], calls=[3])),
    Action.RETRY: (["detect.replay.enabled=true"], None, lambda m, o: OutputFault(m[0], calls=[3])),
    Action.RAISE: (["sanitize.inputs=raise"], poisoned("inputs"), None),
}


def test_counted_by_covers_every_action():
    counters = {f.name for f in dataclasses.fields(Counters)}
    assert set(COUNTED_BY) == set(Action), f"actions without a counter: {set(Action) - set(COUNTED_BY)}"
    assert set(COUNTED_BY.values()) <= counters, f"not Counters fields: {set(COUNTED_BY.values()) - counters}"


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)


@pytest.fixture
def snapshots_taken(monkeypatch):
    """The guard's counters at each snapshot it saved, by step (what the file must hold)."""
    taken = {}
    real = Guard.snapshot

    def snapshot(self, force=False):
        event = real(self, force)
        if event.action == "saved":
            taken[self.counters.steps] = dict(vars(self.counters))
        return event

    monkeypatch.setattr(Guard, "snapshot", snapshot)
    return taken


def run(action, run_dir):
    """Fit the action's scenario; returns the trainer and the counters as the run ended."""
    overrides, wrap, setup = SCENARIOS[action]
    model = mlp(seed=0)
    opt = sgd(model)
    if setup is not None:
        setup(model, opt)
    data = regression_data(n=64)
    data = wrap(data) if wrap is not None else data
    cfg = load_config(None, [*BASE, f"log.dir={run_dir}", *overrides])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss)

    def fit():
        return trainer.fit(loader(data, batch_size=8, shuffle=False), epochs=1)

    if action is Action.ABORT:
        with pytest.raises(TrainingAborted) as info:
            fit()
        result = info.value.result
        assert result is not None and result.aborted, "TrainingAborted.result is the FitResult, aborted"
        return trainer, {f.name: getattr(result, f.name) for f in dataclasses.fields(Counters)}
    if action is Action.RAISE:
        with pytest.raises(BatchError):
            fit()
        return trainer, dict(vars(trainer.guard.counters))
    result = fit()
    assert not result.aborted
    return trainer, {f.name: getattr(result, f.name) for f in dataclasses.fields(Counters)}


def fresh_state():
    model = mlp(seed=1)
    return TrainState(model, sgd(model))


def fresh_guard_counters(extra):
    model = mlp(seed=1)
    guard = Guard(model, sgd(model), load_config(None, ["log.progress=false"]))
    try:
        guard.load_state_dict(extra)
        return dict(vars(guard.counters))
    finally:
        guard.close()


@pytest.mark.parametrize("action", list(Action), ids=str)
def test_every_action_is_journaled_counted_and_snapshotted(action, tmp_path, snapshots_taken):
    assert action in SCENARIOS, f"no fit scenario makes the guard take {action!r}: add one to SCENARIOS"
    counter = COUNTED_BY[action]
    run_dir = tmp_path / "run"
    trainer, counters = run(action, run_dir)

    # (a) journaled
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    actions = [r.get("action") for r in records if r["event"] != "summary"]
    assert str(action) in actions, f"{action}: not in the journal's actions {actions}"

    # (b) counted
    assert counters[counter] > 0, f"{action}: counter {counter} is {counters[counter]}"

    # (c) the newest snapshot the guard wrote holds its counters as they stood then; a fresh Guard takes them
    info = load_snapshot(run_dir / "snapshots", fresh_state())
    assert info.extra["counters"] == snapshots_taken[info.step], f"{action}: snapshot at step {info.step}"
    if action not in TERMINAL:  # the fault came before the last snapshot
        assert info.extra["counters"][counter] == counters[counter], f"{action}: {counter} in the last snapshot"
    assert fresh_guard_counters(info.extra) == info.extra["counters"], f"{action}: a fresh Guard's counters"

    # ...and the counters as the run ended (after a terminal action too) through a snapshot file
    store = SafetensorsStore(tmp_path / "final")
    model = mlp(seed=0)
    store.save(TrainState(model, sgd(model)), {"step": counters["steps"], **counters}, extra=trainer.guard.state_dict())
    store.close()
    final = load_snapshot(tmp_path / "final", fresh_state())
    assert fresh_guard_counters(final.extra) == counters, f"{action}: the final counters after a round trip"
