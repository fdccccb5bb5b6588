"""How a run ends: stop signals caught while ``fit`` runs, the word the journal closes with, closing it all.

A job scheduler (Kubernetes, SLURM, a spot instance's reclaim) sends SIGTERM some seconds before
it kills; Ctrl-C sends SIGINT. :class:`SignalStop` turns either into a request that ``fit``
honours after the step it is in (a snapshot, the journal closed ``interrupted``), and puts the
previous handlers back when ``fit`` leaves. A second signal stops at once; the stop raises
:func:`interruption` (for Ctrl-C a ``KeyboardInterrupt`` too). :func:`ending_of` names how a run
ended from what ended it: ``done``, ``aborted``, ``interrupted`` or ``failed``; :class:`~safetrain.run.Run`
closes a run with it. Nothing here imports torch.

Example::

    >>> with SignalStop("term") as stop:
    ...     stop.requested
    False
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Dict, Optional, Tuple

from .errors import TrainingAborted, TrainingInterrupted, TrainingKeyboardInterrupt

__all__ = ["SignalStop", "interruption", "ending_of", "describe", "ENDINGS"]

logger = logging.getLogger(__name__)

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
        #: Whether a signal asked the run to stop (``signum`` is set): a plain attribute, read after every step.
        self.requested = False
        self._previous: Dict[int, Any] = {}

    @property
    def name(self) -> str:
        """The caught signal's name (``SIGTERM``), or ``""``."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise interruption(f"{signal.Signals(signum).name} again: stopped at once, mid-step", signum)
        self.signum, self.requested = signum, True
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


def describe(result: Any) -> str:
    """The one line ``run_ended`` carries: how the run ended and its counters."""
    how = {"done": "finished", "failed": f"failed ({result.error})"}.get(result.ended, result.ended)
    return (
        f"{how}: {result.steps} steps, {result.healthy_steps} healthy, "
        f"{result.skipped_batches} skipped, {result.dropped_rows} rows dropped, {result.zeroed_grads} grads zeroed, "
        f"{result.restores} restores, LR scale {result.lr_scale:g}, final loss {result.final_loss:.4g}"
    )
