"""The guard's recovery state: one object instead of flags spread over the guard.

What the policy remembers (its :class:`~safetrain.policy.History`, brought up to date lazily: a
healthy step only counts, the history is rebuilt when read), the data to skip after a restore,
the steps since the last snapshot and the epoch's loss. Tests and users read it here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Tuple

from ..config import RecoveryConfig
from ..policy import VOUCH_READS, History, climb_pending, observe_healthy

__all__ = ["RecoveryState"]

#: How many of the run's last trained losses the end-of-run check takes the median of.
_LAST = 5
#: An early loss this many times the run's first is a blow-up, not the level the run started from.
_JUMP = 100.0


@dataclass
class RecoveryState:
    """Everything the guard's recovery remembers between steps.

    Attributes:
        recovery: the ``recovery`` section the history moves by.
        skip_after_restore: steps of data still to skip after a restore
            (``recovery.skip_batches_after_restore``).
        skipped_micro: micro-batches of the step being skipped after a restore.
        since_snapshot: healthy steps since the last snapshot.
        epoch_loss: sum and count of this epoch's trained steps' finite losses (the epoch metric of
            an epoch-interval scheduler; part of the snapshot, so a resume mid-epoch keeps it).
        clean_reads: the steps of the last :data:`~safetrain.policy.VOUCH_READS` reads that were
            clean (a restore passes over every snapshot they do not vouch for).
    """

    recovery: RecoveryConfig
    skip_after_restore: int = 0
    skipped_micro: int = 0
    since_snapshot: int = 0
    epoch_loss: Tuple[float, int] = (0.0, 0)
    first_losses: List[float] = field(default_factory=list)  # the run's first trained, finite losses
    last_losses: Deque[float] = field(default_factory=lambda: deque(maxlen=_LAST))  # its last ones
    clean_reads: Deque[int] = field(default_factory=lambda: deque(maxlen=VOUCH_READS))  # their steps
    _history: History = History()
    _healthy_run: int = 0  # healthy steps not yet applied to the history

    @property
    def history(self) -> History:
        """The policy's memory, up to this step."""
        if self._healthy_run:
            self._history, _ = observe_healthy(self._history, self.recovery, self._healthy_run)
            self._healthy_run = 0
        return self._history

    @history.setter
    def history(self, value: History) -> None:
        self._history, self._healthy_run = value, 0

    def vouched(self, step: int) -> bool:
        """Whether a snapshot of ``step`` is vouched for: :data:`~safetrain.policy.VOUCH_READS`
        steps after it read clean (the last of them the update that used its state and LR)."""
        return len(self.clean_reads) == VOUCH_READS and self.clean_reads[0] > step

    def healthy(self) -> Optional[float]:
        """Count a healthy step; returns the new LR scale when it climbs back a notch (an event at
        its own step), else ``None``. Without a pending climb only a counter moves."""
        if self.recovery.lr_restore_after is not None and climb_pending(self._history, self.recovery):
            self._history, new_scale = observe_healthy(self.history, self.recovery)
            return new_scale
        self._healthy_run += 1
        return None

    def count_loss(self, loss: float) -> None:
        """Add a trained step's loss to the epoch's mean and to the run's first and last losses (a
        non-finite one is left out)."""
        if math.isfinite(loss):
            total, n = self.epoch_loss
            self.epoch_loss = (total + loss, n + 1)
            self.last_losses.append(loss)
            if len(self.first_losses) < _LAST:
                self.first_losses.append(loss)

    def ended_worse(self, ratio: Optional[float]) -> Optional[str]:
        """Whether the run ends worse than it started: the median of its last 5 trained losses above
        ``ratio`` times the largest of its first 5 (a bound, so that one low early batch of a flat,
        noisy run is no reference) that are below ``_JUMP`` times the first (a blow-up in the first
        steps is no reference either); a sentence saying so, else ``None``."""
        if ratio is None or len(self.first_losses) < _LAST or len(self.last_losses) < _LAST:
            return None
        first = self.first_losses[0]
        start = max(x for x in self.first_losses if x < _JUMP * first or x == first)
        end = statistics.median(self.last_losses)
        if end <= ratio * start:
            return None
        return (
            f"the run ends worse than it started: its last trained losses (median {end:.4g}) are "
            f"{end / start:.3g}x its first (at most {start:.4g}), above guard.end_loss_ratio={ratio:g}"
        )

    def state_dict(self) -> Dict[str, Any]:
        """The persisted part, JSON-ready: ``history`` and ``epoch_loss``."""
        return {
            "history": self.history.to_dict(),
            "epoch_loss": list(self.epoch_loss),
            "losses": {"first": list(self.first_losses), "last": list(self.last_losses)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (snapshots of earlier versions keep the fp16
        overflow streak beside the history, as ``overflows``)."""
        history = dict(state["history"])
        if "overflows" in state:
            history.setdefault("overflows", state["overflows"])
        self.history = History.from_dict(history)
        total, n = state.get("epoch_loss", (0.0, 0))  # absent from snapshots of earlier versions
        self.epoch_loss = (float(total), int(n))
        losses = state.get("losses", {"first": [], "last": []})  # absent from earlier snapshots
        self.first_losses = [float(x) for x in losses["first"]]
        self.last_losses = deque((float(x) for x in losses["last"]), maxlen=_LAST)
