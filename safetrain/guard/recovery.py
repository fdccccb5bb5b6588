"""The recovery executor: carries out the policy's decision and says what came of it.

Slow path only: skip the step, zero non-finite gradients, put bad rows right (skip, replace,
drop and re-run), restore the last good snapshot (passing over the newest when the policy says
so), scale the LR, abort. The end-of-run judgment is :mod:`.end_check`'s; this executor carries
out what it asks. Applying an update and re-running a step are the protocol's: an
:class:`Outcome` asks for them, so the executor never calls back into the step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Tuple

import torch

from ..config import TrainConfig
from ..detect import batch_error
from ..diagnose import Diagnoser
from ..errors import SnapshotError, TrainingAborted
from ..events import Aborted, AnomalyFound, Event, LRChanged, Restored
from ..kinds import DATA_KINDS, Action, Cause, Kind
from ..optimizers import lrs_by_name
from ..policy import Anomaly, Decision, mark_last_skipped, record_step
from ..policy.causes import Verdict as CauseVerdict
from ..steps import Pending
from .batches import without_rows
from .context import Context, Detectors
from .end_check import check_end
from .judge import micro_rows
from .lr import LRBackoff
from .messages import micro_batch_of, payload_of, place_of, summary, with_hint
from .outcomes import Outcome, Rerun, Verdict
from .plumbing import Buffers
from .returns import MAX_RESTORES, MAX_RETURNS, loop_reason
from .snapshots import Snapshots
from .state import RecoveryState
from .update import Updates

__all__ = ["Recovery", "Outcome", "Rerun", "Verdict", "with_hint"]

logger = logging.getLogger(__name__)


class Recovery:
    """Carries out decisions on the training state; each method is one action.

    Args:
        cfg: the configuration (``recovery.skip_batches_after_restore``, ``guard.*``, ``sanitize``).
        context: the run's counters (every action is counted), journal and sync (agreement
            across ranks: the micro-batches left after ``drop_rows``, the snapshot passed over).
        recovery_state: the recovery state (history, data to skip after a restore).
        snapshots: the snapshot store and the training state it restores into.
        detectors: the gradient check (the norm of what is left after zeroing); the gradient
            norm's statistics and the loss-spike window go back with a restored snapshot's weights.
        backoff: the LR scale kept on top of the schedule.
        updates: a step not applied drops its gradients and is counted as skipped there.
        buffers: the buffers as they were before the step's first forward; a step not applied, or
            run again, leaves none of its BatchNorm updates behind (those it had changed are
            journaled as the event's ``buffers_put_back``).
        diagnoser: the replays, which forget what came after a restored snapshot.
        params: every parameter by name (frozen ones too: one may be unfrozen mid-run).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        context: Context,
        recovery_state: RecoveryState,
        snapshots: Snapshots,
        detectors: Detectors,
        backoff: LRBackoff,
        updates: Updates,
        buffers: Buffers,
        diagnoser: Diagnoser,
        params: Dict[str, torch.Tensor],
    ) -> None:
        self.cfg, self.counters, self.emit, self.sync = cfg, context.counters, context.journal, context.sync
        self.state, self.store, self.train_state = recovery_state, snapshots.store, snapshots.state
        self.detectors, self.grads, self.backoff = detectors, detectors.grads, backoff
        self.updates, self.buffers, self.diagnoser, self.params = updates, buffers, diagnoser, params
        self.masked_targets = 0  # steps whose targets held NaN/Inf while their loss was finite

    def carry_out(
        self, anomaly: Anomaly, decision: Decision, read: Any, pending: Pending, diagnosis: Any = None, *, loss: float
    ) -> Outcome:
        """Carry out ``decision`` about ``anomaly`` (found in ``read``, for the step in ``pending``,
        whose loss as a scheduler steps on it is ``loss``).

        Raises:
            TrainingAborted: the decision was ``abort``; the state is at the last good snapshot.
        """
        action, kind = decision.action, decision.kind
        if action is Action.RETRY:
            self.counters.retries += 1
            event = self.emit(
                AnomalyFound,
                kind,
                action,
                f"{kind} anomaly: {summary(kind, anomaly.detail)} -> "
                "transient (the replay from the same state was finite): retrying the step once",
                self._put_back(payload_of(anomaly.detail, diagnosis)),  # the re-run updates them once
                at=place_of(anomaly.detail, diagnosis),
            )
            rerun = Rerun(list(pending.micro), list(pending.indices), list(pending.places))
            return Outcome(action, (event,), rerun=rerun)
        if anomaly.kind is Kind.OVERFLOW and kind is Kind.OVERFLOW:  # normal in fp16: the scaler backs off
            self.updates.not_applied(loss)
            self.counters.scaler_skips += 1
            event = self.emit(
                AnomalyFound,
                Kind.SCALER,
                Action.SKIP_BATCH,
                "fp16 overflow: GradScaler skipped the "
                f"step and lowered the scale to {anomaly.detail['new_scale']:g} (normal)",
                self._put_back(anomaly.detail),
            )
            return Outcome(Action.SKIP_BATCH, (event,))
        detail = dict(anomaly.detail)
        if anomaly.kind is Kind.OVERFLOW:  # escalated: too many in a row, or the scale too low
            detail = {"scale": detail["new_scale"], "overflows_in_a_row": self.state.history.overflows}
        if kind is Kind.TARGET and read.loss is not None and math.isfinite(read.loss):
            self.masked_targets += 1  # NaN targets, yet a finite loss: the loss masks them
        if kind in DATA_KINDS and action is not Action.ABORT:
            return self.fix_rows(kind, decision, detail["rows"], pending, loss)
        if anomaly.cause is not None and anomaly.cause.cause is Cause.DATA_CHANGE and decision.trains:
            return self.level_shift(anomaly.cause, read)
        replayed = f"; replay: {diagnosis.describe()}" if diagnosis is not None else ""
        message = f"{kind} anomaly: {summary(kind, detail)}{replayed} -> {action} ({decision.reason})"
        payload = {**payload_of(detail, diagnosis), "rung": decision.rung}
        if not decision.trains:  # not applied: the step's buffer updates go too
            payload = self._put_back(payload)
        events: List[Event] = [self.emit(AnomalyFound, kind, action, message, payload, at=place_of(detail, diagnosis))]
        if decision.trains:  # warn, zero_grads (the data kinds' trained actions were handled above)
            self.counters.warnings += action is Action.WARN
            total = read.total_norm
            if action is Action.ZERO_GRADS:
                total = self.zero_nonfinite_grads_(detail.get("finding"))
            return Outcome(
                action,
                tuple(events),
                apply=True,
                total_norm=total if total is not None and math.isfinite(total) else None,
            )
        self.updates.not_applied(loss)
        if decision.restore or (action is Action.ABORT and len(self.store)):  # an abort goes back too, if it can
            restored = self.restore(decision)
            events += [restored] if restored is not None else []
            pending.weights = None  # (the periodic check's value was of the weights before the restore)
        if action is Action.SCALE_LR:
            self.counters.lr_backoffs += 1
            events.append(self.lr_changed(decision.lr_scale, f"backoff after {kind}"))
        if action is Action.ABORT:
            self.abort(kind, with_hint(decision.reason, kind, diagnosis, self.masked_targets, self.counters.steps))
        return Outcome(action, tuple(events))

    def level_shift(self, verdict: CauseVerdict, read: Any) -> Outcome:
        """The data changed (the cause test's verdict): the step trains, and one ``level_shift``
        event says where the loss level went (the loss references are re-based by the caller)."""
        old, new = verdict.level, verdict.current
        event = self.emit(
            AnomalyFound,
            "level_shift",
            Action.WARN,
            f"level shift: the loss level moved from {old:.4g} to {new:.4g} and the snapshots' models do as badly "
            "on the new data: the data changed, not the model; training on, the spike, divergence and end-of-run "
            "references re-based at the new level",
            {"step": self.counters.steps, "old_level": old, "new_level": new},
        )
        total = read.total_norm
        return Outcome(
            Action.WARN, (event,), apply=True, total_norm=total if total is not None and math.isfinite(total) else None
        )

    def abort(self, kind: str, reason: str) -> NoReturn:
        """Journal the abort and raise; the state is already at the last good snapshot.

        Raises:
            TrainingAborted: always, with ``reason`` (the cause and its fix).
        """
        aborted = self.emit(
            Aborted,
            kind,
            Action.ABORT,
            f"training aborted: {reason}; model and optimizer left "
            + ("at the last good snapshot" if len(self.store) else "as they were (no snapshot to go back to)"),
            {"reason": reason},
        )
        raise TrainingAborted(reason, result=None, event=aborted)

    def check_end(self, seen: int, trained: int) -> None:
        """The end-of-run judgment (:func:`~.end_check.check_end`), carried out by this executor.

        Raises:
            TrainingAborted: naming the cause and the fix.
        """
        check_end(self, seen, trained)

    def reject_rows(self, anomaly: Anomaly, loss: float) -> None:
        """``sanitize.*: raise``: the step is not applied, the rows are journaled, then BatchError."""
        self.updates.not_applied(loss)
        self.counters.rejected_batches += 1
        rows = anomaly.detail["rows"]
        error = batch_error(rows)
        detail = self._put_back({"rows": [f.to_dict() for f in rows]})
        self.emit(AnomalyFound, anomaly.kind, Action.RAISE, str(error), detail, at=place_of(anomaly.detail))
        raise error

    def empty_batch(self, whole_step: bool, loss: float) -> Event:
        """An empty batch (0 rows) is a data event: skipped and journaled, never a reason to recover.
        With ``whole_step`` (one micro-batch a step) it is a skipped step, counted toward
        ``recovery.max_skip_fraction``; else it is left out of the step being accumulated."""
        if whole_step:  # (the step is counted by the protocol)
            self.state.history = record_step(self.state.history, self.cfg.recovery, skipped=True)
            self.updates.skipped_data(loss)  # counted; the scheduler moves only when it follows batches
        return self.emit(AnomalyFound, Kind.INPUT, Action.SKIP_BATCH, "empty batch (0 rows): skipped", {"rows": 0})

    def zero_nonfinite_grads_(self, finding: Any) -> Optional[float]:
        """Zero the gradients named non-finite; returns the total norm of what is left (slow path)."""
        names = getattr(finding, "nonfinite", ()) if finding is not None else ()
        for name in names:
            grad = self.params[name].grad
            if grad is not None:
                grad.zero_()
        self.counters.zeroed_grads += len(names)
        grads = self.grads.run()
        if not grads:
            return None
        return math.hypot(*(float(n) for n in torch.stack(grads.norm_list).tolist()))  # host sync: slow path

    def fix_rows(self, kind: Kind, decision: Decision, rows: List[Any], pending: Pending, loss: float) -> Outcome:
        """Non-finite input or target rows: skip the step, replace (already done before the
        forward: judge the rest), or drop them and run the step again on what is left."""
        action = decision.action
        n_rows = len({(micro_batch_of(f.path), r) for f in rows for r in f.rows})
        kept: List[Any] = []
        places: List[Tuple[int, int]] = []
        if action is Action.DROP_ROWS:  # each micro-batch without its bad rows, to run the step again
            cleaned = [
                without_rows(b, found) for b, found in zip(pending.micro, micro_rows(pending.micro, self.cfg.sanitize))
            ]
            kept = [b for b, _ in cleaned if b is not None]
            places = [where for (b, _), where in zip(cleaned, pending.places) if b is not None]
            if not self.sync.same_count(len(kept)) or not kept:  # all ranks or none
                action, kept = Action.SKIP_BATCH, []
                self.state.history = mark_last_skipped(self.state.history)
            else:
                self.counters.dropped_rows += sum(d for _, d in cleaned)
        where = "; ".join(f.describe() for f in rows[:4])
        why = " (every row is bad)" if action is not decision.action else ""
        detail = {"rows": [f.to_dict() for f in rows], "count": n_rows, "rung": decision.rung}
        if action is not Action.REPLACE:  # skipped, or run again on the kept rows: buffers updated once
            detail = self._put_back(detail)
        message = f"non-finite {kind} rows: {where} -> {action}{why}"
        event = self.emit(AnomalyFound, kind, action, message, detail, at=place_of({"rows": rows}))
        if action is Action.SKIP_BATCH:
            self.updates.not_applied(loss)
            return Outcome(action, (event,))
        if action is Action.REPLACE:
            self.counters.replaced_rows += n_rows
            return Outcome(action, (event,), rerun=Rerun())
        return Outcome(action, (event,), rerun=Rerun(kept, places=places if len(places) == len(kept) else None))

    def _put_back(self, detail: Mapping[str, Any]) -> Dict[str, Any]:
        """Put the buffers back as they were before the step; ``detail`` with the names of those
        the step had changed (``buffers_put_back``), when any."""
        changed = self.buffers.put_back()
        return {**detail, "buffers_put_back": list(changed)} if changed else dict(detail)

    def restore(self, decision: Decision, why: str = "") -> Optional[Event]:
        """Put the last good snapshot back, keeping the LR scale and policy history in force now
        (``why``: the journal's reason, by default the decision's kind).

        Returns:
            The ``Restored`` event; ``None`` when an ``abort`` found no usable snapshot (it stops anyway).

        Raises:
            TrainingAborted: no snapshot is usable (each damaged or not fitting the model): never a
                ``SnapshotError`` out of the step; the reason lists why each one was not usable.
        """
        passed = None
        for _ in range(decision.older):  # damage: the newer snapshots' models do badly (the cause test)
            more = self.store.pass_over_newest()
            if more is None:
                break
            passed = more if passed is None else f"{passed}, {more}"
        # Every rank passes over the newest or none does (a rank's diagnosis may differ: its own rows).
        if self.sync.total(int(decision.pass_over_newest)):
            # No healthy step has run since the newest snapshot and the fault implicates the weights:
            # it may hold the update that broke the run (an LR blow-up leaves finite but ruined
            # weights). Go one further back; the file is kept (rotation drops it in its time).
            passed = self.store.pass_over_newest()
            # The one before may owe a clean read too (snapshot.every: 1; policy.VOUCH_READS).
            while passed and (older := self.store.latest()) is not None and not self.state.vouched(older.step):
                more = self.store.pass_over_newest()
                if more is None:
                    break
                passed = f"{passed}, {more}"
        try:
            info = self.store.restore(self.train_state)
        except SnapshotError as exc:
            if decision.action is Action.ABORT:
                logger.warning("the last good snapshot could not be put back: %s", exc)
                return None
            self.abort(
                decision.kind,
                f"{decision.kind}: {decision.action} found no usable snapshot ({exc}); model and optimizer left as "
                "they were; fix: check the snapshot directory (disk full, files damaged or from another model)",
            )
        self._rewind(info.step, info.extra)
        self.backoff.load_state_dict({"unscaled": info.extra["lr"]["unscaled"]})
        self.counters.restores += 1
        self.state.since_snapshot = 0
        self.state.newest = (info.step, True)  # the snapshot put back is the run's sound point now
        self.state.skip_after_restore = self.cfg.recovery.skip_batches_after_restore
        detail = {"snapshot_step": info.step, "path": str(info.path) if info.path else None, "passed_over": passed}
        changed = list(info.changed_since)  # what changed layout since the snapshot (observers, groups added)
        event = self.emit(
            Restored,
            decision.kind,
            decision.action,
            f"restored the snapshot of step {info.step} after {why or decision.kind}"
            + (
                f", passing over the newest ({passed}): "
                + (
                    "its model does badly where an older one does well"
                    if decision.older
                    else "no healthy step vouched for it"
                )
                if passed
                else ""
            )
            + "".join(f"; {c}" for c in changed),
            {**detail, "changed_since": changed} if changed else detail,
        )
        self.backoff.hold()  # no LR above the last healthy update's, however often the schedule sets it
        trained = self.counters.optimizer_steps > self.state.restored_updates
        self.state.restored_updates = self.counters.optimizer_steps
        returns = self.state.returns
        loops = returns.arrive(info.step, self.counters.steps, self.backoff.scale, trained)
        if not returns.stuck or decision.action is Action.ABORT:
            return event
        if loops >= MAX_RETURNS and returns.restores < MAX_RESTORES and self._backs_off_a_loop():
            return event  # a restore loop, with the LR backoff still to try: this return is a new try
        b = self.backoff  # a restore loop: it stops here
        restored = [lr * b.failed_scale for lr in info.extra["lr"]["unscaled"]]  # (as the failed update's)
        why = loop_reason(str(decision.kind), returns, failed_lr=b.failed, snapshot_lr=restored, scheduler=b.scheduler)
        self.abort(decision.kind, why)

    def _backs_off_a_loop(self) -> bool:
        """A restore loop under a policy that escalates to ``scale_lr``: scale the LR down once more
        (journaled) while that still lowers some group's LR above ``recovery.min_lr``, and say so;
        the next return, under the lower LR, is a new try. Without that remedy left, the loop stops."""
        r = self.cfg.recovery
        scale = self.backoff.scale * r.lr_factor
        if Action.SCALE_LR not in r.escalate or not any(lr * scale > r.min_lr for lr in self.backoff.unscaled):
            return False
        self.lr_changed(scale, "restore loop: the run keeps failing at the same point under this LR")
        return True

    def skip_data(self, loss: float) -> Event:
        """Skip the data that led into a restore, a whole step (its micro-batches) at a time; returns
        its event (``loss``: the step's, as a scheduler stepping on the loss gets it)."""
        s = self.state
        s.skip_after_restore -= 1  # (the step is counted by the protocol)
        s.history = record_step(s.history, self.cfg.recovery, skipped=True)
        self.updates.skipped_data(loss)  # counted; the scheduler moves only when it follows batches
        return self.emit(
            Restored,
            "restore",
            Action.SKIP_BATCH,
            "skipped a step's batches after a restore (recovery.skip_batches_after_restore)",
            {"remaining": s.skip_after_restore},
        )

    def _rewind(self, step: int, extra: Mapping[str, Any]) -> None:
        """What goes back with a restored snapshot's weights besides the training state: the
        gradient norm's statistics and the loss-spike window that describe them (the divergence
        episode does not: it is what the restore answers); the replays forget what came after it."""
        self.detectors.norm_stats.load_state_dict(extra.get("grad_norm", {}))
        if "spike" in extra:
            self.detectors.spike.load_state_dict(extra["spike"])
        self.diagnoser.rng_reset()  # the snapshot's RNG state is back
        self.diagnoser.clear(step)

    def lr_changed(self, scale: float, why: str) -> Event:
        """Set the LR scale and journal the change."""
        old = self.backoff.lrs()
        self.backoff.set_scale(scale)
        each = lrs_by_name(self.train_state.optimizer)  # several optimizers: each one's groups, by name
        detail = {"scale": scale, "old_lr": old, "new_lr": self.backoff.lrs(), **({"optimizers": each} if each else {})}
        message = f"LR scale {scale:g} ({why}); lr {old} -> {self.backoff.lrs()}" + (
            f" by optimizer {each}" if each else ""
        )
        return self.emit(LRChanged, "lr", Action.SCALE_LR, message, detail)
