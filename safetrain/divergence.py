"""Divergence detection: a finite loss that keeps growing geometrically; pure Python, no torch.

An LR several times above the stable step makes the loss grow by a roughly constant factor per
step from the very first steps (plain SGD on unscaled regression data: ~100x per step), long
before any value is NaN/Inf and long before the spike detector has ``min_history`` losses. So
this detector has no warm-up: it judges each loss against the healthy losses just before it.

A loss ``L`` is divergence when it is a new high of the recent (``window``) healthy losses, at
the end of a climb in which each loss was a new high of the window before it, and either

* **geometric**: ``L`` and the ``steps - 1`` healthy losses before it each are at least
  ``growth`` times the one before (``steps`` ratios in a row), or
* **climb**: ``L`` ends a climb of new highs that began before this step, the last two steps
  each at least ``growth`` times the one before, and ``L`` is at least ``ratio`` times where
  the climb began (or than the level before the last divergence, see below).

A single jump (a bad batch) is neither: it has no rise before it, and is left to the spike
detector. The new highs keep a converged, heavy-tailed run quiet: its noisy batches seldom pass
every loss of the last 128, let alone several times in a row (measured on a synthetic curve of
lognormal batches around 1e-4 with one in 16 up to 0.05: no trip in 30 x 6000 steps).

Recovery is checked, not assumed. :meth:`fault` records a divergence that was acted on: the
climb's losses are dropped from the window (they were the fault, not the run's level) and the
loss level before the climb becomes the **reference**. Until ``recover_after`` healthy losses
have come after the last fault and the loss is back within ``growth`` x the reference, the
episode stays open: a loss that climbs back to ``ratio`` x the reference is the same anomaly
again (``episode`` counts them, and the policy's ladder goes on instead of starting afresh).

:attr:`DivergenceDetector.climbing` says a climb may be under way (the last two healthy losses
were each a new high of the window before them, the second at least ``growth`` x the first): the
guard then takes no snapshot and lets no snapshot be vouched for, so that a restore after the
divergence lands before the climb began.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from .config import DivergenceConfig

__all__ = ["DivergenceDetector", "DivergenceFinding"]


@dataclass(frozen=True)
class DivergenceFinding:
    """The evidence of a divergence, for the journal.

    Attributes:
        loss: the loss that was judged.
        start: the loss where the climb began (the lowest of it).
        reference: the loss level before the previous divergence of this episode, or ``None``.
        rule: ``"geometric"`` or ``"climb"``.
        rises: healthy losses in the climb before ``loss`` (the window drops them on a fault).
        episode: 1 for a first divergence, n for the n-th of an episode not yet recovered from.
    """

    loss: float
    start: float
    reference: Optional[float]
    rule: str
    rises: int
    episode: int

    def describe(self) -> str:
        """One line: how far the loss climbed, and over how many steps."""
        base = f"loss {self.loss:.4g} is {self.loss / self.start:.3g}x the {self.start:.4g} where it began to "
        base += f"climb {self.rises + 1} steps ago ({self.rule})"
        if self.reference is not None:
            base += f"; it climbed back from the level {self.reference:.4g} before the last divergence"
        return base

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form."""
        return {
            "loss": self.loss,
            "start": self.start,
            "reference": self.reference,
            "rule": self.rule,
            "rises": self.rises,
            "episode": self.episode,
        }


class DivergenceDetector:
    """Judge each loss against the healthy losses just before it, from the first step of a run.

    Args:
        growth: a step that grows the loss by at least this factor counts toward ``steps``.
        steps: this many such steps in a row are divergence.
        ratio: a climb this many times above where it began (or the reference) is divergence.
        enabled: ``False`` makes :meth:`check` always return ``None``.
        window: healthy losses kept.
        recover_after: healthy losses after a fault before its episode can close.

    Example::

        >>> d = DivergenceDetector()
        >>> for x in (1.0, 100.0): d.add(x)
        >>> d.check(1e4).rule
        'climb'
    """

    def __init__(
        self,
        growth: float = 2.0,
        steps: int = 3,
        ratio: float = 100.0,
        enabled: bool = True,
        window: int = 128,
        recover_after: int = 20,
    ) -> None:
        if growth <= 1 or steps < 2 or ratio <= 1 or window < steps:
            raise ValueError(
                f"DivergenceDetector: got growth={growth}, steps={steps}, ratio={ratio}, window={window}; "
                "expected growth > 1, steps >= 2, ratio > 1 and window >= steps"
            )
        self.growth, self.steps, self.ratio, self.enabled = growth, steps, ratio, enabled
        self.window, self.recover_after = window, recover_after
        self._losses: deque = deque(maxlen=window)
        # The window's maximum as a decreasing queue of (add count, loss), as in SpikeDetector:
        # the healthy path reads one float instead of scanning the window.
        self._peaks: deque = deque()
        self._added = 0
        self.reference: Optional[float] = None
        self.episode = 0
        self._since = 0  # healthy losses since the last fault
        self._highs = 0  # a run of new highs of the window, each (after the first) >= growth x the one before

    @classmethod
    def from_config(cls, cfg: "DivergenceConfig", recover_after: int = 20) -> "DivergenceDetector":
        """The detector of a ``guard.divergence`` section (``recover_after``: ``recovery.reset_after``)."""
        return cls(cfg.growth, cfg.steps, cfg.ratio, cfg.enabled, recover_after=recover_after)

    @property
    def climbing(self) -> bool:
        """Whether a climb may be under way: the last two (or more) healthy losses in a row were
        each a new high of the window before them (the first loss of an empty window is one), each
        after the first at least ``growth`` times the one before it.

        One integer comparison: the guard asks it on every healthy step."""
        return self._highs >= 2

    def check(self, loss: float) -> Optional[DivergenceFinding]:
        """Return the evidence when ``loss`` is divergence, else ``None`` (nothing is recorded)."""
        h = self._losses
        if not self.enabled or not h or not math.isfinite(loss) or loss <= 0 or loss <= self._peaks[0][1]:
            return None  # the cheap test first: most healthy steps are no new high of the window
        # The climb: the longest tail of the window in which every loss was a new high of the
        # window before it (then ``loss``, a new high too); ``start`` is the loss just before it.
        values = list(h)
        highs, top = [], -math.inf
        for x in values:
            highs.append(x > top)
            top = max(top, x)
        j = len(values) - 1
        while j > 0 and highs[j] and values[j - 1] > 0:
            j -= 1
        start, rises = values[j], len(values) - 1 - j  # rises: healthy losses of the climb after its start
        if start <= 0:
            return None
        seq = values[-self.steps :] + [loss]
        ref = self.reference
        # Growth is measured from a robust level: one tiny early loss of a flat, noisy run is no base
        # a climb of 100x can be measured from (iid noise would then "diverge" in its first steps).
        level = max(start, statistics.median(values))
        low = level if ref is None else min(level, ref)
        geometric = rises >= self.steps - 1 and all(b >= self.growth * a for a, b in zip(seq, seq[1:]))
        began_before = rises >= 1 and values[-1] >= self.growth * start and loss >= self.growth * values[-1]
        climbed_back = ref is not None and loss >= self.ratio * ref
        climb = (began_before and loss >= self.ratio * low) or climbed_back
        if not (geometric or climb):
            return None
        episode = self.episode + 1 if ref is not None else 1
        return DivergenceFinding(float(loss), float(start), ref, "geometric" if geometric else "climb", rises, episode)

    def fault(self, finding: DivergenceFinding) -> None:
        """Record a divergence acted on: drop its climb from the window, keep the level before it."""
        kept = list(self._losses)[: len(self._losses) - finding.rises]
        self._refill(kept)
        level = max(finding.start, statistics.median(kept)) if kept else finding.start  # as in check()
        self.reference = level if self.reference is None else min(self.reference, level)
        self.episode = finding.episode
        self._since = 0

    def add(self, loss: float) -> None:
        """Record a healthy (trained) loss; a recovered episode closes here."""
        if not math.isfinite(loss):
            return
        self._push(float(loss))
        if self.reference is not None:
            self._since += 1
            if self._since >= self.recover_after and loss <= self.growth * self.reference:
                self.reference, self.episode, self._since = None, 0, 0

    def state_dict(self) -> Dict[str, Any]:
        """``{"losses": [...], "reference": float | None, "episode": int, "since": int}``, JSON-ready."""
        return {
            "losses": list(self._losses),
            "reference": self.reference,
            "episode": self.episode,
            "since": self._since,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        self._refill([float(x) for x in state.get("losses", ())])
        ref = state.get("reference")
        self.reference = float(ref) if ref is not None else None
        self.episode, self._since = int(state.get("episode", 0)), int(state.get("since", 0))

    def _push(self, loss: float) -> None:
        peaks = self._peaks
        if not peaks or loss > peaks[0][1]:  # a new high of the window (peaks[0]: its max)
            self._highs = self._highs + 1 if self._highs and loss >= self.growth * self._losses[-1] else 1
        else:
            self._highs = 0
        self._losses.append(loss)
        while peaks and peaks[-1][1] <= loss:
            peaks.pop()
        peaks.append((self._added, loss))
        self._added += 1
        if peaks[0][0] < self._added - self.window:  # left the window
            peaks.popleft()

    def _refill(self, losses: List[float]) -> None:
        self._losses = deque(maxlen=self.window)
        self._peaks.clear()
        self._highs = 0
        for x in losses:
            self._push(x)
