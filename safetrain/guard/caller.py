"""The guard's step told at the natural points of a loop the caller owns (a framework's).

The caller runs forward, backward and ``optimizer.step()``; the guard is told: a batch arrives
(:meth:`begin_batch`: scanned, cleaned), its loss (:meth:`record_loss`), before the optimizer
step (:meth:`before_optimizer_step`: the one host read and the decision; the gradients are
dropped when the step must not train) and after it (:meth:`after_optimizer_step`: counters,
snapshots). ``Guard.step`` runs the same parts itself; the decision loop is one implementation.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from torch import Tensor

from ..config import TrainConfig, without_replays
from ..steps import Phase, StepResult
from .outcomes import Verdict

__all__ = ["CallerSteps", "without_reruns"]


def without_reruns(cfg: TrainConfig) -> TrainConfig:
    """A caller-owned loop without a ``loss_fn`` or ``step_fn``: the guard cannot run the step's
    forward itself, so replays are off (logged once) and ``drop_rows``/``retry`` become ``skip_batch``."""
    return without_replays(
        cfg,
        "caller-owned steps without a loss_fn or step_fn: replays are off and drop_rows/retry skip the batch "
        "instead (the guard cannot run the step's forward); give step_fn to have them",
    )


class CallerSteps:
    """The four calls of a caller-owned step, for a ``Guard(..., caller_steps=True)``.

    Example::

        guard = Guard(model, optimizer, cfg, caller_steps=True, step_fn=lambda m, b: loss_of(m, b))
        for batch in loader:
            batch = guard.begin_batch(batch)
            loss = loss_of(model, batch)
            loss.backward()
            guard.record_loss(loss)
            if guard.before_optimizer_step().trained:
                optimizer.step()
            guard.after_optimizer_step()
            optimizer.zero_grad()
    """

    _verdict: Optional[Verdict] = None
    _skipping = False
    #: Each micro-batch's loss is its share of the step's (divided by the whole step's item count,
    #: as a Hugging Face model given ``num_items_in_batch`` computes it): the step's loss is their
    #: sum, not their mean. Set by the caller; the guard's own re-runs keep the same convention.
    loss_shares = False

    def begin_batch(self: Any, batch: Any, indices: Optional[Sequence[int]] = None) -> Any:
        """A (micro-)batch arrives: returns it scanned, non-finite values zero-filled (or replaced)
        where the configuration says so; run the forward on what this returns.

        Raises:
            RuntimeError: the guard was not made with ``caller_steps=True``, or is closed.
        """
        self._check_caller("begin_batch")
        if self._verdict is not None:  # the last step's optimizer step was not reported
            self.after_optimizer_step()
        self._arrive(batch)
        if self.phase is Phase.READY:  # the data that led into a restore is skipped after its backward
            self._skipping = self.recovery_state.skip_after_restore > 0
        batch, p = self._add_micro(batch, indices)
        self.phase = Phase.ACCUMULATING
        return self.forward.begin(batch, p)

    def record_loss(self: Any, loss: Tensor) -> None:
        """The loss of the micro-batch begun last, as the model computed it (not divided by the
        gradient accumulation); no host sync."""
        self._check_caller("record_loss")
        self._pending.calls.append(self.monitor.recorded)  # which micro-batch a forward finding is in
        self.forward.add_loss(loss, self._pending)

    def before_optimizer_step(self: Any) -> StepResult:
        """Before ``optimizer.step()``: the step's one host read and its decision, carried out.

        Returns:
            The :class:`StepResult`; when ``trained`` is false the gradients were dropped (set to
            ``None``), so the optimizer's step leaves every parameter as it is.

        Raises:
            TrainingAborted: the policy aborted; the model and optimizer are at the last good snapshot.
        """
        self._check_caller("before_optimizer_step")
        if self.phase is not Phase.ACCUMULATING:
            raise RuntimeError("before_optimizer_step() without a batch begun (call begin_batch first)")
        if self._skipping:  # the data that led into a restore
            self.plumbing.drop_grads()
            # The window (however short: an epoch's end) is one whole step skipped.
            self.recovery_state.skipped_micro = self.cfg.guard.accumulate_steps - 1
            event = self.recovery.skip_data(lambda: self.updates.skipped_data(self.last_loss))
            self.phase = Phase.READY
            return StepResult(self.counters.steps, False, math.nan, math.nan, "skip_batch", (event,) if event else ())
        try:
            verdict = self._decide(self._read())
        except BaseException:
            self.phase = Phase.READY
            raise
        if verdict.trains:
            self.updates.prepare(verdict.total_norm, self._pending.micro)
        self._verdict = verdict
        steps, events = self.counters.steps, tuple(verdict.events)
        return StepResult(steps, verdict.trains, self.last_loss, self.last_grad_norm, verdict.action, events)

    def after_optimizer_step(self: Any) -> Optional[StepResult]:
        """After ``optimizer.step()`` (or where it would have been): counters, the scheduler's
        bookkeeping, the periodic snapshot; returns the step's final :class:`StepResult` (with the
        snapshot's event), ``None`` when no step was decided."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return None
        try:
            if verdict.trains:
                self.updates.applied(self.last_loss)
            return self._close_step(verdict)
        finally:
            self.phase = Phase.READY

    def _check_caller(self: Any, call: str) -> None:
        if self.phase is Phase.CLOSED:
            raise RuntimeError(f"Guard.{call}() after close(); make a new Guard")
        if not self.caller_steps:
            raise RuntimeError(
                f"Guard.{call}() is for a loop the caller owns: make the guard with caller_steps=True "
                "(or call guard.step(batch), which runs forward, backward and the optimizer step itself)"
            )
