"""The decision loop of a step that read anomalous, and what a decided step comes to.

Each turn judges the read, diagnoses (the slow path's replay), decides (the policy) and carries
the decision out (the recovery executor). A re-run (``drop_rows``, ``replace``, ``retry``) is the
next turn: :meth:`Decisions.run` returns to the protocol with the ``Rerun`` (:mod:`.outcomes`) in its verdict,
and the protocol runs the step again and hands the new read back; the loop never calls into the
step. A step that reads clean costs one judgment.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional

from .. import detect
from ..diagnose import Diagnoser, Diagnosis
from ..events import Event
from ..kinds import CAUSE_TESTED, Action, Cause
from ..policy import Anomaly, Rules, decide, raises, read_clean
from ..steps import Pending, StepResult
from .cadence import Cadence
from .context import Context
from .judge import Judge
from .lr import LRBackoff
from .outcomes import Outcome, Verdict
from .recovery import Recovery
from .state import RecoveryState

__all__ = ["Decisions"]


class Decisions:
    """Runs a step's decision loop and closes the decided step.

    Args:
        context: the run's counters.
        judge: a read -> its anomaly (``None``: clean); its loss detectors say whether the loss
            is settled (mid-climb, or above its level, a clean read vouches for nothing).
        recovery: carries out a decision; its store says whether there is a snapshot to restore.
        diagnoser: the slow path's replays and the cause test.
        recovery_state: the policy's history and what recovery remembers.
        backoff: the LR backoff (a clean read trusts the last update's LRs).
    """

    def __init__(
        self,
        context: Context,
        judge: Judge,
        recovery: Recovery,
        diagnoser: Diagnoser,
        recovery_state: RecoveryState,
        backoff: LRBackoff,
    ) -> None:
        self.judge, self.recovery, self.diagnoser, self.store = judge, recovery, diagnoser, recovery.store
        self.recovery_state, self.divergence, self.spike = recovery_state, judge.divergence, judge.spike
        self.backoff, self.counters = backoff, context.counters

    def run(
        self, read: detect.StepRead, pending: Pending, loss: float, rules: Rules, so_far: Optional[Verdict] = None
    ) -> Verdict:
        """One turn of the decision loop on the step's read, its pending micro-batches and its loss:
        judge, diagnose, decide, carry out.

        Args:
            so_far: the verdict the last turn returned, when this read is its re-run's (``None``:
                the step's first read).

        Returns:
            The step's verdict; while its ``rerun`` is set the protocol runs the step again as it
            says and calls again with the next read and this verdict::

                verdict = decisions.run(read, pending, loss, rules)
                while verdict.rerun is not None:
                    read = ...  # the step run again
                    verdict = decisions.run(read, pending, loss, rules, verdict)
        """
        anomaly = self.judge(read, pending, loss)
        if anomaly is None:
            # Unsettled, a read vouches for nothing: a climb may be under way, or the loss stands
            # above its level (a damaged model's loss before the cause test has spoken).
            if not (self.divergence.climbing or self.spike.rising):
                self.backoff.read_clean()  # the last update's LRs are trusted: a restore holds the schedule to them
                self.recovery_state.clean_reads.append(self.counters.steps)
            return Verdict(read, []) if so_far is None else Verdict(read, so_far.events, so_far.rerun_action)
        events, rerun_action, retried = (
            ([], "", False) if so_far is None else (so_far.events, so_far.rerun_action, so_far.retried)
        )
        rs = self.recovery_state
        anomaly = dataclasses.replace(anomaly, retried=retried, again=bool(rerun_action))
        if raises(anomaly.kind, rules):
            self.recovery.reject_rows(anomaly, loss)
        if self._tests_cause(anomaly, rules):  # before the ladder escalates: which cause?
            anomaly = self._cause(anomaly, pending)
        replays = rules.reruns and self.diagnoser.explains(anomaly.kind)  # (a replay runs the step's forward)
        diagnosis = self._explain(anomaly, pending) if replays else None
        # A typed fact for the policy: is there a snapshot to restore (slow path: lists a directory)?
        history = rs.for_policy(has_snapshot=bool(len(self.store)))
        decision, rs.history = decide(anomaly, history, rules, diagnosis)
        outcome = self.recovery.carry_out(anomaly, decision, read, pending, diagnosis, loss=loss)
        events += outcome.events
        if anomaly.cause is not None and anomaly.cause.cause is Cause.DATA_CHANGE:
            self.judge.rebase()  # the new level is the run's level from here on
            rs.rebase()
        if outcome.rerun is None:
            return Verdict(read, events, rerun_action, outcome)
        retried = retried or decision.action is Action.RETRY
        return Verdict(read, events, str(outcome.action), rerun=outcome.rerun, retried=retried)

    def _tests_cause(self, anomaly: Anomaly, rules: Rules) -> bool:
        """Whether the cause test runs: a finite loss far above its level (a spike) that the ladder
        would escalate (the second anomalous step in a row, before a restore or a second skip),
        when the guard can run the forward and a snapshot may witness."""
        return (
            anomaly.kind in CAUSE_TESTED
            and rules.recovery.cause_test
            and rules.reruns
            and not anomaly.again
            and (self._follows_an_anomaly() or anomaly.detail.get("rule") == "level")
            and "median" in anomaly.detail
            and bool(len(self.store))
        )

    def _follows_an_anomaly(self) -> bool:
        """Whether the step before this one was anomalous too (this batch is the fresh one after a
        jump). Not merely a second anomaly on the ladder: one bad batch a few healthy steps after
        another is a bad batch again, and the snapshots doing badly on it says nothing of the data."""
        history = self.recovery_state.history
        return history.consecutive >= 1 and history.healthy_streak == 0

    def _cause(self, anomaly: Anomaly, p: Pending) -> Anomaly:
        """The cause test's verdict on the step's batch, in the anomaly; damage names the step the
        loss jumped at (the first of the anomalous steps in a row)."""
        rs = self.recovery_state
        sigma = anomaly.detail.get("sigma")
        spread = float(sigma) if sigma is not None else None
        verdict = self.diagnoser.cause_test.run(
            p.micro, self.store, rs.vouched, float(anomaly.detail["median"]), spread
        )
        detail = {**anomaly.detail, "cause": str(verdict.cause)}
        if verdict.cause is Cause.DAMAGE:
            rise = int(anomaly.detail.get("steps", 1))  # a level rise: its first loss; else the first in a row
            began = self.counters.steps - (
                rise - 1 if anomaly.detail.get("rule") == "level" else rs.history.consecutive
            )
            detail.update(jump_began=began, sound_snapshot=verdict.step)
            rs.damage = (began, verdict.step)
        return dataclasses.replace(anomaly, detail=detail, cause=verdict)

    def after_update(self, anomaly: Anomaly, verdict: Verdict, pending: Pending, rules: Rules, loss: float) -> Outcome:
        """An anomaly found inside the update itself, after the step was judged (an evaluation of a
        closure optimizer's line search went non-finite): decided and carried out as one turn of the
        loop (no replay, no re-run: the update has already moved the state; the ladder restores).
        A step that read clean vouched for the state it started from (its clean read is recorded):
        the newest snapshot is kept."""
        rs = self.recovery_state
        if verdict.outcome is None and not verdict.rerun_action:
            rs.history = read_clean(rs.history)
        read = verdict.read
        decision, rs.history = decide(anomaly, rs.for_policy(has_snapshot=bool(len(self.store))), rules, None)
        return self.recovery.carry_out(anomaly, decision, read, pending, None, loss=loss)

    def _explain(self, anomaly: Anomaly, p: Pending) -> Diagnosis:
        """The slow path's replay: the step's (its parameters were finite: the judge checked), or
        for weights the updates' since the newest snapshot."""
        diagnosis = self.diagnoser.explain(anomaly.kind, micro=p.micro, indices=p.indices, store=self.store)
        where = p.place(diagnosis.micro)  # the micro-batch it reproduced in: its events name that batch
        return dataclasses.replace(diagnosis, epoch=where[0], batch_index=where[1]) if where else diagnosis

    def close(
        self, verdict: Verdict, decided: StepResult, cadence: Cadence, snapshot: Callable[[], Event]
    ) -> StepResult:
        """After the update (applied or not): what a trained step's loss joins, and the periodic
        snapshot (``snapshot()`` when ``cadence`` says one is due; a healthy step's wall time is
        measured for it); ``decided``: the step's result as decided, returned with the snapshot's event added."""
        rs, loss = self.recovery_state, decided.loss
        if verdict.outcome is not None or verdict.rerun_action:
            cadence.interrupted()  # (the slow path ran: not a healthy step's time)
        else:
            cadence.healthy()
        if verdict.outcome is not None:
            if verdict.trains:
                rs.count_loss(loss)
                self.judge.observe(loss)  # a trained step's loss joins the spike and divergence windows
            return decided
        # A step that read clean; a re-run of an anomalous step trains but is not healthy.
        events: List[Event] = []  # (those this adds to the decided step's)
        rs.count_loss(loss)  # before the snapshot below, which keeps the epoch's losses
        self.judge.observe(loss)
        # Mid-climb, or the loss above its level (unsettled), a read vouches for no snapshot (run()
        # keeps it out of clean_reads) and none is taken.
        if verdict.rerun_action:
            rs.history = read_clean(rs.history)  # ends an fp16 overflow run (run() recorded the clean read)
        else:
            self.counters.healthy_steps += 1
            new_scale = rs.healthy()  # (vouching is run()'s record of the clean read)
            if new_scale is not None:  # the climb is an event at its step
                events.append(self.recovery.lr_changed(new_scale, "healthy run: LR scale climbs back one notch"))
        rs.since_snapshot += 1
        unsettled = self.divergence.climbing or self.spike.rising
        if unsettled is (rs.left_level is None):  # the loss left its level here, or came back to it
            rs.left_level = self.counters.steps if unsettled else None
        if rs.since_snapshot >= cadence.every and not unsettled:  # a snapshot is due
            events.append(snapshot())
        return dataclasses.replace(decided, events=decided.events + tuple(events)) if events else decided


def nan_result(steps: int, action: str, events: tuple) -> StepResult:
    """A step that ran no read (its data skipped, or empty): no loss, no norm, not trained."""
    return StepResult(steps, False, math.nan, math.nan, action, events)
