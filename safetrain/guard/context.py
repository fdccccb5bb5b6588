"""What a guard's parts share: the run's :class:`Context`, and the :class:`Detectors` a step's read holds.

Each part is built from its configuration section, this context, and the parts whose state it
reads (never a callable into another part): the counters it writes (each counter has one
writer), the journal every event goes through, the sync that makes ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch

from .. import detect
from ..config import TrainConfig
from ..snapshot import TrainState
from ..stats.divergence import DivergenceDetector
from ..stats.gradclip import NormStats
from ..stats.spike import SpikeDetector
from ..steps import Counters
from .journal import StepJournal
from .plumbing import Buffers

__all__ = ["Context", "Detectors"]


@dataclass(frozen=True)
class Context:
    """The run a part works in.

    Attributes:
        counters: the guard's counters (the step, epoch and batch; what each action counts).
        journal: ``journal(cls, kind, action, message, detail, at=None) -> event`` (:class:`StepJournal`).
        sync: the distributed sync (``distributed.LocalSync`` in one process).
    """

    counters: Counters
    journal: StepJournal
    sync: Any


@dataclass(frozen=True)
class Detectors:
    """What a step's one read holds values of, and the host-side statistics judged from it.

    Attributes:
        monitor: the activation hooks (``detect.mode``).
        grads: the fused gradient norms (always on: clipping and the scaler need the norm).
        weights: the periodic weight check (``detect.check_weights_every``).
        all_weights: the exact weight check after a trip: every parameter, frozen ones too, and
            the buffers as kept before the step.
        spike: the loss spikes and level.
        divergence: a loss growing geometrically.
        norm_stats: the gradient norm's EMA statistics (adaptive clipping and ``grad_norm_threshold: adaptive``).
    """

    monitor: detect.ActivationMonitor
    grads: detect.GradCheck
    weights: detect.WeightCheck
    all_weights: detect.WeightCheck
    spike: SpikeDetector
    divergence: DivergenceDetector
    norm_stats: NormStats

    @classmethod
    def of(
        cls,
        cfg: TrainConfig,
        named: torch.nn.Module,
        all_params: List[Tuple[str, torch.Tensor]],
        buffers: Buffers,
        state: TrainState,
    ) -> "Detectors":
        """The detectors ``cfg`` configures for the model ``named`` (its forward hooks attached),
        over ``all_params`` (every parameter by plain name, frozen ones too: one may be unfrozen
        mid-run) and the floating ``buffers`` (BatchNorm statistics; a mask's ``-inf`` is checked by
        its pattern, the one ``state`` accepted at the start). The activation and weight checks
        follow ``detect.mode``; a disabled one is a no-op, not an ``if`` on the step."""
        params = [(n, p) for n, p in all_params if p.requires_grad]
        monitor = detect.ActivationMonitor.from_config(named, cfg.detect)
        monitor.attach()
        on = cfg.detect.mode != "off"
        weights = detect.WeightCheck(
            params + buffers.checked(), cfg.detect.check_weights_every, enabled=on, probes=buffers.patterned(state)
        )
        kept = buffers.checked(kept=True), buffers.patterned(state, kept=True)  # as before the step
        sp, cl = cfg.guard.spike, cfg.guard.clip
        return cls(
            monitor=monitor,
            grads=detect.GradCheck(all_params),
            weights=weights,
            all_weights=detect.WeightCheck(all_params + kept[0], 0, probes=kept[1]),
            spike=SpikeDetector(sp.window, sp.min_history, sp.zscore, sp.enabled, sp.min_ratio, sp.hard_ratio),
            divergence=DivergenceDetector.from_config(cfg.guard.divergence, recover_after=cfg.recovery.reset_after),
            norm_stats=NormStats(cl.alpha, cl.zscore, cl.warmup_steps, cl.anomaly_zscore),
        )
