"""Taking a snapshot of the whole training state: when the guard asks, and what it owes.

A snapshot taken after an update is unverified until two steps read clean, the second the effect
of the update that used its optimizer state and LR (:data:`~safetrain.policy.VOUCH_READS`); a
forced one (the run's start) is sound. The first snapshot's event names the buffers accepted as
non-finite by design (masks), once.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch

from ..events import Event, SnapshotTaken
from ..policy import VOUCH_READS, newest_taken
from ..snapshot import TrainState
from ..snapshot.accepted import describe as describe_accepted
from ..steps import Counters
from .state import RecoveryState

__all__ = ["Snapshots"]


class Snapshots:
    """Takes the guard's snapshots into its store and records what they owe.

    Args:
        store: where snapshots go.
        state: the whole training state (model, optimizer, scheduler, scaler, RNG).
        counters: the guard's counters (saved with each snapshot).
        recovery_state: the recovery state whose history learns of each snapshot.
        clear: forget the replay's kept updates up to a step (a new snapshot starts them afresh).
        emit: the guard's journal call, ``emit(cls, kind, action, message, detail)``.
    """

    def __init__(
        self,
        store: Any,
        state: TrainState,
        counters: Counters,
        recovery_state: RecoveryState,
        clear: Callable[[int], None],
        emit: Callable[..., Event],
    ) -> None:
        self.store, self.state, self.counters, self.recovery_state = store, state, counters, recovery_state
        self._clear, self._emit = clear, emit
        self._accepted_named = False  # the first snapshot's event names the accepted buffers

    def take(self, extra: Mapping[str, Any], epoch_rng: Optional[torch.Tensor], force: bool = False) -> Event:
        """Snapshot the state now with the guard's own ``extra`` state; the :class:`SnapshotTaken`
        event (``action`` ``"saved"``, or ``"refused"`` when the state is not finite)."""
        c, rs = self.counters, self.recovery_state
        rs.since_snapshot = 0
        tensors = {"epoch_rng": epoch_rng} if epoch_rng is not None else {}
        counters = {"step": c.steps, **vars(c)}
        info = self.store.save(self.state, counters=counters, extra=dict(extra), extra_tensors=tensors)
        if info is None:
            why = "snapshot refused: the state is not finite; the previous one stays"
            return self._emit(SnapshotTaken, "snapshot", "refused", why, {})
        rs.history = newest_taken(rs.history, 0 if force else VOUCH_READS)
        self._clear(c.steps)
        detail: Dict[str, Any] = {"path": str(info.path) if info.path else None, "forced": force}
        message = f"snapshot of step {c.steps}"
        if self.state.accepted and not self._accepted_named:  # named once, in the first snapshot's event
            self._accepted_named = True
            detail["accepted_buffers"] = accepted = describe_accepted(self.state.accepted)
            message += f"; accepted non-finite buffers present at the start: {accepted}"
        return self._emit(SnapshotTaken, "snapshot", "saved", message, detail)
