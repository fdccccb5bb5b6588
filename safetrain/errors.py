"""The exceptions safetrain raises: one root, one subclass per kind of bad input or outcome."""

from __future__ import annotations

from typing import Any

__all__ = [
    "SafetrainError",
    "ConfigError",
    "BatchError",
    "SnapshotError",
    "TrainingAborted",
    "TrainingInterrupted",
    "TrainingKeyboardInterrupt",
]


class SafetrainError(Exception):
    """Root of every exception safetrain raises on purpose; catch this to catch them all."""


class ConfigError(SafetrainError, ValueError):
    """A configuration file, key or value is wrong; the message names the key, the value and what is allowed."""


class BatchError(SafetrainError, ValueError):
    """A batch holds non-finite values under ``sanitize.*: raise``, or has a shape the engine cannot use."""


class SnapshotError(SafetrainError):
    """A snapshot cannot be taken, written or loaded; the message names the file and what is wrong."""


class TrainingAborted(SafetrainError):
    """Training stopped under the recovery policy.

    Args:
        message: why the run stopped.
        result: the ``FitResult`` as it stood when the run stopped (``None`` outside ``fit``).
        event: the event that ended the run.
    """

    def __init__(self, message: str, result: Any = None, event: Any = None) -> None:
        super().__init__(message)
        self.result = result
        self.event = event


class TrainingInterrupted(SafetrainError):
    """``fit`` stopped on a signal (SIGTERM from a scheduler, or Ctrl-C) after finishing its current step.

    The journal ends with ``run_ended`` ``interrupted``; with a disk store (and ``snapshot.on_signal``)
    the step it stopped at is snapshotted, so that ``fit(resume="auto")`` continues from there.
    On Ctrl-C (SIGINT) the exception is a :class:`TrainingKeyboardInterrupt`, a ``KeyboardInterrupt`` too.

    Args:
        message: which signal, and at which step.
        result: the ``FitResult`` as it stood when the run stopped.
        signal: the signal's number (``signal.SIGTERM``...), or ``None``.
    """

    def __init__(self, message: str, result: Any = None, signal: Any = None) -> None:
        super().__init__(message)
        self.result = result
        self.signal = signal


class TrainingKeyboardInterrupt(TrainingInterrupted, KeyboardInterrupt):
    """``fit`` stopped on Ctrl-C (SIGINT): a :class:`TrainingInterrupted` that is also a ``KeyboardInterrupt``.

    Python's contract for Ctrl-C holds: a script's ``except KeyboardInterrupt:`` (the usual place to
    save a model) runs, and so does ``except TrainingInterrupted:`` or ``except SafetrainError:``.
    Unlike a bare ``KeyboardInterrupt`` it is an ``Exception`` too (as every ``TrainingInterrupted``
    is), so ``except Exception:`` catches it; an uncaught one ends the script with status 1 and a
    traceback, as any uncaught exception does (a bare ``KeyboardInterrupt`` ends it with 130).

    Example::

        >>> import signal
        >>> exc = TrainingKeyboardInterrupt("SIGINT: stopped after step 7", signal=signal.SIGINT)
        >>> isinstance(exc, KeyboardInterrupt), isinstance(exc, TrainingInterrupted)
        (True, True)
    """
