"""The step replay: re-run a tripped step from its pre-step state, slowly, to explain it.

Cost (slow path only): a forward and a backward under per-op host reads, plus about
``(d + 1) log2 B`` forwards to bisect (``d`` bad rows of ``B``, :mod:`.bisect`). Part of
``diagnose``: :class:`~safetrain.diagnose.Diagnoser` calls it for the ``forward``, ``loss`` and
``gradient`` kinds and spends the budget.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..adapters.compiled import plain_namer
from ..detect import HUGE_NORM, ActivationMonitor, drop_rows, fused_norms, iter_tensors, true_norms
from .bisect import Bisection, isolate_rows
from .diagnosis import Diagnosis
from .nonfinite import any_nonfinite, first_nonfinite_op, nonfinite_names, user_frames
from .rng import RNG_MOVED, StepRNG

__all__ = ["StepReplay"]


class StepReplay:
    """Replays a tripped step and isolates its bad samples. Spends no budget: the
    :class:`~safetrain.diagnose.Diagnoser` that calls it does.

    The same micro-batches run again with the same parameters, RNG streams (dropout masks
    identical, see :mod:`.rng`) and autocast settings, with

    * exact hooks on every module (the first module, in execution order, with a non-finite output),
    * a dispatch mode that names the first op whose output is non-finite from finite inputs (say
      ``aten.log``) and flows on into a non-finite module output or the loss, with the line of the
      user's (or the model's) code that called it and that code's caller (so a ``log(0)`` inside a
      loss is found, and a kernel's internal ``-inf``, such as SDPA's boolean mask, is not blamed),
    * ``torch.autograd.detect_anomaly(check_nan=True)`` for the backward (the autograd node, such as
      ``LogBackward0``, and the forward traceback that created it),

    then a **reproducible** fault (a module's output, the loss or a gradient is non-finite again, or
    the gradients' norm overflows float32 again) is told from a **transient** one (the replay is
    finite there, whatever a kernel does inside) and, when
    the loss is per-sample separable, the batch is bisected (:mod:`.bisect`) to the rows that make it
    non-finite. Parameters already non-finite before the step are a ``weights`` fault: the step only
    shows it (:mod:`.weight_replay` explains those). The replay leaves training exactly as it was:
    gradients, buffers, the model's mode and every RNG stream are put back (the cost: see the
    module docstring).

    Args:
        model: the model (its buffers and mode are put back after each replay).
        monitor: the guard's :class:`ActivationMonitor` (its exact ``inspect`` hooks are used).
        cfg: the ``detect.replay`` section (``time_limit_s`` bounds the bisection).
        loss_of: ``loss_of(batch) -> loss``: the guard's forward and loss for one micro-batch.
        autocast: a zero-argument callable returning the step's autocast context.
        rng: the step RNG bookkeeping the replay starts from.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        monitor: ActivationMonitor,
        cfg: Any,
        loss_of: Callable[[Any], torch.Tensor],
        autocast: Callable[[], Any],
        rng: StepRNG,
    ) -> None:
        self.model, self.monitor, self.cfg = model, monitor, cfg
        self.loss_of, self.autocast, self.rng = loss_of, autocast, rng

    def replay(self, micro: Sequence[Any], indices: Optional[Sequence[Sequence[int]]] = None) -> Diagnosis:
        """Re-run the tripped step and explain it.

        Args:
            micro: the micro-batches of the step, as the forward saw them.
            indices: for each micro-batch, the dataset index of each row, when known.

        Returns:
            A :class:`~safetrain.diagnose.Diagnosis`.
        """
        moved = self.rng.moved()  # before the replay draws anything
        diagnosis = self._replay(micro, indices)
        if moved:
            note = RNG_MOVED
            if not diagnosis.reproducible:  # not reproduced, but not shown transient: no retry, the ladder acts
                note += "; the fault did not reproduce, which proves nothing here: not treated as transient"
                diagnosis = replace(diagnosis, reproducible=True)
            diagnosis = replace(diagnosis, note=f"{diagnosis.note}; {note}" if diagnosis.note else note)
        return diagnosis

    @contextlib.contextmanager
    def _as_before(self) -> Iterator[None]:
        """Run from the step's starting RNG; put RNG, gradients, buffers and mode back afterwards."""
        params = [p for p in self.model.parameters()]
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        training = self.model.training
        with self.rng.step_start():
            try:
                yield
            finally:
                self.model.train(training)
                for p, g in zip(params, grads):
                    p.grad = g

    def _named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """Parameters by the names of the user's code (no compile wrapper's ``_orig_mod.``)."""
        plain = plain_namer(self.model)
        return [(plain(n), p) for n, p in self.model.named_parameters()]

    def _replay(self, micro: Sequence[Any], indices: Optional[Sequence[Sequence[int]]]) -> Diagnosis:
        started = time.perf_counter()
        weights = nonfinite_names(self._named_parameters())
        if weights:  # an earlier update (or code outside the step) broke them: this step only shows it
            return Diagnosis(
                reproducible=True,
                kind="weights",
                nonfinite_weights=weights,
                seconds=time.perf_counter() - started,
                note="parameters were non-finite before the step",
            )
        found: Dict[str, Any] = {}
        with self._as_before():
            for k, batch in enumerate(micro):
                self.model.zero_grad(set_to_none=True)
                # The backward runs inside inspect(): BatchNorm saves its running statistics for
                # the backward, so they are put back only after it.
                with self.monitor.inspect() as seen:
                    with first_nonfinite_op(self.model) as op_mode, self.autocast():
                        loss = self.loss_of(batch)
                    loss_bad = not math.isfinite(float(loss.detach().float()))  # host sync: replay only
                    culprit = op_mode.culprit([loss])
                    node, frames = self._backward(loss)
                grads = [n for n, p in self._named_parameters() if p.grad is not None and any_nonfinite([p.grad])]
                huge = 0.0 if grads or loss_bad else self._huge_norm()  # finite, but too large for float32?
                # Reproduced: a module's output, the loss or a gradient is non-finite (or its norm
                # overflows) again. An op that made an Inf inside a kernel (SDPA's boolean mask) and
                # no further is not.
                if seen.finding is not None or loss_bad or node is not None or grads or huge:
                    f = seen.finding
                    found = dict(
                        module=f.module if f else None,
                        module_type=f.module_type if f else None,
                        call_index=f.call_index if f else None,
                        op=culprit.op if culprit else None,
                        op_line=culprit.line if culprit else None,
                        op_caller=culprit.caller if culprit else None,
                        backward_node=node,
                        traceback=tuple(frames),
                        nonfinite_grads=tuple(grads),
                        micro=k,
                        loss_bad=loss_bad,
                    )
                    if huge:  # the same finite gradients too large for float32: reproduced, not transient
                        found["note"] = f"gradient norm {huge:.4g} overflows float32 again (every element finite)"
                    break
        if not found:
            return Diagnosis(reproducible=False, seconds=time.perf_counter() - started)
        rows: Tuple[int, ...] = ()
        passes, note = 0, found.pop("note", "")
        k = found["micro"]  # kept: the guard names that micro-batch's own epoch and batch index
        if found.pop("loss_bad"):
            rows, passes, note = self._bisect(micro[k], started)
        dataset = tuple(indices[k][r] for r in rows) if indices and k < len(indices) and indices[k] else ()
        return Diagnosis(
            reproducible=True,
            bad_rows=rows,
            dataset_indices=dataset,
            forward_passes=passes,
            seconds=time.perf_counter() - started,
            note=note,
            **found,
        )

    def _huge_norm(self) -> float:
        """The replayed gradients' true total norm when it overflows float32 though every element is
        finite (:data:`~safetrain.detect.HUGE_NORM`), else 0 (replay only: host reads)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        total = math.hypot(*true_norms(grads, [float(n) for n in fused_norms(grads)]))
        return total if HUGE_NORM <= total < math.inf else 0.0

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
                        frames = user_frames((f, int(n), fn) for f, n, fn in lines)
                return match.group(1), frames
        return None, []

    def _bisect(self, batch: Any, started: float) -> Bisection:
        """Group-test the rows of ``batch``: which ones make the loss non-finite (eval mode, no grad)."""
        size = next((t.shape[0] for _, t in iter_tensors(batch) if t.dim() > 0), None)
        limit = self.cfg.time_limit_s

        def is_bad(rows: Sequence[int]) -> bool:
            keep = set(rows)
            subset = drop_rows(batch, [i for i in range(size) if i not in keep], batch_size=size)
            with torch.no_grad(), self.autocast():
                return not math.isfinite(float(self.loss_of(subset).float()))  # host sync: replay only

        if size is None or size < 2:
            return isolate_rows(size, is_bad, started + limit, limit)  # nothing to run: a note only
        # Eval mode: rows must not mix through BatchNorm batch statistics, dropout is off, and no
        # buffer moves. The mode is put back here, and by _as_before for the model as a whole.
        training = self.model.training
        self.model.eval()
        try:
            return isolate_rows(size, is_bad, started + limit, limit)
        finally:
            self.model.train(training)
