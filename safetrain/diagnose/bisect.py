"""Row bisection: which rows of a batch make its loss non-finite, by adaptive group testing.

Pure logic, no torch: the caller supplies ``is_bad(rows)`` (a forward pass on just those rows,
in :mod:`.step_replay`). The cost that matters is the number of forward passes: about
``(d + 1) log2 B`` for ``d`` bad rows in a batch of ``B``.
"""

from __future__ import annotations

import time
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["Bisection", "bisect_rows", "isolate_rows"]


def bisect_rows(size: int, is_bad: Callable[[Sequence[int]], bool]) -> List[int]:
    """The rows ``r`` of a batch of ``size`` for which ``is_bad`` says a group holding ``r`` is bad.

    Adaptive group testing for a batch already seen to be bad as a whole (the replay's loss was
    non-finite), so the whole batch is not tested again. One bad row at a time is found by binary
    search (log2 B tests); the rows not yet cleared are then tested together once, and searched
    again if bad: about (d + 1) log2 B tests for d bad rows, ``2 log2 B + 2`` for two, log2 B + 1
    for one. Inferring "left half clean, so the right half is bad" is only sound when the parent is
    bad: the first search starts from the batch that was bad in *train* mode (BatchNorm batch
    statistics, dropout) while ``is_bad`` may run in eval mode, so when none of its tests came out
    bad, the row it ends on is tested once more, and nothing is reported if that one is clean.
    (Testing the largest unknown group before the union of the rest, measured over every
    placement of 1 to 3 bad rows in 64, costs one test more for a single bad row and saves
    nothing on average for two.)

    Args:
        size: the number of rows.
        is_bad: ``is_bad(rows) -> bool``: whether the loss of just those rows is non-finite.

    Returns:
        The bad rows, sorted.

    Example::

        >>> bisect_rows(64, lambda rows: bool({5, 41} & set(rows)))
        [5, 41]
    """
    found: List[int] = []
    group, known_bad = list(range(size)), True  # the batch was bad in the replay
    while group and (known_bad or is_bad(group)):
        unknown: List[int] = []
        rows, confirmed = group, not known_bad
        while len(rows) > 1:
            left, right = rows[: len(rows) // 2], rows[len(rows) // 2 :]
            if is_bad(left):
                unknown.extend(right)  # may hold more bad rows: not tested yet
                rows, confirmed = left, True
            else:
                rows = right  # the group is bad and its left half is not: no test needed
        if not confirmed and not is_bad(rows):
            break  # bad in train mode only: no single row is to blame
        found.append(rows[0])
        group, known_bad = sorted(unknown), False
    return sorted(found)


class Bisection(NamedTuple):
    """The outcome of :func:`isolate_rows`: the bad rows, the tests (forward passes) spent, and
    why no row is named when none is (``""`` otherwise)."""

    rows: Tuple[int, ...]
    passes: int
    note: str


def isolate_rows(
    size: Optional[int],
    is_bad: Callable[[Sequence[int]], bool],
    deadline: float,
    time_limit_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Bisection:
    """:func:`bisect_rows` with the replay's limits: a batch without rows, a deadline, a model
    that cannot run on a subset, a loss that is not per-sample separable each end it with a note.

    Args:
        size: the batch's number of rows (``None``: it has no row dimension).
        is_bad: as in :func:`bisect_rows`; an exception from it stops the bisection.
        deadline: ``clock()`` value after which no further test starts.
        time_limit_s: the limit the deadline came from (``detect.replay.time_limit_s``), for the note.
        clock: the time source (``time.perf_counter``).

    Returns:
        A :class:`Bisection`.

    Example::

        >>> isolate_rows(8, lambda rows: 3 in rows, deadline=float("inf"), time_limit_s=60.0)
        Bisection(rows=(3,), passes=4, note='')
    """
    if size is None or size < 2:
        return Bisection((), 0, "batch has no row dimension to bisect")
    passes = 0

    def counted(rows: Sequence[int]) -> bool:
        nonlocal passes
        if clock() > deadline:
            raise TimeoutError
        passes += 1
        return is_bad(rows)

    try:
        rows = bisect_rows(size, counted)
    except TimeoutError:
        return Bisection((), passes, f"bisection stopped at detect.replay.time_limit_s={time_limit_s}")
    except Exception as exc:  # a model that cannot run on a subset of rows
        return Bisection((), passes, f"bisection not possible: {type(exc).__name__}: {exc}")
    if not rows:
        return Bisection((), passes, "the loss is not per-sample separable: no subset of rows is non-finite alone")
    return Bisection(tuple(rows), passes, "")
