"""Applying a step's update, or not: clip, optimizer (and scaler) step, scheduler, free gradients.

The healthy path's last stretch. Clipping uses the total norm the step's one read brought to the
host: a fixed norm (``guard.clip_grad_norm``), or adaptive (``guard.clip.mode: adaptive``, ZClip:
:class:`~safetrain.stats.gradclip.NormStats`, a few float operations on that number, no sync and no
device op). A clipped step is counted (``clipped_steps``) and journaled once per episode (a run of
clipped trained steps). The scheduler follows optimizer steps by default (skipped and restored
steps do not advance it), or every batch (``guard.scheduler_follows: batch``); the LR backoff stays
a scale on top of the schedule.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Set, Tuple

from ..config import GuardConfig
from ..diagnose import Diagnoser
from ..events import Clipped, Event
from .context import Context, Detectors
from .lr import LRBackoff
from .plumbing import Plumbing

__all__ = ["Updates"]


class Updates:
    """Applies or drops a step's update, and steps the scheduler as configured.

    Args:
        cfg: the ``guard`` section (``clip_grad_norm``, ``clip``, ``grad_norm_threshold``,
            ``scheduler_follows``, ``scheduler_interval``).
        context: the run's counters (``optimizer_steps`` and ``skipped_batches`` move here) and
            journal (a clip episode's start).
        detectors: the gradient check, whose norm clipping reuses, and the gradient norm's EMA
            statistics (adaptive clipping and the adaptive ``grad_norm`` anomaly).
        plumbing: the optimizer step (and the scaler's update) and freeing gradients.
        scheduler: the user's LR scheduler, if any.
        backoff: the LR scale kept on top of the schedule.
        diagnoser: keeps references to each update's batches just before it (the weight replay).

    A scheduler the caller's loop steps is followed (:meth:`follow`) instead of stepped.
    """

    def __init__(
        self,
        cfg: GuardConfig,
        context: Context,
        detectors: Detectors,
        plumbing: Plumbing,
        scheduler: Any,
        backoff: LRBackoff,
        diagnoser: Diagnoser,
    ) -> None:
        self.plumbing, self.grads, self.counters = plumbing, detectors.grads, context.counters
        self.scheduler, self.backoff = scheduler, backoff
        # (Diagnoser.record_update's two parts, held: the healthy path calls the replay's record directly)
        self.replay, self.rng = diagnoser.weight_replay, diagnoser.rng
        self.clip = cfg.clip_grad_norm
        self.adaptive = cfg.clip.mode == "adaptive"
        # The statistics run when adaptive clipping or the adaptive grad_norm anomaly reads them.
        self.stats = detectors.norm_stats if self.adaptive or cfg.grad_norm_threshold == "adaptive" else None
        self.emit = context.journal
        self.episode = False  # the last trained step was clipped: a clipped step goes on its episode (state)
        self.per_step = scheduler is not None and cfg.scheduler_interval == "step"
        self.on_skips = cfg.scheduler_follows == "batch"
        self.applied_last = True  # whether the last step's update was applied (a followed scheduler may step)
        self._followed: Set[int] = set()  # the schedulers followed (their step is wrapped once)

    def prepare(self, total: Optional[float], micro: List[Any], clean: bool = True) -> Tuple[float, Optional[Event]]:
        """Before the optimizer steps: clip with the norm already read, keep the step's references.

        Args:
            total: the step's total gradient norm as read (``None``: not known, no clipping).
            micro: the step's micro-batches (the weight replay keeps references).
            clean: the step read clean; only such a step's norm joins the statistics (an anomalous
                step applied anyway, ``warn`` or ``zero_grads``, is clipped but does not teach them).

        Returns:
            ``(clipped_to, event)``: the norm after clipping (``nan``: not clipped) and the
            :class:`~safetrain.events.Clipped` event when this step begins a clip episode.
        """
        self.applied_last = True  # (a followed scheduler steps between this and applied())
        self.backoff.mark_used()  # the LRs this update uses: trusted once a later step reads clean
        limit, adaptive, seen = self.clip, None, {}
        stats = self.stats
        if stats is not None and total is not None:
            adaptive = stats.limit(total) if self.adaptive else None
            if adaptive is not None:
                limit = adaptive if limit is None else min(limit, adaptive)
                # (before this step joins them: for the event)
                seen = {"mean": stats.mean, "std": math.sqrt(stats.var), "zscore": stats.zscore_of(total)}
            if clean:
                stats.update(total, adaptive)  # as read, and as the clip leaves it
        clipped = limit is not None and total is not None and math.isfinite(total) and limit / (total + 1e-6) < 1.0
        if limit is not None and total is not None:
            self.grads.clip_(limit, total)
        self.replay.record(self.counters.steps, micro, total, self.rng.state, clip=limit)  # references only
        if not clipped:
            self.episode = False
            return math.nan, None
        self.counters.clipped_steps += 1
        if self.episode:
            return float(limit), None  # type: ignore[arg-type]
        self.episode = True
        detail = {"total_norm": total, "clipped_to": limit, "mode": "adaptive" if self.adaptive else "fixed"}
        why = "guard.clip_grad_norm"
        if seen and limit == adaptive:
            detail.update(seen)
            why = f"adaptive: {seen['zscore']:.3g} standard deviations above its EMA mean {seen['mean']:.4g}"
        message = (
            f"gradient norm {total:.4g} clipped to {limit:.4g} ({why}); the clipped steps that follow in a row are "
            "counted in clipped_steps, not journaled"
        )
        return float(limit), self.emit(Clipped, "grad_norm", "clip", message, detail)  # type: ignore[arg-type]

    def applied(self, loss: float) -> None:
        """After the optimizer stepped: count it, step the scheduler, free the gradients."""
        self.counters.optimizer_steps += 1
        if self.per_step:
            self.backoff.step(self.scheduler, loss)
        self.plumbing.drop_grads()  # (the next step need not free them again)

    def follow(self, scheduler: Any) -> None:
        """Make a scheduler that the caller's loop steps keep the LR backoff on top of it
        (:meth:`LRBackoff.follow <safetrain.guard.lr.LRBackoff.follow>`); once per scheduler. The guard's
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
        """A step's data was skipped (after a restore, or an empty batch): counted as a skipped
        step, and the scheduler moves when it follows batches."""
        self.counters.skipped_batches += 1
        self.applied_last = False
        if self.on_skips:
            self.step_scheduler(loss)

    def step_scheduler(self, loss: float) -> None:
        """Step the scheduler (step interval), the LR backoff holding on top of it."""
        if self.per_step:
            self.backoff.step(self.scheduler, loss)
