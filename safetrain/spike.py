"""Loss-spike detection on robust statistics of recent healthy losses; pure Python, no torch.

A spike is a finite loss more than ``zscore`` robust standard deviations above the median of the
last ``window`` healthy losses (robust sigma = 1.4826 x median absolute deviation, floored at 1% of
the median so that a flat loss curve does not make every wiggle a spike) AND at least ``min_ratio``
times the largest healthy loss in the window. The ratio keeps a converged run quiet: near a loss of
0.005 the per-batch losses are heavy-tailed (one misclassified sample in 64 gives 0.05), so such a
batch is many sigmas out without being a blow-up; measured on a converged 4-class MLP run, the
z-score alone called 37 false spikes in 768 steps, ``2 x median`` 37, ``2 x window max`` none. Nothing is judged
before ``min_history`` healthy losses. The defaults (128, 20, 6) follow OLMo-core's loss z-score rule.

Early in a run the z-score has no history, yet one batch in the wrong unit (targets x10^4, a loss
x10^8) can ruin the model. So a loss at least ``hard_ratio`` times the largest healthy loss of the
whole run is a spike as soon as ``HARD_MIN_HISTORY`` (3) healthy losses are known: from the 4th
healthy step on; from the 2nd, a loss ``hard_ratio`` squared times (x10^4) the first is one already
(a batch in the wrong unit at step 2 or 3; a loss growing 100x a step, an LR far too high, is
left to the divergence detector). The run's largest loss is usually its first, so a healthy run
never comes near.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Dict, Optional, Sequence, Tuple

__all__ = ["SpikeDetector", "HARD_MIN_HISTORY", "START_RATIO"]

#: Healthy losses the ``hard_ratio`` rule needs before it judges (it judges the 4th step on).
HARD_MIN_HISTORY = 3
#: Before the first healthy loss, a loss whose excess over the start model's losses is this many
#: times their spread is a spike (``hard_ratio`` squared: two start losses are a thin sample).
START_RATIO = 1e4
#: Relative float32 rounding: spreads below it of a loss's level are rounding, not signal.
_ROUNDING = 1e-6


class SpikeDetector:
    """Judge each loss against the window of recent healthy ones.

    Args:
        window: number of healthy losses kept.
        min_history: no spike is called before this many.
        zscore: threshold in robust standard deviations above the median.
        min_ratio: a spike is also at least this many times the largest loss in the window.
        enabled: ``False`` makes :meth:`check` always return ``None``.
        hard_ratio: a loss this many times the run's largest healthy loss is a spike after
            :data:`HARD_MIN_HISTORY` healthy losses, whatever ``min_history`` says (``None``: off).

    Example::

        >>> d = SpikeDetector(window=8, min_history=4, zscore=6)
        >>> for x in (1.0, 1.1, 0.9, 1.0): d.add(x)
        >>> d.check(50.0) is not None
        True
    """

    def __init__(
        self,
        window: int = 128,
        min_history: int = 20,
        zscore: float = 6.0,
        enabled: bool = True,
        min_ratio: float = 2.0,
        hard_ratio: Optional[float] = None,
    ) -> None:
        self.window, self.min_history, self.zscore, self.enabled = window, min_history, zscore, enabled
        self.min_ratio, self.hard_ratio = min_ratio, hard_ratio
        self.run_max = -math.inf  # the largest healthy loss of the run
        self.start: Tuple[float, ...] = ()  # the start model's losses, until the first healthy one
        self._losses: deque = deque(maxlen=window)
        # The window's maximum, kept as a decreasing queue of (add count, loss): O(1) amortized
        # per step. max() over the window read 128 floats scattered over the heap at every step.
        self._peaks: deque = deque()
        self._added = 0

    def check(self, loss: float) -> Optional[Dict[str, float]]:
        """Return the evidence (median, sigma, z; ``rule``: ``zscore`` or ``hard_ratio``) when
        ``loss`` is a spike, else ``None``."""
        n = len(self._losses)
        if not self.enabled or not math.isfinite(loss):
            return None
        if n == 0:  # nothing trained yet: only the start model's losses can judge it
            return self._against_start(loss) if self.start else None
        ratio = self.hard_ratio if n >= HARD_MIN_HISTORY or self.hard_ratio is None else self.hard_ratio**2
        hard = ratio is not None and 0 < self.run_max and loss >= ratio * self.run_max
        if not hard and (n < self.min_history or loss < self.min_ratio * self._peaks[0][1]):
            return None  # the cheap tests first (the window max): most steps end here
        median = statistics.median(self._losses)
        mad = statistics.median(abs(x - median) for x in self._losses)
        sigma = max(1.4826 * mad, 0.01 * abs(median), 1e-12)
        z = (loss - median) / sigma
        if hard:
            return {"loss": loss, "median": median, "sigma": sigma, "z": z, "threshold": self.zscore,
                    "rule": "hard_ratio", "ratio": loss / self.run_max, "run_max": self.run_max}  # fmt: skip
        if z > self.zscore:
            return {"loss": loss, "median": median, "sigma": sigma, "z": z, "threshold": self.zscore, "rule": "zscore"}
        return None

    def begin(self, losses: Sequence[float]) -> None:
        """Take the start model's losses on batches the run has not trained on (two or more):
        until the first healthy loss is added, a loss is judged against them (:data:`START_RATIO`)."""
        self.start = tuple(float(x) for x in losses if math.isfinite(x))

    def _against_start(self, loss: float) -> Optional[Dict[str, float]]:
        """A loss before any healthy one: a spike when its excess over the largest start loss is
        more than ``START_RATIO`` times the spread of the start losses (at least a float32 rounding
        of their level, so that identical start losses, a zero-initialized head, call no spike).
        Offset- and scale-invariant up to that rounding floor."""
        top, low = max(self.start), min(self.start)
        spread = max(top - low, _ROUNDING * max(abs(top), abs(low)), 1e-30)
        if len(self.start) < 2 or loss - top < START_RATIO * spread:
            return None
        median = statistics.median(self.start)
        return {
            "loss": loss,
            "median": median,
            "sigma": spread,
            "z": (loss - median) / spread,
            "threshold": START_RATIO,
            "rule": "start",
            "start": list(self.start),
        }

    def add(self, loss: float) -> None:
        """Record a healthy loss (the first one ends the judging against the start losses)."""
        if math.isfinite(loss):
            self.start = ()
            loss = float(loss)
            self._losses.append(loss)
            self.run_max = max(self.run_max, loss)
            peaks = self._peaks
            while peaks and peaks[-1][1] <= loss:
                peaks.pop()
            peaks.append((self._added, loss))
            self._added += 1
            if peaks[0][0] < self._added - self.window:  # left the window
                peaks.popleft()

    def state_dict(self) -> Dict[str, Any]:
        """``{"losses": [...], "run_max": float | None, "start": [...]}``, JSON-ready."""
        return {
            "losses": list(self._losses),
            "run_max": self.run_max if math.isfinite(self.run_max) else None,
            "start": list(self.start),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Put back the window of healthy losses."""
        self._losses = deque(maxlen=self.window)
        self._peaks.clear()
        self.run_max = -math.inf
        for x in state["losses"]:
            self.add(float(x))
        if state.get("run_max") is not None:  # absent from snapshots of earlier versions
            self.run_max = max(self.run_max, float(state["run_max"]))
        self.start = tuple(float(x) for x in state.get("start", ()))  # (absent from earlier ones too)
