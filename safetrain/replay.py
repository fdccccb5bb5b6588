"""Diagnosis by replay: re-run a tripped step from its pre-step state, slowly, to explain it.

Nothing here runs on a healthy step except :meth:`Replayer.begin_step`, which keeps a reference
to the RNG state the step starts from. When a step trips, :meth:`Replayer.replay` runs the same
micro-batches again with the same parameters, RNG streams (dropout masks identical) and autocast
settings, with

* exact hooks on every module (the first module, in execution order, with a non-finite output),
* a dispatch mode that names the first op whose output is non-finite from finite inputs (say
  ``aten.log``) with the user's line that called it (so a ``log(0)`` inside a loss is found),
* ``torch.autograd.detect_anomaly(check_nan=True)`` for the backward (the autograd node, such as
  ``LogBackward0``, and the forward traceback that created it),

then tells a **reproducible** fault from a **transient** one (the replay is finite) and, when the
loss is per-sample separable, bisects the batch to the rows that make it non-finite. Parameters
that are already non-finite before the step are a ``weights`` fault: the step only shows it, so
the diagnosis says so and :mod:`safetrain.replay_weights` replays the steps before it (the guard
checks the parameters before it replays a step, so there it goes straight to that replay). The replay
leaves training exactly as it was: gradients, buffers, the model's mode and every RNG stream
are put back.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .config import ReplayConfig
from .detect import ActivationMonitor, drop_rows, iter_tensors
from .events import jsonable
from .snapshot.tensors import nonfinite
from .wrappers import plain_namer

__all__ = ["Diagnosis", "Replayer", "bad_rows", "first_nonfinite_op", "nonfinite_names"]

logger = logging.getLogger("safetrain")
_LIBS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)), "<frozen ", "/contextlib.py")


@dataclass(frozen=True)
class Diagnosis:
    """What a replay found.

    Attributes:
        reproducible: the replay was non-finite again (``False``: a transient fault; for a
            ``weights`` fault: the steps replayed from the snapshot stayed finite, so the weights
            were changed outside the training step).
        kind: ``"weights"`` when the fault is in the parameters: non-finite before the step, or
            a weight replay; ``None`` for a fault of the step itself.
        nonfinite_weights: the non-finite parameters (before the step, or after the replayed
            step that made them so).
        weights_step: the step (global step number) whose update first made a weight non-finite
            in a weight replay.
        module: the first module (qualified name) whose output was non-finite, ``None`` if none.
        module_type: its class name.
        call_index: which call of that module.
        op: the first op whose output was non-finite from finite inputs (``aten.log.default``).
        op_line: the user's ``file:line in function`` that called it.
        backward_node: the autograd node anomaly mode named (``LogBackward0``), if any.
        nonfinite_grads: parameters whose gradient was non-finite in the replay.
        traceback: the forward traceback of that node, trimmed to the user's frames.
        bad_rows: positions in the batch whose loss is non-finite (bisection), in order.
        dataset_indices: the dataset indices of those rows, when known.
        forward_passes: forward passes the bisection used.
        seconds: time the replay took.
        note: why something is missing (budget, time limit, not separable...).
    """

    reproducible: bool
    kind: Optional[str] = None
    nonfinite_weights: Tuple[str, ...] = ()
    weights_step: Optional[int] = None
    module: Optional[str] = None
    module_type: Optional[str] = None
    call_index: Optional[int] = None
    op: Optional[str] = None
    op_line: Optional[str] = None
    backward_node: Optional[str] = None
    nonfinite_grads: Tuple[str, ...] = ()
    traceback: Tuple[str, ...] = ()
    bad_rows: Tuple[int, ...] = ()
    dataset_indices: Tuple[int, ...] = ()
    forward_passes: int = 0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form for the journal."""
        return jsonable({k: getattr(self, k) for k in self.__dataclass_fields__})

    def describe(self) -> str:
        """One line: where it started and whether it reproduces."""
        if self.kind == "weights":
            return self._describe_weights()
        if not self.reproducible:
            return "transient: the replay from the same state was finite"
        parts = []
        if self.module is not None:
            parts.append(f"first non-finite output in module '{self.module or '<root>'}' ({self.module_type})")
        if self.op is not None:
            parts.append(f"op {self.op} at {self.op_line}")
        if self.backward_node is not None:
            parts.append(f"backward {self.backward_node}")
        if self.nonfinite_grads:
            parts.append(f"non-finite gradients in {', '.join(self.nonfinite_grads[:5])}")
        if self.bad_rows:
            parts.append(f"bad rows {list(self.bad_rows)} ({self.forward_passes} forward passes)")
        return "reproducible: " + ("; ".join(parts) or "non-finite again")

    def _describe_weights(self) -> str:
        names = ", ".join(self.nonfinite_weights[:5]) or "parameters"
        if self.weights_step is not None:
            op = f" by {self.op}" + (f" at {self.op_line}" if self.op_line else "") if self.op else ""
            return f"weights: the update of step {self.weights_step} made {names} non-finite{op}"
        if not self.reproducible:
            return f"transient: {self.note}"
        return f"weights: {names} non-finite" + (f" ({self.note})" if self.note else "")


def _user_frames(stack: Sequence[traceback.FrameSummary]) -> List[str]:
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in stack if not f.filename.startswith(_LIBS)]


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


def _nonfinite(tensors: Sequence[Any]) -> bool:
    """Whether some floating tensor holds NaN/Inf (one host read per device)."""
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
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted", "resize_", "resize_as_"})


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
            finite_before = not _nonfinite(ins)
            out = func(*args, **kwargs)
            blame = finite_before and _nonfinite(ins + tree_flatten(out)[0])
        else:
            out = func(*args, **kwargs)
            blame = _nonfinite(tree_flatten(out)[0]) and not _nonfinite(ins)
        if blame:
            self.op = str(func)
            frames = _user_frames(traceback.extract_stack()[:-1])
            self.line = frames[-1] if frames else None
        return out


#: Steps between two comparisons of the RNG state with the kept one (see ``Replayer.begin_step``).
_RNG_LOOK_EVERY = 50
#: A replay's note when the RNG state kept for the step may not be the step's.
RNG_MOVED = "random numbers were drawn since the RNG state was last kept: if the step drew any, the replay's differ"


def _same_rng(a: Tuple[torch.Tensor, List[torch.Tensor]], b: Tuple[torch.Tensor, List[torch.Tensor]]) -> bool:
    """Two (CPU, CUDA) RNG states are equal (host-side byte tensors: no device sync)."""
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class Replayer:
    """Replays tripped steps under a budget (``detect.replay``) and isolates bad samples.

    Args:
        model: the model (its buffers and mode are put back after each replay).
        monitor: the guard's :class:`ActivationMonitor` (its exact ``inspect`` hooks are used).
        cfg: the ``detect.replay`` section: ``enabled``, ``max_per_run``, ``time_limit_s``.
        loss_of: ``loss_of(batch) -> loss``: the guard's forward and loss for one micro-batch.
        autocast: a zero-argument callable returning the step's autocast context.
    """

    def __init__(self, model: torch.nn.Module, monitor: ActivationMonitor, cfg: ReplayConfig,
                 loss_of: Callable[[Any], torch.Tensor], autocast: Callable[[], Any]) -> None:
        self.model, self.monitor, self.cfg = model, monitor, cfg
        self.loss_of, self.autocast = loss_of, autocast
        self.used = 0
        self._rng: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None
        self._cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self._idle = False  # no random number was drawn between the last two looks at the RNG
        self._since = 0  # steps since the last look
        self._look: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None  # the state at the last look

    @property
    def enabled(self) -> bool:
        """Replays are on and the budget is not spent."""
        return bool(self.cfg.enabled) and self.used < self.cfg.max_per_run

    @property
    def rng_state(self) -> Optional[Tuple[torch.Tensor, List[torch.Tensor]]]:
        """The (CPU, CUDA) RNG states the current step started from: copied at its start, or, while
        the RNG is idle, at the last look (the same state unless something drew since, which
        :meth:`rng_moved` tells); ``None`` with replays off."""
        return self._rng

    def begin_step(self) -> None:
        """Keep the RNG state this step starts from (a host-side copy, no device sync).

        A copy costs about 10 us inside a training step (the state is 5 KB, cold by then). A
        model that draws no random numbers (no dropout) leaves the state as it was, and any
        kept copy is then the step's: so every :data:`_RNG_LOOK_EVERY` steps the state is
        compared with the one at the previous look; while a whole such window drew nothing, no
        copy is made until the next look (otherwise one every step). A replay checks again that
        the state is unchanged, and says so when it is not (a model that began to draw random
        numbers since the last look, dropout switched on late, say).
        """
        if not self.cfg.enabled:
            return
        self._since += 1
        if self._since < _RNG_LOOK_EVERY:
            if not self._idle:
                self._rng = self._capture()
            return
        state = self._capture()
        self._idle = self._look is not None and _same_rng(state, self._look)
        self._rng, self._look, self._since = state, state, 0

    def rng_reset(self) -> None:
        """The RNG was set or drawn from outside the steps (a restore, an epoch's shuffle): copy
        it at every step again until a whole window between two looks finds it idle."""
        self._idle, self._since, self._look = False, 0, None

    def _capture(self) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self._cuda else [])

    def rng_moved(self) -> bool:
        """Whether the RNG was drawn from since the state kept for this step was taken, when it
        was not copied at the step's start: then the kept state may not be the step's, and a
        replay's random draws may differ from the step's. Copies resume at every step."""
        if not self._idle or self._rng is None or _same_rng(self._capture(), self._rng):
            return False
        self.rng_reset()
        return True

    @contextlib.contextmanager
    def _as_before(self) -> Iterator[None]:
        """Run from the step's starting RNG; put RNG, gradients, buffers and mode back afterwards."""
        params = [p for p in self.model.parameters()]
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        training = self.model.training
        devices = list(range(torch.cuda.device_count())) if self._cuda else []
        with torch.random.fork_rng(devices=devices):
            if self._rng is not None:
                torch.set_rng_state(self._rng[0])
                if self._cuda:
                    torch.cuda.set_rng_state_all(self._rng[1])
            try:
                yield
            finally:
                self.model.train(training)
                for p, g in zip(params, grads):
                    p.grad = g

    def replay(self, micro: Sequence[Any], indices: Optional[Sequence[Sequence[int]]] = None) -> Diagnosis:
        """Re-run the tripped step and explain it.

        Args:
            micro: the micro-batches of the step, as the forward saw them.
            indices: for each micro-batch, the dataset index of each row, when known.

        Returns:
            A :class:`Diagnosis`.
        """
        moved = self.rng_moved()  # before the replay draws anything
        diagnosis = self._replay(micro, indices)
        if moved:
            note = RNG_MOVED
            if not diagnosis.reproducible:  # not reproduced, but not shown transient: no retry, the ladder acts
                note += "; the fault did not reproduce, which proves nothing here: not treated as transient"
                diagnosis = replace(diagnosis, reproducible=True)
            diagnosis = replace(diagnosis, note=f"{diagnosis.note}; {note}" if diagnosis.note else note)
        return diagnosis

    def _named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """Parameters by the names of the user's code (no compile wrapper's ``_orig_mod.``)."""
        plain = plain_namer(self.model)
        return [(plain(n), p) for n, p in self.model.named_parameters()]

    def _replay(self, micro: Sequence[Any], indices: Optional[Sequence[Sequence[int]]]) -> Diagnosis:
        self.used += 1
        started = time.perf_counter()
        weights = nonfinite_names(self._named_parameters())
        if weights:  # an earlier update (or code outside the step) broke them: this step only shows it
            return Diagnosis(reproducible=True, kind="weights", nonfinite_weights=weights,
                             seconds=time.perf_counter() - started,
                             note="parameters were non-finite before the step")
        found: Dict[str, Any] = {}
        with self._as_before():
            for k, batch in enumerate(micro):
                self.model.zero_grad(set_to_none=True)
                # The backward runs inside inspect(): BatchNorm saves its running statistics for
                # the backward, so they are put back only after it.
                with self.monitor.inspect() as seen:
                    with first_nonfinite_op() as op_mode, self.autocast():
                        loss = self.loss_of(batch)
                    loss_bad = not math.isfinite(float(loss.detach().float()))  # host sync: replay only
                    node, frames = self._backward(loss)
                grads = [n for n, p in self._named_parameters() if p.grad is not None and _nonfinite([p.grad])]
                if seen.finding is not None or op_mode.op is not None or loss_bad or node is not None or grads:
                    f = seen.finding
                    found = dict(module=f.module if f else None, module_type=f.module_type if f else None,
                                 call_index=f.call_index if f else None, op=op_mode.op, op_line=op_mode.line,
                                 backward_node=node, traceback=tuple(frames), nonfinite_grads=tuple(grads),
                                 micro=k, loss_bad=loss_bad)
                    break
        if not found:
            return Diagnosis(reproducible=False, seconds=time.perf_counter() - started)
        rows: Tuple[int, ...] = ()
        passes, note = 0, ""
        k = found.pop("micro")
        if found.pop("loss_bad"):
            rows, passes, note = self._bisect(micro[k], started)
        dataset = tuple(indices[k][r] for r in rows) if indices and k < len(indices) and indices[k] else ()
        return Diagnosis(reproducible=True, bad_rows=rows, dataset_indices=dataset, forward_passes=passes,
                         seconds=time.perf_counter() - started, note=note, **found)

    def _backward(self, loss: torch.Tensor) -> Tuple[Optional[str], List[str]]:
        if not loss.requires_grad:
            return None, []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    loss.backward()
            except RuntimeError as exc:
                match = re.search(r"Function '(\w+)' returned nan", str(exc))
                if match is None:
                    raise
                frames: List[str] = []
                for w in caught:
                    text = str(w.message)
                    if "Traceback of forward call" in text:
                        lines = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)
                        frames = [f"{f}:{n} in {fn}" for f, n, fn in lines if not f.startswith(_LIBS)]
                return match.group(1), frames
        return None, []

    def _bisect(self, batch: Any, started: float) -> Tuple[Tuple[int, ...], int, str]:
        """Group-test the rows of ``batch``: which ones make the loss non-finite (eval mode, no grad)."""
        size = next((t.shape[0] for _, t in iter_tensors(batch) if t.dim() > 0), None)
        if size is None or size < 2:
            return (), 0, "batch has no row dimension to bisect"
        passes = 0
        deadline = started + self.cfg.time_limit_s

        def bad(rows: Sequence[int]) -> bool:
            nonlocal passes
            if time.perf_counter() > deadline:
                raise TimeoutError
            passes += 1
            keep = set(rows)
            subset = drop_rows(batch, [i for i in range(size) if i not in keep], batch_size=size)
            with torch.no_grad(), self.autocast():
                return not math.isfinite(float(self.loss_of(subset).float()))  # host sync: replay only

        # Eval mode: rows must not mix through BatchNorm batch statistics, dropout is off, and no
        # buffer moves. The mode is put back by _as_before's caller.
        training = self.model.training
        self.model.eval()
        try:
            rows = bad_rows(size, bad)
        except TimeoutError:
            return (), passes, f"bisection stopped at detect.replay.time_limit_s={self.cfg.time_limit_s}"
        except Exception as exc:  # a model that cannot run on a subset of rows
            return (), passes, f"bisection not possible: {type(exc).__name__}: {exc}"
        finally:
            self.model.train(training)
        if not rows:
            return (), passes, "the loss is not per-sample separable: no subset of rows is non-finite alone"
        return tuple(rows), passes, ""


def bad_rows(size: int, bad: Callable[[Sequence[int]], bool]) -> List[int]:
    """The rows ``r`` of a batch of ``size`` for which ``bad`` says a group holding ``r`` is bad.

    Adaptive group testing for a batch already seen to be bad as a whole (the replay's loss was
    non-finite), so the whole batch is not tested again. One bad row at a time is found by binary
    search (log2 B tests); the rows not yet cleared are then tested together once, and searched
    again if bad: about (d + 1) log2 B tests for d bad rows, ``2 log2 B + 2`` for two, log2 B + 1
    for one. Inferring "left half clean, so the right half is bad" is only sound when the parent is
    bad: the first search starts from the batch that was bad in *train* mode (BatchNorm batch
    statistics, dropout) while ``bad`` may run in eval mode, so when none of its tests came out
    bad, the row it ends on is tested once more, and nothing is reported if that one is clean.
    (Testing the largest unknown group before the union of the rest, measured over every
    placement of 1 to 3 bad rows in 64, costs one test more for a single bad row and saves
    nothing on average for two.)

    Args:
        size: the number of rows.
        bad: ``bad(rows) -> bool``: whether the loss of just those rows is non-finite.

    Returns:
        The bad rows, sorted.

    Example::

        >>> bad_rows(64, lambda rows: bool({5, 41} & set(rows)))
        [5, 41]
    """
    found: List[int] = []
    group, known_bad = list(range(size)), True  # the batch was bad in the replay
    while group and (known_bad or bad(group)):
        unknown: List[int] = []
        rows, confirmed = group, not known_bad
        while len(rows) > 1:
            left, right = rows[: len(rows) // 2], rows[len(rows) // 2:]
            if bad(left):
                unknown.extend(right)  # may hold more bad rows: not tested yet
                rows, confirmed = left, True
            else:
                rows = right  # the group is bad and its left half is not: no test needed
        if not confirmed and not bad(rows):
            break  # bad in train mode only: no single row is to blame
        found.append(rows[0])
        group, known_bad = sorted(unknown), False
    return sorted(found)
