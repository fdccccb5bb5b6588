"""The judge: a step's host-side read -> the most upstream anomaly, or ``None`` for a healthy step.

Reading the flags costs nothing more (the read is the step's one host sync); only a tripped flag
pays for the exact look that confirms and names it: the bad rows, the first non-finite module
(confirmed by an exact re-run when the loss is finite), the parameters, the gradients.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional

from .. import detect
from ..config import SanitizeConfig, TrainConfig
from ..kinds import Kind
from ..policy import Anomaly
from ..steps import Pending
from .batches import row_findings
from .context import Context, Detectors
from .forward import Forward
from .lr import LRBackoff
from .plumbing import Plumbing

__all__ = ["Judge", "micro_rows"]

logger = logging.getLogger(__name__)


def micro_rows(micro: List[Any], sanitize: SanitizeConfig) -> List[List[Any]]:
    """Each micro-batch's exact non-finite rows (slow path: host syncs), named ``batch[...]`` in a
    step of one micro-batch, else ``micro[i][...]``."""
    many = len(micro) > 1
    return [row_findings(batch, sanitize, f"micro[{i}]" if many else "batch") for i, batch in enumerate(micro)]


class Judge:
    """Names a step's anomaly from its read, the most upstream cause first.

    Order: weights the periodic check found broken, input rows, target rows, then (parameters
    checked exactly first, so a symptom is not blamed) a module's output, the loss, an fp16
    overflow, gradients, the gradient norm (above the threshold, or overflowing float32), a loss
    growing geometrically (divergence), a loss spike.

    Args:
        cfg: the configuration (``detect.mode``, ``sanitize``, ``guard.grad_norm_threshold``,
            ``recovery.cause_test``).
        context: the run's counters (findings say where: step, epoch, batch) and the sync
            (agreement across ranks on the slow path; a no-op in one process).
        detectors: the detectors whose values the read holds, and the loss and norm statistics:
            ``guard.grad_norm_threshold: adaptive`` judges by the norm's (a far z-score; nothing
            before their warm-up is over); a divergence's evidence carries the schedule's LRs.
        plumbing: the scaler's backoff factor.
        forward: runs the step's forwards again exactly (:meth:`~.forward.Forward.confirm`), to
            confirm an activation flag.
        backoff: the LRs in force, the held ones under an LR hold (a divergence's evidence carries
            them, for the policy's ``recovery.min_lr`` limit and abort message); ``None``: none known.

    A loss that rose to a new level and stays (:meth:`~safetrain.stats.spike.SpikeDetector.level`) is
    judged a ``spike`` of rule ``level`` while ``recovery.cause_test`` is on (the cause test
    explains it: damage, a data change, or nothing found).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        context: Context,
        detectors: Detectors,
        plumbing: Plumbing,
        forward: Forward,
        backoff: Optional[LRBackoff] = None,
    ) -> None:
        d = detectors
        self.counters, self.sync = context.counters, context.sync
        self.monitor, self.grads, self.all_weights, self.spike = d.monitor, d.grads, d.all_weights, d.spike
        self.plumbing, self._confirm = plumbing, forward.confirm
        self.sanitize = cfg.sanitize
        threshold = cfg.guard.grad_norm_threshold
        self.threshold: Optional[float] = None if threshold == "adaptive" else threshold  # type: ignore[assignment]
        self.norm_stats = d.norm_stats if threshold == "adaptive" else None
        self.weights_checked = cfg.detect.mode != "off"
        self.divergence = d.divergence
        self.lrs: Callable[[], List[float]] = backoff.effective if backoff is not None else list
        self.levels = cfg.recovery.cause_test  # a level rise is the cause test's to explain

    def where(self, pending: Optional[Pending] = None, micro: Optional[int] = None) -> Dict[str, int]:
        """The current step, epoch and batch index, as findings name them: those of micro-batch
        ``micro`` of ``pending`` when given and known, else the step's last batch."""
        c = self.counters
        place = pending.place(micro) if pending is not None else None
        epoch, batch = place if place is not None else (c.epoch, c.batch - 1)
        return {"step": c.steps, "epoch": epoch, "batch_index": batch}

    def __call__(self, read: detect.StepRead, pending: Pending, loss: float) -> Optional[Anomaly]:
        """The step's anomaly, or ``None``.

        Args:
            read: the step's host-side read.
            pending: the step's micro-batches (for the exact looks of the slow path).
            loss: the step's mean loss as read.
        """
        if read.weights:
            finding = self.broken_weights(flagged=True)
            if finding is not None:
                return Anomaly(Kind.WEIGHTS, {"finding": finding})
        for kind, tripped in ((Kind.INPUT, read.input), (Kind.TARGET, read.target)):
            if tripped:
                rows = self.bad_rows(kind, pending)
                if self.sync.total(len(rows)):
                    return Anomaly(kind, {"rows": rows})
                # a finite sum overflowed (on every rank): no value is NaN/Inf, judge the rest
                logger.debug(
                    "step %d: %s flag tripped but every value is finite (sum overflow)", self.counters.steps, kind
                )
        overflowed = self.plumbing.scaler.enabled and bool(read.extra.get("found_inf", (0.0,))[0])
        forward_tripped, loss_tripped = read.forward_tripped, read.loss_tripped
        if forward_tripped or loss_tripped or (read.gradient and not overflowed):
            # Parameters already NaN/Inf (an earlier update, or code outside the step) make every
            # forward trip: named here, before a replay or the ladder spends a step on a symptom.
            finding = self.broken_weights(flagged=False)
            if finding is not None:
                return Anomaly(Kind.WEIGHTS, {"finding": finding})
        if forward_tripped:
            # The hooks fold a cheap sum; with a finite loss, confirm by an exact re-run (RNG and
            # buffers kept as they were) before calling it, since a finite sum can overflow.
            rerun = None if loss_tripped else (lambda: self._confirm(pending.micro))
            finding = self.monitor.locate(read.forward, rerun=rerun, **self.where())
            if rerun is not None:  # confirmed on some rank: on all
                finding = self.sync.agree_finding(finding, lambda: self.monitor.locate(read.forward, **self.where()))
            if finding is not None:  # named at the micro-batch whose forward made it
                finding = finding.with_context(**self.where(pending, pending.micro_of_call(finding.position)))
                return Anomaly(Kind.FORWARD, {"finding": finding})
        if loss_tripped:
            return Anomaly(Kind.LOSS, {"finding": detect.LossFinding(kind="loss", value=loss, **self.where())})
        if overflowed:
            scale = read.extra["scale"][0]
            return Anomaly(Kind.OVERFLOW, {"scale": scale, "new_scale": scale * self.plumbing.backoff_factor()})
        total, threshold = read.total_norm, self.threshold
        if self.norm_stats is not None and total is not None and self.norm_stats.outlier(total):
            threshold = self.norm_stats.anomaly_threshold()  # adaptive: far beyond the EMA statistics
        if read.gradient or (
            total is not None and (total >= detect.HUGE_NORM or (threshold is not None and total > threshold))
        ):
            # An Inf norm of finite elements (float32 squares overflowed) is GRAD_NORM with its true
            # norm, whatever the threshold; only NaN/Inf elements are GRADIENT.
            finding = self.sync.agree_gradient(self.grads.finding(read.grad_norms, threshold, **self.where()))
            return Anomaly(Kind.GRADIENT if finding.kind == "gradient" else Kind.GRAD_NORM, {"finding": finding})
        # A climb over steps, each loss a new high of the window (a single jump is a spike, below):
        # check() finds none in a loss no higher than the window's highest, so it is asked only above it.
        diverged = self.divergence.check(loss) if loss > self.divergence.high else None
        if diverged is not None:
            self.divergence.fault(diverged)  # its climb leaves the window; the level before it is kept
            lrs = tuple(float(x) for x in self.lrs())
            detail = {"finding": diverged, "episode": diverged.episode, "lr": list(lrs)}  # (the journal's)
            return Anomaly(Kind.DIVERGENCE, detail, episode=diverged.episode, lrs=lrs)
        spike = self.spike
        evidence = spike.check(loss)
        if evidence is None and self.levels and spike.rising:  # a loss that jumped and stays, no step of it a spike
            evidence = spike.level(loss)  # (asked only during a rise: level() ends none before one)
        if evidence is not None:
            return Anomaly(Kind.SPIKE, evidence)
        return None

    def observe(self, loss: float) -> None:
        """A trained step's loss joins the spike and divergence windows (a non-finite one is ignored)."""
        self.spike.add(loss)
        self.divergence.add(loss)

    def rebase(self) -> None:
        """The data changed (the cause test said so): the loss detectors forget the old level and
        learn the new one from the next trained losses."""
        self.spike.load_state_dict({"losses": []})
        self.divergence.load_state_dict({})

    def state_dict(self) -> Dict[str, Any]:
        """The loss detectors' windows, JSON-ready: ``spike`` and ``divergence``."""
        return {"spike": self.spike.state_dict(), "divergence": self.divergence.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back :meth:`state_dict`'s keys (``divergence`` is absent from earlier snapshots)."""
        self.spike.load_state_dict(state["spike"])
        self.divergence.load_state_dict(state.get("divergence", {}))

    def bad_rows(self, kind: Kind, pending: Pending) -> List[Any]:
        """The exact non-finite rows of ``kind`` in the step's micro-batches (slow path), each
        finding at its own micro-batch's epoch and batch index."""
        return [
            f.with_context(**self.where(pending, i))
            for i, rows in enumerate(micro_rows(pending.micro, self.sanitize))
            for f in rows
            if f.kind == kind
        ]

    def broken_weights(self, flagged: bool) -> Optional[detect.WeightFinding]:
        """The parameters' exact check (slow path): a finding when some are NaN/Inf, on every rank
        when on any rank (one small collective under DDP, so every rank takes the same decision).

        Args:
            flagged: the step's periodic weight check tripped; else one fused pass runs first.
        """
        if not self.weights_checked:
            return None
        bad = flagged
        if not flagged:
            value = self.all_weights.run(force=True)
            bad = value is not None and not math.isfinite(value.item())  # host sync: slow path
        finding = self.all_weights.finding(**self.where()) if bad else None  # None: the norms overflowed
        return self.sync.agree_weights(
            finding, lambda ranks: detect.WeightFinding(kind="weights", nonfinite=(), ranks=ranks, **self.where())
        )
