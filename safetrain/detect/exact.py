"""Exact forward hooks for one slow re-run: every monitored output is checked on the host.

The hot hooks of :class:`~safetrain.detect.activations.ActivationMonitor` fold each output into a
sum that rides in the step's one read; when that read trips, the monitor re-runs the forward under
:func:`exact_hooks` to confirm the fault and describe the module's input and output. Each hook
here syncs the host once per call: slow path only, never on a healthy step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .findings import ModuleFinding, tensor_stats
from .hooks import floating_tensors

__all__ = ["ExactTrace", "exact_hooks"]


@dataclass
class ExactTrace:
    """What the exact hooks saw in one re-run (:meth:`ActivationMonitor.inspect`).

    Attributes:
        finding: the first module call whose output holds NaN (or Inf, outside ``nan_only``),
            with full tensor statistics and ``confirmed=True``; ``None`` when every output was finite.
        calls: ``(module name, call index, finite)`` for every monitored call, in call order.
    """

    finding: Optional[ModuleFinding] = None
    calls: List[Tuple[str, int, bool]] = field(default_factory=list)


@contextlib.contextmanager
def exact_hooks(modules: Sequence[Tuple[str, nn.Module, bool]]) -> Iterator[ExactTrace]:
    """Register exact, host-syncing forward hooks on ``modules`` for the duration of the block.

    Args:
        modules: ``(name, module, nan_only)`` for each module to check, as the monitor holds them;
            under ``nan_only`` only NaN counts (legitimate ``-inf`` in attention masks).

    Returns:
        A context manager yielding an :class:`ExactTrace`, filled in as the forward runs; the hooks
        are removed on exit.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> with exact_hooks([("0", model[0], False), ("1", model[1], False)]) as seen:
        ...     _ = model(torch.randn(2, 4))
        >>> seen.finding is None, [finite for _, _, finite in seen.calls]
        (True, [True, True])
    """
    seen = ExactTrace()
    counts: dict = {}

    def make(i: int, name: str, nan_only: bool) -> Any:
        def detail_hook(module: nn.Module, args: Any, out: Any) -> None:
            outs = floating_tensors(out)
            if not outs:
                return
            call = counts[i] = counts.get(i, -1) + 1
            bad_t = None
            for t in outs:
                d = t.detach()
                bad = torch.isnan(d).any() if nan_only else ~torch.isfinite(d).all()
                if bool(bad):  # host sync: inspect (slow path) only
                    bad_t = d
                    break
            seen.calls.append((name, call, bad_t is None))
            if bad_t is not None and seen.finding is None:
                ins = floating_tensors(args)
                seen.finding = ModuleFinding(
                    kind="forward",
                    module=name,
                    module_type=type(module).__name__,
                    call_index=call,
                    position=len(seen.calls) - 1,
                    value=math.nan,
                    confirmed=True,
                    output=tensor_stats(bad_t),
                    input=tensor_stats(ins[0]) if ins else None,
                )

        return detail_hook

    handles = [
        module.register_forward_hook(make(i, name, nan_only)) for i, (name, module, nan_only) in enumerate(modules)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
