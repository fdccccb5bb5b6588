"""Slow non-finite checks both replays share: which tensors hold NaN/Inf, which op made the first.

Every function here reads the host (once per device, or per op for :class:`first_nonfinite_op`):
slow path only, never on a healthy step. Used by :mod:`.step_replay` and :mod:`.weight_replay`.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..snapshot.tensors import nonfinite

__all__ = ["any_nonfinite", "first_nonfinite_op", "nonfinite_names", "user_frames", "LIBRARY_PATHS"]

#: Path prefixes of frames that are not the user's: torch, safetrain itself, the standard plumbing.
LIBRARY_PATHS = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "<frozen ",
    "/contextlib.py",
)


def user_frames(stack: Sequence[traceback.FrameSummary]) -> List[str]:
    """The frames of ``stack`` outside torch and safetrain, as ``file:line in function``."""
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in stack if not f.filename.startswith(LIBRARY_PATHS)]


def _finite(tensors: Sequence[torch.Tensor]) -> List[bool]:
    """Whether each tensor is all finite: one reduction per tensor, one host read per device."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    finite = [True] * len(tensors)
    for where in by_device.values():
        reduced = torch.stack([torch.isfinite(tensors[i].detach()).all() for i in where])
        for i, ok in zip(where, reduced.tolist()):  # host sync: replay only
            finite[i] = ok
    return finite


def any_nonfinite(tensors: Sequence[Any]) -> bool:
    """Whether some floating tensor among ``tensors`` holds NaN/Inf (one host read per device).

    Anything that is not a non-empty floating tensor is passed over.

    Example::

        >>> any_nonfinite([torch.ones(2), 3, torch.tensor([float("inf")])])
        True
    """
    floats = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    return not all(_finite(floats))


def nonfinite_names(named: Iterable[Tuple[str, torch.Tensor]]) -> Tuple[str, ...]:
    """The names of the floating tensors that hold NaN/Inf, in order (slow path; see
    :func:`safetrain.snapshot.tensors.nonfinite`, which reads the host once per device).

    Example::

        >>> nonfinite_names([("a", torch.ones(2)), ("b", torch.tensor([float("nan")]))])
        ('b',)
    """
    return tuple(nonfinite((n, t.detach()) for n, t in named))


# Ops whose output is uninitialised memory: whatever bits it holds (NaN included) mean nothing yet.
_UNINITIALISED = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "empty_permuted",
        "resize_",
        "resize_as_",
    }
)


class first_nonfinite_op(TorchDispatchMode):
    """A dispatch mode that records the first op whose output is non-finite while its inputs are finite.

    An in-place op (``aten.add_``, ``aten._foreach_addcdiv_``: an optimizer's update) overwrites its
    own input, so its inputs are checked *before* it runs and its outputs and inputs after: an
    update that makes a finite weight non-finite is named. Slow (host reads per op): for replays
    only. After the ``with`` block, :attr:`op` is the op's name (``"aten.log.default"``) and
    :attr:`line` the innermost user frame that called it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.op: Optional[str] = None
        self.line: Optional[str] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if self.op is not None or name in _UNINITIALISED:
            return func(*args, **kwargs)
        given = {k: v for k, v in kwargs.items() if k != "out"}  # out= is written, not read
        ins, _ = tree_flatten((args, given))
        if name.endswith("_"):  # in place: its inputs are not what they were once it has run
            finite_before = not any_nonfinite(ins)
            out = func(*args, **kwargs)
            blame = finite_before and any_nonfinite(ins + tree_flatten(out)[0])
        else:
            out = func(*args, **kwargs)
            blame = any_nonfinite(tree_flatten(out)[0]) and not any_nonfinite(ins)
        if blame:
            self.op = str(func)
            frames = user_frames(traceback.extract_stack()[:-1])
            self.line = frames[-1] if frames else None
        return out
