"""The fp16 loss scaler as one object with or without a GradScaler: :class:`FP16Scaler` wraps a
``torch.amp.GradScaler`` for one optimizer, :class:`NoScaler` has the same methods and does
nothing, at no cost (no tensor op, no allocation), so the guard never branches on ``scaler is
None`` (as :class:`~safetrain.distributed.LocalSync` does for one process).

The GradScaler's private state (its per-optimizer stage and overflow flags, its scale tensor) is
read through :mod:`safetrain.adapters.torch_private` only.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..optimizers import members
from . import torch_private

__all__ = ["FP16Scaler", "NoScaler", "Scaler", "make_scaler"]

_NOTHING: Tuple[None, None] = (None, None)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class NoScaler:
    """No loss scaling (full precision or bfloat16): every method returns its input or nothing.

    The same methods as :class:`FP16Scaler`; the healthy path calls them every step, so none makes
    a tensor op.

    Example::

        >>> scaler = NoScaler()
        >>> loss = torch.tensor(2.0)
        >>> scaler.scale(loss) is loss, scaler.values(), scaler.enabled
        (True, (None, None), False)
    """

    #: Whether a GradScaler scales the loss.
    enabled = False
    #: The wrapped ``torch.amp.GradScaler`` (what a snapshot saves): none.
    scaler: Optional[torch.amp.GradScaler] = None
    #: The loss scale as a device tensor: none (a framework's loss is as computed).
    loss_scale: Optional[torch.Tensor] = None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: ``loss`` itself."""
        return loss

    def unscale_(self) -> None:
        """Nothing to unscale."""

    def values(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(None, None)``: no overflow flag and no scale join the step's read."""
        return _NOTHING

    def backoff_factor(self) -> float:
        """1.0: no scale to lower."""
        return 1.0

    @property
    def unscaled(self) -> bool:
        """Never: no gradient is scaled."""
        return False

    def join_read(self, flags: Any) -> None:
        """Nothing joins the step's read."""

    def update_if_read(self) -> None:
        """Nothing to update."""

    def update(self) -> None:
        """Nothing to update."""

    def reset_for_rerun(self) -> None:
        """Nothing to reset."""

    def state_dict(self) -> Dict[str, Any]:
        """``{}``."""
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Accept an empty state.

        Raises:
            ValueError: a GradScaler's state (a snapshot of an fp16 run) given to a run without one.
        """
        if state_dict:
            raise ValueError(
                f"a GradScaler's state (keys {sorted(state_dict)}) given to a run without loss scaling; "
                "expected {} (set amp.dtype: float16 or pass the GradScaler to resume an fp16 run)"
            )

    def __repr__(self) -> str:
        return "NoScaler()"


class FP16Scaler:
    """A ``torch.amp.GradScaler`` driven for one optimizer, read without a host sync.

    The guard scales the loss, unscales once per step (a framework may have unscaled first, for
    its clipping), reads the overflow flag and the scale with the step's one host read, and steps
    the optimizer itself on a step it judged healthy (then :meth:`update`): ``scaler.step``'s own
    ``.item()`` is never needed.

    Args:
        scaler: an enabled ``torch.amp.GradScaler`` (the user's, a framework's, or one made by
            :func:`make_scaler`).
        optimizer: the torch optimizer the scaler's per-optimizer state is keyed by (the one
            inside a framework's wrapper), or several as one (:class:`~safetrain.optimizers.Optimizers`:
            each is unscaled, their overflow flags summed on the device).

    Raises:
        TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
        ValueError: ``scaler`` is disabled (use :class:`NoScaler`, or :func:`make_scaler`).

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = FP16Scaler(torch.amp.GradScaler("cpu", init_scale=1024.0), opt)
        >>> scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        >>> scaler.unscale_(); scaler.unscale_()  # the second does nothing
        >>> found_inf, scale = scaler.values()
        >>> float(found_inf), float(scale)
        (0.0, 1024.0)
    """

    enabled = True

    def __init__(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
        if not scaler.is_enabled():
            raise ValueError("scaler: this GradScaler is disabled; expected an enabled one (or NoScaler)")
        self.scaler, self.optimizer = scaler, optimizer
        # One scaler, several optimizers (Muon + AdamW): each is unscaled and read (its own stage and flags).
        self._members = [opt for _, opt in members(optimizer)]

    @property
    def loss_scale(self) -> Optional[torch.Tensor]:
        """The loss scale as the scaler's device tensor (``None`` before its first ``scale()``):
        divide a framework's scaled loss by it on the device, without a host sync."""
        return torch_private.scale_tensor(self.scaler)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale, to call ``backward`` on."""
        return self.scaler.scale(loss)

    def unscale_(self) -> None:
        """Unscale the optimizer's gradients in place, once per step: nothing when they were
        unscaled since the last :meth:`update` (by the guard or by a framework's clipping)."""
        for opt in self._members:
            if not torch_private.unscaled(self.scaler, opt):
                self.scaler.unscale_(opt)

    def values(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(found_inf, scale)`` as device tensors for the step's one read: the overflow flags of
        the last :meth:`unscale_` summed over devices (``None`` before it), and the scale."""
        scale = torch_private.scale_tensor(self.scaler)
        if len(self._members) == 1:
            return torch_private.found_inf(self.scaler, self.optimizer), scale
        flags = [f for opt in self._members if (f := torch_private.found_inf(self.scaler, opt)) is not None]
        return (torch.stack(flags).sum() if flags else None), scale  # (device-side: no sync)

    def backoff_factor(self) -> float:
        """The factor the scale is multiplied by after an overflow."""
        return self.scaler.get_backoff_factor()

    @property
    def unscaled(self) -> bool:
        """Whether the optimizer's gradients were unscaled since the last :meth:`update` (a step
        was read): an :meth:`update` is due after its optimizer step, taken or not."""
        return all(torch_private.unscaled(self.scaler, opt) for opt in self._members)

    def join_read(self, flags: Any) -> None:
        """Unscale (once) and put ``found_inf`` and ``scale`` into the step's read (``flags``:
        a :class:`~safetrain.detect.StepFlags`), as device tensors."""
        self.unscale_()
        found_inf, scale = self.values()
        flags.put("found_inf", found_inf)
        flags.put("scale", scale)

    def update_if_read(self) -> None:
        """:meth:`update` after a step whose gradients were unscaled (read): an overflow lowers the
        scale, a run of good steps raises it; nothing after a step that read nothing (its data skipped)."""
        if self.unscaled:
            self.scaler.update()

    def update(self) -> None:
        """The scaler's ``update()``: back off after an overflow, grow after enough clean steps;
        every optimizer's stage goes back to ``READY``."""
        self.scaler.update()

    def reset_for_rerun(self) -> None:
        """The step runs again: the optimizer's stage goes back to before its unscale and its
        overflow flags are forgotten, so the re-run's gradients (scaled like the first run's) are
        unscaled by the next :meth:`unscale_`, and a framework's ``scaler.step`` reads the
        re-run's flags. The scale is kept. A no-op right after :meth:`update`."""
        for opt in self._members:
            torch_private.rewind_unscale(self.scaler, opt)

    def state_dict(self) -> Dict[str, Any]:
        """The GradScaler's ``state_dict()`` (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The GradScaler's ``load_state_dict``."""
        self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"FP16Scaler({type(self.scaler).__name__}, optimizer={type(self.optimizer).__name__})"


#: What the guard holds: one of the two, never ``None``.
Scaler = Union[FP16Scaler, NoScaler]


def make_scaler(
    scaler: Optional[torch.amp.GradScaler],
    optimizer: torch.optim.Optimizer,
    amp_dtype: Union[torch.dtype, str, None],
    device: Union[torch.device, str],
    init_scale: float = 2.0**16,
) -> Scaler:
    """The guard's scaler: an :class:`FP16Scaler` around the given GradScaler, or around a new one
    for float16 autocast when none is given (on ``device``'s type, starting at ``init_scale``);
    :class:`NoScaler` otherwise, and for a disabled GradScaler (the caller turned scaling off:
    none is made in its place).

    Args:
        scaler: the user's (or framework's) ``torch.amp.GradScaler``, or ``None``.
        optimizer: the torch optimizer the scaler serves.
        amp_dtype: the autocast dtype: ``torch.float16``/``"float16"``, ``torch.bfloat16``/
            ``"bfloat16"``, or ``None`` (full precision).
        device: the model's device (its type picks the GradScaler's device).
        init_scale: ``amp.init_scale``, for a GradScaler made here.

    Raises:
        TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
        ValueError: ``amp_dtype`` is none of the above.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        >>> make_scaler(None, opt, None, "cpu")
        NoScaler()
        >>> make_scaler(None, opt, "float16", "cpu").scaler.get_scale()
        65536.0
    """
    dtype = _DTYPES.get(amp_dtype, amp_dtype) if isinstance(amp_dtype, str) else amp_dtype
    if dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"amp_dtype: expected None, float16 or bfloat16, got {amp_dtype!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler: expected a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    if scaler is None and dtype is torch.float16:
        scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale)
    if scaler is not None and scaler.is_enabled():
        return FP16Scaler(scaler, optimizer)
    return NoScaler()
