"""The recovery policy: a pure state machine from (anomaly kind, history) to an action.

No torch and no I/O here: :func:`decide` and :func:`observe_healthy` take the history and the
configuration and return a new history with the decision, so every path is a table test that
runs in microseconds. The guard carries the decisions out.

The ladder. The n-th anomalous step in a row (n = 1, 2, ...) gets:

* n = 1: the kind's first action (``recovery.actions[kind]``; input and target kinds take
  ``sanitize.inputs`` / ``sanitize.targets``);
* n >= 2: ``recovery.escalate[n - 2]``, the last entry repeating;
* n > ``recovery.max_retries`` + 1: ``abort``.

``warn``, ``drop_rows`` and ``replace`` still train the step and do not climb the ladder, and
input and target anomalies never climb it (bad data is not fixed by rolling the model back);
``recovery.reset_after`` healthy steps in a row put it back at the first rung. Independently, a
run aborts when more than ``recovery.max_skip_fraction`` of the last ``recovery.skip_window``
steps were not trained, so it never reaches its end by skipping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = [
    "History",
    "Decision",
    "decide",
    "observe_healthy",
    "climb_pending",
    "record_step",
    "mark_last_skipped",
    "NON_CLIMBING",
    "TRAINING_ACTIONS",
]

#: Actions after which the step's update is still applied.
TRAINING_ACTIONS = frozenset({"warn", "drop_rows", "replace", "zero_grads"})
#: Actions that do not count as a failed attempt on the ladder.
NON_CLIMBING = frozenset({"warn", "drop_rows", "replace"})
_DATA_KINDS = frozenset({"input", "target"})


@dataclass(frozen=True)
class History:
    """What the policy remembers between steps; part of every snapshot via :meth:`to_dict`.

    Attributes:
        consecutive: anomalous steps that climbed the ladder since it was last reset
            (``reset_after`` healthy steps in a row reset it).
        healthy_streak: healthy steps in a row.
        recent: for the last ``skip_window`` steps, 1 if the step was not trained, else 0.
        lr_scale: the product of every LR backoff still in force (1.0: none).
        since_lr_change: healthy steps since ``lr_scale`` last changed.
    """

    consecutive: int = 0
    healthy_streak: int = 0
    recent: Tuple[int, ...] = ()
    lr_scale: float = 1.0
    since_lr_change: int = 0

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form, for snapshots and the journal."""
        return {
            "consecutive": self.consecutive,
            "healthy_streak": self.healthy_streak,
            "recent": list(self.recent),
            "lr_scale": self.lr_scale,
            "since_lr_change": self.since_lr_change,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "History":
        """Inverse of :meth:`to_dict`."""
        return cls(
            consecutive=int(data["consecutive"]),
            healthy_streak=int(data["healthy_streak"]),
            recent=tuple(int(x) for x in data["recent"]),
            lr_scale=float(data["lr_scale"]),
            since_lr_change=int(data["since_lr_change"]),
        )

    def skipped_fraction(self, window: int) -> float:
        """Fraction of the last ``window`` steps that were not trained (steps not yet run count as trained)."""
        return sum(self.recent) / window


@dataclass(frozen=True)
class Decision:
    """What to do about one anomalous step.

    Attributes:
        kind: the anomaly kind that was decided on.
        action: one of ``warn skip_batch drop_rows replace zero_grads restore scale_lr abort``.
        rung: 1-based position on the ladder (1: the kind's first action).
        restore: roll back to the last good snapshot (true for ``restore`` and ``scale_lr``).
        lr_scale: the LR scale in force after this decision.
        trains: whether the step's update is still applied.
        reason: one line for the journal.
    """

    kind: str
    action: str
    rung: int
    restore: bool
    lr_scale: float
    trains: bool
    reason: str


def _first_action(kind: str, recovery: Any, sanitize: Any) -> str:
    if kind == "input":
        return "abort" if sanitize.inputs == "raise" else sanitize.inputs
    if kind == "target":
        return "abort" if sanitize.targets == "raise" else sanitize.targets
    return recovery.actions[kind]


def _push(recent: Tuple[int, ...], skipped: bool, window: int, times: int = 1) -> Tuple[int, ...]:
    return (recent + (int(skipped),) * min(times, window))[-window:]


def decide(kind: str, history: History, recovery: Any, sanitize: Any) -> Tuple[Decision, History]:
    """Decide what to do about an anomalous step, and how the history moves on.

    Args:
        kind: the anomaly kind (see ``safetrain.config.ANOMALY_KINDS``).
        history: the policy's memory before this step.
        recovery: the ``recovery`` section of the config.
        sanitize: the ``sanitize`` section (first actions for input and target).

    Returns:
        ``(decision, new_history)``.

    Example::

        >>> from safetrain import load_config
        >>> cfg = load_config()
        >>> d, h = decide("loss", History(), cfg.recovery, cfg.sanitize)
        >>> d.action, h.consecutive
        ('skip_batch', 1)
    """
    first = _first_action(kind, recovery, sanitize)
    climbs = kind not in _DATA_KINDS and first not in NON_CLIMBING
    n = history.consecutive + 1 if climbs else 1
    if not climbs:
        action, reason = first, f"{kind}: {first}"
    elif n > recovery.max_retries + 1:
        action, reason = "abort", f"{kind}: {n} anomalous steps in a row, more than recovery.max_retries={recovery.max_retries} retries"
    elif n == 1:
        action, reason = first, f"{kind}: first action {first}"
    else:
        ladder = recovery.escalate or (first,)
        action = ladder[min(n - 2, len(ladder) - 1)]
        reason = f"{kind}: anomalous step {n} in a row, escalated to {action}"

    lr_scale, since = history.lr_scale, history.since_lr_change
    if action == "scale_lr":
        lr_scale, since = lr_scale * recovery.lr_factor, 0
    trains = action in TRAINING_ACTIONS
    recent = _push(history.recent, not trains, recovery.skip_window)
    new = replace(
        history,
        consecutive=n if climbs else history.consecutive,
        healthy_streak=0 if climbs else history.healthy_streak,
        recent=recent,
        lr_scale=lr_scale,
        since_lr_change=since,
    )
    if action != "abort" and sum(recent) / recovery.skip_window > recovery.max_skip_fraction:
        action = "abort"
        reason = (
            f"{kind}: {sum(recent)} of the last {recovery.skip_window} steps were not trained, more than "
            f"recovery.max_skip_fraction={recovery.max_skip_fraction}"
        )
        trains = False
    decision = Decision(
        kind=kind,
        action=action,
        rung=n,
        restore=action in ("restore", "scale_lr"),
        lr_scale=lr_scale,
        trains=trains,
        reason=reason,
    )
    return decision, new


def observe_healthy(history: History, recovery: Any, steps: int = 1) -> Tuple[History, Optional[float]]:
    """Record ``steps`` healthy steps: reset the ladder after ``reset_after``, climb the LR scale back.

    Several steps at once are what one step at a time would give, as long as no LR climb can
    happen on the way (:func:`climb_pending` is false): the guard then counts healthy steps and
    brings the history up to date only when it is read, instead of building one every step.

    Args:
        history: the policy's memory before these steps.
        recovery: the ``recovery`` section of the config.
        steps: how many healthy steps in a row (>= 1).

    Returns:
        ``(new_history, new_lr_scale)``; ``new_lr_scale`` is ``None`` unless the LR scale
        climbed back one notch (after ``recovery.lr_restore_after`` healthy steps).

    Raises:
        ValueError: ``steps`` < 1, or ``steps`` > 1 while an LR climb is pending (each climb is
            an event at its own step).
    """
    if steps < 1 or (steps > 1 and climb_pending(history, recovery)):
        raise ValueError(f"observe_healthy: got steps={steps}; expected 1, or more only when no LR climb is pending")
    streak = history.healthy_streak + steps
    consecutive = 0 if streak >= recovery.reset_after else history.consecutive
    since = history.since_lr_change + steps
    lr_scale, changed = history.lr_scale, None
    after = recovery.lr_restore_after
    if after is not None and lr_scale < 1.0 and since >= after:
        lr_scale = min(1.0, lr_scale / recovery.lr_factor)
        changed, since = lr_scale, 0
    new = History(
        consecutive=consecutive,
        healthy_streak=streak,
        recent=_push(history.recent, False, recovery.skip_window, steps),
        lr_scale=lr_scale,
        since_lr_change=since,
    )
    return new, changed


def climb_pending(history: History, recovery: Any) -> bool:
    """Whether a run of healthy steps could climb the LR scale back (``lr_restore_after`` set and
    the scale below 1): then :func:`observe_healthy` must see them one at a time."""
    return recovery.lr_restore_after is not None and history.lr_scale < 1.0


def record_step(history: History, recovery: Any, skipped: bool) -> History:
    """Record a step outside the ladder: a batch skipped after a restore (``skipped=True``), or a
    transient fault retried and trained (``skipped=False``).

    It counts toward ``recovery.max_skip_fraction`` but neither climbs nor resets the ladder.
    """
    return replace(history, recent=_push(history.recent, skipped, recovery.skip_window))


def mark_last_skipped(history: History) -> History:
    """The step :func:`decide` recorded as trained was not (``drop_rows`` found every row bad)."""
    return replace(history, recent=history.recent[:-1] + (1,)) if history.recent else history
