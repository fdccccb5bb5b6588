"""The private parts of torch that safetrain reads or calls, each behind one small function.

Nothing else in safetrain touches these names; when a torch release moves one, this module and
its contract tests (``tests/unit/adapters/test_adapters.py``) are the one place to change. Each entry
says what it is, since when torch has it (checked against the torch source), and what breaks in
safetrain if it goes.

``GradScaler._per_optimizer_states[id(optimizer)]`` (``torch.amp.grad_scaler``: in ``torch.cuda.amp``
since 1.6, in ``torch.amp`` since 2.3; checked in 2.13)
    A ``defaultdict`` of per-optimizer dicts; safetrain uses two keys:

    * ``"stage"``: an :class:`~torch.amp.grad_scaler.OptState` (``READY``, ``UNSCALED``,
      ``STEPPED``); ``unscale_`` raises when it is ``UNSCALED``. Read by :func:`unscaled` so the
      guard unscales once per step even when a framework unscaled first (Lightning's and the
      Trainer's clipping); reset by :func:`rewind_unscale`. If it goes: a second ``unscale_``
      raises inside a framework's step (fp16 with clipping), or a re-run's gradients stay scaled.
    * ``"found_inf_per_device"``: ``{device: tensor}`` that ``unscale_`` fills (1.0 where a
      gradient was non-finite). Summed on the device by :func:`found_inf`, so the overflow flag
      joins the step's one host read. If it goes: the scaler's overflow is no longer seen in the
      read (every fp16 overflow would be judged a gradient anomaly).

``GradScaler._scale`` (since 1.6; checked in 2.13)
    The loss scale as a one-element float32 device tensor (``None`` before the first
    ``scale()``). Read by :func:`scale_tensor` instead of ``get_scale()``, which is a host sync.
    If it goes: the scale no longer joins the step's read, and a framework's scaled loss cannot be
    divided back on the device (Lightning's ``on_before_backward``).

``torch.autograd._profiler_enabled`` (a C binding re-exported in ``torch.autograd``; checked in 2.13)
    Whether a profiler is recording. :func:`profiler_enabled` lets the guard free gradients with
    torch's own ``set_to_none`` loop without the profiler range ``Optimizer.zero_grad`` opens; if
    it goes, :func:`profiler_enabled` answers ``True`` (the range is never lost, the step costs a
    dispatcher call more).

``torch.autograd.Variable._execution_engine.queue_callback`` (1.x on; checked in 2.13)
    Runs a function once the current backward has finished (the engine's "final callbacks", what
    DDP's reducer uses). :func:`at_backward_end` is how the Hugging Face callback decides a step at
    the end of the last micro-batch's backward, before the Trainer clips. If it goes: the decision
    falls back to ``on_pre_optimizer_step``, after the Trainer's clip has already turned a
    non-finite norm into NaN gradients everywhere. A final callback may queue another, which runs
    after every callback queued so far: :func:`after_backward_end` uses that to run after DDP's
    reducer has written the all-reduced gradients (it queues its own callback late in the backward).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch.amp.grad_scaler import OptState

__all__ = [
    "OptState",
    "unscaled",
    "rewind_unscale",
    "found_inf",
    "scale_tensor",
    "profiler_enabled",
    "at_backward_end",
    "after_backward_end",
]

_profiler: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)


def _state(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Dict[str, object]:
    return scaler._per_optimizer_states[id(optimizer)]


def unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s gradients were unscaled since the scaler's last ``update()``
    (``scaler.unscale_(optimizer)`` would raise)."""
    return _state(scaler, optimizer)["stage"] is OptState.UNSCALED


def rewind_unscale(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Put ``optimizer``'s stage back to before its ``unscale_`` and forget its overflow flags: the
    next ``unscale_`` runs (on a re-run's gradients) and ``scaler.step`` reads the new flags.

    The scale and the growth tracker are left alone. After ``update()`` the state is already so.
    """
    state = _state(scaler, optimizer)
    state["stage"], state["found_inf_per_device"] = OptState.READY, {}


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
    """The overflow flags of ``optimizer``'s last ``unscale_`` summed over devices, as a device
    tensor (> 0: a gradient was non-finite), or ``None`` when it was not unscaled. No host sync."""
    per_device = _state(scaler, optimizer)["found_inf_per_device"]
    if not per_device:
        return None
    flags = list(per_device.values())  # type: ignore[union-attr]
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()


def scale_tensor(scaler: torch.amp.GradScaler) -> Optional[torch.Tensor]:
    """The loss scale as the scaler's own device tensor (``None`` before its first ``scale()``).
    No host sync, unlike ``get_scale()``; the tensor changes in place at ``update()``."""
    return scaler._scale


#: Whether a torch profiler is recording (``True`` if torch ever stops saying): the private
#: function itself, called once a step (no wrapper call on the healthy path).
profiler_enabled: Callable[[], bool] = _profiler


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward now running has finished, on the thread that called
    ``backward`` (with grad mode off: enable it inside for a forward of its own).

    Raises:
        RuntimeError: called outside a backward (torch: "Final callbacks can only be installed
            during backward pass"); call it from a tensor or module backward hook.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def after_backward_end(callback: Callable[[], None]) -> None:
    """Like :func:`at_backward_end`, but after every other final callback of this backward: the
    callback queued now queues ``callback`` when it runs, so ``callback`` runs after those queued
    later in the backward (DDP's reducer finalizes the all-reduced gradients in one; FSDP2's
    root post-backward in another). Call it from a tensor or module backward hook."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(lambda: queue(callback))
