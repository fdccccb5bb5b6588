"""Divergence detection: a finite loss that keeps growing geometrically; pure Python, no torch.

An LR several times above the stable step makes the loss grow by a roughly constant factor per
step from the very first steps (plain SGD on unscaled regression data: ~100x per step), long
before any value is NaN/Inf and long before the spike detector has ``min_history`` losses. So
this detector has no warm-up: it judges each loss against the healthy losses just before it.

Every rule is **invariant**: it gives the same decision for ``loss``, ``loss + c`` and ``a * loss``
(``a > 0``), so a negative or offset loss (``mse - 1``, a Gaussian NLL, ``-log p``) diverges or not
like any other. A geometric divergence ``c + a * g**k`` has **increments** (a loss minus the one
before) that grow by ``g`` whatever ``c`` and ``a`` are, and its rise above the level where the
climb began is measured in a **scale** of the run's own: the robust spread (1.4826 x MAD) of the
window before the climb, or the climb's first increment when that is larger or when fewer than
three losses came before the climb (no spread is known then). These scales are the positive
quantities the rules need; a loss itself never is one. Float rounding is the only difference.

A loss ``L`` is divergence when it is a new high of the recent (``window``) healthy losses, at
the end of a climb in which each loss was a new high of the window before it, and either

* **geometric**: the last ``steps`` increments up to ``L`` each are at least ``growth`` times the
  one before (``steps - 1`` ratios in a row; ``growth`` squared while no spread is known, since a
  healthy run's first steps can wobble up by chance), and ``L`` has risen at least ``growth **
  steps`` scales above the level where the climb began, or
* **climb** (once a spread is known): ``L`` ends a climb of new highs that began before this step,
  its last increment at least ``growth`` times the one before, and ``L`` has risen at least
  ``ratio`` scales above where the climb began (or above the level before the last divergence,
  in that divergence's scale, see below).

A single jump (a bad batch) is neither: it has no rise before it, and is left to the spike
detector. The new highs keep a converged, heavy-tailed run quiet: its noisy batches seldom pass
every loss of the last 128, let alone several times in a row (measured on a synthetic curve of
lognormal batches around 1e-4 with one in 16 up to 0.05: no trip in 5 x 6000 steps, the unit test). With two
healthy losses only (a climb from the first step) no spread is known and the first increment is
the scale: an LR ~10x too high (the loss x100 a step) is caught at the 4th loss, where a ratio to
the first loss caught it at the 3rd.

Recovery is checked, not assumed. :meth:`fault` records a divergence that was acted on: the
climb's losses are dropped from the window (they were the fault, not the run's level) and the
loss level before the climb becomes the **reference**, with the climb's scale. Until
``recover_after`` healthy losses have come after the last fault and the loss is back within
``growth`` scales of the reference, the episode stays open: a loss that climbs back to ``ratio``
scales above the reference is the same anomaly again (``episode`` counts them, and the policy's
ladder goes on instead of starting afresh).

:attr:`DivergenceDetector.climbing` says a climb may be under way (the last two healthy losses
were each a new high of the window before them, the second's increment at least ``growth`` x the
first's when that is known): the guard then takes no snapshot and lets no snapshot be vouched
for, so that a restore after the divergence lands before the climb began.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .spike import oldest_first, spread_floor, tail_extremes

if TYPE_CHECKING:
    from ..config import DivergenceConfig

__all__ = ["DivergenceDetector", "DivergenceFinding"]

_INF = math.inf


@dataclass(frozen=True)
class DivergenceFinding:
    """The evidence of a divergence, for the journal.

    Attributes:
        loss: the loss that was judged.
        start: the loss where the climb began (the lowest of it).
        reference: the loss level before the previous divergence of this episode, or ``None``.
        scale: the spread the rise was measured in (see the module docstring); a positive number.
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
    scale: float = 0.0

    def describe(self) -> str:
        """One line: how far the loss climbed, and over how many steps."""
        rise = f"{(self.loss - self.start) / self.scale:.3g} scales" if self.scale > 0 else "far"
        base = f"loss {self.loss:.4g} rose {rise} (of {self.scale:.3g}) above the {self.start:.4g} where it began to "
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
            "scale": self.scale,
        }


class DivergenceDetector:
    """Judge each loss against the healthy losses just before it, from the first step of a run.

    Args:
        growth: a step whose increment is at least this many times the one before counts toward ``steps``.
        steps: this many increments in a row, each ``growth`` x the one before, are divergence.
        ratio: a climb this many scales above where it began (or the reference) is divergence.
        enabled: ``False`` makes :meth:`check` always return ``None``.
        window: healthy losses kept.
        recover_after: healthy losses after a fault before its episode can close.

    Example::

        >>> d = DivergenceDetector()
        >>> for x in (1.0, 100.0, 1e4): d.add(x)
        >>> d.check(1e6).rule
        'geometric'
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
        self.reference: Optional[float] = None
        self.reference_scale = 0.0  # the scale of the divergence that set the reference
        self.episode = 0
        self._since = 0  # healthy losses since the last fault
        self._highs = 0  # a run of new highs of the window, each (after the first) >= growth x the one before
        #: Whether a climb may be under way: the last two (or more) healthy losses in a row were
        #: each a new high of the window before them (the first loss of an empty window is one), each
        #: increment after the first at least ``growth`` times the one before it (the second loss of a
        #: run has no increment before it: any rise there counts, since with one loss before it no
        #: invariant rule can tell a wobble from an LR far too high, and vouching for the snapshot
        #: it read would let a restore land inside the climb). ``_highs >= 2``, kept as a plain
        #: attribute: the guard reads it on every healthy step.
        self.climbing = False
        self._clear_window()

    @classmethod
    def from_config(cls, cfg: "DivergenceConfig", recover_after: int = 20) -> "DivergenceDetector":
        """The detector of a ``guard.divergence`` section (``recover_after``: ``recovery.reset_after``)."""
        return cls(cfg.growth, cfg.steps, cfg.ratio, cfg.enabled, recover_after=recover_after)

    def check(self, loss: float) -> Optional[DivergenceFinding]:
        """Return the evidence when ``loss`` is divergence, else ``None`` (nothing is recorded)."""
        if not self.enabled or not self._count or loss <= self.high or not math.isfinite(loss):
            return None  # the cheap test first: most healthy steps are no new high of the window (NaN passes it)
        # The climb: the longest tail of the window in which every loss was a new high of the
        # window before it (then ``loss``, a new high too); ``start`` is the loss just before it.
        values = self._window_losses()
        j, top = 0, -math.inf  # j: the last loss that was no new high (the first always is one)
        for i, x in enumerate(values):  # (comparisons only: no call per loss)
            if x > top:
                top = x
            else:
                j = i
        start, rises = values[j], len(values) - 1 - j  # rises: healthy losses of the climb after its start
        chain = values[j:] + [loss]
        steps = [b - a for a, b in zip(chain, chain[1:])]  # the increments, each > 0 (new highs)
        # The scale: the robust spread of the window up to the climb's start, or the climb's first
        # increment when that is larger or no spread is known (fewer than 3 losses before the climb).
        before = values[: j + 1]
        known = len(before) >= 3
        middle = statistics.median(before)
        spread = 1.4826 * statistics.median([middle - x if x < middle else x - middle for x in before])  # (abs)
        scale = max(steps[0], spread if known else 0.0, spread_floor(loss))
        # Growth is measured from a robust level: one tiny early loss of a flat, noisy run is no base
        # a climb can be measured from (iid noise would then "diverge" in its first steps).
        level = max(start, statistics.median(values))
        ref = self.reference
        growth = self.growth if known else self.growth**2
        tail = steps[-self.steps :]
        geometric = (
            len(steps) >= self.steps
            and all(b >= growth * a for a, b in zip(tail, tail[1:]))
            and loss - level >= self.growth**self.steps * scale
        )
        began_before = known and rises >= 1 and steps[-1] >= self.growth * steps[-2]
        climbed_back = ref is not None and loss - ref >= self.ratio * self.reference_scale
        climb = (began_before and loss - level >= self.ratio * scale) or climbed_back
        if not (geometric or climb):
            return None
        episode = self.episode + 1 if ref is not None else 1
        rule = "geometric" if geometric else "climb"
        return DivergenceFinding(float(loss), float(start), ref, rule, rises, episode, float(scale))

    def fault(self, finding: DivergenceFinding) -> None:
        """Record a divergence acted on: drop its climb from the window, keep the level before it."""
        kept = self._window_losses()[: self._count - finding.rises]
        self._refill(kept)
        level = max(finding.start, statistics.median(kept)) if kept else finding.start  # as in check()
        if self.reference is None:
            self.reference, self.reference_scale = level, finding.scale
        else:
            self.reference, self.reference_scale = min(self.reference, level), max(self.reference_scale, finding.scale)
        self.episode = finding.episode
        self._since = 0

    def add(self, loss: float) -> None:
        """Record a healthy (trained) loss; a recovered episode closes here."""
        if not -_INF < loss < _INF:  # (not finite, by comparisons: NaN fails both)
            return
        loss = float(loss)
        ring, count, pos = self._losses, self._count, self._pos
        if loss > self.high:  # a new high of the window (an empty one's high is -inf)
            # the increment grew; the second loss of a run has none before it: a rise there may be a
            # climb (an LR far too high: 669, then 9.2e4), so no snapshot is vouched for by it
            # (ring[pos - 1]: the last loss, ring[pos - 2] the one before; negative slots wrap around)
            grew = count < 2 or loss - ring[pos - 1] >= self.growth * (ring[pos - 1] - ring[pos - 2])
            self._highs = self._highs + 1 if self._highs and grew else 1
        else:
            self._highs = 0
        self.climbing = self._highs >= 2
        # The ring's slot `pos` takes the loss; the window's high is that of the last finished
        # block's slots after `pos` and of this block's so far (spike.tail_extremes: no call here).
        if pos == 0:  # a block begins: the last one, if any, is finished
            if count:
                self._highs_after = tail_extremes(ring, max, -_INF)
            top = loss
        else:
            top = loss if loss >= self._block_high else self._block_high
        ring[pos], self._block_high = loss, top
        after = self._highs_after[pos + 1]
        self.high = after if after > top else top
        self._pos = pos + 1 if pos + 1 < self.window else 0
        if count < self.window:
            self._count = count + 1
        if self.reference is not None:
            self._since += 1
            if self._since >= self.recover_after and loss - self.reference <= self.growth * self.reference_scale:
                self.reference, self.reference_scale, self.episode, self._since = None, 0.0, 0, 0

    def state_dict(self) -> Dict[str, Any]:
        """``{"losses": [...], "reference": float | None, "reference_scale": float, "episode": int,
        "since": int}``, JSON-ready."""
        return {
            "losses": self._window_losses(),
            "reference": self.reference,
            "reference_scale": self.reference_scale,
            "episode": self.episode,
            "since": self._since,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        self._refill([float(x) for x in state.get("losses", ())])
        ref = state.get("reference")
        self.reference = float(ref) if ref is not None else None
        # Absent from snapshots of earlier versions, whose reference was a loss level x ratio: the
        # reference's own magnitude is the closest scale they knew.
        scale = state.get("reference_scale")
        self.reference_scale = float(scale) if scale is not None else abs(self.reference or 0.0)
        self.episode, self._since = int(state.get("episode", 0)), int(state.get("since", 0))

    def _window_losses(self) -> List[float]:
        """The window's healthy losses, oldest first."""
        return oldest_first(self._losses, self._count, self._pos)

    def _clear_window(self) -> None:
        """Empty the window (a ring of ``window`` slots) and the climb it held."""
        self._losses: List[float] = [0.0] * self.window  # the healthy losses, slot by slot
        self._count = 0  # losses in the window
        self._pos = 0  # the slot the next loss takes
        self._highs_after = [-_INF] * (self.window + 1)  # tail_extremes of the last finished block (none yet)
        self._block_high = -_INF  # this block's highest loss so far
        #: The window's highest loss (``-inf`` while it is empty). Only a loss above it can be
        #: divergence: the guard asks :meth:`check` only then (a plain attribute, read every step).
        self.high = -_INF
        self._highs, self.climbing = 0, False

    def _refill(self, losses: List[float]) -> None:
        """The window of ``losses`` (oldest first), added again; the episode is left as it stands."""
        self._clear_window()
        reference, self.reference = self.reference, None  # (put back, not trained now: no recovery counted)
        for x in losses:
            self.add(x)
        self.reference = reference
