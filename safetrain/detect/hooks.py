"""The hot forward hook and its handle: what runs for every module call in eager mode.

Per call the hook does two list appends and one reduction (``out.detach().sum()``; fp16 is
summed in float32), binding everything it needs as closure cells at attach time: on small models
the per-hook Python cost, not the arithmetic, is the overhead. Tuple, list, dict and named-tuple
outputs are reduced tensor by tensor and added; non-floating outputs record nothing.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, List, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookHandle", "floating_tensors", "make_hook", "MAX_RECORDS", "PASSTHROUGH"]

logger = logging.getLogger(__name__)

#: A forward that records more calls than this without a ``reset()`` drops its records (and
#: warns), so a monitor left attached through a long evaluation cannot grow without bound.
MAX_RECORDS = 1_000_000

#: Module classes (exact types, not subclasses) whose output is finite whenever their input is:
#: parameter-free elementwise activations that are bounded or at most linear, dropout, pooling
#: and reshapes (``PReLU`` is not here: a NaN slope makes NaN from finite inputs).
#: A NaN/Inf in their output was already in their input, so such a module is never the origin
#: of a real fault; ``ActivationMonitor(skip_passthrough=True)`` leaves them unhooked. Edge cases
#: accepted: dropout and average pooling can overflow only for values within a factor
#: ``1/(1-p)`` or the window size of the float maximum.
PASSTHROUGH = (
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.RReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Softsign,
    nn.Tanhshrink,
    nn.Softshrink,
    nn.Hardshrink,
    nn.LogSigmoid,
    nn.Softplus,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)


class HookHandle:
    """One handle for a group of hooks: ``remove()`` removes them all, idempotently.

    Also a context manager (``with monitor.attach(): ...`` removes the hooks on exit, exception
    included). Each hook is held by its own :class:`torch.utils.hooks.RemovableHandle`.

    Args:
        handles: the hooks' handles.
        on_remove: called once, after the hooks are gone.
    """

    def __init__(self, handles: Sequence[RemovableHandle] = (), on_remove: Any = None) -> None:
        self._handles: List[RemovableHandle] = list(handles)
        self._on_remove = on_remove

    @property
    def active(self) -> bool:
        """``True`` until :meth:`remove` has run."""
        return bool(self._handles) or self._on_remove is not None

    def remove(self) -> None:
        """Remove every hook; calling it again does nothing."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        callback, self._on_remove = self._on_remove, None
        if callback is not None:
            callback()

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def floating_tensors(obj: Any) -> List[Tensor]:
    """The floating tensors inside an output: a tensor, tuple, list, named tuple or dict of them.

    Args:
        obj: a module's output (or inputs).

    Returns:
        The floating tensors, depth first; non-floating tensors and other objects are skipped.
    """
    if isinstance(obj, Tensor):
        return [obj] if obj.dtype.is_floating_point else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in floating_tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in floating_tensors(o)]
    return []


_F16 = torch.float16
_F32 = torch.float32


def _reduce(t: Tensor, nan_only: bool) -> Tensor:
    d = t.detach()
    if nan_only:
        if d.numel() == 0:
            return d.sum(dtype=_F32)
        return torch.clamp(d.amax().float(), -1.0, 1.0)
    return d.sum(dtype=_F32) if d.dtype is _F16 else d.sum()


def _reduce_nested(out: Any, nan_only: bool) -> Optional[Tensor]:
    value = None
    for t in floating_tensors(out):
        r = _reduce(t, nan_only)
        value = r if value is None else value + r
    return value


def _too_many(ids: List[int], vals: List[Tensor]) -> None:
    logger.warning(
        "ActivationMonitor: %d records without reset(); dropping them (call reset() once per step)", len(ids)
    )
    ids.clear()
    vals.clear()


def make_hook(
    index: int,
    ids: List[int],
    vals: List[Tensor],
    nan_only: bool,
    guard_growth: bool,
    last: Optional[List[Any]] = None,
) -> Any:
    """Build one module's hot hook with everything it needs bound as closure cells.

    Args:
        index: the module's index in the monitor, appended to ``ids`` per call.
        ids: the monitor's per-step list of module indices.
        vals: the monitor's per-step list of 0-dim values, aligned with ``ids``.
        nan_only: record ``clamp(amax, -1, 1)``: NaN trips, infinities do not.
        guard_growth: also cap the lists at :data:`MAX_RECORDS` (given to the outermost monitored
            module's hook, which runs at least once per forward).
        last: a one-item list shared by the monitor's hooks, holding ``(weakref, version)`` of the
            tensor reduced last. When given, an output tensor that is that very tensor or a view of
            all of it, unchanged since (same ``_version``), is not reduced again: a container returning
            its last child's output (a model's logits, once in ``lm_head`` and again in the
            model's output) costs no second pass. No reference is kept (a weak one only).

    Returns:
        A forward hook ``(module, args, output) -> None``.
    """
    ids_append, vals_append = ids.append, vals.append
    tensor_cls = Tensor
    if last is not None:
        return _deduping_hook(index, ids, vals, nan_only, guard_growth, last)
    if nan_only or guard_growth:

        def careful_hook(module: nn.Module, args: Any, out: Any) -> None:
            if not nan_only and out.__class__ is tensor_cls:
                value = None
                if out.dtype.is_floating_point:  # (what _reduce takes, without the call)
                    d = out.detach()
                    value = d.sum(dtype=_F32) if d.dtype is _F16 else d.sum()
            else:
                value = _reduce_nested(out, nan_only)
            if value is not None:
                vals_append(value)
                ids_append(index)
            if guard_growth and len(ids) > MAX_RECORDS:
                _too_many(ids, vals)

        return careful_hook

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if out.__class__ is tensor_cls:
            if out.dtype.is_floating_point:  # (an attribute: no call per hooked module)
                d = out.detach()
                vals_append(d.sum(dtype=_F32) if d.dtype is _F16 else d.sum())
                ids_append(index)
        else:
            value = _reduce_nested(out, False)
            if value is not None:
                vals_append(value)
                ids_append(index)

    return hook


def _deduping_hook(
    index: int, ids: List[int], vals: List[Tensor], nan_only: bool, guard_growth: bool, last: List[Any]
) -> Any:
    """:func:`make_hook`'s hook when ``last`` is given (``detect.granularity: block``)."""
    ids_append, vals_append = ids.append, vals.append
    tensor_cls, ref = Tensor, weakref.ref
    traced = make_hook(index, ids, vals, nan_only, guard_growth)
    compiling = torch.compiler.is_compiling

    def dedup_hook(module: nn.Module, args: Any, out: Any) -> None:
        if compiling():  # traced into a graph (a compiled model): no weak references there
            return traced(module, args, out)
        prev = last[0]
        seen = prev[0]() if prev is not None else None
        value = None
        for t in (out,) if out.__class__ is tensor_cls else floating_tensors(out):
            if not t.dtype.is_floating_point:
                continue
            # that tensor, or a view of all of it (GPT-2 returns ln_f's output reshaped), unchanged
            if seen is not None and (t is seen or (t._base is seen and t.numel() == seen.numel())):
                if t._version == prev[1]:
                    continue
            r = _reduce(t, nan_only)
            value = r if value is None else value + r
            last[0] = (ref(t), t._version)
        if value is not None:
            vals_append(value)
            ids_append(index)
        if guard_growth and len(ids) > MAX_RECORDS:
            _too_many(ids, vals)

    return dedup_hook
