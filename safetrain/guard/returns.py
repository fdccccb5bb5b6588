"""Restore loops: the run keeps coming back to one snapshot and never gets past the point it fails at.

A restore is an answer only if the run, set back, gets further than before. A schedule whose peak
LR is too high (a one-cycle schedule, a warmup to an LR the model cannot take) breaks the run at
the same point each time it is restored: the restored scheduler climbs to the same LR again. Each
restore lands on the same snapshot; the steps after it are thrown away each time. :class:`Returns`
counts, for the snapshot restored last, how far the run got from it (steps, from the snapshot or
from the last restore to it); a return that trained and still got no meaningfully further than the
furthest before (:func:`got_further`: a quarter more steps, at least 3), under an LR no lower than
the last time, is a loop, and :data:`MAX_RETURNS` of them stop the run with a reason that names the
point, the cause and the fix (:func:`loop_reason`). Whatever each return reached, a run put back to
one snapshot :data:`MAX_RESTORES` times has thrown away all it trained since that snapshot as often:
it stops too (:attr:`Returns.stuck`). Returns
with no update between them are anomalous steps in a row, bounded by the ladder
(``recovery.max_retries``); a return under a backed-off LR is a new try (``scale_lr`` is the
remedy being tried, bounded by ``recovery.min_lr`` and the ladder). What the ladder does not bound
is a fault that comes back after enough healthy steps to reset it (``recovery.reset_after``),
under the same LR: that is a loop. No torch.

Example::

    >>> r = Returns()
    >>> [r.arrive(snapshot=0, now=n, trained=True) for n in (30, 45, 58)]
    [0, 1, 2]
    >>> r.furthest, r.stuck
    (30, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Returns", "MAX_RETURNS", "MAX_RESTORES", "got_further", "loop_reason", "cause_of"]

#: Returns to one snapshot that got no further than the furthest before, after which the run stops.
MAX_RETURNS = 2
#: Restores to one snapshot after which the run stops, however far each return got: every one threw
#: away all the run trained since that snapshot, so none of it was kept.
MAX_RESTORES = 5


def got_further(reached: int, furthest: int) -> bool:
    """Whether a return that reached ``reached`` steps past a snapshot got past the point the run
    failed at before (``furthest``): by a quarter more steps, at least 3. Returns that fail a step or
    two later each time, as a rising schedule meets the same LR a little later under noise, do not.

    Example::

        >>> got_further(44, 41), got_further(52, 41), got_further(5, 1)
        (False, True, True)
    """
    return reached > furthest + max(2, furthest // 4)


@dataclass
class Returns:
    """How the run fares after restores to one snapshot.

    Attributes:
        snapshot: the step of the snapshot restored last (``None``: no restore yet).
        restored_at: the step counter when it was restored last.
        furthest: the most steps the run got past that snapshot before a fault.
        loops: returns to it since that got no further than ``furthest``.
        restores: restores to it in all.
        scale: the LR scale in force at the last restore to it.
    """

    snapshot: Optional[int] = None
    restored_at: int = 0
    furthest: int = 0
    loops: int = 0
    restores: int = 0
    scale: float = 1.0

    def arrive(self, snapshot: int, now: int, scale: float = 1.0, trained: bool = True) -> int:
        """A restore at step counter ``now`` put back the snapshot of step ``snapshot``, with the LR
        scale ``scale`` in force (before any backoff this restore comes with); ``trained``: an update
        was applied since the last restore. Returns how many returns to it in a row trained and got
        no further than before, under an LR no lower (0: a new snapshot, progress, a lower LR)."""
        if snapshot != self.snapshot:  # a new snapshot: how far the run got from it, from its own step
            self.snapshot, self.furthest, self.loops, self.restores = snapshot, now - snapshot, 0, 1
        else:
            reached = now - self.restored_at
            self.restores += 1
            if got_further(reached, self.furthest) or scale < self.scale * 0.999:
                self.furthest, self.loops = max(reached, self.furthest), 0
            elif trained:
                self.loops += 1
        self.restored_at, self.scale = now, scale
        return self.loops

    @property
    def stuck(self) -> bool:
        """Whether the run stops here: :data:`MAX_RETURNS` returns in a row got no further, or it
        was put back to this snapshot :data:`MAX_RESTORES` times."""
        return self.loops >= MAX_RETURNS or self.restores >= MAX_RESTORES


def loop_reason(
    kind: str,
    returns: Returns,
    *,
    failed_lr: Optional[Sequence[float]],
    snapshot_lr: Optional[Sequence[float]],
    scheduler: str = "",
) -> str:
    """The abort's reason for a restore loop: the snapshot, the point the run never got past, and
    :func:`cause_of` (the other arguments are its).

    Example::

        >>> r = Returns(snapshot=0, furthest=30, loops=2, restores=3)
        >>> loop_reason("divergence", r, failed_lr=[0.6], snapshot_lr=[0.1], scheduler="OneCycleLR")[:40]
        'divergence: restore loop: the run was pu'
    """
    point = (
        f"{kind}: restore loop: the run was put back to the snapshot of step {returns.snapshot} {returns.restores} "
        f"times and never got more than {returns.furthest} steps past it"
    )
    cause = cause_of(kind, failed_lr=failed_lr, snapshot_lr=snapshot_lr, scheduler=scheduler)
    return f"{point}; {cause}"


def cause_of(
    kind: str,
    *,
    failed_lr: Optional[Sequence[float]],
    snapshot_lr: Optional[Sequence[float]],
    scheduler: str = "",
) -> str:
    """Why restores to a snapshot do not help, and the fix: the LR schedule when the LR the failing
    update used is above the snapshot's (the restored scheduler climbs back to it), else the fault
    itself. ``failed_lr`` and ``snapshot_lr`` are the LRs in use (the LR backoff's scale included).

    Example::

        >>> cause_of("spike", failed_lr=[0.1], snapshot_lr=[0.1])[:40]
        'cause: the spike fault the restores answ'
    """
    failed = max(failed_lr) if failed_lr else None
    start = max(snapshot_lr) if snapshot_lr else None
    if failed is not None and start is not None and failed > start * 1.001:
        schedule = f"the LR scheduler {scheduler}" if scheduler else "the LR schedule"
        return (
            f"cause: {schedule} rises from lr {start:.3g} at the snapshot to lr {failed:.3g} where the run fails, "
            "each time it is restored; fix: lower the schedule's peak LR (a OneCycleLR's max_lr, a warmup's target) "
            f"below {failed:.3g}, or lengthen its warmup"
        )
    return (
        f"cause: the {kind} fault the restores answered, at that point; fix: a smaller learning rate, or look at the "
        "data and the model state at that point (recovery.skip_batches_after_restore leaves out the batches that "
        "led in)"
    )
