"""LR backoff that survives any scheduler: a scale kept on top of the schedule, never inside it.

Schedulers compute the next LR either in closed form from ``base_lrs`` (LambdaLR, OneCycleLR) or
by chaining from the optimizer's current ``lr`` (StepLR, ExponentialLR, CosineAnnealingLR,
ReduceLROnPlateau). Writing a scaled LR into the optimizer and letting the scheduler chain from
it would compound the scale at every step, and closed-form schedulers would silently erase it.
So :class:`LRBackoff` keeps the schedule's own (unscaled) LR per group: around each scheduler
step it puts the unscaled LR back, lets the scheduler step, reads the new unscaled LR and
writes ``max(unscaled * scale, min(min_lr, unscaled))`` for the optimizer to use. After one
backoff, every later LR is exactly ``scale`` times what the schedule alone gives, and no
backoff takes an LR below ``recovery.min_lr``. When the guard steps the scheduler nothing of the
user's objects is wrapped or patched; a scheduler a framework's loop steps is made to
:meth:`~LRBackoff.follow` (its class becomes a subclass whose ``step`` does the same around it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

__all__ = ["LRBackoff", "step_scheduler"]


def step_scheduler(scheduler: Any, metric: Optional[float] = None) -> None:
    """Step any torch LR scheduler; ``ReduceLROnPlateau`` gets ``metric`` (skipped when ``None``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        if metric is not None:
            scheduler.step(metric)
    else:
        scheduler.step()


class LRBackoff:
    """A multiplicative LR scale on top of an optimizer's schedule.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is scaled.
        min_lr: a backoff never takes a group's LR below this (a schedule below it is left alone).

    Example::

        >>> backoff = LRBackoff(optimizer, min_lr=1e-6)
        >>> backoff.set_scale(0.5)            # LR halves now...
        >>> backoff.step(scheduler)           # ...and stays half of the schedule's at every step
    """

    def __init__(self, optimizer: torch.optim.Optimizer, min_lr: float = 0.0) -> None:
        self.optimizer = optimizer
        self.min_lr = float(min_lr)
        self.scale = 1.0
        self.unscaled: List[float] = [float(g["lr"]) for g in optimizer.param_groups]

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.unscaled):
            group["lr"] = lr if self.scale == 1.0 else max(lr * self.scale, min(self.min_lr, lr))

    def set_scale(self, scale: float) -> None:
        """Use ``scale`` times the schedule's LR from now on."""
        self.scale = float(scale)
        self._apply()

    def step(self, scheduler: Any, metric: Optional[float] = None) -> None:
        """Step ``scheduler`` on the unscaled LRs, then put the scale back on."""
        self.step_with(lambda: step_scheduler(scheduler, metric))

    def step_with(self, step: Callable[[], Any]) -> None:
        """Run ``step`` (a scheduler's step) on the unscaled LRs, then put the scale back on."""
        for group, lr in zip(self.optimizer.param_groups, self.unscaled):
            group["lr"] = lr
        step()
        self.unscaled = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._apply()

    def follow(self, scheduler: Any, may_step: Optional[Callable[[], bool]] = None) -> None:
        """Make a scheduler that someone else steps (a framework's loop) keep this backoff on top:
        its ``step`` runs on the unscaled LRs, and does nothing when ``may_step()`` is false. The
        instance's class becomes a subclass with that ``step``; its ``state_dict`` and everything
        else stay the scheduler's own (an attribute set on the instance would land in its state)."""
        cls, backoff = type(scheduler), self

        def step(sched: Any, *args: Any, **kwargs: Any) -> None:
            if may_step is None or may_step():
                backoff.step_with(lambda: cls.step(sched, *args, **kwargs))

        scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def lrs(self) -> List[float]:
        """The LRs the optimizer uses now, one per param group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> Dict[str, Any]:
        """``{"scale": float, "unscaled": [float per group]}``; JSON-ready."""
        return {"scale": self.scale, "unscaled": list(self.unscaled)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take the unscaled LRs of a snapshot and apply the scale in force now (kept unless given)."""
        self.unscaled = [float(x) for x in state["unscaled"]]
        if "scale" in state:
            self.scale = float(state["scale"])
        self._apply()
