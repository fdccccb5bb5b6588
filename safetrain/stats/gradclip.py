"""Adaptive gradient-norm statistics: ZClip's z-score clipping and a far-outlier check; pure Python, no torch.

ZClip (Kumar et al., arXiv:2504.02507) keeps exponential moving averages of the mean and variance
of the total gradient norm and, when a step's norm is a z-score outlier, clips it toward the mean
plus a few standard deviations instead of to a fixed number that the user must know and that goes
stale as the norm drifts over a run. :class:`NormStats` does the same on the host:

- **warm-up**: the first ``warmup_steps`` norms are collected (no adaptive clip; ``guard.clip_grad_norm``
  clips them when set); then ``mean`` and ``var`` start as their mean and (population) variance.
- **the clip** (ZClip's ``zscore`` mode with ``adaptive_scaling``): with ``std = sqrt(var)`` and
  ``z = (norm - mean) / std``, a norm with ``z > zscore`` is clipped to
  ``mean + zscore**2 * std / z``, the reciprocal rule: the farther out, the harder the clip
  (``z = zscore`` lands on ``mean + zscore * std``, the threshold itself).
- **the update**: after a step, ``mean = a*mean + (1-a)*x`` then ``var = a*var + (1-a)*(x - mean)**2``
  (the new mean, as ZClip's code does) with ``x`` the norm as applied (the clipped one on a clipped
  step), so an outlier does not drag the statistics after it.
- **a far outlier** (``guard.grad_norm_threshold: adaptive``): ``z > anomaly_zscore``, with the
  standard deviation floored at :data:`ANOMALY_STD_FLOOR` of the mean, so a run whose norm barely
  varies is not called anomalous for a norm a few times its mean (the ``grad_norm`` anomaly is
  for norms no clip should hide: x10 and beyond). It is judged against a second pair of EMAs, of
  the norms **as read** (``read_mean``, ``read_var``; the same updates with the unclipped norm):
  a norm that rises steadily (2% a step, a warm-up's LR) is clipped at every step, and the clip's
  statistics, fed the clipped norms, fall further behind it each step, until a healthy norm stood
  12 floored deviations above them (hypothesis found it: step 95 of a noiseless rise, 6.4x the
  start); the statistics as read follow the rise.

Why on the host and not the device: the step's one read (:class:`safetrain.detect.StepFlags`)
brings the total norm to the host already, combined across ranks under DDP/FSDP, and the fixed
clip already works its coefficient out there (:meth:`safetrain.detect.GradCheck.clip_`). A few
float operations on that number cost no host sync and no device op at all (a statistics tensor on
the device would add kernels every step, and its value would still have to ride in the read for the
journal); every rank computes the same float64 numbers from the same read, so ranks clip
identically; and the state is plain floats, JSON-exact in a snapshot (``repr`` round-trips).

Every rule is invariant to the norm's positive scale (``z`` is a ratio of differences; the
floors are relative to the mean), so a model whose norms are 1e-6 is judged like one at 1e3.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

__all__ = ["NormStats", "ANOMALY_STD_FLOOR", "STD_FLOOR"]

#: The standard deviation a clip's z-score divides by is at least this fraction of the mean (a
#: scale-free stand-in for ZClip's absolute ``eps``: only a run of near-identical norms reaches it).
STD_FLOOR = 1e-3
#: The far-outlier check's standard deviation is at least this fraction of the mean: with the
#: default ``anomaly_zscore`` of 12 a norm must be at least 4x the mean to be a ``grad_norm`` anomaly.
ANOMALY_STD_FLOOR = 0.25


class NormStats:
    """EMA mean and variance of the total gradient norm, the adaptive clip and the far-outlier check.

    Args:
        alpha: the EMA's smoothing factor (``guard.clip.alpha``; ZClip's default 0.97).
        zscore: a norm more than this many standard deviations above the mean is clipped (``guard.clip.zscore``).
        warmup_steps: norms collected before the statistics start (``guard.clip.warmup_steps``).
        anomaly_zscore: a norm this many (floored) standard deviations out is a ``grad_norm``
            anomaly under ``guard.grad_norm_threshold: adaptive`` (``guard.clip.anomaly_zscore``).

    Example::

        >>> stats = NormStats(alpha=0.9, zscore=2.0, warmup_steps=2)
        >>> for norm in (1.0, 3.0):
        ...     stats.update(norm)             # warm-up: mean 2, var 1
        >>> stats.limit(6.0)                   # z = 4: clipped to 2 + 2**2 * 1 / 4
        3.0
        >>> stats.limit(3.5) is None           # z = 1.5: left as it is
        True
    """

    def __init__(self, alpha: float = 0.97, zscore: float = 2.5, warmup_steps: int = 25, anomaly_zscore: float = 12.0):
        self.alpha, self.zscore, self.warmup_steps, self.anomaly_zscore = alpha, zscore, warmup_steps, anomaly_zscore
        self.mean: Optional[float] = None  # None until the warm-up is over: the norms as applied (the clip's)
        self.var = 0.0
        self.read_mean: Optional[float] = None  # the same of the norms as read (the far-outlier check's)
        self.read_var = 0.0
        self.warmup: List[float] = []  # the warm-up's norms so far

    @property
    def ready(self) -> bool:
        """The warm-up is over: :meth:`limit` and :meth:`outlier` judge."""
        return self.mean is not None

    def _std(self, floor: float) -> float:
        """The clip's standard deviation, floored at ``floor`` times its mean (``mean`` is set)."""
        std, low = math.sqrt(self.var), floor * abs(self.mean)  # type: ignore[arg-type]
        return std if std > low else low

    def _read_std(self) -> float:
        """The standard deviation of the norms as read, floored at :data:`ANOMALY_STD_FLOOR` of their mean."""
        std, low = math.sqrt(self.read_var), ANOMALY_STD_FLOOR * abs(self.read_mean)  # type: ignore[arg-type]
        return std if std > low else low

    def limit(self, norm: float) -> Optional[float]:
        """The norm this step's gradients are clipped to, or ``None`` (no adaptive clip: in the
        warm-up, a non-finite norm, ``z <= zscore``, or statistics of all-zero norms, which give no scale)."""
        mean = self.mean
        if mean is None or not mean < norm < math.inf:  # (False for NaN too)
            return None
        std = self._std(STD_FLOOR)
        if std <= 0.0:
            return None
        z = (norm - mean) / std
        return mean + self.zscore * self.zscore * std / z if z > self.zscore else None

    def zscore_of(self, norm: float) -> float:
        """``norm``'s z-score as the clip judges it (``nan`` in the warm-up or without a scale)."""
        if self.mean is None:
            return math.nan
        std = self._std(STD_FLOOR)
        return (norm - self.mean) / std if std > 0.0 else math.nan

    def outlier(self, norm: float) -> bool:
        """``norm`` is a far outlier: more than ``anomaly_zscore`` floored standard deviations above
        the mean of the norms as read."""
        mean = self.read_mean
        if mean is None or not mean < norm < math.inf:
            return False
        std = self._read_std()
        return std > 0.0 and (norm - mean) / std > self.anomaly_zscore

    def anomaly_threshold(self) -> Optional[float]:
        """The norm above which :meth:`outlier` is true (``None`` in the warm-up): for findings."""
        if self.read_mean is None:
            return None
        return self.read_mean + self.anomaly_zscore * self._read_std()

    def update(self, norm: float, applied: Optional[float] = None) -> None:
        """A trained step's norm joins the statistics: ``norm`` as read, ``applied`` as the clip
        left it (``None``: not clipped, the same); a non-finite norm is ignored."""
        if not math.isfinite(norm):
            return
        if applied is None or not math.isfinite(applied):
            applied = norm
        if self.mean is None:
            self.warmup.append(norm)  # (no adaptive clip in the warm-up)
            if len(self.warmup) >= self.warmup_steps:
                n = len(self.warmup)
                mean = sum(self.warmup) / n
                self.mean, self.var = mean, sum((x - mean) ** 2 for x in self.warmup) / n
                self.read_mean, self.read_var = self.mean, self.var
                self.warmup = []
            return
        a = self.alpha
        self.mean = mean = a * self.mean + (1.0 - a) * applied
        self.var = a * self.var + (1.0 - a) * (applied - mean) ** 2
        self.read_mean = mean = a * self.read_mean + (1.0 - a) * norm  # type: ignore[operator]
        self.read_var = a * self.read_var + (1.0 - a) * (norm - mean) ** 2

    def state_dict(self) -> Dict[str, Any]:
        """JSON-ready: ``mean`` (``None`` in the warm-up), ``var``, ``read_mean``, ``read_var``,
        ``warmup`` (the warm-up's norms so far)."""
        return {
            "mean": self.mean,
            "var": self.var,
            "read_mean": self.read_mean,
            "read_var": self.read_var,
            "warmup": list(self.warmup),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back :meth:`state_dict`'s keys (an empty mapping: a fresh start; without ``read_mean``,
        a snapshot of an earlier version, the statistics as read start from the clip's)."""
        mean = state.get("mean")
        self.mean = float(mean) if mean is not None else None
        self.var = float(state.get("var", 0.0))
        read_mean = state.get("read_mean", mean)
        self.read_mean = float(read_mean) if read_mean is not None else None
        self.read_var = float(state.get("read_var", self.var))
        self.warmup = [float(x) for x in state.get("warmup", ())]
