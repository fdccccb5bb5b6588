"""How often the guard snapshots: a fixed number of healthy steps, or ``auto``, from what a snapshot costs.

With ``snapshot.every: auto`` the interval is the fewest healthy steps whose training time pays
for one snapshot within ``snapshot.overhead`` (a share of training time, 1% by default):

    every = ceil(C / (overhead x T)),  bounded to [snapshot.min_every, snapshot.max_every]

where ``C`` is the measured wall time of a snapshot (the median of the last few; the memory store's
copy and finiteness check, the disk store's write) and ``T`` the measured wall time of a healthy step
(the median of the last few, host-side, from one finished step to the next: data loading and the
step's one read included, so on an accelerator it is the device's pace). This is the cost-budget form
of Young's optimal checkpoint interval ``sqrt(2 C M)`` (``M`` the mean time between failures): the
failures here are not known in advance, so the interval spends a fixed share of training time on
snapshots instead, which bounds the overhead whatever the failure rate. A small model (a snapshot of
microseconds) gets one every few steps, so a restore loses a few steps, not the run; the bounds keep a
tiny model from snapshotting every step and a huge one still snapshotting at all.

Nothing here adds a host sync: the clock is read on the host after a step's one read (and around a
snapshot, which is off the healthy path). The interval is re-planned at each snapshot only; under
DDP/FSDP every rank takes the largest rank's interval (one small collective, at the snapshot, beside
the snapshot's own). No torch.

Example::

    >>> c = Cadence("auto", overhead=0.01, min_every=5, max_every=1000)
    >>> c.plan(snapshot_s=0.002, step_s=0.05)   # 2 ms a snapshot, 50 ms a step: 1% is one every 4 steps
    5
    >>> c.plan(snapshot_s=0.5, step_s=0.05)
    1000
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Callable, Deque, Optional, Union

__all__ = ["Cadence", "AUTO_FIRST"]

#: Healthy steps measured before the first planned interval: until then, ``min_every``.
AUTO_FIRST = 3
#: How many of the last snapshot costs and step times the medians are taken of.
_KEPT = 16


class Cadence:
    """When the next periodic snapshot is due.

    Args:
        every: a fixed number of healthy steps, or ``"auto"``.
        overhead: ``auto``: the share of training time snapshots may take.
        min_every: ``auto``: the fewest healthy steps between two snapshots.
        max_every: ``auto``: the most healthy steps between two snapshots.
        clock: seconds, monotonic (``time.perf_counter``; a test injects its own).
    """

    def __init__(
        self,
        every: Union[int, str],
        overhead: float = 0.01,
        min_every: int = 5,
        max_every: int = 1000,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.auto = every == "auto"
        self.overhead, self.min_every, self.max_every = float(overhead), int(min_every), int(max_every)
        #: the healthy steps between two snapshots now: one is due after this many since the last
        self.every = self.min_every if self.auto else int(every)
        self._clock = clock
        self._costs: Deque[float] = deque(maxlen=_KEPT)
        self._steps: Deque[float] = deque(maxlen=_KEPT)
        self._last: Optional[float] = None  # when the last healthy step finished (None: after anything else)

    def healthy(self) -> None:
        """A healthy step finished: the time since the one before is a healthy step's (host clock only)."""
        if not self.auto:
            return
        now = self._clock()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now

    def interrupted(self) -> None:
        """Something else ran since the last healthy step (an anomaly, a restore): the next step's
        time is not a healthy step's."""
        self._last = None

    def timed(self, save: Callable[[], object]) -> object:
        """Run ``save`` (a snapshot) and keep its wall time; returns what it returned."""
        if not self.auto:
            return save()
        start = self._clock()
        try:
            return save()
        finally:
            self._costs.append(self._clock() - start)
            self._last = None  # the next step's time starts after the snapshot

    @property
    def snapshot_s(self) -> Optional[float]:
        """The median wall time of the last snapshots, the lower of the middle two for an even
        count (``None``: none measured): of the first two, the faster, so that one slow first
        snapshot (allocations, a page-in, a busy host) does not set the interval for the run."""
        return statistics.median_low(self._costs) if self._costs else None

    @property
    def step_s(self) -> Optional[float]:
        """The median wall time of the last healthy steps (``None``: too few measured)."""
        return statistics.median(self._steps) if len(self._steps) >= AUTO_FIRST else None

    def plan(self, snapshot_s: Optional[float] = None, step_s: Optional[float] = None) -> int:
        """The interval ``auto`` gives for these costs (by default the measured ones); a fixed
        ``every`` is returned as it is. Too little measured yet: ``min_every``."""
        if not self.auto:
            return self.every
        c = self.snapshot_s if snapshot_s is None else snapshot_s
        t = self.step_s if step_s is None else step_s
        if c is None or t is None or t <= 0:
            return self.min_every
        wanted = math.ceil(c / (self.overhead * t))
        return max(self.min_every, min(self.max_every, wanted))

    def replan(self, agree: Callable[[int], int] = lambda every: every) -> int:
        """After a snapshot: the interval from the costs measured so far, agreed across ranks by
        ``agree`` (under DDP/FSDP: the largest rank's); returns it."""
        if self.auto:
            self.every = agree(self.plan())
        return self.every
