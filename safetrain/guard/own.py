"""The guard's step when the guard owns it: ``Guard.step`` runs forward, backward and the optimizer step.

Each call scans a (micro-)batch, runs it forward and backward; the k-th (``guard.accumulate_steps``)
makes the step's one host read, runs the decision loop and applies the update when the verdict
trains. A loop the caller owns drives the same parts through :mod:`.caller`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from ..batches import batch_rows
from ..kinds import Action
from ..steps import Phase, StepResult

__all__ = ["OwnSteps"]


class OwnSteps:
    """``step`` and ``flush`` for a :class:`~safetrain.guard.Guard` that runs the whole step."""

    def step(self: Any, batch: Any, indices: Optional[Sequence[int]] = None) -> Optional[StepResult]:
        """Feed one (micro-)batch; returns the :class:`StepResult` when an optimizer step was decided.

        With ``guard.accumulate_steps`` = k, the first k - 1 calls only accumulate gradients and
        return ``None``; the k-th makes the single host sync and decides.

        Args:
            batch: the (micro-)batch. Its CPU tensors are copied to the model's accelerator
                (``guard.to_device``), asynchronously when the loader pins memory.
            indices: the dataset index of each row, when known: a replay then names bad samples
                by dataset index (``SafeTrainer.fit`` passes them from a :class:`QuarantineSampler`).

        Raises:
            TrainingAborted: the policy aborted; the model and optimizer are at the last good snapshot.
            BatchError: the batch fits no convention, or ``sanitize.*: raise`` met a bad row.
        """
        if self.phase is Phase.CLOSED:
            raise RuntimeError("Guard.step() after close(); make a new Guard")
        if self.caller_steps:
            raise RuntimeError("Guard(caller_steps=True): the caller steps; tell the guard with begin_batch, "
                               "record_loss, before_optimizer_step and after_optimizer_step")  # fmt: skip
        self._arrive(batch)
        if self.recovery_state.skip_after_restore > 0 and self.phase is Phase.READY:
            return self._skip_data()
        if batch_rows(batch) == 0 and self.sync.steps_alone:  # (under DDP every rank must step)
            whole = self.phase is Phase.READY and self.cfg.guard.accumulate_steps == 1  # else one micro-batch less
            event = self.recovery.empty_batch(whole, lambda: self.updates.skipped_data(self.last_loss))
            return StepResult(self.counters.steps, False, math.nan, math.nan, "skip_batch", (event,)) if whole else None
        batch, p = self._add_micro(batch, indices)
        self.forward.run(batch, p)
        if len(p.micro) < self.cfg.guard.accumulate_steps:
            self.phase = Phase.ACCUMULATING
            return None
        return self._finish()

    def flush(self: Any) -> Optional[StepResult]:
        """Take the step of a partial accumulation now (at the end of an epoch or of the data).

        With ``guard.accumulate_steps`` = k and fewer than k micro-batches pending, their summed
        gradients (each scaled by 1/k) make one step; returns ``None`` when nothing is pending.
        """
        if self.phase is not Phase.ACCUMULATING:
            return None
        return self._finish()

    def _finish(self: Any) -> StepResult:
        """The step's one read, the decision loop, then the update when the verdict trains.
        However it ends (an abort or a BatchError included), the guard is ready for a new step."""
        try:
            verdict = self._decide(self._read())
            if verdict.trains:
                self.updates.apply(verdict.total_norm, self._pending.micro, self.last_loss)
            return self._close_step(verdict)
        finally:
            self.phase = Phase.READY

    def _skip_data(self: Any) -> Optional[StepResult]:
        """Skip the data that led into a restore, a whole step at a time."""
        event = self.recovery.skip_data(lambda: self.updates.skipped_data(self.last_loss))
        if event is None:
            return None
        return StepResult(self.counters.steps, False, math.nan, math.nan, str(Action.SKIP_BATCH), (event,))
