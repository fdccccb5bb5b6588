"""What a step leaves behind: a step's result, the counters, the pending step.

(The guard's phase is :mod:`safetrain.guard.machine`'s.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .events import Event
from .kinds import Action

__all__ = ["StepResult", "Counters", "Pending", "COUNTED_BY"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step came to.

    Attributes:
        step: the guard's step counter after this step (attempts, monotonic).
        trained: whether the optimizer applied an update.
        loss: the step's loss (mean over micro-batches), ``nan`` if it was not finite.
        grad_norm: total gradient norm before clipping, ``nan`` when not computed.
        action: ``""`` for a healthy step, else the action taken (``skip_batch``, ``restore``...).
        events: the events this step emitted.
        restored: the step restored a snapshot (the model, optimizer state and LR are the snapshot's now).
        clipped_to: the total gradient norm after clipping when the step's update was clipped, else ``nan``.
    """

    step: int
    trained: bool
    loss: float
    grad_norm: float
    action: str = ""
    events: Tuple[Event, ...] = ()
    restored: bool = False
    clipped_to: float = math.nan


@dataclass
class Counters:
    """The guard's counters; ``FitResult``, the progress bar and the journal all read these.

    Attributes:
        steps: step attempts (one per ``accumulate_steps`` micro-batches), monotonic.
        optimizer_steps: updates the optimizer applied, monotonic (rolled-back ones included).
        healthy_steps: steps with no anomaly at all.
        skipped_batches: steps whose update was not applied (skip, restore, abort, scaler overflow).
        dropped_rows: input or target rows dropped by ``drop_rows``.
        replaced_rows: rows whose non-finite values were replaced.
        zeroed_grads: parameters whose non-finite gradient was zeroed.
        restores: restores of a snapshot.
        scaler_skips: fp16 steps skipped by the GradScaler for overflow (normal, not failures).
        warnings: anomalous steps applied anyway (``warn``).
        lr_backoffs: LR backoffs (``scale_lr``; each also restores).
        retries: transient faults run once more (``retry``).
        rejected_batches: batches refused with ``BatchError`` (``sanitize.*: raise``).
        clipped_steps: trained steps whose gradients were clipped (``guard.clip_grad_norm`` or
            ``guard.clip.mode: adaptive``): healthy steps, not failures.
        epoch: the current epoch.
        batch: batches of the current epoch consumed so far.
    """

    steps: int = 0
    optimizer_steps: int = 0
    healthy_steps: int = 0
    skipped_batches: int = 0
    dropped_rows: int = 0
    replaced_rows: int = 0
    zeroed_grads: int = 0
    restores: int = 0
    scaler_skips: int = 0
    warnings: int = 0
    lr_backoffs: int = 0
    retries: int = 0
    rejected_batches: int = 0
    clipped_steps: int = 0
    epoch: int = 0
    batch: int = 0


#: The :class:`Counters` field each action moves (``abort`` restores first, and ends the run:
#: ``FitResult.aborted``; ``raise`` refuses the batch with ``BatchError``).
COUNTED_BY: Dict[Action, str] = {
    Action.WARN: "warnings",
    Action.SKIP_BATCH: "skipped_batches",
    Action.DROP_ROWS: "dropped_rows",
    Action.REPLACE: "replaced_rows",
    Action.ZERO_GRADS: "zeroed_grads",
    Action.RESTORE: "restores",
    Action.SCALE_LR: "lr_backoffs",
    Action.ABORT: "restores",
    Action.RETRY: "retries",
    Action.RAISE: "rejected_batches",
}


@dataclass
class Pending:
    """Device-side values of the step being accumulated; read in the single sync.

    Attributes:
        micro: the step's micro-batches, as trained.
        indices: each micro-batch's dataset indices (an empty list when unknown).
        places: each micro-batch's own ``(epoch, batch index)``: an event about one micro-batch
            of an accumulated step names it, not the step's last batch.
        calls: the forward hooks' records made up to the end of each micro-batch's forward (a
            finding at record ``k`` is in the first micro-batch whose count exceeds ``k``).
    """

    micro: List[Any] = field(default_factory=list)
    indices: List[List[int]] = field(default_factory=list)
    places: List[Tuple[int, int]] = field(default_factory=list)
    calls: List[int] = field(default_factory=list)
    loss: Optional[torch.Tensor] = None
    input_values: List[torch.Tensor] = field(default_factory=list)
    target_values: List[torch.Tensor] = field(default_factory=list)
    weights: Optional[torch.Tensor] = None  # the periodic weight check's value, when it ran

    def place(self, micro: Optional[int]) -> Optional[Tuple[int, int]]:
        """The ``(epoch, batch index)`` of micro-batch ``micro`` (``None``: not known)."""
        return self.places[micro] if micro is not None and 0 <= micro < len(self.places) else None

    def micro_of_call(self, position: int) -> Optional[int]:
        """Which micro-batch's forward made monitored call ``position`` of the step (``None``: not known)."""
        return next((i for i, end in enumerate(self.calls) if position < end), None)
