"""How a run ends: stop signals caught while ``fit`` runs, the word the journal closes with, closing it all.

A job scheduler (Kubernetes, SLURM, a spot instance's reclaim) sends SIGTERM some seconds before
it kills; Ctrl-C sends SIGINT. :class:`SignalStop` turns either into a request that ``fit``
honours after the step it is in (a snapshot, the journal closed ``interrupted``), and puts the
previous handlers back when ``fit`` leaves. A second signal stops at once; the stop raises
:func:`interruption` (for Ctrl-C a ``KeyboardInterrupt`` too). :func:`ending_of` names how a run
ended from what ended it: ``done``, ``aborted``, ``interrupted`` or ``failed``; :class:`RunWriters`
holds what ``fit`` opened (the run directory's lock first) and closes it on every way out.
Nothing here imports torch.

Example::

    >>> with SignalStop("term") as stop:
    ...     stop.requested
    False
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import TrainingAborted, TrainingInterrupted, TrainingKeyboardInterrupt
from .events import EventBus, Quarantined, RunEnded
from .rundir import METRICS_FILE, Journal, MetricsWriter, journal_path, lock_run_dir

__all__ = ["SignalStop", "RunWriters", "interruption", "ending_of", "describe", "ENDINGS"]

logger = logging.getLogger("safetrain")

#: The words ``run_ended`` may close a run with.
ENDINGS = ("done", "aborted", "interrupted", "failed")

_CAUGHT = {"term": ("SIGTERM",), "term+int": ("SIGTERM", "SIGINT"), "off": ()}


class SignalStop:
    """While in its ``with`` block, SIGTERM (and SIGINT) set :attr:`signum` instead of killing.

    Handlers are installed only in the main thread (Python allows no other) and for signals the
    platform has; the previous handlers are restored on exit, whatever happened. A second signal
    while a stop is pending raises :class:`~safetrain.errors.TrainingInterrupted` at once (a user
    pressing Ctrl-C twice means it).

    Args:
        which: ``"term"`` (SIGTERM), ``"term+int"`` (SIGTERM and SIGINT) or ``"off"`` (``log.signals``).
    """

    def __init__(self, which: str = "term+int") -> None:
        if which not in _CAUGHT:
            raise ValueError(f"log.signals: got {which!r}; expected one of {sorted(_CAUGHT)}")
        self.signals = [getattr(signal, n) for n in _CAUGHT[which] if hasattr(signal, n)]
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a signal asked the run to stop."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The caught signal's name (``SIGTERM``), or ``""``."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise interruption(f"{signal.Signals(signum).name} again: stopped at once, mid-step", signum)
        self.signum = signum
        logger.warning("%s: stopping after the current step", signal.Signals(signum).name)

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._previous:
            s, previous = self._previous.popitem()
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)


def interruption(message: str, signum: Optional[int]) -> TrainingInterrupted:
    """The exception a stop on ``signum`` raises: a :class:`TrainingKeyboardInterrupt` for SIGINT
    (a ``KeyboardInterrupt`` too, so a script's ``except KeyboardInterrupt:`` runs as on any
    Ctrl-C), else a :class:`TrainingInterrupted`.

    Example::

        >>> isinstance(interruption("SIGINT: stopped", signal.SIGINT), KeyboardInterrupt)
        True
        >>> isinstance(interruption("SIGTERM: stopped", signal.SIGTERM), KeyboardInterrupt)
        False
    """
    cls = TrainingKeyboardInterrupt if signum == getattr(signal, "SIGINT", None) else TrainingInterrupted
    return cls(message, signal=signum)


def ending_of(exc: Optional[BaseException]) -> Tuple[str, Dict[str, Any]]:
    """How a run ended, from the exception that ended it (``None``: it ran to the end).

    Returns:
        ``(ending, detail)``: ``done``; ``aborted`` (:class:`TrainingAborted`); ``interrupted``
        (:class:`TrainingInterrupted`, ``KeyboardInterrupt``, ``SystemExit``); ``failed`` (any
        other exception), with ``detail`` naming the exception's type and message.

    Example::

        >>> ending_of(ValueError("bad batch"))
        ('failed', {'error': 'ValueError', 'error_message': 'bad batch'})
    """
    if exc is None:
        return "done", {}
    detail = {"error": type(exc).__name__, "error_message": str(exc)[:1000]}
    if isinstance(exc, TrainingAborted):
        return "aborted", {}
    if isinstance(exc, (TrainingInterrupted, KeyboardInterrupt, SystemExit)):
        return "interrupted", detail
    return "failed", detail


class RunWriters:
    """What ``fit`` (and the Lightning and Hugging Face callbacks) open and must close on every way
    out: the run directory's lock, journal, metrics, progress bar, guard.

    :meth:`close` closes each part even when another fails, the guard first (its hooks come off
    the user's model), and ends the journal with ``run_ended`` saying how the run ended.
    """

    def __init__(self) -> None:
        self.journal: Optional[Journal] = None
        self.metrics: Optional[MetricsWriter] = None
        self.bus = EventBus()
        self.guard: Any = None  # the Guard, once made
        self.bar: Any = None
        self.rank = 0
        self.lock: Any = None  # the run directory's DirLock (rank 0)

    def open(self, run_dir: Optional[Path], rank: int, flush_every: int) -> None:
        """Lock ``run_dir`` (rank 0) before writing anything, then open the journal (every rank)
        and ``metrics.csv`` (rank 0) in it, if any; on an error nothing stays open or locked.

        Raises:
            RunDirBusy: another run is writing ``run_dir``.
            RunDirError: it cannot be written.
        """
        self.rank = rank
        if run_dir is None:
            return
        if rank == 0:  # the other ranks of a distributed run write beside it (events-rank{r}.jsonl)
            self.lock = lock_run_dir(run_dir)
        try:
            self.journal = Journal(journal_path(run_dir, rank))
            self.bus.journal = self.journal
            if rank == 0:
                self.metrics = MetricsWriter(run_dir / METRICS_FILE, flush_every=flush_every)
        except BaseException:
            if self.journal is not None:
                with contextlib.suppress(Exception):  # the error that stopped the opening is the one to see
                    self.journal.close()
            self._unlock()
            raise

    def _unlock(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()

    def _emit(
        self, cls: type, action: str, message: str, detail: Dict[str, Any], kind: str = "run", at: Any = None
    ) -> None:
        c = getattr(self.guard, "counters", None)
        step, epoch, batch = (c.steps, c.epoch, c.batch - 1) if c is not None else (0, 0, -1)
        if at is not None:  # the (epoch, batch index) of the batch the event is about
            epoch, batch = at
        self.bus.emit(cls(step=step, epoch=epoch, batch=batch, kind=kind, rank=self.rank,
                          action=action, message=message, detail=detail))  # fmt: skip

    def quarantined(self, action: str, message: str, detail: Dict[str, Any], at: Any = None) -> None:
        """Journal a quarantine action (the :class:`QuarantineKeeper`'s callback); ``at``: the
        ``(epoch, batch index)`` of the batch it is about, else the step's."""
        self._emit(Quarantined, action, message, detail, kind="quarantine", at=at)

    def close(self, result: Any, started: float, error: Optional[BaseException]) -> None:
        """Close everything, each part even if another fails; the journal's last word says how the run ended.
        ``result`` (a ``FitResult``) takes the guard's counters, its LR scale and the wall time since ``started``.

        Raises:
            RunDirError: the journal or metrics could not be closed and nothing else is being raised.
        """
        failed: List[Exception] = []

        def attempt(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every part gets closed; the first failure is raised below
                logger.error("closing the run: %s", exc)
                failed.append(exc)

        ending, detail = ending_of(error)
        if self.guard is not None:
            attempt(self.guard.close)  # first: the hooks come off the user's model whatever else fails
            for name, value in vars(self.guard.counters).items():
                setattr(result, name, value)
            result.lr_scale = self.guard.backoff.scale
        result.wall_time = time.perf_counter() - started
        result.ended, result.aborted = ending, ending == "aborted"
        result.error = f"{detail['error']}: {detail['error_message']}" if ending == "failed" else None
        if self.bar is not None:
            attempt(self.bar.close)
        # A run refused before it started (another run's snapshots, a bad resume) says nothing in the
        # journal: a run_ended there would read as the end of the previous run.
        began = any(e.name == "run_started" for e in self.bus.events)
        if began:
            attempt(lambda: self._emit(RunEnded, ending, describe(result), {**result.summary(), **detail}))
        if self.metrics is not None:
            attempt(self.metrics.close)
        if self.journal is not None:
            attempt(lambda: self.journal.close(result.summary() if began else None))
        attempt(self._unlock)  # last: the next run may start once all is written
        if failed and error is None:
            raise failed[0]


def describe(result: Any) -> str:
    """The one line ``run_ended`` carries: how the run ended and its counters."""
    how = {"done": "finished", "failed": f"failed ({result.error})"}.get(result.ended, result.ended)
    return (
        f"{how}: {result.steps} steps, {result.healthy_steps} healthy, "
        f"{result.skipped_batches} skipped, {result.dropped_rows} rows dropped, {result.zeroed_grads} grads zeroed, "
        f"{result.restores} restores, LR scale {result.lr_scale:g}, final loss {result.final_loss:.4g}"
    )
