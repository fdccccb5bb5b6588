"""How the guard journals: each event stamped with the step, the batch it is about and the rank."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from ..events import AnomalyFound, Event, EventBus
from ..steps import Counters

__all__ = ["StepJournal"]


class StepJournal:
    """``journal(cls, kind, action, message, detail, at=None) -> event``: one event onto the bus,
    at the guard's step; ``at``: the ``(epoch, batch index)`` of the micro-batch it is about (an
    accumulated step's micro-batches each have their own), else the step's last batch.

    Args:
        bus: where events go.
        counters: the guard's counters (the step, epoch and batch stamped on each event).
        sync: the distributed sync (an anomaly names which ranks' own values tripped; the rank).
    """

    def __init__(self, bus: EventBus, counters: Counters, sync: Any) -> None:
        self.bus, self.counters, self.sync = bus, counters, sync

    def __call__(
        self,
        cls: type,
        kind: str,
        action: str,
        message: str,
        detail: Mapping[str, Any],
        at: Optional[Tuple[int, int]] = None,
    ) -> Event:
        c, kind = self.counters, str(kind)  # the journal holds plain strings
        if cls is AnomalyFound:  # under DDP: which ranks' own values tripped
            detail = self.sync.annotate(detail, kind)
        epoch, batch = at if at is not None else (c.epoch, c.batch - 1)
        return self.bus.emit(
            cls(
                step=c.steps,
                epoch=epoch,
                batch=batch,
                kind=kind,
                action=str(action),
                message=message,
                detail=detail,
                rank=self.sync.rank,
            )
        )
