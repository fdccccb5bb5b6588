"""What a fuzz example of a reader may cost: a clear answer within a second, in bounded memory.

The time is the process's CPU time (threads included), so that a loaded CI machine does not fail
a sound reader; a reader blocked on a FIFO uses no CPU, so the wall clock is bounded too, more
loosely. Memory is the growth of the process's peak resident size (``ru_maxrss``): a reader that
allocates what a crafted file asks for (gigabytes from a few bytes) raises it at once.
"""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Iterator

__all__ = ["bounded"]


@contextlib.contextmanager
def bounded(cpu_s: float = 1.0, wall_s: float = 10.0, memory_mb: int = 256) -> Iterator[None]:
    """Fail the test if the block takes more than ``cpu_s`` of CPU, ``wall_s`` of wall time, or
    raises the peak resident size by more than ``memory_mb``."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    cpu, wall = time.process_time(), time.perf_counter()
    yield
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
    assert cpu < cpu_s and wall < wall_s, f"took {cpu:.2f} s of CPU ({wall:.2f} s): bound {cpu_s} s"
    assert grown < memory_mb, f"the peak resident size grew by {grown:.0f} MiB: bound {memory_mb} MiB"
