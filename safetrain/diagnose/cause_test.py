"""The cause test's effects: a step's batch through the current model and each vouched snapshot's.

Slow path only (an anomaly the ladder would escalate): the live state is set aside, the batch goes
forward without a backward under the current model, then under each snapshot's weights and
buffers in turn (a snapshot is restored into the live objects for that), and the live state is
put back exactly: parameters, buffers, optimizer, scheduler, scaler and every RNG stream. The
rules that read the losses are :mod:`safetrain.policy.causes` (pure); this module only measures.

Cost: one capture of the training state (as a snapshot takes it), one forward of the step's
micro-batches per model (the current one and each vouched snapshot: ``snapshot.keep`` at most),
one restore per snapshot and one to put the live state back. Measured in ``benchmarks/causes.py``.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, List, Optional, Sequence

import torch

from ..kinds import Cause
from ..policy.causes import Verdict, Witness, agree, cause_of, level_of

__all__ = ["CauseTest"]

logger = logging.getLogger(__name__)


class CauseTest:
    """Measures the losses the cause test reads (see :mod:`safetrain.policy.causes`).

    Args:
        state: the guard's :class:`~safetrain.snapshot.TrainState` (what a snapshot restores).
        loss_of: ``loss_of(batch) -> loss``: the guard's forward and loss for one micro-batch.
        autocast: a zero-argument callable returning the step's autocast context.
        prepare: ``prepare(batch) -> batch``: the sanitizer's device-side cleaning.
        sync: the guard's sync: every rank tests its own batch, :func:`~safetrain.policy.causes.agree`
            makes one verdict of theirs.
    """

    def __init__(
        self,
        state: Any,
        loss_of: Callable[[Any], torch.Tensor],
        autocast: Callable[[], Any],
        prepare: Callable[[Any], Any],
        sync: Any,
    ) -> None:
        self.state, self.loss_of, self.autocast, self.prepare, self.sync = state, loss_of, autocast, prepare, sync

    def run(
        self,
        micro: Sequence[Any],
        store: Any,
        vouched: Callable[[int], bool],
        level: float,
        spread: Optional[float] = None,
    ) -> Verdict:
        """The agreed verdict on the step's ``micro``-batches, whose loss stands far above ``level``.

        Args:
            micro: the step's micro-batches, as the loader gave them.
            store: the guard's snapshot store (each usable snapshot, newest first, is a witness).
            vouched: whether the snapshot of a step is vouched for (an unvouched one is no witness).
            level: the loss level before the jump (the spike's median).
            spread: the robust sigma of the losses before the jump (snapshots from another regime
                are no witnesses), or ``None``.
        """
        try:
            verdict = self._test(micro, store, vouched, level, spread)
        except Exception as exc:  # diagnosis only: the ladder decides as before
            logger.warning("cause test failed: %s: %s", type(exc).__name__, exc)
            verdict = Verdict(Cause.UNKNOWN, level=level)
        return agree(self.sync.gather_object(verdict))

    def _test(
        self, micro: Sequence[Any], store: Any, vouched: Callable[[int], bool], level: float, spread: Optional[float]
    ) -> Verdict:
        captured = self.state.capture({"step": 0})
        homes = {n: t.device for n, t in captured.tensors.items()}
        live = {n: t.detach().clone() for n, t in captured.tensors.items()}
        meta = copy.deepcopy(captured.meta)
        witnesses: List[Witness] = []
        try:
            current = self._loss(micro)
            for older in range(len(store)):
                info = store.restore(self.state, older=older)
                if vouched(info.step):
                    window = info.extra.get("spike", {}).get("losses", ())
                    witnesses.append(Witness(older, info.step, self._loss(micro), level_of(window)))
        finally:
            self.state.apply(live, meta, owned=False, where="the live state before the cause test", homes=homes)
        verdict = cause_of(current, level, witnesses, spread)
        logger.info(
            "cause test: %s (current model %.4g on the batch, level %.4g; snapshots: %s)",
            verdict.cause,
            current,
            level,
            ", ".join(f"step {w.step}: {w.loss:.4g} (level {w.level})" for w in witnesses) or "none vouched",
        )
        return verdict

    def _loss(self, micro: Sequence[Any]) -> float:
        """The mean loss of the micro-batches under the model as it stands, without a backward."""
        device = next((t.device for t in self.state.model.parameters()), torch.device("cpu"))
        total = 0.0
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in micro:
                with self.autocast():
                    total += float(self.loss_of(self.prepare(batch)).float())  # host sync: slow path
        return total / max(1, len(micro)) if math.isfinite(total) else math.inf
