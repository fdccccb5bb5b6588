"""Loss-spike detection on robust statistics of recent healthy losses; pure Python, no torch.

Every rule here is **invariant**: it gives the same decision for ``loss``, ``loss + c`` and
``a * loss`` (``a > 0``), so a loss that is negative or offset (``mse - 1``, a Gaussian NLL with a
learned variance, ``-log p``, ``-PSNR``, an entropy bonus) is judged like any other. It is built
from differences only: the excess of a loss over a **floor** (the lowest healthy loss of the window,
or of the run) and spreads (the median absolute deviation, the range between the lowest and the
highest loss). The positive quantities are those spreads, never a loss itself. Float rounding is
the only difference (the sigma floor below, ``1e-6 x |median|``, bites only at float32 precision,
on a window where more than half the losses are equal).

A spike is a finite loss more than ``zscore`` robust standard deviations above the median of the
last ``window`` healthy losses (robust sigma = 1.4826 x median absolute deviation) AND whose excess
over the window's floor is at least ``min_ratio`` times the largest **excess** of the window: each
healthy loss's excess over the floor of the window when it came. That keeps a converged run quiet:
near a loss of 0.005 the per-batch losses are heavy-tailed (one misclassified sample in 64 gives
0.05), so such a batch is many sigmas out without being a blow-up; measured on a converged 4-class
MLP run, the z-score alone called 37 false spikes in 768 steps, ``2 x median`` 37, ``2 x window
max`` none (the floor of such a run is flat and near 0, so its largest excess is the old window
max). And it does not compare a jump with the early, high losses of a falling run still in the
window: each of those was near the floor of its own time, so the excesses are the run's noise
around its trend, not its descent (a jump from 2.0 back to 5.5 in a run that fell from 3.9 is a
spike; ``2 x window max`` asked for 7.8).
Nothing is judged before ``min_history`` healthy losses. The defaults (128, 20, 6) follow
OLMo-core's loss z-score rule.

Early in a run the z-score has no history, yet one batch in the wrong unit (targets x10^4, a loss
x10^8) can ruin the model. So a loss whose excess over the run's lowest healthy loss is at least
``hard_ratio`` times the run's range (its highest healthy loss above its lowest) is a spike as soon
as ``HARD_MIN_HISTORY`` (3) healthy losses are known: from the 4th healthy step on; with two, the
range is the difference of those two and the ratio is ``hard_ratio`` squared (x10^4), to stay quiet
on a range that is small by chance. With one healthy loss there is no scale at all (an invariant
rule of two losses sees only the sign of their difference). That is what the **start losses** are
for: before a fresh run's first step, ``SafeTrainer.fit`` measures the start model's loss on the two
batches after the first step's (:meth:`~safetrain.Guard.measure_start`, :meth:`begin`). Until
``HARD_MIN_HISTORY`` healthy losses are known, they join the healthy ones as the reference, with
``hard_ratio`` squared: the first step's loss is judged against two losses of the same model (a
first batch in the wrong unit is a spike, skipped before its update), the second's against three.
A loss growing 100x a step (an LR far too high) is left to the divergence detector. The run's range
is usually its first descent, so a healthy run never comes near.

A loss can also jump and stay without any one step being a spike (a plateau a few sigmas up, a
rise over two steps): :meth:`SpikeDetector.level` calls it after :data:`LEVEL_STEPS` losses in a
row each at least ``zscore / 2`` robust sigmas above the median of the window before them. The
median and sigma the healthy path compares with are refreshed every :data:`LEVEL_REFRESH` losses
(amortized O(1)); the call that finds a rise checks it exactly against the window before it. The
guard then asks the cause test (issue 32).

The healthy path is O(1) amortized and calls nothing: the window is a ring of ``window`` slots
written by index, its lowest loss and largest excess are kept block by block (:func:`tail_extremes`),
and the median and MAD are computed only for a loss that passed the cheap gates.
"""

from __future__ import annotations

import math
import statistics
from itertools import accumulate
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["SpikeDetector", "HARD_MIN_HISTORY", "RESOLUTION", "LEVEL_STEPS"]

#: Healthy losses the ``hard_ratio`` rule needs before it judges (it judges the 4th step on).
HARD_MIN_HISTORY = 3
#: The relative float resolution a spread is floored at (a few float32 ulps): a spread smaller
#: than this times the loss's magnitude is rounding, not information. The only place the rules
#: depend on where zero is.
RESOLUTION = 1e-6
#: Losses in a row above the window's noise that make a level rise (:meth:`SpikeDetector.level`).
LEVEL_STEPS = 4
#: The window's median and sigma that a level rise is measured from are refreshed this often.
LEVEL_REFRESH = 32

_INF = math.inf


def robust_level(losses: Sequence[float]) -> Tuple[float, float]:
    """``(median, robust sigma)`` of ``losses``: sigma is 1.4826 x the median absolute deviation,
    never below :func:`spread_floor` of the median. The same numbers as ``statistics.median``
    twice over ``abs(x - median)``, without a call per loss (the healthy path refreshes it)."""
    median = _median(sorted(losses))
    deviations = sorted([median - x if x < median else x - median for x in losses])  # (exactly abs(x - median))
    return median, max(1.4826 * _median(deviations), spread_floor(median))


def _median(ordered: Sequence[float]) -> float:
    """``statistics.median`` of values already sorted."""
    n = len(ordered)
    if n == 0:
        raise statistics.StatisticsError("no median for empty data")
    i = n // 2
    return ordered[i] if n % 2 else (ordered[i - 1] + ordered[i]) / 2


def spread_floor(level: float) -> float:
    """The smallest spread the rules take as real at a loss ``level``: float rounding (``RESOLUTION``)."""
    return max(RESOLUTION * abs(level), 1e-12)


def tail_extremes(block: List[float], pick: Callable[[float, float], float], empty: float) -> List[float]:
    """``out[i] = pick(block[i:])`` for every ``i``, and ``out[len(block)] = empty``.

    A ring of ``W`` slots written in turn holds, when its write position comes back to 0, the
    last ``W`` values in slot order: one finished block. The window of the last ``W`` values
    after slot ``p`` of the next block is written is that block's slots ``p + 1 ...`` and the new
    block's slots ``0 ... p``, so its extreme is ``pick(out[p + 1], extreme of the new block so
    far)``: O(1) a value and no call, with this O(W) pass once every ``W`` values (the sliding
    extreme of van Herk and Gil-Werman). It replaced monotonic deques (an append and a pop a value).
    Of equal values the newest is kept, as the deques did (``0.0`` and ``-0.0`` are equal; a
    difference taken from them is not): ``pick`` is ``min`` or ``max``, which keep their first argument.
    """
    out = list(accumulate(reversed(block), pick))
    out.reverse()
    out.append(empty)
    return out


def oldest_first(ring: List[float], count: int, pos: int) -> List[float]:
    """The values of a ring holding ``count`` values, the next to be written at ``pos``, oldest first."""
    return ring[:count] if count < len(ring) else ring[pos:] + ring[:pos]


def _spread(ordered: Sequence[float]) -> float:
    """The range of sorted losses, at least float rounding (a zero-initialized head gives equal ones)."""
    return max(ordered[-1] - ordered[0], spread_floor(ordered[-1]))


class SpikeDetector:
    """Judge each loss against the window of recent healthy ones (invariant to the loss's offset and scale).

    Args:
        window: number of healthy losses kept.
        min_history: no spike is called before this many.
        zscore: threshold in robust standard deviations above the median.
        min_ratio: a spike's excess over the window's lowest loss is also at least this many times
            the window's largest excess (each window loss over the window's lowest when it came).
        enabled: ``False`` makes :meth:`check` always return ``None``.
        hard_ratio: a loss whose excess over the run's lowest healthy loss is this many times the
            run's range is a spike after :data:`HARD_MIN_HISTORY` healthy losses, whatever
            ``min_history`` says; its square after two (``None``: off).

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
        self.run_max = -math.inf  # the highest healthy loss of the run
        self.run_min = math.inf  # the lowest
        self._run_range = math.inf  # run_max - run_min, at least float rounding: set where they move
        self.start: Tuple[float, ...] = ()  # the start model's losses (begin), until HARD_MIN_HISTORY healthy ones
        self._clear_window()
        self._added = 0  # healthy losses added since the start (the level gate's clock)
        self._streak = 0  # healthy losses in a row above the gate below (a level rise under way)
        #: The last healthy losses stand above the window's noise (a level rise may be under way):
        #: the guard then takes no snapshot and lets none be vouched for until it is judged.
        #: ``_streak > 0``, kept as a plain attribute: the guard reads it on every healthy step.
        self.rising = False
        self._gate = math.inf  # the window's median + zscore / 2 sigmas, refreshed every LEVEL_REFRESH losses
        self._gated = -LEVEL_REFRESH  # the add count the gate was computed at

    def check(self, loss: float) -> Optional[Dict[str, float]]:
        """Return the evidence (median, sigma, z; ``rule``: ``zscore`` or ``hard_ratio``) when
        ``loss`` is a spike, else ``None``."""
        n = self._count
        if not self.enabled or not -_INF < loss < _INF:  # (not finite, by comparisons: NaN fails both)
            return None
        if self.start and n < HARD_MIN_HISTORY:
            return self._early(loss)
        if n == 0:
            return None
        hard = False
        if self.hard_ratio is not None and n >= HARD_MIN_HISTORY - 1:
            ratio = self.hard_ratio if n >= HARD_MIN_HISTORY else self.hard_ratio * self.hard_ratio
            hard = loss - self.run_min >= ratio * self._run_range
        if not hard:
            if n < self.min_history:
                return None
            floor = self._floor  # the cheap test first (the window's largest excess): most steps end here
            if loss - floor < self.min_ratio * self._top_over or loss <= floor:
                return None
        median, sigma = robust_level(self._window_losses())
        z = (loss - median) / sigma
        evidence = {"loss": loss, "median": median, "sigma": sigma, "z": z, "threshold": self.zscore}
        if hard:
            excess_ratio = (loss - self.run_min) / max(self.run_max - self.run_min, 1e-300)
            evidence.update(rule="hard_ratio", ratio=excess_ratio, run_max=self.run_max, run_min=self.run_min)
            return evidence
        if z > self.zscore:
            evidence["rule"] = "zscore"
            return evidence
        return None

    def level(self, loss: float) -> Optional[Dict[str, Any]]:
        """The evidence when ``loss`` ends :data:`LEVEL_STEPS` losses in a row that stand above the
        window's noise as it was before them (rule ``level``), else ``None``; the streak starts
        again after a call that finds one. O(1) unless the streak is long enough."""
        if self._streak < LEVEL_STEPS - 1 or not self.enabled or not math.isfinite(loss):
            return None
        if loss <= self._gate:
            return None
        streak = self._streak
        losses = self._window_losses()
        before, rise = losses[:-streak], [*losses[-streak:], loss]
        if len(before) < self.min_history:
            return None
        median, sigma = robust_level(before)
        z = (min(rise) - median) / sigma
        if z <= self.zscore / 2:
            return None
        level = statistics.median(rise)
        # Judged once: the gate moves to the new level and holds there until the window has turned over.
        self._streak, self.rising, self._gate = 0, False, level + self.zscore / 2 * sigma
        self._gated = self._added + self.window - LEVEL_REFRESH
        return {
            "loss": loss,
            "median": median,
            "sigma": sigma,
            "z": z,
            "threshold": self.zscore / 2,
            "rule": "level",
            "steps": len(rise),
            "level": level,
        }

    def _window_losses(self) -> List[float]:
        """The window's healthy losses, oldest first."""
        return oldest_first(self._losses, self._count, self._pos)

    def _level_gate(self) -> float:
        """The window's median plus ``zscore / 2`` robust sigmas: a loss above it counts toward a level rise."""
        median, sigma = robust_level(self._window_losses())  # (the order does not matter to it)
        return median + self.zscore / 2 * sigma

    def begin(self, losses: Sequence[float]) -> None:
        """Take the start model's losses on batches the run has not trained on (two or more, finite):
        until :data:`HARD_MIN_HISTORY` healthy losses are known, they join the reference of the hard rule."""
        start = tuple(float(x) for x in losses if math.isfinite(x))
        self.start = start if len(start) >= 2 else ()

    def _early(self, loss: float) -> Optional[Dict[str, Any]]:
        """The hard rule while the start losses stand in for a history: a spike when ``loss``'s excess
        over the lowest of the start and healthy losses is ``hard_ratio`` squared times their range."""
        if self.hard_ratio is None:
            return None
        ratio = self.hard_ratio * self.hard_ratio
        # A start batch may itself be in the wrong unit: with three or more distinct losses, the
        # highest is left out while it stands hard_ratio cubed times the others' range above them
        # (a margin that two close losses by chance do not reach; a batch measured ahead and then
        # trained by the same model, after a skipped first step, gives the same loss twice: one).
        reference = sorted(set(self.start + tuple(self._window_losses())))
        while len(reference) >= 3 and reference[-1] - reference[0] >= ratio * self.hard_ratio * _spread(reference[:-1]):
            reference.pop()
        low, spread = reference[0], _spread(reference)
        if loss - low < ratio * spread:
            return None
        median = statistics.median(reference)
        return {
            "loss": loss,
            "median": median,
            "sigma": spread,
            "z": (loss - median) / spread,
            "threshold": self.hard_ratio * self.hard_ratio,
            "rule": "start",
            "ratio": (loss - low) / spread,
            "start": list(self.start),
            "trained": self._count,
        }

    def add(self, loss: float, over: Optional[float] = None) -> None:
        """Record a healthy loss (``over``: its excess over the floor it came to, when put back from a state)."""
        if not -_INF < loss < _INF:  # (not finite, by comparisons: NaN fails both)
            return
        count = self._count  # the window's losses before this one
        if self.start and count + 1 >= HARD_MIN_HISTORY:
            self.start = ()  # the run has a history of its own now
        loss = float(loss)
        if not self._streak and self._added - self._gated >= LEVEL_REFRESH and count >= self.min_history:
            self._gate, self._gated = self._level_gate(), self._added  # (amortized: a median every 32 losses)
        self._streak = self._streak + 1 if loss > self._gate else 0  # the gate stays put during a rise
        self.rising = self._streak > 0
        if over is None:
            over = loss - self._floor  # (an empty window's floor is +inf: no excess)
            if over < 0.0:
                over = 0.0
        if loss > self.run_max or loss < self.run_min:  # (seldom once a run has settled)
            self._set_run_range(max(self.run_max, loss), min(self.run_min, loss))
        self._added += 1
        # The ring: slot `pos` takes the loss and its excess. The window's floor and largest excess
        # are those of the last finished block's slots after `pos` and of this block's so far
        # (tail_extremes: no call here, and an O(window) pass once every `window` losses).
        pos = self._pos
        if pos == 0:  # a block begins: the last one, if any, is finished
            if count:
                self._lows_after = tail_extremes(self._losses, min, _INF)
                self._overs_after = tail_extremes(self._overs, max, -_INF)
            low, top = loss, over
        else:
            # (of equal values the newest, as in tail_extremes)
            low = loss if loss <= self._block_low else self._block_low
            top = over if over >= self._block_top else self._block_top
        self._losses[pos], self._overs[pos] = loss, over
        self._block_low, self._block_top = low, top
        after = self._lows_after[pos + 1]
        self._floor = after if after < low else low
        after = self._overs_after[pos + 1]
        self._top_over = after if after > top else top
        self._pos = pos + 1 if pos + 1 < self.window else 0
        if count < self.window:
            self._count = count + 1

    def _clear_window(self) -> None:
        """Empty the window (a ring of ``window`` slots of losses and of their excesses)."""
        w = self.window
        self._losses: List[float] = [0.0] * w  # the healthy losses, slot by slot
        self._overs: List[float] = [0.0] * w  # each one's excess over the floor it came to (for state_dict)
        self._count = 0  # losses in the window
        self._pos = 0  # the slot the next loss takes
        self._lows_after = [_INF] * (w + 1)  # tail_extremes of the last finished block (none yet)
        self._overs_after = [-_INF] * (w + 1)
        self._block_low, self._block_top = _INF, -_INF  # this block's lowest loss and largest excess so far
        self._floor = _INF  # the window's lowest loss
        self._top_over = -_INF  # the window's largest excess

    def _set_run_range(self, run_max: float, run_min: float) -> None:
        """Set the run's extremes and the range the hard rule measures in (under it: float rounding)."""
        self.run_max, self.run_min = run_max, run_min
        self._run_range = max(run_max - run_min, spread_floor(run_max))

    def state_dict(self) -> Dict[str, Any]:
        """``{"losses": [...], "excess": [...], "run_max": float | None, "run_min": float | None, "start": [...]}``,
        JSON-ready."""
        return {
            "losses": self._window_losses(),
            "excess": oldest_first(self._overs, self._count, self._pos),
            "run_max": self.run_max if math.isfinite(self.run_max) else None,
            "run_min": self.run_min if math.isfinite(self.run_min) else None,
            "start": list(self.start),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Put back the window of healthy losses (``excess``, ``run_max`` and ``run_min`` are absent
        from snapshots of earlier versions: the excesses are recomputed from the window, the window's
        extremes stand in for the run's)."""
        self._clear_window()
        self._set_run_range(-math.inf, math.inf)
        self._streak, self.rising, self._gate, self._gated = 0, False, math.inf, -LEVEL_REFRESH
        losses, excess = state["losses"], state.get("excess")
        if excess is None or len(excess) != len(losses):
            excess = [None] * len(losses)
        for x, e in zip(losses, excess):
            self.add(float(x), None if e is None else float(e))
        run_max, run_min = state.get("run_max"), state.get("run_min")
        self._set_run_range(
            max(self.run_max, float(run_max)) if run_max is not None else self.run_max,
            min(self.run_min, float(run_min)) if run_min is not None else self.run_min,
        )
        self.start = tuple(float(x) for x in state.get("start", ()))  # absent from earlier snapshots
