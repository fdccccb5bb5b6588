"""The guard's recovery state: one object instead of flags spread over the guard.

What the policy remembers (its :class:`~safetrain.policy.History`, brought up to date lazily: a
healthy step only counts, the history is rebuilt when read), the data to skip after a restore,
the steps since the last snapshot and the epoch's loss. Tests and users read it here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import RecoveryConfig
from ..policy import VOUCH_READS, History, climb_pending, observe_healthy
from ..stats.spike import spread_floor
from .returns import Returns

__all__ = ["RecoveryState"]

#: How many of the run's first trained losses the end-of-run check takes the start level from
#: (and how many trained losses it needs at each end).
_LAST = 5
#: How many of the run's last trained losses the end level is the lower quartile of (their spread:
#: the run's noise at its end).
_TAIL = 16
#: The expected range of three draws of a normal distribution, in standard deviations.
_RANGE_OF_3 = 1.693


@dataclass
class RecoveryState:
    """Everything the guard's recovery remembers between steps.

    Attributes:
        recovery: the ``recovery`` section the history moves by.
        skip_after_restore: steps of data still to skip after a restore
            (``recovery.skip_batches_after_restore``).
        since_snapshot: healthy steps since the last snapshot.
        epoch_loss: sum and count of this epoch's trained steps' finite losses (the epoch metric of
            an epoch-interval scheduler; part of the snapshot, so a resume mid-epoch keeps it).
        clean_reads: the steps of the last :data:`~safetrain.policy.VOUCH_READS` reads that were
            clean, while the loss stood at its level: the one record of vouching (a restore passes
            over every snapshot they do not vouch for; the policy's ``History.unverified`` is
            derived from them, :meth:`for_policy`).
        left_level: the step at which the loss last rose above its level and has stood there
            since (no snapshot is taken or vouched for meanwhile), else ``None``; the end-of-run
            check names it.
        newest: ``(step, sound as taken)`` of the newest snapshot (forced: the run's start, a
            resumed state; or restored), else ``None``.
        returns: how far the run got after each restore to the snapshot restored last (a restore
            loop stops the run).
        restored_updates: the optimizer steps applied when the last restore was carried out (a run
            that has applied none since a restore to its start ends there: it is never "done").
        damage: ``(step the loss jumped, snapshot step restored)`` of the last damage the cause
            test found (the end-of-run check names it), else ``None``.
    """

    recovery: RecoveryConfig
    skip_after_restore: int = 0
    since_snapshot: int = 0
    epoch_loss: Tuple[float, int] = (0.0, 0)
    first_losses: List[float] = field(default_factory=list)  # the run's first trained, finite losses
    start_losses: List[float] = field(default_factory=list)  # the start model's on batches ahead (measure_start)
    last_losses: Deque[float] = field(default_factory=lambda: deque(maxlen=_TAIL))  # its last ones
    clean_reads: Deque[int] = field(default_factory=lambda: deque(maxlen=VOUCH_READS))  # their steps
    newest: Optional[Tuple[int, bool]] = None
    left_level: Optional[int] = None
    returns: Returns = field(default_factory=Returns)
    restored_updates: int = -1
    damage: Optional[Tuple[int, int]] = None
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
        """Whether a snapshot of ``step`` is vouched for: sound as taken (the newest, forced or
        restored), or :data:`~safetrain.policy.VOUCH_READS` steps after it read clean (the last of
        them the update that used its state and LR). The one rule the policy (:meth:`for_policy`),
        a restore's pass-over, the cause test and the end check all ask."""
        return self._owed(step) == 0

    def _owed(self, step: int) -> int:
        """Clean reads a snapshot of ``step`` still needs before it is vouched for."""
        if self.newest == (step, True):
            return 0  # sound as taken: the run's start, a resumed state, a snapshot put back
        return max(0, VOUCH_READS - sum(1 for read in self.clean_reads if read > step))

    def for_policy(self, has_snapshot: bool) -> History:
        """The history with the facts the guard knows and the policy reads: whether a snapshot
        exists, and how many clean reads the newest one still needs (``History.unverified``,
        derived here from :attr:`clean_reads`; 0 for a snapshot sound as taken)."""
        owed = 0 if self.newest is None else self._owed(self.newest[0])
        return replace(self.history, has_snapshot=has_snapshot, unverified=owed)

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

    def rebase(self) -> None:
        """The data changed: the end-of-run check takes its start from the next trained losses (the
        new level), not from the run's first."""
        self.first_losses, self.start_losses = [], []
        self.last_losses.clear()

    def ended_worse(self, margin: Optional[float]) -> Optional[str]:
        """Whether the run ends worse than it started; a sentence saying so, else ``None``.

        * The **end level** is the lower quartile of the last 16 trained losses: a level the run's
          end stays above, settled rather than one unlucky batch (a ruin in the very last steps is
          the detectors' to catch, non-finite weights the check before this one).
        * The **start level** is the median of the first 5 trained losses that are at most
          ``2 x margin`` end spreads (below) above the very first: a blow-up in the first steps, or
          the losses of weights it ruined, is no start; the first loss, the model as it came,
          always counts; twice the margin, so that a first loss low by chance leaves the others in.
        * The run's **noise** ``sigma`` is the geometric mean of its spread at the start (of those
          start losses) and at the end (of the last 16), each 1.4826 x a median absolute deviation,
          floored at float resolution. The end's alone hides a run whose noise grew with its level
          (an LR left x1000 makes the losses 15x higher and 40x noisier); the start's alone, from 5
          losses, is too often small by chance. When fewer than 3 of the first 5 are a start (the
          first updates blew the run up), the start has no spread: an end above the start level by
          more than float rounding is worse.

        The run ends worse when its end level is more than ``margin`` sigmas above its start level.
        Measured on 2000 flat, untrained runs of 10-300 steps each of Gaussian, lognormal and
        heavy-tailed noise at margin 4: at most 0.1% false alarms (Gaussian and lognormal; none for
        the heavy-tailed ones, none for falling runs); a run ruined at its 5th step to 15x its start
        level with noise proportional to it: 95% caught; the issue's case (3.9, then 2.0, then 5.5,
        noise 0.25): 97%.

        When the start model's losses on the batches ahead were measured (``fit`` does it,
        :meth:`~safetrain.Guard.measure_start`), they and the first trained loss, all three losses of
        the model as it came, are the start: its level their median, its spread their range over
        1.693 (the expected range of three normal draws). Then weights ruined by the very first
        update, whose losses' noise grows with their level, are told from a flat run too; without
        them one sound loss gives the start no spread.

        Every quantity is a difference or a spread, so the decision is the same for ``loss``,
        ``loss + c`` and ``a * loss`` (``a > 0``), up to float rounding: a negative or offset loss is
        judged like any other. Only the start is a bound: after a restore the run legitimately
        stands at an older snapshot's level, anywhere between its start and where it stood before
        its last fault, so that level is no bound; a run left there is no worse than it started.
        """
        return self.worse(self.last_losses, margin)

    def worse(self, tail: Sequence[float], margin: Optional[float]) -> Optional[str]:
        """:meth:`ended_worse` for another ``tail`` of trained losses than the run's last ones:
        those a snapshot kept (the run's last losses when it was taken), to tell whether the run
        already stood worse than it started there."""
        tail = list(tail)
        if margin is None or len(self.first_losses) < _LAST or len(tail) < _LAST:
            return None
        ending = sorted(tail)
        first, end = self.first_losses[0], ending[len(ending) // 4]
        at_end = _robust_sigma(tail)
        if self.start_losses:  # the model as it came, on three batches: the start's level and spread
            starts = [*self.start_losses, first]
            at_start = (max(starts) - min(starts)) / _RANGE_OF_3
        else:
            starts = [x for x in self.first_losses if x - first <= 2 * margin * at_end]
            at_start = _robust_sigma(starts) if len(starts) >= 3 else 0.0  # the first steps blew up: no spread
        start = statistics.median(starts)
        sigma = max(math.sqrt(at_start * at_end), spread_floor(end))
        if end - start <= margin * sigma:
            return None
        return (
            f"the run ends worse than it started: its last trained losses (lower quartile {end:.4g}) are "
            f"{(end - start) / sigma:.3g} standard deviations of its losses ({sigma:.3g}) above where it "
            f"started ({start:.4g}), more than guard.end_margin={margin:g}"
        )

    def state_dict(self) -> Dict[str, Any]:
        """The persisted part, JSON-ready: ``history`` and ``epoch_loss``."""
        return {
            "history": self.history.to_dict(),
            "epoch_loss": list(self.epoch_loss),
            "losses": {
                "first": list(self.first_losses),
                "last": list(self.last_losses),
                "start": list(self.start_losses),
            },
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
        self.last_losses = deque((float(x) for x in losses["last"]), maxlen=_TAIL)
        self.start_losses = [float(x) for x in losses.get("start", ())]  # absent from earlier snapshots


def _robust_sigma(values: List[float]) -> float:
    """1.4826 x the median absolute deviation of ``values``: their standard deviation, robust to outliers."""
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(x - middle) for x in values)
