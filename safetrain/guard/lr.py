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

A restore never re-installs an LR that no healthy update used: the backoff remembers the LRs of
the last update a clean read followed (:meth:`~LRBackoff.mark_used`, :meth:`~LRBackoff.read_clean`),
and after a restore it holds the schedule at or below them (:meth:`~LRBackoff.hold`), so a
schedule bug (a scheduler that returns 1000x its LR for a few steps) is held against however
often the restored scheduler computes it again. The hold lifts when the schedule comes back to
that LR, or after ``release_after`` clean reads once the schedule is no higher than the LR the
failed update used (:attr:`~LRBackoff.failed`): a one-cycle or warmup schedule still rising past
the LR that broke the run stays held, else it climbs back into the same fault.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

from ..events import LRChanged
from ..kinds import Action
from ..optimizers import Schedulers

__all__ = ["LRBackoff", "step_scheduler"]


def step_scheduler(scheduler: Any, metric: Optional[float] = None) -> None:
    """Step any torch LR scheduler; ``ReduceLROnPlateau`` gets ``metric`` (skipped when ``None``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        if metric is not None:
            scheduler.step(metric)
    elif isinstance(scheduler, Schedulers):  # several: each member as above
        scheduler.step(metric)
    else:
        scheduler.step()


class LRBackoff:
    """A multiplicative LR scale on top of an optimizer's schedule.

    Args:
        optimizer: the optimizer whose param groups' ``lr`` is scaled.
        min_lr: a backoff never takes a group's LR below this (a schedule below it is left alone).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        >>> backoff = LRBackoff(optimizer, min_lr=1e-6)
        >>> backoff.set_scale(0.5)            # LR halves now...
        >>> optimizer.param_groups[0]["lr"]
        0.05
        >>> optimizer.step()
        >>> backoff.step(scheduler)           # ...and stays half of the schedule's at every step
        >>> round(optimizer.param_groups[0]["lr"], 6)  # 0.5 x (0.1 x 0.9)
        0.045
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        min_lr: float = 0.0,
        journal: Optional[Callable[..., Any]] = None,
        release_after: int = 20,
    ) -> None:
        self.optimizer = optimizer
        self.min_lr = float(min_lr)
        self.scale = 1.0
        self.unscaled: List[float] = [float(g["lr"]) for g in optimizer.param_groups]
        #: ``journal(cls, kind, action, message, detail)`` (the guard's :class:`~.journal.StepJournal`):
        #: an ``LRChanged`` event when the hold starts to bind, or lifts.
        self.journal = journal
        self.release_after = release_after
        self.used: Optional[List[float]] = None  # the (unscaled) LRs the last update used
        self.trusted: Optional[List[float]] = None  # ...of the last update a clean read followed
        self.ceiling: Optional[List[float]] = None  # the hold after a restore (None: none)
        #: the LRs the update before the fault a hold answers used (the scale included): the hold does
        #: not lift by clean reads while the schedule (under the scale then in force) is above them (None: not known)
        self.failed: Optional[List[float]] = None
        self.failed_scale = 1.0  # the LR scale in force when it ran
        self._kept_told = False  # the hold outlived release_after clean reads (journaled once per hold)
        self._binding = False  # the schedule is above the ceiling (journaled once per stretch)
        self.scheduler = ""  # the class of the scheduler last stepped, for the journal
        self._held_reads = 0

    def effective(self) -> List[float]:
        """The schedule's LRs under the hold (the unscaled LRs the optimizer's are a scale of): the
        schedule's own while no hold is in force."""
        if self.ceiling is None:
            return self.unscaled
        return [min(lr, cap) for lr, cap in zip(self.unscaled, self.ceiling)]

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.effective()):
            group["lr"] = lr if self.scale == 1.0 else max(lr * self.scale, min(self.min_lr, lr))

    def set_scale(self, scale: float) -> None:
        """Use ``scale`` times the schedule's LR from now on."""
        self.scale = float(scale)
        self._apply()

    def step(self, scheduler: Any, metric: Optional[float] = None) -> None:
        """Step ``scheduler`` on the unscaled LRs, then put the scale back on."""
        self.step_with(lambda: step_scheduler(scheduler, metric), type(scheduler).__name__)

    def step_with(self, step: Callable[[], Any], name: str = "") -> None:
        """Run ``step`` (a scheduler's step, of class ``name``) on the unscaled LRs, then put the
        scale (and a hold, when one is in force) back on."""
        for group, lr in zip(self.optimizer.param_groups, self.unscaled):
            group["lr"] = lr
        step()
        self.unscaled = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.scheduler = name or self.scheduler
        if self.ceiling is not None:
            self._check_hold(f"the LR scheduler {name}" if name else "the LR schedule")
        self._apply()

    # ------------------------------------------------------------------ the hold after a restore
    def mark_used(self) -> None:
        """An update is about to be applied with the LRs in force now (no copy, no sync)."""
        self.used = self.unscaled if self.ceiling is None else self.effective()  # (no hold: no call)

    def read_clean(self) -> None:
        """A step read clean: the update before it (its LRs) is trusted; a hold counts toward its release."""
        if self.used is not None:
            self.trusted = self.used
        if self.ceiling is not None:
            self._held_reads += 1
            if self._held_reads >= self.release_after:
                if self._below_failed():
                    self._release(f"{self._held_reads} steps read clean under it")
                elif not self._kept_told:
                    self._kept_told = True
                    failed = list(self.failed or ())
                    self._tell(
                        f"LR hold kept after {self._held_reads} clean reads: the schedule (lr "
                        f"{max(self.unscaled) * self.scale:g}{' with the LR scale' if self.scale != 1.0 else ''}) "
                        f"is still above the LR the failed update used ({max(failed):g}); it lifts when the "
                        "schedule comes back to the held LR",
                        {"scheduled_lr": list(self.unscaled), "failed_lr": failed},
                    )

    def _below_failed(self) -> bool:
        """Whether the schedule, under the scale in force, is at or below the LRs the failed update
        used (or those are not known)."""
        return self.failed is None or all(lr * self.scale <= f for lr, f in zip(self.unscaled, self.failed))

    def hold(self) -> None:
        """After a restore: hold the schedule at or below the LRs of the last update a clean read
        followed (none known yet: no hold); the restored LRs are checked against them now."""
        if self.used is not None:  # the LRs that led into the fault (the lowest of those a hold still answers)
            used = [lr * self.scale for lr in self.used]  # (a backoff after this restore comes after it)
            if self.ceiling is None or self.failed is None or max(used) < max(self.failed):
                self.failed, self.failed_scale = used, self.scale
        self.used = None  # the restored weights were not made by the last update
        if self.trusted is None:
            return
        self.ceiling, self._binding, self._held_reads, self._kept_told = list(self.trusted), False, 0, False
        self._check_hold(f"the restored LR scheduler {self.scheduler}" if self.scheduler else "the restored snapshot")
        self._apply()

    def _check_hold(self, source: str) -> None:
        """Journal the hold when the schedule first goes above it; lift it once the schedule is back."""
        if self.ceiling is None:
            return
        over = [i for i, (lr, cap) in enumerate(zip(self.unscaled, self.ceiling)) if lr > cap]
        if not over:
            if self._binding:
                self._release("the schedule is back at or below the held LR")
            return
        if self._binding:
            return
        self._binding = True
        i = over[0]
        lr, cap = self.unscaled[i], self.ceiling[i]
        ratio = lr / cap if cap > 0 else math.inf
        self._tell(
            f"{source} set lr={lr:g}, x{ratio:.3g} the last healthy update's ({cap:g}): held at {cap:g}"
            f"{f' x LR scale {self.scale:g}' if self.scale != 1.0 else ''} until the schedule comes back to it "
            f"(or {self.release_after} steps read clean)",
            {"source": source, "scheduled_lr": list(self.unscaled), "held_lr": list(self.ceiling), "ratio": ratio},
        )

    def _release(self, why: str) -> None:
        was, self.ceiling, self._binding, self._held_reads = self.ceiling, None, False, 0
        self._apply()
        self._tell(f"LR hold lifted ({why}); lr {self.lrs()}", {"held_lr": was, "new_lr": self.lrs()})

    def _tell(self, message: str, detail: Dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal(LRChanged, "lr", Action.SCALE_LR, message, detail)

    def follow(self, scheduler: Any, may_step: Optional[Callable[[], bool]] = None) -> None:
        """Make a scheduler that someone else steps (a framework's loop) keep this backoff on top:
        its ``step`` runs on the unscaled LRs, and does nothing when ``may_step()`` is false. The
        instance's class becomes a subclass with that ``step``; its ``state_dict`` and everything
        else stay the scheduler's own (an attribute set on the instance would land in its state)."""
        cls, backoff = type(scheduler), self

        def step(sched: Any, *args: Any, **kwargs: Any) -> None:
            if may_step is None or may_step():
                backoff.step_with(lambda: cls.step(sched, *args, **kwargs), cls.__name__)

        scheduler.__class__ = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__})

    def lrs(self) -> List[float]:
        """The LRs the optimizer uses now, one per param group."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> Dict[str, Any]:
        """``{"scale": float, "unscaled": [float per group], "trusted": [...] or None, "ceiling":
        [...] or None, "failed": [...] or None}``; JSON-ready."""
        return {
            "scale": self.scale,
            "unscaled": list(self.unscaled),
            "trusted": list(self.trusted) if self.trusted is not None else None,
            "ceiling": list(self.ceiling) if self.ceiling is not None else None,
            "failed": list(self.failed) if self.failed is not None else None,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take the unscaled LRs of a snapshot and apply the scale in force now (kept unless given);
        ``trusted``, ``ceiling`` and ``failed`` (a resume) too when given (absent from earlier snapshots)."""
        self.unscaled = [float(x) for x in state["unscaled"]]
        if "scale" in state:
            self.scale = float(state["scale"])
        for key in ("trusted", "ceiling", "failed"):
            if key in state:
                setattr(self, key, [float(x) for x in state[key]] if state[key] is not None else None)
        self._apply()
