"""Applying a step's update, or not: clip, optimizer (and scaler) step, scheduler, free gradients.

The healthy path's last stretch. The scheduler follows optimizer steps by default (skipped and
restored steps do not advance it), or every batch (``guard.scheduler_follows: batch``); the LR
backoff stays a scale on top of the schedule.
"""

from __future__ import annotations

from typing import Any, List, Optional, Set

from .. import detect
from ..config import GuardConfig
from ..lr import LRBackoff
from ..steps import Counters
from .plumbing import Plumbing

__all__ = ["Updates"]


class Updates:
    """Applies or drops a step's update, and steps the scheduler as configured.

    Args:
        cfg: the ``guard`` section (``clip_grad_norm``, ``scheduler_follows``, ``scheduler_interval``).
        plumbing: the optimizer step (and the scaler's update) and freeing gradients.
        grads: the gradient check, whose norm clipping reuses.
        counters: ``optimizer_steps`` and ``skipped_batches`` move here.
        scheduler: the user's LR scheduler, if any.
        backoff: the LR scale kept on top of the schedule.
        record: ``record(step, micro, total)`` just before an update (the weight replay keeps references).

    A scheduler the caller's loop steps is followed (:meth:`follow`) instead of stepped.
    """

    def __init__(
        self,
        cfg: GuardConfig,
        plumbing: Plumbing,
        grads: detect.GradCheck,
        counters: Counters,
        scheduler: Any,
        backoff: LRBackoff,
        record: Any,
    ) -> None:
        self.plumbing, self.grads, self.counters = plumbing, grads, counters
        self.scheduler, self.backoff, self.record = scheduler, backoff, record
        self.clip = cfg.clip_grad_norm
        self.per_step = scheduler is not None and cfg.scheduler_interval == "step"
        self.on_skips = cfg.scheduler_follows == "batch"
        self.applied_last = True  # whether the last step's update was applied (a followed scheduler may step)
        self._followed: Set[int] = set()  # the schedulers followed (their step is wrapped once)

    def prepare(self, total: Optional[float], micro: List[Any]) -> None:
        """Before the optimizer steps: clip with the norm already read, keep the step's references."""
        self.applied_last = True  # (a followed scheduler steps between this and applied())
        self.backoff.mark_used()  # the LRs this update uses: trusted once a later step reads clean
        if self.clip is not None and total is not None:
            self.grads.clip_(self.clip, total)
        self.record(self.counters.steps, micro, total)  # references only

    def applied(self, loss: float) -> None:
        """After the optimizer stepped: count it, step the scheduler, free the gradients."""
        self.counters.optimizer_steps += 1
        if self.per_step:
            self.backoff.step(self.scheduler, loss)
        self.plumbing.free_grads()
        self.plumbing.grads_dropped = True  # the next step need not zero them again

    def follow(self, scheduler: Any) -> None:
        """Make a scheduler that the caller's loop steps keep the LR backoff on top of it
        (:meth:`LRBackoff.follow <safetrain.lr.LRBackoff.follow>`); once per scheduler. The guard's
        own (step-interval) scheduler also follows the steps: its ``step`` does nothing after a step
        whose update was not applied (unless ``guard.scheduler_follows: batch``), and the guard no
        longer steps it; another (an epoch-interval one) steps whenever the caller steps it."""
        if id(scheduler) in self._followed:
            return
        self._followed.add(id(scheduler))
        if scheduler is self.scheduler:
            self.per_step = False
            self.backoff.follow(scheduler, lambda: self.applied_last or self.on_skips)
        else:
            self.backoff.follow(scheduler)

    def stopped(self) -> None:
        """The run stopped: no gradient is left for an optimizer step, nor a followed scheduler's step."""
        self.plumbing.free_grads()
        self.applied_last = False

    def not_applied(self, loss: float) -> None:
        """The step's update is not applied: drop the gradients, count it, and step the scheduler
        only when it follows batches (``guard.scheduler_follows: batch``)."""
        self.plumbing.drop_grads()
        self.counters.skipped_batches += 1
        self.applied_last = False
        if self.on_skips:
            self.step_scheduler(loss)

    def skipped_data(self, loss: float) -> None:
        """A step's data was skipped after a restore: the scheduler moves when it follows batches."""
        self.applied_last = False
        if self.on_skips:
            self.step_scheduler(loss)

    def step_scheduler(self, loss: float) -> None:
        """Step the scheduler (step interval), the LR backoff holding on top of it."""
        if self.per_step:
            self.backoff.step(self.scheduler, loss)
