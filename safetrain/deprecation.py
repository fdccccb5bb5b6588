"""Old names that keep working for a while, each saying once what replaces it: :func:`warn_once`."""

from __future__ import annotations

import warnings
from typing import Set

__all__ = ["warn_once"]

_warned: Set[str] = set()  # what warned already in this process


def warn_once(old: str, message: str, stacklevel: int = 3) -> None:
    """A :class:`DeprecationWarning` for ``old``, the first time it is used in this process only.

    Args:
        old: the old name (what "once" is counted by).
        message: what to use instead.
        stacklevel: the frame the warning points at (default: the caller's caller, the user's line).
    """
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)
