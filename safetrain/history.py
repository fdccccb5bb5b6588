"""The recovery policy's memory between steps: :class:`History`, part of every snapshot. No torch.

:mod:`safetrain.policy` moves it (``decide`` and ``observe_healthy`` return a new one); it is
frozen, so every state is a value a table test can write down.

Example::

    >>> History.from_dict(History(consecutive=2).to_dict()).consecutive
    2
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from .faults import Signature

__all__ = ["History", "MIN_SKIP_STEPS", "VOUCH_READS", "skip_denominator", "vouch", "read_clean", "newest_taken"]

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
            (a restore passes over it). Not part of a snapshot.
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


def vouch(history: History, reads: int = 1) -> History:
    """``reads`` steps read clean (a re-run of an anomalous step included): each is one of the
    :data:`VOUCH_READS` the newest snapshot needs before it is sound."""
    return replace(history, unverified=max(0, history.unverified - reads)) if history.unverified else history


def read_clean(history: History) -> History:
    """A re-run of an anomalous step read clean: one read toward vouching for the newest snapshot
    and, having passed the scaler's check, the end of an fp16 overflow run (it does not count as a
    healthy step)."""
    return replace(vouch(history), overflows=0)


def newest_taken(history: History, reads: int = VOUCH_READS) -> History:
    """A snapshot was taken after an update: unverified until ``reads`` more steps read clean."""
    return replace(history, unverified=reads)
