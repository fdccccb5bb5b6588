"""The recovery policy's memory between steps: :class:`History`, part of every snapshot. No torch.

:mod:`safetrain.policy` moves it on an anomaly (``decide`` returns a new one); the functions here
move it on healthy steps and on steps outside the ladder (:func:`observe_healthy`,
:func:`record_step`). It is frozen, so every state is a value a table test can write down.

Example::

    >>> History.from_dict(History(consecutive=2).to_dict()).consecutive
    2
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from ..kinds import Kind
from .faults import Signature

if TYPE_CHECKING:  # config imports no torch either; only its type is needed here
    from ..config import RecoveryConfig

__all__ = [
    "History",
    "MIN_SKIP_STEPS",
    "VOUCH_READS",
    "skip_denominator",
    "read_clean",
    "observe_healthy",
    "climb_pending",
    "record_step",
    "mark_last_skipped",
    "push_recent",
]

#: ``recovery.max_skip_fraction`` is judged over the steps so far once this many (or the whole
#: ``skip_window`` when smaller) have run: a run that skips every step stops early, not never.
MIN_SKIP_STEPS = 8


def skip_denominator(seen: int, window: int) -> int:
    """What ``recovery.max_skip_fraction`` divides by after ``seen`` steps: the steps so far (at
    most ``window``) once :data:`MIN_SKIP_STEPS` (or ``window`` when smaller) have run; before
    that the whole ``window``, the steps not yet run counting as trained."""
    return min(seen, window) if seen >= min(MIN_SKIP_STEPS, window) else window


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
        overflows: fp16 overflows in a row.
        unverified: clean reads the newest snapshot still needs before it is vouched for (0: it
            is sound). A snapshot taken after an update needs two
            (:data:`~safetrain.policy.VOUCH_READS`): one of its weights, one of the update that
            used its optimizer state and LR; until then it may hold the state that broke the run
            (a restore passes over it). A fact the guard derives from its record of clean reads
            before each decision, as ``has_snapshot``; not part of a snapshot.
        fault: the signature of the last anomaly that climbed the ladder (``None``: none, or one
            with no place); kept across healthy steps only for ``weights`` (a broken weight is
            silent until read), else until the ladder resets.
        restored: a restore was carried out after ``fault`` (and no other anomaly since).
        recurrences: how many times in a row ``fault`` came back right after a restore.
        reset_from: the rung the last ladder reset cleared, while the healthy streak that made
            it lasts (a ``weights`` fault that takes those healthy steps back puts it back).
        has_snapshot: a usable snapshot exists to restore (``False``: none taken yet, or every one
            refused as non-finite); the guard sets it before each decision; not part of a snapshot.
    """

    consecutive: int = 0
    healthy_streak: int = 0
    recent: Tuple[int, ...] = ()
    lr_scale: float = 1.0
    since_lr_change: int = 0
    overflows: int = 0
    unverified: int = 0
    fault: Optional[Signature] = None
    restored: bool = False
    recurrences: int = 0
    reset_from: int = 0
    has_snapshot: bool = True

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form, for snapshots and the journal."""
        return {
            "consecutive": self.consecutive,
            "healthy_streak": self.healthy_streak,
            "recent": list(self.recent),
            "lr_scale": self.lr_scale,
            "since_lr_change": self.since_lr_change,
            "overflows": self.overflows,
            "fault": self.fault.to_dict() if self.fault is not None else None,
            "restored": self.restored,
            "recurrences": self.recurrences,
            "reset_from": self.reset_from,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "History":
        """Inverse of :meth:`to_dict` (``overflows``, ``fault``, ``restored``, ``recurrences`` and
        ``reset_from`` default to none for snapshots that lack them)."""
        fault = data.get("fault")
        return cls(
            consecutive=int(data["consecutive"]),
            healthy_streak=int(data["healthy_streak"]),
            recent=tuple(int(x) for x in data["recent"]),
            lr_scale=float(data["lr_scale"]),
            since_lr_change=int(data["since_lr_change"]),
            overflows=int(data.get("overflows", 0)),
            fault=Signature.from_dict(fault) if fault else None,
            restored=bool(data.get("restored", False)),
            recurrences=int(data.get("recurrences", 0)),
            reset_from=int(data.get("reset_from", 0)),
        )

    def skipped_fraction(self, window: int) -> float:
        """Fraction of the last ``window`` steps that were not trained; while fewer than ``window``
        have run, of the steps so far once :data:`MIN_SKIP_STEPS` (or ``window`` when smaller)
        have (see :func:`skip_denominator`)."""
        return sum(self.recent[-window:]) / skip_denominator(len(self.recent), window)


#: Clean reads a snapshot taken after an update needs before it is vouched for: the first reads
#: the weights it holds; the second reads the effect of the update that used its optimizer state
#: and the LR its scheduler had already set (a schedule bug's LR is in the snapshot before any
#: update used it).
VOUCH_READS = 2


def read_clean(history: History) -> History:
    """A re-run of an anomalous step read clean: having passed the scaler's check, it ends an fp16
    overflow run (it does not count as a healthy step)."""
    return replace(history, overflows=0)


def push_recent(recent: Tuple[int, ...], skipped: bool, window: int, times: int = 1) -> Tuple[int, ...]:
    """``recent`` with ``times`` more steps (1: not trained), the last ``window`` kept."""
    return (recent + (int(skipped),) * min(times, window))[-window:]


def observe_healthy(history: History, recovery: "RecoveryConfig", steps: int = 1) -> Tuple[History, Optional[float]]:
    """Record ``steps`` healthy steps: reset the ladder after ``reset_after``, climb the LR scale back.

    A healthy step also ends an fp16 overflow streak. Several
    steps at once are what one step at a time would give, as long as no LR climb can happen on the
    way (:func:`climb_pending` is false): the guard then counts healthy steps and brings the
    history up to date only when it is read, instead of building one every step.

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
    reset = streak >= recovery.reset_after
    consecutive = 0 if reset else history.consecutive
    reset_from = history.consecutive if reset and history.consecutive else history.reset_from
    # a fault in the weights is silent until read: healthy steps do not say it is gone
    forget = reset and history.fault is not None and history.fault.kind != Kind.WEIGHTS
    since = history.since_lr_change + steps
    lr_scale, changed = history.lr_scale, None
    after = recovery.lr_restore_after
    if after is not None and lr_scale < 1.0 and since >= after:
        lr_scale = min(1.0, lr_scale / recovery.lr_factor)
        changed, since = lr_scale, 0
    new = History(
        consecutive=consecutive,
        healthy_streak=streak,
        recent=push_recent(history.recent, False, recovery.skip_window, steps),
        lr_scale=lr_scale,
        since_lr_change=since,
        fault=None if forget else history.fault,
        restored=False if forget else history.restored,
        recurrences=0 if forget else history.recurrences,
        reset_from=reset_from,
        unverified=history.unverified,
    )
    return new, changed


def climb_pending(history: History, recovery: "RecoveryConfig") -> bool:
    """Whether a run of healthy steps could climb the LR scale back (``lr_restore_after`` set and
    the scale below 1): then :func:`observe_healthy` must see them one at a time."""
    return recovery.lr_restore_after is not None and history.lr_scale < 1.0


def record_step(history: History, recovery: "RecoveryConfig", skipped: bool) -> History:
    """Record a step outside the ladder: a batch skipped after a restore (``skipped=True``), or a
    transient fault retried and trained (``skipped=False``).

    It counts toward ``recovery.max_skip_fraction`` but neither climbs nor resets the ladder.
    """
    return replace(history, recent=push_recent(history.recent, skipped, recovery.skip_window))


def mark_last_skipped(history: History) -> History:
    """The step :func:`decide` recorded as trained was not (``drop_rows`` found every row bad)."""
    return replace(history, recent=history.recent[:-1] + (1,)) if history.recent else history
