"""The guard's torch plumbing: device moves, autocast, freeing gradients and the fp16 scaler.

Everything here runs on the healthy path, so each piece is the cheapest form of what it does:
no context entered without mixed precision, torch's own ``set_to_none`` loop without the
profiler range ``Optimizer.zero_grad`` opens, the scaler's values read as device tensors.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch.nn.parameter import is_lazy

from ..adapters import Scaler, make_scaler
from ..adapters.torch_private import profiler_enabled
from ..config import AmpConfig
from ..optimizers import members
from ..snapshot.accepted import matches, pattern_tensor
from ..snapshot.tensors import put_buffer_
from .batches import pageable_tensors, to_device

__all__ = ["Plumbing", "Buffers", "put_buffer_"]

logger = logging.getLogger(__name__)

#: What :meth:`Plumbing.autocast` returns without mixed precision: one reusable no-op context.
_NO_AUTOCAST = contextlib.nullcontext()
_DTYPES = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Plumbing:
    """Device placement, mixed precision and gradient bookkeeping for one model and optimizer.

    Args:
        model: the user's model (its first parameter's device is the step's device).
        optimizer: its optimizer.
        amp: the ``amp`` section: autocast dtype, and the GradScaler made for float16.
        scaler: the user's ``GradScaler``, if any (a disabled one counts as none).
        to_device: copy a CPU loader's batches to the model's accelerator (``guard.to_device``).

    The scaler's ``update`` belongs to whoever steps the optimizer (``Guard.step``, or a
    framework's loop); the guard unscales (once, unless the framework did) and reads it, and a
    re-run's backward is scaled and unscaled as the first run's was (:meth:`before_rerun`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: AmpConfig,
        scaler: Optional[torch.amp.GradScaler] = None,
        to_device: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.amp_dtype = _DTYPES[amp.dtype]
        # FP16Scaler around the user's (or a new float16) GradScaler, else NoScaler: never None.
        self.scaler: Scaler = make_scaler(scaler, optimizer, self.amp_dtype, self.device, amp.init_scale)
        self.moves = to_device and self.device.type != "cpu"  # a CPU model gets the batch itself
        self._pinned_checked = False
        # torch's own zero_grad (not overridden by the optimizer's class or instance): free_grads
        # may run its set_to_none loop itself. Decided here: a zero_grad patched in later is not
        # seen; a wrapper forwarding through __getattr__ always goes through optimizer.zero_grad.
        self._plain_zero_grad = all(_plain_zero_grad(opt) for _, opt in members(optimizer))  # (each of several)
        self.grads_dropped = False  # set_to_none done at the end of the last step (written here only)
        # Two parameters looked at per step for gradients left by someone else (O(1), not O(P)).
        params = [p for p in model.parameters() if p.requires_grad]
        self._probe = (params[0], params[-1]) if params else ()

    # ------------------------------------------------------------------ batches
    def move(self, batch: Any) -> Any:
        """The batch on the model's accelerator (``non_blocking`` on CUDA), or the batch itself."""
        if not self.moves:
            return batch
        if not self._pinned_checked:
            self._check_pinned(batch)
        return to_device(batch, self.device)

    def _check_pinned(self, batch: Any) -> None:
        """Say once when the first moved batch comes from pageable memory (its copies are staged
        by the host instead of queued); ``DataLoader(pin_memory=True)`` avoids it."""
        self._pinned_checked = True
        pageable = pageable_tensors(batch) if self.device.type == "cuda" else ()
        if pageable:
            logger.info(
                "batches come from pageable host memory (%s): each copy to %s is staged by the host; "
                "DataLoader(pin_memory=True) makes it asynchronous",
                ", ".join(pageable[:3]),
                self.device,
            )

    def autocast(self) -> ContextManager[Any]:
        """The step's autocast context (a shared no-op without mixed precision)."""
        if self.amp_dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # ------------------------------------------------------------------ the scaler
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (scaled in fp16)."""
        return self.scaler.scale(loss)

    def unscale_(self) -> None:
        """Unscale the gradients in place before they are checked and clipped (fp16 only; once per
        step: a framework may have unscaled them already, for its own clipping)."""
        self.scaler.unscale_()

    def before_rerun(self) -> None:
        """A step runs again: the scaler's state for the optimizer goes back to before its unscale,
        so that the re-run's gradients (scaled like the first run's: small ones do not underflow in
        half precision) are unscaled by the next read, and a framework's ``scaler.step`` reads the
        re-run's overflow flags, not the first run's."""
        self.scaler.reset_for_rerun()

    def scaler_values(self) -> tuple:
        """``(found_inf, scale)`` as device tensors for the step's one read, or ``(None, None)``:
        read inside the one sync, without the ``.item()`` of ``scaler.step()`` and ``get_scale()``."""
        return self.scaler.values()

    def backoff_factor(self) -> float:
        """How the scaler lowers its scale after an overflow."""
        return self.scaler.backoff_factor()

    def unscaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss as it went to the backward, multiplied by the fp16 loss scale, divided back (on the device)."""
        scale = self.scaler.loss_scale
        return loss / scale if scale is not None else loss

    # ------------------------------------------------------------------ gradients
    def free_grads(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``; for torch's own ``zero_grad`` and no profiler,
        the same loop without the profiler range it opens (a dispatcher call a step)."""
        if self._plain_zero_grad and not profiler_enabled():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def drop_grads(self) -> None:
        """Drop the step's gradients (the scaler's update follows the step, as after any other);
        the next step need not free them again."""
        self.free_grads()
        self.grads_dropped = True

    def begin_step(self) -> None:
        """A step begins: its backward must not add to gradients left from before it. They are
        freed unless the last step dropped them and none were made since (the first step, or a
        user's own backward between two steps: two parameters are looked at, O(1), not O(P))."""
        probe = self._probe
        if not self.grads_dropped or (probe and (probe[0].grad is not None or probe[1].grad is not None)):
            self.free_grads()
        self.grads_dropped = False


class Buffers:
    """The model's buffers as they were before a step's first forward, to put back when the step
    is not applied or runs again.

    A forward in train mode updates state before the step is judged: BatchNorm's running
    statistics and its ``num_batches_tracked``. A skipped step must not leave them behind (NaN
    running statistics make every eval output and every later snapshot non-finite), and a re-run
    (``drop_rows``, ``retry``) must count the step once. Kept: every floating buffer and every
    one-element buffer (a counter), copied into storage allocated once, with one
    ``_foreach_copy_`` per step and no host sync; a model without such buffers costs nothing.

    Args:
        model: the module whose buffers are kept (the plain one inside a compile wrapper).
        namer: the user's name for a buffer's name (no ``_orig_mod.``).
    """

    def __init__(self, model: torch.nn.Module, namer: Callable[[str], str] = str) -> None:
        self._model, self._namer = model, namer
        self._live: List[torch.Tensor] = []
        self._collect()

    def _collect(self) -> None:
        # A buffer kept once stays kept: a fake-quantize zero_point is one int32 before the first
        # forward and one per channel after it (a step not applied must still put it back).
        before = {id(b) for b in self._live}
        named = [(n, b) for n, b in self._model.named_buffers() if not is_lazy(b) and (id(b) in before or _kept(b))]
        self.names = tuple(self._namer(n) for n, _ in named)
        self._live = [b for _, b in named]
        self._saved = [b.detach().clone() for b in self._live]
        self.enabled = bool(self._live)

    def keep(self) -> None:
        """Copy the buffers aside (before the step's first forward; device-side, no host sync)."""
        if not self.enabled:
            return
        try:
            torch._foreach_copy_(self._saved, self._live)
        except RuntimeError:  # a buffer was replaced or changed shape since: collect them again
            self._collect()
            torch._foreach_copy_(self._saved, self._live)

    def recollect(self) -> None:
        """Take the buffers as they are now (a lazy module made its own at the first forward)."""
        self._collect()

    def put_back(self) -> Tuple[str, ...]:
        """Put the kept buffers back, with the shape and dtype they had (a quantization observer's
        per-channel statistics take their shape at the first forward); returns the names of those
        the step had changed (slow path: one host read per buffer)."""
        if not self.enabled:
            return ()
        changed = []
        with torch.no_grad():
            for name, live, saved in zip(self.names, self._live, self._saved):
                if live.shape != saved.shape or live.dtype != saved.dtype or not _same(live, saved):  # host sync
                    put_buffer_(live, saved)
                    changed.append(name)
        if changed:
            logger.info("put back %d buffer(s) the step had changed: %s", len(changed), ", ".join(changed[:6]))
        return tuple(changed)

    def patterned(self, state: Any, kept: bool = False) -> List[Tuple[str, torch.Tensor, Callable[..., Any]]]:
        """The buffers accepted as non-finite by design (``state.accepted``, read at each check so a
        resume's patterns count), each with a check that is NaN when its non-finite pattern changed
        (:mod:`safetrain.snapshot.accepted`); ``kept``: the copies kept before the step."""
        tensors = self._saved if kept else self._live
        on_device: Dict[str, Tuple[Any, torch.Tensor]] = {}  # key -> (pattern, its device copy): no copy per check

        def check(t: torch.Tensor, key: str) -> torch.Tensor:
            want = state.accepted.get(key)
            if want is None:
                return torch.zeros((), device=t.device)
            if key not in on_device or on_device[key][0] != want:
                on_device[key] = (want, pattern_tensor(want, t.device))
            return matches(t, on_device[key][1])

        keys = [(n, t, f"model/{n}") for n, t in zip(self.names, tensors)]
        return [(n, t, functools.partial(check, key=k)) for n, t, k in keys if k in state.accepted]

    def checked(self, kept: bool = False) -> List[Tuple[str, torch.Tensor]]:
        """The floating buffers finite now, by name, for the weight checks (a buffer that holds
        NaN/Inf by design, a ``-inf`` mask, is left out). One host read, at start.

        Args:
            kept: the copies kept before the step instead of the live buffers: what the exact
                check after a trip looks at, since the tripped forward itself has already
                changed the live ones (a NaN activation makes BatchNorm's statistics NaN).
        """
        tensors = self._saved if kept else self._live
        named = [(n, b) for n, b in zip(self.names, tensors) if b.is_floating_point() and b.numel()]
        if not named:
            return []
        with torch.no_grad():
            finite = torch.stack([torch.isfinite(b).all() for _, b in named]).tolist()  # host sync: once
        return [nb for nb, ok in zip(named, finite) if ok]


def _plain_zero_grad(optimizer: Any) -> bool:
    """Whether ``optimizer.zero_grad`` is torch's own (not overridden by its class or instance)."""
    own = getattr(type(optimizer), "zero_grad", None) is torch.optim.Optimizer.zero_grad
    return own and "zero_grad" not in getattr(optimizer, "__dict__", {})


def _kept(b: torch.Tensor) -> bool:
    """Whether a buffer is kept before a step: floating ones and one-element ones (counters)."""
    return b.is_floating_point() or b.numel() == 1


def _same(live: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether a buffer is as it was kept; NaN where it was NaN counts as unchanged (a buffer
    non-finite by design), so only a real change is put back and journaled."""
    if torch.equal(live, saved):
        return True
    return live.is_floating_point() and bool(torch.isclose(live, saved, rtol=0.0, atol=0.0, equal_nan=True).all())
