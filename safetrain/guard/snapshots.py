"""Taking a snapshot of the whole training state: when the guard asks, and what it owes.

A snapshot taken after an update is unverified until two steps read clean, the second the effect
of the update that used its optimizer state and LR (:data:`~safetrain.policy.VOUCH_READS`); a
forced one (the run's start) is sound. The first snapshot's event names the buffers accepted as
non-finite by design (masks), once. How often the periodic one is due is the :class:`~.cadence.Cadence`'s
(``snapshot.every``; under ``auto`` each snapshot is timed for it and re-plans the interval).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from ..config import SnapshotConfig
from ..diagnose import Diagnoser
from ..events import Event, SnapshotTaken
from ..snapshot import TrainState
from ..snapshot.accepted import describe as describe_accepted
from .cadence import Cadence
from .context import Context
from .state import RecoveryState

__all__ = ["Snapshots"]


class Snapshots:
    """Takes the guard's snapshots into its store and records what they owe.

    Args:
        cfg: the ``snapshot`` section: when the periodic snapshot is due (:attr:`cadence`; each
            snapshot is timed for it and re-plans it).
        context: the run's counters (saved with each snapshot), journal, and sync (under DDP/FSDP
            every rank takes the largest rank's interval).
        store: where snapshots go.
        state: the whole training state (model, optimizer, scheduler, scaler, RNG).
        recovery_state: the recovery state whose history learns of each snapshot.
        diagnoser: the replays, whose kept updates a new snapshot starts afresh.
    """

    def __init__(
        self,
        cfg: SnapshotConfig,
        context: Context,
        store: Any,
        state: TrainState,
        recovery_state: RecoveryState,
        diagnoser: Diagnoser,
    ) -> None:
        self.store, self.state, self.counters, self.recovery_state = store, state, context.counters, recovery_state
        self._clear, self._emit = diagnoser.clear, context.journal
        #: when the periodic snapshot is due
        self.cadence = Cadence(cfg.every, cfg.overhead, cfg.min_every, cfg.max_every)
        sync = context.sync
        self._sync = sync if not sync.steps_alone else None
        self._accepted_named = False  # the first snapshot's event names the accepted buffers

    def take(self, extra: Mapping[str, Any], epoch_rng: Optional[torch.Tensor], force: bool = False) -> Event:
        """Snapshot the state now with the guard's own ``extra`` state; the :class:`SnapshotTaken`
        event (``action`` ``"saved"``, or ``"refused"`` when the state is not finite)."""
        c, rs = self.counters, self.recovery_state
        rs.since_snapshot = 0
        tensors = {"epoch_rng": epoch_rng} if epoch_rng is not None else {}
        counters = {"step": c.steps, **vars(c)}
        info: Any = self.cadence.timed(
            lambda: self.store.save(self.state, counters=counters, extra=dict(extra), extra_tensors=tensors)
        )
        self.cadence.replan(self._agree)
        if info is None:
            why = "snapshot refused: the state is not finite; the previous one stays"
            return self._emit(SnapshotTaken, "snapshot", "refused", why, {})
        rs.newest = (c.steps, force)  # (a forced one is sound as taken: the run's start, a resumed state)
        self._clear(c.steps)
        detail: Dict[str, Any] = {"path": str(info.path) if info.path else None, "forced": force}
        if self.cadence.auto:  # the interval snapshot.every: auto planned from the costs measured so far
            detail["every"] = self.cadence.every
        message = f"snapshot of step {c.steps}"
        if self.state.accepted and not self._accepted_named:  # named once, in the first snapshot's event
            self._accepted_named = True
            detail["accepted_buffers"] = accepted = describe_accepted(self.state.accepted)
            message += f"; accepted non-finite buffers present at the start: {accepted}"
        return self._emit(SnapshotTaken, "snapshot", "saved", message, detail)

    def _agree(self, every: int) -> int:
        """The interval every rank uses: the largest rank's (one small collective, at a snapshot)."""
        return max(self._sync.gather_object(every)) if self._sync is not None else every
