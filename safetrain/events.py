"""Typed, frozen events and the bus that delivers them.

A closed, small set: :class:`RunStarted`, :class:`AnomalyFound`, :class:`SnapshotTaken`,
:class:`Restored`, :class:`LRChanged`, :class:`Quarantined`, :class:`Clipped`, :class:`Aborted`,
:class:`RunEnded`.
Observers get each event after it happened and cannot change it; only the guard acts. Every
event goes to the ``safetrain`` logger and, with ``log.dir`` set, to the journal
(:class:`safetrain.rundir.Journal`); this module writes no file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Protocol, Type

__all__ = [
    "Event",
    "RunStarted",
    "AnomalyFound",
    "SnapshotTaken",
    "Restored",
    "LRChanged",
    "Quarantined",
    "Clipped",
    "Aborted",
    "RunEnded",
    "EventBus",
    "jsonable",
]

logger = logging.getLogger(__name__)


def jsonable(value: Any) -> Any:
    """Turn a value into something ``json.dumps`` accepts: non-finite floats become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return jsonable(to_dict() if callable(to_dict) else dataclasses.asdict(value))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class Event:
    """One thing that happened in a run, at a step.

    Attributes:
        step: optimizer steps taken before this event (the global step).
        epoch: 0-based epoch.
        batch: 0-based batch index within the epoch (-1 when not tied to a batch).
        kind: the anomaly kind (``loss``, ``gradient``...) or the lifecycle phase (``run``, ``snapshot``...).
        action: what the guard did (``skip_batch``, ``restore``...), ``""`` for plain records.
        message: one human line.
        detail: the finding's detail, JSON-ready.
        rank: the distributed rank that wrote it.
        time: wall-clock time (``time.time()``).
    """

    name: ClassVar[str] = "event"
    step: int
    epoch: int
    batch: int
    kind: str
    action: str
    message: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    rank: int = 0
    time: float = field(default_factory=time.time)

    def to_dict(self) -> Dict[str, Any]:
        """The event as a JSON-ready dict, with its type under ``"event"``."""
        out: Dict[str, Any] = {"event": self.name}
        for f in dataclasses.fields(self):
            out[f.name] = jsonable(getattr(self, f.name))
        return out


@dataclass(frozen=True)
class RunStarted(Event):
    """``fit`` started (or resumed); detail holds the resolved config."""

    name: ClassVar[str] = "run_started"


@dataclass(frozen=True)
class AnomalyFound(Event):
    """A detector tripped; ``action`` is what the policy decided and the guard did."""

    name: ClassVar[str] = "anomaly"


@dataclass(frozen=True)
class SnapshotTaken(Event):
    """A snapshot was taken (``action="saved"``) or refused because the state was not finite (``"refused"``)."""

    name: ClassVar[str] = "snapshot"


@dataclass(frozen=True)
class Restored(Event):
    """The training state was put back to a snapshot; detail names the snapshot's step."""

    name: ClassVar[str] = "restored"


@dataclass(frozen=True)
class LRChanged(Event):
    """The LR scale changed (backoff, or climb back); detail has the old and new scale and LRs."""

    name: ClassVar[str] = "lr_changed"


@dataclass(frozen=True)
class Quarantined(Event):
    """Samples were put in or skipped from quarantine; detail lists the dataset indices."""

    name: ClassVar[str] = "quarantine"


@dataclass(frozen=True)
class Clipped(Event):
    """An episode of clipped steps began (one event per episode, not per step: a run of trained steps
    each clipped); detail has the norm, what it was clipped to and, adaptive, the EMA statistics.
    Clipped steps are healthy: counted in ``clipped_steps`` and in ``metrics.csv``'s ``clipped_to``."""

    name: ClassVar[str] = "clipped"


@dataclass(frozen=True)
class Aborted(Event):
    """The run stopped under the policy; ``TrainingAborted`` follows."""

    name: ClassVar[str] = "aborted"


@dataclass(frozen=True)
class RunEnded(Event):
    """``fit`` returned; detail holds the summary counts."""

    name: ClassVar[str] = "run_ended"


_LEVELS: Dict[Type[Event], int] = {AnomalyFound: logging.WARNING, Aborted: logging.ERROR, Restored: logging.WARNING}


class _Handle:
    """Removes one subscription; idempotent, and a context manager."""

    def __init__(self, subs: Dict[int, Any], key: int) -> None:
        self._subs, self._key = subs, key

    def remove(self) -> None:
        self._subs.pop(self._key, None)

    def __enter__(self) -> "_Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class _Sink(Protocol):
    """Where the bus writes each event's record: a :class:`safetrain.rundir.Journal`."""

    def write(self, record: Mapping[str, Any]) -> None: ...


class EventBus:
    """Delivers events to subscribers, the logger and the journal, and keeps them in order.

    Args:
        journal: where events are also written as JSON lines (a :class:`safetrain.rundir.Journal`), or ``None``.
    """

    def __init__(self, journal: Optional[_Sink] = None) -> None:
        self.journal = journal
        self.events: List[Event] = []
        self._subs: Dict[int, tuple] = {}
        self._next = 0

    def subscribe(self, fn: Callable[[Event], Any], kind: Optional[Type[Event]] = None) -> _Handle:
        """Call ``fn(event)`` for every event (or every event of class ``kind``); returns a removable handle."""
        self._next += 1
        self._subs[self._next] = (kind, fn)
        return _Handle(self._subs, self._next)

    def emit(self, event: Event) -> Event:
        """Record, log, journal and deliver one event; returns it."""
        self.events.append(event)
        logger.log(_LEVELS.get(type(event), logging.INFO), "step %d: %s", event.step, event.message)
        if self.journal is not None:
            self.journal.write(event.to_dict())
        for kind, fn in list(self._subs.values()):
            if kind is None or isinstance(event, kind):
                fn(event)
        return event
