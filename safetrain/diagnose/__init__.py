"""Diagnosis, the slow path: why a step tripped, told by replaying it; the samples to quarantine.

:class:`Diagnoser` is the one entry point: ``explain(kind, ...)`` picks the step replay
(:mod:`.step_replay`, kinds ``forward``/``loss``/``gradient``) or the weight replay
(:mod:`.weight_replay`, kind ``weights``) and spends the run's replay budget
(``detect.replay.max_per_run``); nothing else spends it. On a healthy step only
:meth:`StepRNG.begin_step <.rng.StepRNG.begin_step>` runs (``diagnoser.rng``: a host-side RNG copy) and
the weight replay's :meth:`~.weight_replay.WeightReplay.record` keeps references to the update's
batches (the guard calls ``diagnoser.weight_replay.record`` with ``diagnoser.rng.state``;
:meth:`Diagnoser.record_update` does the same for a caller that holds the diagnoser only). Row bisection
(:mod:`.bisect`) and the quarantine of isolated samples (:mod:`.quarantine`) sit beside them, and
the cause test (:mod:`.cause_test`: the batch under the current model and the snapshots').
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..config import ReplayConfig
from ..detect import ActivationMonitor
from ..kinds import REPLAYED_KINDS, Kind
from .cause_test import CauseTest
from .diagnosis import Diagnosis
from .optim_numerics import explain_optimizer
from .rng import StepRNG
from .step_replay import StepReplay
from .weight_replay import WeightReplay

__all__ = ["Diagnoser", "Diagnosis"]


class Diagnoser:
    """Explains anomalies by replay, under the run's budget (``detect.replay``).

    Owns the budget (:attr:`used` of ``max_per_run``), the step RNG bookkeeping (:attr:`rng`)
    and both replays (:attr:`step_replay`, :attr:`weight_replay`).

    Args:
        model: the model (its buffers and mode are put back after each replay).
        monitor: the guard's :class:`~safetrain.detect.ActivationMonitor` (exact hooks for the step replay).
        cfg: the ``detect.replay`` section: ``enabled``, ``max_per_run``, ``time_limit_s``,
            ``keep_steps``, ``keep_mb``.
        state: the guard's :class:`~safetrain.snapshot.TrainState` (what the weight replay
            restores from a snapshot and puts back).
        params: the ``(name, parameter)`` pairs that train.
        loss_of: ``loss_of(batch) -> loss``: the guard's forward and loss for one micro-batch.
        autocast: a zero-argument callable returning the step's autocast context.
        prepare: ``prepare(batch) -> batch``: the sanitizer's device-side cleaning.
        accumulate: ``guard.accumulate_steps``.
        clip: ``guard.clip_grad_norm``.
        sync: the guard's sync (:func:`safetrain.distributed.make_sync`): whether this rank's
            replays are its own is asked of it, never of the process (a plain model in a process
            group made for another reason has a :class:`~safetrain.distributed.LocalSync`).

    Example::

        diagnoser = Diagnoser(model, monitor, cfg.detect.replay, state=state, params=params,
                              loss_of=loss_of, autocast=contextlib.nullcontext, prepare=lambda b: b,
                              sync=LocalSync())
        diagnoser.rng.begin_step()                              # every step
        if diagnoser.enabled:                                   # a step tripped
            diagnosis = diagnoser.explain("loss", micro=[batch])
    """

    def __init__(
        self,
        model: torch.nn.Module,
        monitor: ActivationMonitor,
        cfg: ReplayConfig,
        *,
        state: Any,
        params: Sequence[Tuple[str, torch.nn.Parameter]],
        loss_of: Callable[[Any], torch.Tensor],
        autocast: Callable[[], Any],
        prepare: Callable[[Any], Any],
        accumulate: int = 1,
        clip: Optional[float] = None,
        sync: Any,
    ) -> None:
        self.cfg, self.prepare = cfg, prepare
        self.used = 0  # replays spent, step and weight replays together
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self.rng = StepRNG(cfg.enabled, cuda)
        self.step_replay: Any = StepReplay(model, monitor, cfg, loss_of, autocast, self.rng)
        self.weight_replay = WeightReplay(
            state,
            params,
            cfg,
            loss_of=loss_of,
            autocast=autocast,
            prepare=prepare,
            accumulate=accumulate,
            clip=clip,
            sync=sync,
        )
        self.cause_test = CauseTest(state, loss_of, autocast, prepare, sync)

    @property
    def enabled(self) -> bool:
        """Replays are on and the budget is not spent."""
        return bool(self.cfg.enabled) and self.used < self.cfg.max_per_run

    # ---------------------------------------------------------------- per step (cheap)
    def rng_reset(self) -> None:
        """The RNG was set or drawn from outside the steps (a restore, an epoch's shuffle)."""
        self.rng.reset()

    def record_update(self, step: int, micro: List[Any], total: Optional[float], clip: Any = ...) -> None:
        """An update is about to be applied (just before ``optimizer.step()``): keep references to
        its batches for a weight replay. ``total``: the norm clipping uses (``None``: gradients
        used as they were); ``clip``: the norm this update was clipped to (``None``: none; adaptive
        clipping changes it step by step), by default ``guard.clip_grad_norm``."""
        if clip is ...:  # as configured
            self.weight_replay.record(step, micro, total, self.rng.state)
        else:
            self.weight_replay.record(step, micro, total, self.rng.state, clip=clip)

    def clear(self, step: int) -> None:
        """A snapshot of ``step`` was taken or restored: the kept updates start again from it."""
        self.weight_replay.clear(step)

    def wrap_step_replay(self, wrap: Callable[[StepReplay], Any]) -> None:
        """Put ``wrap(step_replay)`` in place of the step replay: an object with the same
        ``replay(micro, indices)`` (under DDP: run locally and agreed across ranks, see
        :func:`safetrain.distributed.wrap_replayer`)."""
        self.step_replay = wrap(self.step_replay)

    # ---------------------------------------------------------------- slow path
    def explains(self, kind: Kind) -> bool:
        """Whether an anomaly of ``kind`` gets a replay now: a kind a replay explains, and budget left."""
        return (kind in REPLAYED_KINDS or kind is Kind.WEIGHTS) and self.enabled

    def explain(
        self,
        kind: Optional[str],
        *,
        micro: Sequence[Any] = (),
        indices: Optional[Sequence[Sequence[int]]] = None,
        store: Any = None,
    ) -> Diagnosis:
        """Explain an anomaly of ``kind`` by the replay that fits it; spends the budget.

        ``forward``, ``loss`` and ``gradient`` (and ``None``: a look at a step that did not
        trip, :meth:`safetrain.Guard.diagnose`) replay the step's ``micro``-batches from the
        step's starting state; ``weights`` replays the updates since ``store``'s newest snapshot.
        Every step replay spends one replay; a weight replay spends one only when it runs (not
        when its updates were not kept or there is no snapshot: the diagnosis then says why).
        The caller asks :attr:`enabled` first; an explicit call runs even when the budget is spent.

        Args:
            kind: the anomaly kind (``"forward"``, ``"loss"``, ``"gradient"``, ``"weights"``) or ``None``.
            micro: the step's micro-batches as the loader gave them (step replay; each goes through
                ``prepare`` first, as the step's forward did).
            indices: for each micro-batch, the dataset index of each row, when known (step replay).
            store: the guard's snapshot store (weight replay).

        Returns:
            A :class:`Diagnosis`.

        Raises:
            ValueError: a kind no replay explains, or ``weights`` without a ``store``.
        """
        if kind == Kind.WEIGHTS:
            if store is None:
                raise ValueError("explain('weights') needs the snapshot store to replay from (store=...)")
            why_not = self.weight_replay.why_not(store)
            if why_not:
                return self._numerics(self.weight_replay.not_replayed(why_not))
            self.used += 1
            moved = self.rng.moved()  # the updates kept since the last look have that look's RNG state
            return self._numerics(self.weight_replay.replay(store, rng_moved=moved))
        if kind is not None and kind not in REPLAYED_KINDS:
            raise ValueError(
                f"no replay explains a {str(kind)!r} anomaly; expected one of "
                f"{sorted(map(str, REPLAYED_KINDS | {Kind.WEIGHTS}))} or None"
            )
        self.used += 1
        return self.step_replay.replay([self.prepare(batch) for batch in micro], indices)

    def _numerics(self, diagnosis: Diagnosis) -> Diagnosis:
        """A ``weights`` diagnosis with the known optimizer numerics fault behind it, if any."""
        broken = set(diagnosis.nonfinite_weights)
        params = [p for n, p in self.weight_replay.params if n in broken]
        known = explain_optimizer(self.weight_replay.state.optimizer, params) if params else ""
        return dataclasses.replace(diagnosis, numerics=known) if known else diagnosis
