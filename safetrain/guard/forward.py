"""One micro-batch through the model: scan the batch, forward under autocast, backward (scaled).

The healthy path's own work. The buffers a forward may change (BatchNorm's running statistics)
are kept before each step's first forward, so a step that is not applied leaves none of its
updates behind. Non-finite input values are zero-filled on the device only when the
forward updates state (a model with buffers, such as BatchNorm's running statistics); the scan's
values join the step's one read. Re-runs for the slow path run eagerly and without DDP's syncs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import detect, distributed
from ..adapters.compiled import can_force_eager, run_eagerly
from ..config import SanitizeConfig
from ..detect import TARGET_KEYS
from ..steps import Pending
from .batches import compute_loss, split_batch
from .plumbing import Buffers, Plumbing

__all__ = ["Forward"]

#: Batch types taken as an (inputs, targets) pair without ``split_batch`` (exact types: a named
#: tuple or another subclass goes through it).
_PLAIN_PAIRS = (tuple, list)


class Forward:
    """Runs micro-batches through the user's model and collects what the step's read needs.

    Args:
        model: the user's model (compiled or not: the forward runs through it).
        named: the module inside a compile wrapper (replays run it eagerly on an old torch).
        monitor: the activation monitor whose hooks record each forward.
        plumbing: device, autocast and scaler.
        buffers: what a forward changes before the step is judged (BatchNorm's running
            statistics): kept before each step's first forward, put back when the step is not
            applied or runs again.
        sanitize: the ``sanitize`` section (what to scan, what to replace with).
        accumulate: ``guard.accumulate_steps`` (each micro-batch's loss is divided by it).
        loss_fn: ``loss_fn(model(inputs), targets)`` for pair batches.
        step_fn: ``step_fn(model, batch) -> loss`` for any other batch.
    """

    def __init__(
        self,
        flags: detect.StepFlags,
        grads: detect.GradCheck,
        model: torch.nn.Module,
        named: torch.nn.Module,
        monitor: detect.ActivationMonitor,
        plumbing: Plumbing,
        buffers: Buffers,
        sanitize: SanitizeConfig,
        accumulate: int,
        loss_fn: Optional[Callable[..., Tensor]],
        step_fn: Optional[Callable[[torch.nn.Module, Any], Tensor]],
    ):
        self.flags, self.grads = flags, grads
        self.model, self.named, self.monitor, self.plumbing = model, named, monitor, plumbing
        self.sanitize, self.accumulate = sanitize, accumulate
        self.loss_fn, self.step_fn = loss_fn, step_fn
        # Zero-fill bad input values before the optimistic forward only where the forward updates
        # state: a model without buffers changes nothing until the step is judged.
        self.clean = any(True for _ in model.buffers())
        self.buffers = buffers
        self._replace_inputs = self._replacement(sanitize.inputs)
        self._replace_targets = self._replacement(sanitize.targets)

    def _replacement(self, action: str) -> Optional[Tuple[float, float, float]]:
        s = self.sanitize
        return (s.nan, s.posinf, s.neginf) if action == "replace" else None

    def begin(self, batch: Any, pending: Pending) -> Any:
        """A micro-batch arrives (already in ``pending.micro``): the step's first keeps the buffers
        as they were before it; returns the batch scanned (and cleaned) for the forward."""
        if self.buffers.enabled and len(pending.micro) == 1:  # (a model without such buffers: no call)
            self.buffers.keep()
        return self.scan(batch, pending)

    def run(self, batch: Any, pending: Pending, divide: int) -> None:
        """Scan, forward and backward one micro-batch (a re-run's), its loss divided by ``divide``
        for the backward; its loss and scan values go to ``pending``."""
        clean = self.begin(batch, pending)
        loss = self.loss(clean, pending)
        if self.monitor.enabled:  # (lazy mode: no hooks, nothing recorded)
            pending.calls.append(self.monitor.recorded)  # which micro-batch a forward finding is in
        self.add_loss(loss, pending)
        self.backward(loss, divide)

    def loss(self, clean: Any, pending: Pending) -> Tensor:
        """The forward of a scanned micro-batch (under autocast): its loss, as the model computes it."""
        # Every forward starts with empty record lists (a compiled graph depends on their length).
        held = self.monitor.set_aside() if self.monitor.enabled and len(pending.micro) > 1 else None
        try:
            if self.plumbing.amp_dtype is None:  # no context to enter and leave: cheaper in a small step
                return compute_loss(self.model, clean, self.loss_fn, self.step_fn)
            with self.plumbing.autocast():
                return compute_loss(self.model, clean, self.loss_fn, self.step_fn)
        finally:
            if held is not None:
                self.monitor.put_back(held)

    def backward(self, loss: Tensor, divide: int = 0) -> None:
        """The backward of a micro-batch's loss, divided by ``divide`` (``0``: by the accumulation;
        a re-run of a short last window divides as the caller did), and scaled in fp16."""
        k = divide or self.accumulate
        self.plumbing.scaler.scale(loss / k if k > 1 else loss).backward()

    @staticmethod
    def add_loss(loss: Tensor, pending: Pending) -> None:
        """Add one micro-batch's loss (as computed, not divided by the accumulation) to the step's."""
        loss = loss.detach()
        if loss.dtype is not torch.float32:  # an fp16/bf16 loss under autocast
            loss = loss.float()
        pending.loss = loss if pending.loss is None else pending.loss + loss

    def read(self, pending: Pending) -> detect.StepRead:
        """Unscale, check the gradients, and read every flag, the loss and the norms at once."""
        flags, pipes = self.flags, self.plumbing
        pipes.scaler.join_read(flags)  # fp16: unscaled, found_inf and the scale join the read (else: nothing)
        grads = self.grads.run()
        flags.put_many(
            (
                ("loss", pending.loss),  # the sum over micro-batches; the mean is taken on the host
                ("grad_norms", grads.norm_list if grads is not None else None),
                ("input", pending.input_values),
                ("target", pending.target_values),
                ("forward", self.monitor.records if self.monitor.enabled else None),
                ("weights", pending.weights),
            )
        )
        return flags.read()  # host sync: the one per step (flags, loss and norms together)

    def scan(self, batch: Any, pending: Optional[Pending] = None) -> Any:
        """Zero-fill (or replace) non-finite values on the device; keep the flags in ``pending``
        (``None``: a quiet scan for a replay, nothing kept)."""
        s = self.sanitize
        p = pending if pending is not None else Pending()
        # A plain (inputs, targets) tuple or list, the common case, is taken apart without split_batch.
        parts = None if type(batch) in _PLAIN_PAIRS and len(batch) == 2 else split_batch(batch)
        if parts is None or parts.style == "pair":
            inputs, targets = batch if parts is None else (parts.inputs, parts.targets)
            new_inputs, new_targets = inputs, targets
            if s.inputs != "off":
                scan = detect.scan_batch(inputs, replace=self._replace_inputs, clean=self.clean)
                new_inputs = scan.batch
                p.input_values += scan.values
            if s.targets != "off" and (
                type(targets) is not Tensor or targets.dtype.is_floating_point or targets.dtype.is_complex
            ):
                # (class indices, the usual targets, hold no NaN/Inf: nothing to scan; complex ones are)
                scan = detect.scan_batch(targets, replace=self._replace_targets, clean=self.clean)
                new_targets = scan.batch
                p.target_values += scan.values
            if new_inputs is inputs and new_targets is targets and type(batch) is tuple:
                return batch  # nothing replaced (a model without buffers): the user's (immutable) batch
            return type(batch)((new_inputs, new_targets)) if parts is None else parts.join(new_inputs, new_targets)
        if s.inputs == "off" and s.targets == "off":
            return batch
        scan = detect.scan_batch(
            batch,
            replace=self._replace_inputs,
            target_keys=TARGET_KEYS,
            clean=self.clean,
            target_replace=self._replace_targets,
        )
        if s.inputs != "off":
            p.input_values += scan.values
        if s.targets != "off":
            p.target_values += scan.target_values
        return scan.batch

    def eager_loss(self, batch: Any) -> Tensor:
        """The loss of one micro-batch, run eagerly (a replay or re-run, under hooks or a dispatch
        mode that a torch.compile'd model must not trace: the run stays compiled after it). A torch
        without compile stances (before 2.6) runs the module inside a compile wrapper instead."""
        model = self.model if can_force_eager() else self.named
        return run_eagerly(lambda: compute_loss(model, batch, self.loss_fn, self.step_fn))

    def confirm(self, micro: Sequence[Any]) -> None:
        """Run the step's forwards again, exactly and quietly (RNG forked, no DDP sync): the
        monitor's exact re-run that confirms an activation flag."""
        device = self.plumbing.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), distributed.local(self.named):
            for batch in micro:
                with self.plumbing.autocast():
                    self.eager_loss(self.scan(batch))
