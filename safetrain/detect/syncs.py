"""Count host syncs: a test helper that wraps every tensor method that reads a value on the host.

On CUDA each of these blocks the host until the device has caught up; on the CPU they are cheap,
so a test on the CPU counts the calls instead of timing them. Wrapped while the context is open:
``Tensor.item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``cpu``,
``numpy``, ``__array__``, ``nonzero``, ``masked_select``, ``unique``, ``equal``, ``allclose``,
``is_nonzero``, ``__repr__``/``__format__``, the same functions in the ``torch`` namespace, and
``torch.cuda.synchronize``. Only the outermost call counts (``__repr__`` calling ``tolist``
is one sync), and only on the thread that opened the context.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Tuple

import torch

__all__ = ["SyncCounter", "count_host_syncs", "TENSOR_SYNC_METHODS", "TORCH_SYNC_FUNCTIONS"]

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

    Returns:
        A context manager yielding a :class:`SyncCounter`, updated live.

    Example::

        >>> with count_host_syncs() as syncs:
        ...     read = flags.read()
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
