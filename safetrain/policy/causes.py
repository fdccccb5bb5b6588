"""The cause test's rules: a bad batch, a damaged model, or data that changed; pure Python, no torch.

A loss far above its level has three causes that call for opposite actions. The guard tells them
apart only on an anomaly, before the ladder escalates (a second spike in a row): it evaluates the
step's batch, without a backward, with the current model and with each vouched snapshot's model
(weights and buffers), and :func:`cause_of` reads the losses:

* **damage**: a snapshot's model does about as well on this batch as it did on its own data when
  it was taken (its rise is below :data:`DAMAGE_SHARE` of the current model's jump), while the
  current model does badly: the model changed, not the data. Restore that snapshot.
* **data change**: every snapshot's model also does badly on it (its rise is at least
  :data:`CHANGE_SHARE` of the jump): the data is harder now (new classes, a curriculum stage, a
  new mixture). Train on, and re-base the loss references at the new level.
* **unknown**: no snapshot with a level of its own, or a rise in between: the ladder decides, as
  before the test.

A **bad batch** needs no test: the next fresh batch is normal, so the ladder never climbs past
its first action (one skip).

A snapshot's **level** is the median of the last losses its spike window held when it was taken,
its **rise** the loss of its model on the batch minus the lower of that level and the run's level
before the jump; the current model's **jump** is its loss on the batch minus the level before the
jump (the spike's median). Only differences are compared, so the verdict is the same for ``loss``,
``loss + c`` and ``a * loss`` (``a > 0``). An untrained model (the run's first snapshot, with no
level) is no witness: it can do better than a trained, confident model on new classes without the
trained one being damaged. For the same reason a snapshot from early training (taken every few
steps under ``snapshot.every: auto``) does not do well merely by staying near its own high level:
it must also come near where the run stood before the jump.

Under DDP every rank tests its own batch and :func:`agree` gives one verdict: damage when any rank
saw it (going back as far as the rank that needs it most), a data change only when every rank did.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..kinds import Cause

__all__ = [
    "Witness",
    "Verdict",
    "cause_of",
    "agree",
    "level_of",
    "DAMAGE_SHARE",
    "CHANGE_SHARE",
    "LEVEL_LOSSES",
    "MATURE_SIGMAS",
]

#: A snapshot whose rise on the batch is below this share of the current model's jump does well.
DAMAGE_SHARE = 0.25
#: A snapshot whose rise is at least this share of the jump does badly too: the data changed.
CHANGE_SHARE = 0.5
#: How many of a snapshot's last window losses its level is the median of.
LEVEL_LOSSES = 16
#: A snapshot needs this many window losses to have a level (else it is no witness).
MIN_LEVEL_LOSSES = 3
#: A snapshot whose own level stands more than this many robust sigmas of the window before the
#: jump above the run's level was taken in another regime (early training): it is no witness.
MATURE_SIGMAS = 6.0


@dataclass(frozen=True)
class Witness:
    """One snapshot's evidence: which it is, its model's loss on the batch, and its level.

    Attributes:
        older: how many newer usable snapshots lie before it in the store (0: the newest).
        step: the step it was taken at.
        loss: its model's loss on the step's batch (no backward).
        level: the median of its last window losses when it was taken (``None``: too few).
    """

    older: int
    step: int
    loss: float
    level: Optional[float]


@dataclass(frozen=True)
class Verdict:
    """What the cause test found.

    Attributes:
        cause: a :class:`~safetrain.kinds.Cause`.
        older: for ``damage``, the snapshot to restore (its ``Witness.older``).
        step: for ``damage``, that snapshot's step.
        current: the current model's loss on the batch.
        level: the level before the jump.
    """

    cause: Cause
    older: int = 0
    step: int = -1
    current: float = float("nan")
    level: float = float("nan")


def level_of(window: Sequence[float]) -> Optional[float]:
    """A snapshot's level: the median of its spike window's last :data:`LEVEL_LOSSES` losses
    (``None`` with fewer than :data:`MIN_LEVEL_LOSSES`: the run's start has no level)."""
    last = list(window)[-LEVEL_LOSSES:]
    return statistics.median(last) if len(last) >= MIN_LEVEL_LOSSES else None


def cause_of(current: float, level: float, witnesses: Sequence[Witness], spread: Optional[float] = None) -> Verdict:
    """The cause of a loss ``current`` far above ``level``, from the snapshots' ``witnesses``
    (newest first). With ``spread`` (the robust sigma of the losses before the jump), a snapshot
    whose own level stands more than :data:`MATURE_SIGMAS` of it above ``level`` is no witness: a
    barely trained model does "well" on new classes only because it never learned the old ones.

    Example::

        >>> cause_of(10.0, 1.0, [Witness(0, 100, 1.2, 1.0)]).cause
        <Cause.DAMAGE: 'damage'>
        >>> cause_of(10.0, 1.0, [Witness(0, 100, 9.0, 1.0)]).cause
        <Cause.DATA_CHANGE: 'data_change'>
    """
    jump = current - level
    judged = [w for w in witnesses if w.level is not None]
    if spread is not None and spread > 0.0:  # (a zero or NaN spread says nothing of maturity)
        judged = [w for w in judged if w.level - level <= MATURE_SIGMAS * spread]  # type: ignore[operator]
    if not judged or not jump > 0.0:  # (NaN too)
        return Verdict(Cause.UNKNOWN, current=current, level=level)
    for w in judged:
        if _rise(w, level) < DAMAGE_SHARE * jump:
            return Verdict(Cause.DAMAGE, w.older, w.step, current, level)
    if all(_rise(w, level) >= CHANGE_SHARE * jump for w in judged):
        return Verdict(Cause.DATA_CHANGE, current=current, level=level)
    return Verdict(Cause.UNKNOWN, current=current, level=level)


def _rise(w: Witness, level: float) -> float:
    """How far a witness's loss on the batch stands above the lower of its own level and the
    run's before the jump (an early snapshot near its own high level has not done well)."""
    return w.loss - min(w.level, level)  # type: ignore[type-var]


def agree(verdicts: List[Verdict]) -> Verdict:
    """One verdict from every rank's: damage when any rank saw it (the oldest snapshot any needs),
    a data change when every rank saw one, else unknown.

    Example::

        >>> agree([Verdict(Cause.DATA_CHANGE), Verdict(Cause.UNKNOWN)]).cause
        <Cause.UNKNOWN: 'unknown'>
    """
    damaged = [v for v in verdicts if v.cause is Cause.DAMAGE]
    if damaged:
        return max(damaged, key=lambda v: v.older)
    if verdicts and all(v.cause is Cause.DATA_CHANGE for v in verdicts):
        return verdicts[0]
    first = verdicts[0] if verdicts else Verdict(Cause.UNKNOWN)
    return Verdict(Cause.UNKNOWN, current=first.current, level=first.level)
