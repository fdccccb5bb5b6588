"""Helpers for testing a training run: count its host syncs, inject the faults safetrain must catch.

Nothing in safetrain imports this module; it is for tests (safetrain's own and a user's).
:func:`count_host_syncs` patches ``torch.Tensor`` while its block is open: tests only, never in
production. The fault injectors are plain hooks and a dataset wrapper, each a handle with
``remove()`` and a context manager:

* :class:`PoisonRows`: a dataset whose chosen rows hold NaN/Inf in the inputs or the targets;
* :class:`OutputFault`: a module's output turns NaN (or is scaled) at chosen forward calls;
* :class:`GradFault`: a tensor's gradient turns non-finite (or is scaled) at chosen backward calls;
* :class:`WeightFault`: a parameter entry is overwritten right after chosen optimizer steps;
* :class:`LRFault`: the learning rate is multiplied for the update of chosen optimizer steps.

Calls and steps are counted from 1 and include re-runs (a replay's forward is a call too).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator, List, Literal, Optional, Sequence, Tuple, Union

import torch
from torch.utils.data import Dataset

from .guard.measure import measuring

__all__ = [
    "SyncCounter",
    "count_host_syncs",
    "TENSOR_SYNC_METHODS",
    "TORCH_SYNC_FUNCTIONS",
    "PoisonRows",
    "OutputFault",
    "GradFault",
    "WeightFault",
    "LRFault",
]

# ---------------------------------------------------------------------------- host syncs

#: ``torch.Tensor`` methods that bring a value to the host.
TENSOR_SYNC_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "cpu",
    "numpy",
    "__array__",
    "nonzero",
    "masked_select",
    "unique",
    "equal",
    "allclose",
    "is_nonzero",
    "__repr__",
    "__format__",
)
#: ``torch`` functions that bring a value to the host (data-dependent shapes or a bool result).
TORCH_SYNC_FUNCTIONS = ("nonzero", "masked_select", "unique", "equal", "allclose", "is_nonzero")


@dataclass
class SyncCounter:
    """What :func:`count_host_syncs` saw.

    Attributes:
        calls: ``(what, "file:line")`` for each counted sync, in order.
    """

    calls: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def count(self) -> int:
        """The number of host syncs counted."""
        return len(self.calls)

    def reset(self) -> None:
        """Forget the calls counted so far."""
        self.calls.clear()

    def __str__(self) -> str:
        return f"{self.count} host syncs: " + ", ".join(f"{what} at {where}" for what, where in self.calls)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Count the host syncs made inside the block (tests only: it patches ``torch.Tensor``).

    What counts: ``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``,
    ``cpu`` (of a device tensor), ``numpy``, ``__array__``, ``nonzero``, ``masked_select``, ``unique``,
    ``equal``, ``allclose``, ``is_nonzero``, ``__repr__``/``__format__``, the same functions in the
    ``torch`` namespace, and ``torch.cuda.synchronize``. On CUDA each blocks the host until the
    device has caught up; on the CPU they are cheap, so a CPU test counts them instead of timing.
    Only the outermost call counts (``__repr__`` calling ``tolist`` is one sync), and only on the
    thread that opened the context.

    Returns:
        A context manager yielding a :class:`SyncCounter`, updated live.

    Example::

        >>> loss = torch.ones(3).sum()
        >>> with count_host_syncs() as syncs:
        ...     value = loss.item()           # one host sync
        ...     total = loss + 1              # device work: none
        >>> syncs.count
        1
    """
    counter = SyncCounter()
    state = threading.local()
    owner = threading.get_ident()

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner or getattr(state, "depth", 0):
                return fn(*args, **kwargs)
            if name == "Tensor.cpu" and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
                return fn(*args, **kwargs)  # already on the host: no transfer, no sync
            frame = sys._getframe(1)
            counter.calls.append((name, f"{frame.f_code.co_filename}:{frame.f_lineno}"))
            state.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                state.depth = 0

        counted.__name__ = getattr(fn, "__name__", name)
        return counted

    patches: List[Tuple[Any, str, Any, bool]] = []  # (owner, attribute, original, was_own)
    targets = [(torch.Tensor, m, f"Tensor.{m}") for m in TENSOR_SYNC_METHODS]
    targets += [(torch, f, f"torch.{f}") for f in TORCH_SYNC_FUNCTIONS]
    if hasattr(torch, "cuda"):
        targets.append((torch.cuda, "synchronize", "torch.cuda.synchronize"))
    for obj, attr, label in targets:
        original = getattr(obj, attr, None)
        if original is None:
            continue
        patches.append((obj, attr, original, attr in vars(obj)))
        setattr(obj, attr, wrap(label, original))
    try:
        yield counter
    finally:
        for obj, attr, original, was_own in reversed(patches):
            if was_own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


# ---------------------------------------------------------------------------- fault injectors


def _calls(calls: Optional[Iterable[int]]) -> Optional[Collection[int]]:
    """The calls or steps to act on, for membership tests: a ``range`` is kept as it is (``range(k,
    10**9)`` is "from the k-th on", not a set of a billion numbers), anything else becomes a set."""
    if calls is None or isinstance(calls, range):
        return calls
    return set(calls)


def _spoil(t: torch.Tensor, value: float) -> torch.Tensor:
    """``t + nan`` (NaN everywhere) for a NaN ``value``, else ``t * value`` (Inf, or a finite scale)."""
    return t + value if math.isnan(value) else t * value


class _Fault:
    """Shared handle behaviour: ``remove()`` and a context manager that removes on exit."""

    _handles: Sequence[Any] = ()

    def remove(self) -> None:
        """Remove the hooks (idempotent): the fault stops firing."""
        for h in self._handles:
            h.remove()
        self._handles = ()

    def __enter__(self) -> "_Fault":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class PoisonRows(Dataset):
    """A dataset wrapper whose chosen rows hold a non-finite (or outlier) value.

    For ``where="inputs"`` the first entry of the row's input (``x[0]``) is set to ``value``; for
    ``"targets"`` the whole target is. The base dataset must yield ``(input, target)`` pairs of
    tensors; it is not changed (poisoned inputs are copies).

    Args:
        base: the dataset to wrap.
        indices: dataset indices of the rows to poison.
        where: ``"inputs"`` or ``"targets"``.
        value: the value written (NaN, Inf, or a finite outlier for a loss spike).

    Example::

        >>> data = PoisonRows(torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1)), indices=[1])
        >>> data[1][0]
        tensor([nan, 0.])
    """

    def __init__(
        self,
        base: Dataset,
        indices: Iterable[int],
        where: Literal["inputs", "targets"] = "inputs",
        value: float = math.nan,
    ) -> None:
        if where not in ("inputs", "targets"):
            raise ValueError(f"PoisonRows: where={where!r}; expected 'inputs' or 'targets'")
        self.base, self.indices, self.where, self.value = base, set(indices), where, value

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        x, y = self.base[i]
        if i in self.indices:
            if self.where == "inputs":
                x = x.clone()
                x[0] = self.value
            else:
                y = torch.full_like(y, self.value)
        return x, y


class OutputFault(_Fault):
    """A forward hook that spoils a module's output at chosen calls: a layer going NaN at step k.

    At a chosen call the output becomes ``out + nan`` (``value`` NaN: NaN everywhere) or
    ``out * value`` (Inf, or a finite factor for an activation blow-up). The module must return
    one tensor.

    Args:
        module: the module whose output is spoiled.
        calls: 1-based forward calls to spoil (``range(k, 10**9)``: from the k-th on); ``None``: every call.
            Replays count; the start measurement (:meth:`~safetrain.Guard.measure_start`) does not.
        value: NaN, Inf or a factor.

    Attributes:
        count: forward calls seen so far.

    Example::

        >>> layer = torch.nn.Linear(2, 2)
        >>> fault = OutputFault(layer, calls=[2])
        >>> bool(layer(torch.ones(1, 2)).isnan().any()), bool(layer(torch.ones(1, 2)).isnan().all())
        (False, True)
        >>> fault.remove()
    """

    def __init__(self, module: torch.nn.Module, calls: Optional[Iterable[int]] = None, value: float = math.nan):
        self.calls, self.value, self.count = _calls(calls), value, 0
        self._handles = (module.register_forward_hook(self),)

    def __call__(self, module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if measuring():  # the start model's loss measured before a run's first step: no step's forward
            return out
        self.count += 1
        if self.calls is None or self.count in self.calls:
            return _spoil(out, self.value)
        return out


class GradFault(_Fault):
    """A gradient hook that spoils a tensor's gradient at chosen backward calls.

    At a chosen call the gradient becomes ``grad + nan`` (``value`` NaN) or ``grad * value``
    (Inf, or a finite factor: a gradient-norm outlier that stays finite).

    Args:
        tensor: a tensor that requires grad (usually a parameter).
        calls: 1-based calls of the gradient hook to spoil (one per backward through ``tensor``,
            replays included); ``None``: every call.
        value: NaN, Inf or a factor.

    Attributes:
        count: gradient hook calls seen so far.

    Example::

        >>> w = torch.ones(2, requires_grad=True)
        >>> fault = GradFault(w, calls=[1], value=math.inf)
        >>> (w * 2).sum().backward()
        >>> w.grad
        tensor([inf, inf])
    """

    def __init__(self, tensor: torch.Tensor, calls: Optional[Iterable[int]] = None, value: float = math.inf):
        self.calls, self.value, self.count = _calls(calls), value, 0
        self._handles = (tensor.register_hook(self),)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.count += 1
        if self.calls is None or self.count in self.calls:
            return _spoil(grad, self.value)
        return grad


class WeightFault(_Fault):
    """An optimizer step post-hook that overwrites one parameter entry after chosen steps.

    A weight going non-finite between steps (a bad update, a bit flip, user code): the guard's
    weight check (``detect.check_weights_every``) or the next step's forward must find it.

    Args:
        optimizer: the optimizer whose ``step()`` calls are counted.
        param: the parameter to overwrite.
        index: the entry of ``param`` written (``(0, 0)`` for a matrix's first entry).
        steps: 1-based ``optimizer.step()`` calls after which the entry is written.
        value: the value written.

    Attributes:
        count: ``optimizer.step()`` calls seen so far.

    Example::

        >>> layer = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> fault = WeightFault(opt, layer.weight, (0, 0), steps=[1])
        >>> opt.step()
        >>> layer.weight.isnan().sum().item()
        1
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        param: torch.Tensor,
        index: Union[int, Tuple[int, ...]],
        steps: Iterable[int],
        value: float = math.nan,
    ) -> None:
        self.param, self.index, self.steps, self.value, self.count = param, index, _calls(steps), value, 0
        self._handles = (optimizer.register_step_post_hook(self._after_step),)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1
        if self.count in self.steps:
            with torch.no_grad():
                self.param[self.index] = self.value


class LRFault(_Fault):
    """Optimizer step hooks that multiply every group's learning rate during chosen steps.

    Before a chosen ``optimizer.step()`` each ``param_group["lr"]`` is multiplied by ``factor``
    and after it divided back: only that update sees the blown-up (or ``inf``) learning rate.

    Args:
        optimizer: the optimizer.
        steps: 1-based ``optimizer.step()`` calls whose update uses the multiplied rate.
        factor: the multiplier (``1000.0`` for a divergent update, ``math.inf`` for a non-finite one).

    Attributes:
        count: ``optimizer.step()`` calls seen so far.

    Example::

        >>> layer = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> fault = LRFault(opt, steps=[1], factor=1000.0)
        >>> opt.step(); opt.param_groups[0]["lr"]
        0.1
    """

    def __init__(self, optimizer: torch.optim.Optimizer, steps: Iterable[int], factor: float) -> None:
        self.steps, self.factor, self.count = _calls(steps), factor, 0
        self._handles = (
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        )

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.count += 1
        if self.count in self.steps:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.count in self.steps:
            for group in optimizer.param_groups:
                group["lr"] /= self.factor
