"""The snapshot store's contract: ``SnapshotStore`` (lifecycle, save and restore loops) and ``SnapshotInfo``.

The concrete stores are :mod:`.memory` and :mod:`.disk`; :mod:`.make` picks one from the config.

A store's life is ``OPEN`` -> ``CLOSED``; using a closed store raises. ``save`` captures the
state, refuses it when a parameter or optimizer tensor is non-finite (one device-side pass,
one host read), and hands the capture to the concrete store. ``restore`` walks the snapshots
from newest to oldest and applies the first one that verifies and fits the live state.

A store belongs to one run: ``run_id`` (a uuid, written into every snapshot's metadata) names it,
and a store restores, rotates and deletes only the snapshots of its run. :meth:`SnapshotStore.adopt`
continues the run a resume loaded; :meth:`SnapshotStore.check_fresh` refuses a fresh run in a
directory that holds another run's snapshots (see :class:`~.disk.SafetensorsStore`).
"""

from __future__ import annotations

import abc
import enum
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from ..errors import SnapshotError
from .codec import decode
from .tensors import nonfinite

__all__ = ["SnapshotInfo", "SnapshotStore", "StoreState", "CorruptSnapshotError", "make_info", "new_run_id", "run_of"]

log = logging.getLogger(__name__)


class CorruptSnapshotError(SnapshotError):
    """A snapshot's bytes are damaged or not a snapshot at all (empty, truncated, checksum, format)."""


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot is: its counters, the caller's extra state, and where it lives.

    Attributes:
        step: ``counters["step"]``.
        epoch: ``counters.get("epoch", 0)``.
        batch: ``counters.get("batch", 0)``, the batch index within the epoch.
        counters: every counter saved.
        extra: the caller's JSON state, as saved (tuples and non-finite floats intact).
        extra_tensors: the caller's tensors, as fresh copies on the device they were saved from.
        path: the file, or ``None`` for a memory snapshot.
        created: ``time.time()`` when the snapshot was taken.
        passed_over: ``(path, why)`` of each newer file that a load from a directory skipped
            (damaged, not a regular file, from another model), newest first.
        run_id: the run that wrote it (``None``: a snapshot of a safetrain without run ids).
        changed_since: after a restore or a resume, what no longer had the snapshot's layout and
            how it was handled (:attr:`TrainState.changed`: a buffer put back with another shape,
            param groups added since); empty when everything fit as it was.
    """

    step: int
    epoch: int
    batch: int
    counters: Dict[str, int] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)
    extra_tensors: Dict[str, torch.Tensor] = field(default_factory=dict, compare=False)
    path: Optional[str] = None
    created: float = 0.0
    passed_over: Tuple[Tuple[str, str], ...] = field(default=(), compare=False)
    run_id: Optional[str] = None
    changed_since: Tuple[str, ...] = ()


def make_info(
    meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], path: Optional[str], where: str, copy: Any = None
) -> SnapshotInfo:
    """Build a :class:`SnapshotInfo` from a snapshot's JSON part and tensors.

    ``copy(name, tensor)`` makes the returned ``extra_tensors`` independent of a store's buffers.
    """
    counters = dict(meta.get("counters", {}))
    extra_tensors = {}
    for name in meta.get("extra_tensors", []):
        t = tensors[f"extra/{name}"]
        extra_tensors[name] = copy(f"extra/{name}", t) if copy is not None else t
    return SnapshotInfo(
        step=int(counters.get("step", 0)),
        epoch=int(counters.get("epoch", 0)),
        batch=int(counters.get("batch", 0)),
        counters=counters,
        extra=decode(meta.get("extra", {}), {}, where),
        extra_tensors=extra_tensors,
        path=path,
        created=float(meta.get("created", 0.0)),
        run_id=run_of(meta),
    )


def run_of(meta: Mapping[str, Any]) -> Optional[str]:
    """The run id in a snapshot's metadata, or ``None`` (none recorded)."""
    run = meta.get("run_id")
    return run if isinstance(run, str) else None


def new_run_id() -> str:
    """A fresh run id: a uuid4 as 32 hex digits."""
    return uuid.uuid4().hex


class StoreState(enum.Enum):
    """A store's lifecycle: open until :meth:`SnapshotStore.close`, then every use raises."""

    OPEN = "open"
    CLOSED = "closed"


class SnapshotStore(abc.ABC):
    """Base of :class:`MemoryStore` and :class:`SafetensorsStore`: save, restore with fallback, close.

    Args:
        keep: how many snapshots are kept; the oldest is dropped when a new one is taken.
        run_id: the run this store belongs to (default: a fresh uuid); stamped into every snapshot.

    Example::

        >>> import torch
        >>> from safetrain.snapshot.memory import MemoryStore
        >>> from safetrain.snapshot.state import TrainState
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> state = TrainState(model, opt)
        >>> store = MemoryStore(keep=2)
        >>> store.save(state, counters={"step": 10, "epoch": 0, "batch": 10}).step
        10
        >>> store.restore(state).counters
        {'step': 10, 'epoch': 0, 'batch': 10}
    """

    def __init__(self, keep: int, run_id: Optional[str] = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise SnapshotError(f"snapshot.keep: got {keep!r}; expected an integer >= 1")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise SnapshotError(f"run_id: got {run_id!r}; expected a non-empty string")
        self.keep = keep
        self.run_id: str = run_id or new_run_id()
        self.state = StoreState.OPEN
        self._passed: Set[Any] = set()  # keys of snapshots passed over (suspect): kept, never restored
        self.refused: Tuple[str, ...] = ()  # the non-finite tensors of the last refused snapshot

    def adopt(self, run_id: Optional[str]) -> None:
        """Continue the run ``run_id`` (the one a resume loaded): its snapshots become this store's
        (restored and rotated like its own) and new snapshots carry its id. ``None`` (a snapshot
        without a run id) keeps this store's id and adopts the snapshots that have none."""
        self._require_open("adopt")
        self._adopt(run_id)
        if run_id is not None:
            self.run_id = run_id

    def foreign(self) -> List[str]:
        """Snapshots of other runs this store can see (a directory's files), oldest first; never
        restored, rotated or deleted by this store."""
        return []

    def check_fresh(self) -> List[str]:
        """Before a fresh run's first snapshot: refuse a directory that holds another run's snapshots.

        Returns:
            The other run's files deleted because the store was opened with ``overwrite``.

        Raises:
            SnapshotError: another run's snapshots are there (the message names the directory
                and the ways out: ``resume=``, a new directory, ``snapshot.overwrite: true``).
        """
        return []

    def _require_open(self, what: str) -> None:
        if self.state is not StoreState.OPEN:
            raise SnapshotError(f"{type(self).__name__}.{what}(): the store is closed")

    def save(
        self,
        state: Any,
        counters: Mapping[str, int],
        extra: Optional[Mapping[str, Any]] = None,
        extra_tensors: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Optional[SnapshotInfo]:
        """Take a snapshot of ``state`` unless a parameter or optimizer tensor is non-finite.

        Args:
            state: the :class:`TrainState` to capture.
            counters: integer counters; ``step`` is required, ``epoch`` and ``batch`` expected.
            extra: JSON-able state of the caller (tuples and inf allowed; no arbitrary objects).
            extra_tensors: the caller's own tensors (an epoch's RNG state, say).

        Returns:
            The new snapshot's :class:`SnapshotInfo`, or ``None`` when it was refused because a
            tensor is non-finite (a warning names the tensors; older snapshots are untouched).

        Raises:
            SnapshotError: the store is closed, some state cannot be stored without pickle, or
                the write failed (the message names the file).
        """
        self._require_open("save")
        return self._save(state.capture(counters, extra, extra_tensors))

    def _refused(self, captured: Any, names: Optional[Iterable[str]] = None) -> bool:
        """Run the finiteness check (one device-side pass, one host read); log and say if it failed.

        ``names`` limits it to those tensors (default: every one that gates a snapshot). A buffer
        accepted as non-finite by design is checked against its pattern instead (:mod:`.accepted`).
        """
        names = captured.checked if names is None else names
        bad = nonfinite(((n, captured.tensors[n]) for n in names), captured.accepted)
        if bad:
            self._warn_refused(captured, bad)
        return bool(bad)

    def _warn_refused(self, captured: Any, bad: List[str], lost: str = "") -> None:
        """Log a refused snapshot, naming the non-finite tensors (and ``lost``, a snapshot it cost);
        ``refused`` keeps their names until the next refusal."""
        self.refused = tuple(bad)
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        changed = [n for n in bad if n in captured.accepted]
        log.warning(
            "snapshot refused at step %d: non-finite values in %s%s%s; keeping the previous snapshot%s",
            captured.meta["counters"]["step"],
            ", ".join(bad[:5]),
            more,
            f" ({', '.join(changed)}: non-finite by design, but no longer as at the start)" if changed else "",
            lost,
        )

    def restore(self, state: Any, older: int = 0) -> SnapshotInfo:
        """Put the newest usable snapshot back into ``state`` (model, optimizer, scheduler, scaler, RNGs).

        Snapshots are tried newest first; one that is damaged or does not fit the live state is
        logged and skipped (a damaged file is set aside as ``*.corrupt``), and the next older one
        is used.

        Args:
            state: the :class:`TrainState` to write into.
            older: skip this many of the newest snapshots first (0: start from the newest).

        Returns:
            The :class:`SnapshotInfo` of the snapshot restored: counters, extra state and tensors.

        Raises:
            SnapshotError: no snapshot is usable; the message lists why each one was not.
        """
        self._require_open("restore")
        failures: List[str] = []
        candidates = self._usable()[older:]
        for candidate in candidates:
            try:
                return self._restore(candidate, state)
            except CorruptSnapshotError as exc:
                failures.append(str(exc))
                log.warning("snapshot unusable, trying an older one: %s", exc)
                self._set_aside(candidate)
            except SnapshotError as exc:
                failures.append(str(exc))
                log.warning("snapshot unusable, trying an older one: %s", exc)
        if not failures:
            raise SnapshotError(f"{self._where()}: no snapshot to restore (none taken yet)")
        raise SnapshotError(f"{self._where()}: no usable snapshot; " + "; ".join(failures))

    def latest(self) -> Optional[SnapshotInfo]:
        """The newest snapshot's :class:`SnapshotInfo` (without restoring it), or ``None``."""
        self._require_open("latest")
        for candidate in self._usable():
            try:
                return self._info(candidate)
            except SnapshotError as exc:
                log.warning("snapshot unreadable: %s", exc)
        return None

    def discard_newest(self) -> bool:
        """Drop the newest snapshot: one that turned out to hold a bad update (finite, but the
        next step broke). Returns ``False`` when the store is empty."""
        self._require_open("discard_newest")
        for candidate in self._usable():
            self._discard(candidate)
            log.warning("discarded the newest snapshot (%s): the step after it was not healthy", candidate)
            return True
        return False

    def pass_over_newest(self) -> Optional[str]:
        """Never restore the newest snapshot again, but keep it (it may hold the update that broke
        the run; rotation drops it in its time). Returns what was passed over (a file, a memory
        slot), or ``None`` when fewer than two snapshots are usable (the only one is kept in use)."""
        self._require_open("pass_over_newest")
        usable = self._usable()
        if len(usable) < 2:
            return None
        self._passed.add(self._key(usable[0]))
        where = self._name(usable[0])
        log.warning("passing over the newest snapshot (%s): no healthy step vouched for it", where)
        return where

    def _usable(self) -> List[Any]:
        """Candidates, newest first, without those passed over."""
        return [c for c in self._candidates() if self._key(c) not in self._passed]

    def _key(self, candidate: Any) -> Any:
        """What identifies a snapshot across calls (a file's path)."""
        return candidate

    def _name(self, candidate: Any) -> str:
        """A snapshot, for messages."""
        return str(candidate)

    def close(self) -> None:
        """Release buffers and threads; the store cannot be used afterwards. Idempotent."""
        if self.state is StoreState.OPEN:
            self._close()
        self.state = StoreState.CLOSED

    def __enter__(self) -> "SnapshotStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return 0 if self.state is StoreState.CLOSED else len(self._usable())

    # -- what a concrete store provides --------------------------------------------------------

    @abc.abstractmethod
    def _save(self, captured: Any) -> Optional[SnapshotInfo]:
        """Check (``_refused``) and store a capture; ``None`` when refused."""

    @abc.abstractmethod
    def _candidates(self) -> Iterable[Any]:
        """Snapshots, newest first."""

    @abc.abstractmethod
    def _restore(self, candidate: Any, state: Any) -> SnapshotInfo: ...

    @abc.abstractmethod
    def _info(self, candidate: Any) -> SnapshotInfo: ...

    @abc.abstractmethod
    def _where(self) -> str: ...

    def _discard(self, candidate: Any) -> None:
        """Forget a snapshot that is whole but not wanted (slots dropped, files deleted)."""
        self._set_aside(candidate)

    def _set_aside(self, candidate: Any) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Keep a damaged snapshot from being tried again (files are renamed, slots dropped)."""

    def _close(self) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Free the store's resources."""

    def _adopt(self, run_id: Optional[str]) -> None:  # noqa: B027 (an optional hook: a no-op by default)
        """Take over the snapshots of run ``run_id`` that the store can see."""
