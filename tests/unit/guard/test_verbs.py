"""The step's four verbs (issue #24): every legal order works, every illegal one raises a sentence
naming the fix and leaves the guard as it was.

A loop the caller owns drives ``begin_batch`` -> forward -> ``record_loss`` -> backward (once per
micro-batch) -> ``decide`` -> ``optimizer.step()`` -> ``finish_step``. Random sequences of the
verbs are checked against a model of the legal moves: a legal call moves the model on, an
illegal one raises ``RuntimeError`` with the fix in its message and changes nothing, so the
sequence goes on from where it was.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safetrain import Guard, TrainingAborted
from safetrain.guard import machine
from safetrain.guard.machine import Phase, Verb
from safetrain.testing import OutputFault
from tests.helpers.models import loader, mlp, regression_data

CFG = {"snapshot": {"every": 3}, "detect": {"check_weights_every": 0}, "log": {"progress": False}}
BATCHES = list(loader(regression_data(), shuffle=False))

#: (state, verb) -> the next state, or the words the RuntimeError must carry (the fix).
MOVES = {
    ("ready", "begin"): "begun",
    ("begun", "begin"): "begun",  # the batch before gave no loss: it is left out of the step
    ("recorded", "begin"): "begun",
    ("decided", "begin"): "call finish_step()",
    ("ready", "record"): "call begin_batch(batch) first",
    ("begun", "record"): "recorded",
    ("recorded", "record"): "call begin_batch(batch) first",
    ("decided", "record"): "call begin_batch(batch) first",
    ("ready", "decide"): "call begin_batch(batch) first",
    ("begun", "decide"): "call record_loss(loss) first",
    ("recorded", "decide"): "decided",
    ("decided", "decide"): "call finish_step()",
    ("ready", "finish"): "call decide()",
    ("begun", "finish"): "call decide()",
    ("recorded", "finish"): "call decide()",
    ("decided", "finish"): "ready",
}
STATES = {"ready", "begun", "recorded", "decided"}
VERBS = {"begin": Verb.BEGIN, "record": Verb.RECORD, "decide": Verb.DECIDE, "finish": Verb.FINISH}


def test_the_model_of_the_moves_is_the_guards_own_table():
    """The state machine the verbs consult (:data:`safetrain.guard.machine.MOVES`) is the one
    this test's model spells out: each legal move goes where the model says, each illegal one
    raises the model's fix; every phase has a move or a refusal for every verb, and a closed
    guard refuses every verb."""
    for (state, verb), after in MOVES.items():
        move = machine.MOVES[Phase(state), VERBS[verb]]
        if after in STATES:
            assert move is Phase(after), (state, verb, move)
        else:
            assert isinstance(move, str) and after in move, (state, verb, move)
    assert set(machine.MOVES) == {(p, v) for p in Phase for v in Verb}
    assert all(isinstance(machine.MOVES[Phase.CLOSED, v], str) for v in Verb)


class Loop:
    """A caller's loop around a guard, one verb at a time."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.guard = Guard(self.model, self.opt, CFG, loss_fn=F.mse_loss)
        self.i, self.batch, self.loss = 0, None, None
        self.decided: Any = None
        self.trained = 0

    def begin(self) -> None:
        self.batch = self.guard.begin_batch(BATCHES[self.i % len(BATCHES)])
        self.i += 1
        x, y = self.batch
        self.loss = F.mse_loss(self.model(x), y)

    def record(self) -> None:
        self.guard.record_loss(self.loss)
        self.loss.backward()

    def decide(self) -> None:
        self.decided = self.guard.decide()
        if self.decided.trained:
            self.opt.step()

    def finish(self) -> None:
        final = self.guard.finish_step()
        assert final.step == self.decided.step and final.trained == self.decided.trained
        self.trained += final.trained


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["begin", "record", "decide", "finish"]), min_size=1, max_size=14))
def test_every_order_of_the_verbs_is_legal_or_raises_the_fix(verbs: List[str]):
    loop, state, decides = Loop(), "ready", 0
    with loop.guard:
        for verb in verbs:
            after = MOVES[(state, verb)]
            if after in STATES:
                getattr(loop, verb)()
                decides += verb == "decide"
                state = after
            else:
                with pytest.raises(RuntimeError, match=after.replace("(", r"\(").replace(")", r"\)")):
                    getattr(loop, verb)()
        assert loop.guard.steps == decides, "each decide() is one step, an illegal call none"
        assert loop.guard.counts.optimizer_steps == loop.trained


def test_the_legal_orders_train_as_guard_step_does():
    """Accumulation (two micro-batches a step), the loss recorded before or after the backward:
    the same model, bitwise, as ``Guard.step``."""
    own_model = mlp()
    cfg = {**CFG, "guard": {"accumulate_steps": 2}}
    own = Guard(own_model, torch.optim.SGD(own_model.parameters(), lr=0.05), cfg, loss_fn=F.mse_loss)
    for b in BATCHES[:8]:
        own.step(b)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, cfg, loss_fn=F.mse_loss)
    for i, b in enumerate(BATCHES[:8]):
        x, y = guard.begin_batch(b)
        loss = F.mse_loss(model(x), y)
        if i % 4 < 2:
            guard.record_loss(loss)
            (loss / 2).backward()
        else:
            (loss / 2).backward()
            guard.record_loss(loss)
        if i % 2:
            if guard.decide().trained:
                opt.step()
            guard.finish_step()
    assert guard.steps == own.steps == 4
    for p, q in zip(model.parameters(), own_model.parameters()):
        assert torch.equal(p, q)


def test_a_verb_after_close_and_a_second_driver_are_refused():
    loop = Loop()
    loop.guard.close()
    with pytest.raises(RuntimeError, match="begin_batch\\(\\) after close\\(\\); make a new Guard"):
        loop.begin()
    with pytest.raises(RuntimeError, match="Guard.step\\(\\) after close\\(\\); make a new Guard"):
        loop.guard.step(BATCHES[0])
    guard = Guard(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), CFG, loss_fn=F.mse_loss)
    guard.step(BATCHES[0])
    for verb in (lambda: guard.begin_batch(BATCHES[1]), guard.decide, guard.finish_step):
        with pytest.raises(RuntimeError, match="driven by Guard.step"):
            verb()
    assert guard.step(BATCHES[1]) is not None, "a refused call changes nothing: the guard steps on"


def test_an_abort_in_decide_leaves_the_verbs_usable_for_a_new_step():
    """``decide`` raising ``TrainingAborted`` ends the step: no finish is due, a new step may begin."""
    loop = Loop()
    OutputFault(loop.model[2], calls=range(2, 10**9))  # a layer NaN from the 2nd forward on: no cure
    with pytest.raises(TrainingAborted):
        for _ in range(20):
            loop.begin()
            loop.record()
            loop.decide()
            loop.finish()
    with pytest.raises(RuntimeError, match="call decide\\(\\)"):
        loop.finish()
    loop.begin()


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(3)
    nn = torch.nn
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def _nan_at(call: int) -> Any:
    count = [0]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        loss = F.mse_loss(out, y)
        return loss * float("nan") if count[0] == call else loss

    return loss_fn


def test_the_data_skipped_after_a_restore_is_one_whole_step_in_either_driver():
    """``recovery.skip_batches_after_restore=1`` with two micro-batches a step: after the restore,
    the next two micro-batches are one skipped step, whoever drives. The caller's loop runs its
    forward on the skipped data (a framework does), which updates BatchNorm's running statistics:
    they are put back, so both runs end bitwise equal, buffers included (fails before: the
    caller-driven run kept the skipped batches' statistics)."""
    cfg = {
        **CFG,
        "guard": {"accumulate_steps": 2},
        "recovery": {"actions": {"loss": "restore"}, "skip_batches_after_restore": 1},
        "detect": {"check_weights_every": 0, "replay": {"enabled": False}},
    }
    data = BATCHES[:12]
    own_model = _bn_model()
    own = Guard(own_model, torch.optim.SGD(own_model.parameters(), lr=0.05), cfg, loss_fn=_nan_at(7))
    own_results = [r for b in data if (r := own.step(b)) is not None]
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = _nan_at(7)
    guard = Guard(model, opt, cfg, loss_fn=loss_fn)
    results = []
    for i, b in enumerate(data):
        x, y = guard.begin_batch(b)
        loss = loss_fn(model(x), y)
        guard.record_loss(loss)
        (loss / 2).backward()
        if i % 2:
            if guard.decide().trained:
                opt.step()
            results.append(guard.finish_step())
            opt.zero_grad()
    actions = [r.action for r in results]
    assert actions == [r.action for r in own_results] == ["", "", "", "restore", "skip_batch", ""], actions
    assert guard.counts.skipped_batches == own.counts.skipped_batches == 2
    for (name, p), q in zip(model.state_dict().items(), own_model.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_batch_whose_forward_fails_is_no_part_of_a_step():
    """An error from the forward (here the model called with keys it does not take) leaves the
    guard ready for the next batch, which makes a step of its own."""
    loop = Loop()
    with pytest.raises(TypeError):
        loop.guard.step({"neither": torch.ones(2)})
    result = loop.guard.step(BATCHES[0])
    assert result is not None and result.trained and result.step == 1
    assert loop.guard.pending.micro and len(loop.guard.pending.micro) == 1
