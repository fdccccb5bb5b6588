"""Slow non-finite checks both replays share: which tensors hold NaN/Inf, which op made the first.

Every function here reads the host (once per device, or per op for :class:`first_nonfinite_op`):
slow path only, never on a healthy step. Used by :mod:`.step_replay` and :mod:`.weight_replay`.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..snapshot.tensors import nonfinite

__all__ = ["Culprit", "any_nonfinite", "first_nonfinite_op", "nonfinite_names", "user_frames", "LIBRARY_PATHS"]

_TORCH = os.path.dirname(torch.__file__)
_SAFETRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Path prefixes of frames that are not the user's: torch, safetrain itself, the standard plumbing.
LIBRARY_PATHS = (_TORCH, _SAFETRAIN, "<frozen ", "/contextlib.py")
_PLUMBING = (_TORCH, "<frozen ", "/contextlib.py")
_MODULE_CALL = (os.path.join(_TORCH, "nn", "modules", "module.py"), ("_call_impl", "_wrapped_call_impl"))


def user_frames(stack: Iterable[Tuple[str, int, str]]) -> List[str]:
    """The frames of ``stack`` (outermost first: ``(file, line, function)``, or
    :class:`traceback.FrameSummary`) that are the user's code, as ``file:line in function``.

    torch's frames are never the user's. safetrain's own are not either, except for code a module
    call runs in a top-level module of the package (a model defined there, such as
    :class:`safetrain.cli.demo.LogNormFeatures`: its ``forward`` is the model's code; a
    :mod:`safetrain.testing` fault hook). A model in any other installed package is the user's.
    """
    out: List[str] = []
    in_module = False
    for frame in stack:
        filename, lineno, name = frame[0], frame[1], frame[2]
        if filename == _MODULE_CALL[0] and name in _MODULE_CALL[1]:
            in_module = True
        elif not filename.startswith(_PLUMBING) and (
            not filename.startswith(_SAFETRAIN)
            or (in_module and os.path.dirname(filename) in (_SAFETRAIN, os.path.join(_SAFETRAIN, "cli")))
        ):
            out.append(f"{filename}:{lineno} in {name}")
    return out


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values: a sparse COO gradient's (``nn.Embedding(sparse=True)``) as a dense vector."""
    return t.coalesce().values() if t.is_sparse else t


def _finite(tensors: Sequence[torch.Tensor]) -> List[bool]:
    """Whether each tensor is all finite: one reduction per tensor, one host read per device."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    finite = [True] * len(tensors)
    for where in by_device.values():
        reduced = torch.stack([torch.isfinite(_values(tensors[i].detach())).all() for i in where])
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


class Culprit(NamedTuple):
    """An op that made a non-finite output from finite inputs, and where it was called.

    Attributes:
        op: the op's name (``"aten.log.default"``).
        line: the innermost frame of the user's (or the model's) code that ran it, ``file:line in function``.
        caller: the next such frame outward (a parent module's ``forward``, the script's line), if any.
        inside: ``line`` is code the replayed call ran (a model's ``forward``, a loss function, a
            hand-written optimizer's ``step``); ``False``: no such code ran the op (torch's own
            optimizer, safetrain's loss), and ``line`` is where the user's code started the run.
    """

    op: str
    line: Optional[str]
    caller: Optional[str]
    inside: bool = True


def _floats(tree: Any) -> List[torch.Tensor]:
    seen, out = set(), []
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass, a meta tensor)
        return None


class first_nonfinite_op(TorchDispatchMode):
    """A dispatch mode that finds the op whose non-finite output made the run non-finite.

    Every op whose output is non-finite while its inputs are finite is a *candidate*; its
    non-finite outputs are marked with it, and so is every non-finite output of an op that takes a
    marked input (a NaN flowing on). A candidate is the culprit only when its mark reaches what
    went wrong: a non-finite output of a module of ``model`` (watched while the mode is on), or
    one of the ``sinks`` given to :meth:`culprit` (the loss, the parameters an update broke). A
    kernel's own infinities (``F.scaled_dot_product_attention`` with a boolean mask builds
    ``-inf`` and softmaxes it away) stop at the first finite output and are never blamed.

    An in-place op (``aten.add_``, ``aten._foreach_addcdiv_``: an optimizer's update) overwrites its
    own input, so its inputs are checked *before* it runs and the tensors it wrote after. Slow
    (host reads per op): for replays only. :attr:`op`, :attr:`line` and :attr:`caller` are the
    first candidate's, reached or not; :meth:`culprit` is the one to report.

    Args:
        model: a module whose modules' outputs are watched for marked tensors (``None``: none).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None) -> None:
        super().__init__()
        self.model = model
        self.candidates: List[Culprit] = []
        self._marks: Any = WeakIdKeyDictionary()  # non-finite tensor -> index of its candidate
        self._reached: set = set()  # candidates whose mark reached a module's output
        self._entry: Optional[FrameType] = None
        self._hooks: List[Any] = []

    @property
    def op(self) -> Optional[str]:
        """The first candidate's op, whether or not it reached anything."""
        return self.candidates[0].op if self.candidates else None

    @property
    def line(self) -> Optional[str]:
        """The first candidate's line."""
        return self.candidates[0].line if self.candidates else None

    @property
    def caller(self) -> Optional[str]:
        """The first candidate's caller line."""
        return self.candidates[0].caller if self.candidates else None

    def __enter__(self) -> "first_nonfinite_op":
        self._entry = sys._getframe(1)  # the replay's own frame: the user's code runs inside it
        if self.model is not None:  # registered last: they see the output other hooks returned
            self._hooks = [m.register_forward_hook(self._module_output) for m in self.model.modules()]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self._entry = [], None
        super().__exit__(*exc)

    def culprit(self, sinks: Sequence[Any] = ()) -> Optional[Culprit]:
        """The first candidate whose mark reached a watched module's output or one of ``sinks``
        (tensors; a sink is reached when it, or a tensor sharing its storage, is marked)."""
        reached = set(self._reached)
        floats = _floats(list(sinks))
        if floats:
            by_storage: Dict[int, int] = {}
            for t, k in list(self._marks.items()):
                ptr = _storage(t)
                if ptr is not None:
                    by_storage[ptr] = min(k, by_storage.get(ptr, k))
            for s in floats:
                k = self._marks.get(s)
                k = by_storage.get(_storage(s)) if k is None else k  # type: ignore[arg-type]
                if k is not None:
                    reached.add(k)
        return self.candidates[min(reached)] if reached else None

    def _module_output(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        for t in _floats(out):
            k = self._marks.get(t)
            if k is not None:
                self._reached.add(k)

    def _where(self) -> Tuple[Optional[str], Optional[str], bool]:
        """The innermost frame of the user's code that ran the op, the one outside it, and whether
        the first is code the replayed call ran (else it is the line that started the run)."""
        stack: List[Tuple[str, int, str]] = []
        frame: Optional[FrameType] = sys._getframe(2)
        inside = True
        outer: List[Tuple[str, int, str]] = []
        while frame is not None:
            (stack if inside else outer).append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            if frame is self._entry:
                inside = False
            frame = frame.f_back
        frames = user_frames(reversed(stack))
        inside = bool(frames)
        if len(frames) < 2:  # the caller is outside the replay: the user's line that started the run
            frames = user_frames(reversed(outer))[-1:] + frames
        return (frames[-1] if frames else None), (frames[-2] if len(frames) > 1 else None), inside

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in _UNINITIALISED:
            return func(*args, **kwargs)
        given = {k: v for k, v in kwargs.items() if k != "out"}  # out= is written, not read
        ins = _floats((args, given))
        marked = [k for k in (self._marks.get(t) for t in ins) if k is not None]
        in_place = func.overloadpacket.__name__.endswith("_")
        # in place: its inputs are not what they were once it has run
        finite_before = (not marked and not any_nonfinite(ins)) if in_place else None
        out = func(*args, **kwargs)
        written = _floats((args[0] if in_place and args else (), kwargs.get("out"), out))
        bad = [t for t, ok in zip(written, _finite(written)) if not ok]
        if in_place:
            broken = {id(t) for t in bad}
            for t in written:
                if id(t) not in broken:
                    self._marks.pop(t, None)  # made finite again in place
        if not bad:
            return out
        if marked:
            k = min(marked)
        elif finite_before if in_place else not any_nonfinite(ins):
            k = len(self.candidates)
            self.candidates.append(Culprit(str(func), *self._where()))
        else:
            return out
        for t in bad:
            self._marks[t] = k
        return out
