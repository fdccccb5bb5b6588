"""The guard: one training step's protocol around a user's model and optimizer, usable from any loop.

A step is four verbs, whoever runs the forward, backward and optimizer step:

    begin_batch(batch)  -> the batch scanned (non-finite values cleaned where configured); run the forward on it
    record_loss(loss)   -> the micro-batch's loss, no host sync; then its backward
    decide()            -> the step's ONE host sync and its verdict; the gradients are dropped when it must not train
    finish_step()       -> after the optimizer step (or where it would have been): counters, scheduler, snapshot

``Guard.step(batch)`` is those verbs around the guard's own forward, backward and optimizer step;
``SafeTrainer.fit`` drives it, the Lightning and Hugging Face callbacks drive the verbs at their
framework's hooks. A step that reads anomalous runs the decision loop (:mod:`.decisions`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, List, Optional, Sequence, Tuple

from .. import detect
from ..config import TrainConfig, without_replays
from ..diagnose import Diagnosis
from ..kinds import Kind
from ..steps import Pending, StepResult
from . import start
from .batches import batch_rows
from .decisions import nan_result
from .machine import Driver, Phase, StepFacts, Verb
from .outcomes import Rerun, Verdict
from .parts import Parts
from .stepping import after_fault

__all__ = ["Guard", "without_reruns"]

logger = logging.getLogger(__name__)


def without_reruns(cfg: TrainConfig) -> TrainConfig:
    """A caller-driven loop without a ``loss_fn`` or ``step_fn``: the guard cannot run the step's
    forward itself, so replays are off (logged once) and ``drop_rows``/``retry`` become ``skip_batch``."""
    return without_replays(
        cfg,
        "a caller-driven loop without a loss_fn or step_fn: replays are off and drop_rows/retry skip the batch "
        "instead (the guard cannot run the step's forward); give step_fn to have them",
    )


class Guard(Parts):
    """The per-step protocol: detect, decide and recover, around a user's model and optimizer.

    Args:
        model: the module to train (for a GAN, a ``ModuleDict`` of both networks).
        optimizer: its optimizer, or several stepped together: a list or a dict ``name ->
            optimizer`` (:mod:`safetrain.optimizers`); one whose ``step`` needs a closure (LBFGS)
            is handed one by :meth:`step` (:mod:`.stepping`).
        cfg: anything :func:`safetrain.as_config` accepts (path, dict, DictConfig, TrainConfig, None).
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
        step_fn: ``step_fn(model, batch) -> loss`` for any other batch; a loop that runs its own
            forward gives it so that the guard can re-run and replay a step. A dict ``name ->
            step_fn`` (names of the optimizers' dict) makes named steps: ``step(batch, name=...)``.
        scheduler: an LR scheduler, stepped as ``guard.scheduler_interval`` says (a loop that steps
            it itself: the guard follows it instead, see :meth:`follow_scheduler`).
        scaler: a ``torch.amp.GradScaler``; made from ``amp.*`` when ``amp.dtype`` is float16 and none is given.
        bus: where events go; a new :class:`EventBus` (logging only) when omitted.
        run_dir: directory for safetensors snapshots when ``snapshot.dir`` is not set.

    Example::

        guard = Guard(model, optimizer, "configs/default.yaml", loss_fn=F.cross_entropy)
        with guard:
            for batch in loader:
                result = guard.step(batch)

    or, with the forward, backward and optimizer step in the caller's loop::

        for batch in loader:
            batch = guard.begin_batch(batch)
            loss = loss_of(model, batch)
            guard.record_loss(loss)
            loss.backward()
            if guard.decide().trained:
                optimizer.step()
            guard.finish_step()
    """

    #: Each micro-batch's loss is its share of the step's (divided by the whole step's item count,
    #: as a Hugging Face model given ``num_items_in_batch`` computes it): the step's loss is their
    #: sum, not their mean. Set by the caller; the guard's own re-runs keep the same convention.
    loss_shares = False

    # ----------------------------------------------------------------- the guard's own step
    def step(
        self, batch: Any, indices: Optional[Sequence[int]] = None, *, name: Optional[str] = None
    ) -> Optional[StepResult]:
        """Feed one (micro-)batch; returns the :class:`StepResult` when an optimizer step was decided.

        With ``guard.accumulate_steps`` = k, the first k - 1 calls only accumulate gradients and
        return ``None``; the k-th makes the single host sync and decides.

        Args:
            batch: the (micro-)batch. Its CPU tensors are copied to the model's accelerator
                (``guard.to_device``), asynchronously when the loader pins memory.
            indices: the dataset index of each row, when known: a replay then names bad samples
                by dataset index (``SafeTrainer.fit`` passes them from a :class:`QuarantineSampler`).
            name: with named steps (``step_fn`` a dict, the optimizers a dict of the same names: a
                GAN's ``"d"`` and ``"g"``), the step to take: its ``step_fn`` gives the loss and only
                its optimizer moves (:mod:`.stepping`).

        Raises:
            TrainingAborted: the policy aborted; the model and optimizer are at the last good snapshot.
            BatchError: the batch fits no convention, or ``sanitize.*: raise`` met a bad row.
        """
        m = self.machine
        if m.phase is Phase.CLOSED:
            raise RuntimeError("Guard.step() after close(); make a new Guard")
        if name is not None or self.stepper.named:  # named steps: that step's loss and optimizer
            self.stepper.select(name)
        m.stepping = True
        try:
            clean = self.begin_batch(batch, indices)
            if m.phase is Phase.BEGUN:  # (a skipped or empty micro-batch runs no forward)
                try:
                    loss = self.forward.loss(clean, self._pending)
                except BaseException:  # (a BatchError): the batch is no part of any step
                    self._leave_out_last()
                    m.phase = Phase.RECORDED if m.facts.window else Phase.READY
                    raise
                self.record_loss(loss)
                self.forward.backward(loss)
            k, facts = self.cfg.guard.accumulate_steps, m.facts
            if k > 1 and (facts.window if facts.skipping else len(self._pending.micro)) < k:
                return None  # (an empty micro-batch is left out of an accumulated step)
            return self._take_step()
        finally:
            m.stepping = False

    def flush(self) -> Optional[StepResult]:
        """Take the step of a partial accumulation now (at the end of an epoch or of the data).

        With ``guard.accumulate_steps`` = k and fewer than k micro-batches pending, their summed
        gradients (each scaled by 1/k) make one step; returns ``None`` when nothing is pending.
        """
        m = self.machine
        if m.phase is Phase.READY or m.phase is Phase.CLOSED:
            return None
        if m.facts.window == 0:  # only empty micro-batches, each journaled as left out
            m.phase = Phase.READY
            return None
        m.stepping = True
        try:
            return self._take_step()
        finally:
            m.stepping = False

    def _take_step(self) -> StepResult:
        """Decide, step the optimizer when the verdict trains, and finish."""
        decided = self.decide()
        if decided.trained:
            fault = self.stepper.step(self._pending)  # (LBFGS: a closure; a named step: its optimizer)
            if fault is not None:
                facts = self.machine.facts
                facts.decided = after_fault(
                    fault, facts.decided, self.decisions, self._pending, self.rules, self.optimizer
                )  # type: ignore[arg-type]
        # fp16: the scaler's update after a step it read (a skipped one lowers the scale); none when no read
        # unscaled this step (its data was skipped)
        self.plumbing.scaler.update_if_read()
        return self.finish_step()

    # ----------------------------------------------------------------- the four verbs
    def begin_batch(self, batch: Any, indices: Optional[Sequence[int]] = None) -> Any:
        """A (micro-)batch arrives: returns it on the model's device, scanned, non-finite values
        zero-filled (or replaced) where the configuration says so; run the forward on what this returns.

        Args:
            batch: the (micro-)batch as the loader gave it.
            indices: each row's dataset index, when known (a replay names bad samples by it).

        Raises:
            RuntimeError: out of order (after :meth:`decide` without :meth:`finish_step`), or closed.
            TrainingAborted: the run starts with non-finite parameters or optimizer state.
        """
        m = self.machine
        if (m.phase, Verb.BEGIN, m.stepping) not in m.legal:
            self._enter(Verb.BEGIN)  # (the first verb, or refused)
        if m.phase is Phase.BEGUN:  # the last batch gave no loss (Lightning: training_step
            self._leave_out_last()  # returned None): it is no part of the step
        if not m.started or self.counters.steps == 0 or self.lazy.pending:  # (a step under way: nothing to see)
            self._arrive(batch)
        self.counters.batch += 1
        if m.phase is Phase.READY:  # a new step
            m.facts = StepFacts(skipping=self.recovery_state.skip_after_restore > 0)  # the step's facts start afresh
            self._start_step()
        m.phase, facts = Phase.BEGUN, m.facts
        if self.plumbing.moves and not (facts.skipping and m.stepping):  # (Guard.step runs no skipped batch)
            batch = self.plumbing.move(batch)  # a CPU loader's batch to the model's accelerator
        if not facts.skipping and self.sync.steps_alone and batch_rows(batch) == 0:  # (under DDP every rank steps)
            m.phase = m.move(Verb.UNTRAINED)
            if self.cfg.guard.accumulate_steps > 1:  # left out; with one micro-batch a step, decide() skips the step
                self.recovery.empty_batch(False, self.last_loss)
            return batch
        facts.window += 1
        if facts.skipping:  # the data that led into a restore: no gradient of it is used
            m.phase = m.move(Verb.UNTRAINED)
            if facts.window == 1:  # a caller's forward on it leaves no buffer update behind
                self.forward.buffers.keep()
            return batch
        p = self._pending
        p.micro.append(batch)
        p.indices.append(list(indices) if indices is not None else [])
        p.places.append((self.counters.epoch, self.counters.batch - 1))  # its own place, for its events
        return self.forward.begin(batch, p)

    def record_loss(self, loss: Any, *, scaled: bool = False) -> None:
        """The loss of the micro-batch begun last, as the model computed it (not divided by the
        gradient accumulation); no host sync. ``scaled``: the loss as it goes to the backward,
        multiplied by the fp16 loss scale (the guard divides it back on the device).

        Raises:
            RuntimeError: no batch begun since the last loss (call :meth:`begin_batch` first).
        """
        m = self.machine
        key, skipped = (m.phase, Verb.RECORD, m.stepping), m.phase is Phase.SKIPPED
        m.phase = m.legal[key] if key in m.legal else self._enter(Verb.RECORD)
        if skipped:  # a skipped or empty micro-batch: its loss is no part of the step
            m.facts.forwarded = m.facts.forwarded or m.facts.skipping
            return
        if scaled:
            loss = self.plumbing.unscaled_loss(loss.detach())
        if self.monitor.enabled:  # (lazy mode: no hooks, nothing recorded)
            self._pending.calls.append(self.monitor.recorded)  # which micro-batch a forward finding is in
        self.forward.add_loss(loss, self._pending)

    def decide(self, window: Optional[int] = None) -> StepResult:
        """After the step's last backward, before ``optimizer.step()``: the step's one host read and
        its decision, carried out (a restore, a re-run, gradients zeroed, ...).

        Args:
            window: what the caller divided each micro-batch's loss by, when not
                ``guard.accumulate_steps`` (a short last window at an epoch's end); the guard's
                re-runs and replays divide the same way.

        Returns:
            The :class:`StepResult`; when ``trained`` is false the gradients were dropped (set to
            ``None``), so an optimizer step leaves every parameter as it is.

        Raises:
            RuntimeError: out of order (no batch begun, a loss not recorded, or decided already).
            TrainingAborted: the policy aborted; the model and optimizer are at the last good snapshot.
        """
        m = self.machine
        key = m.phase, Verb.DECIDE, m.stepping
        after = m.legal[key] if key in m.legal else self._enter(Verb.DECIDE)
        try:
            verdict, result = self._decide(window)
        except BaseException:
            m.phase = Phase.READY
            raise
        m.facts.decided, m.phase = (verdict, result), after
        return result

    def finish_step(self) -> StepResult:
        """After ``optimizer.step()`` (or where it would have been): counters, the scheduler's
        bookkeeping, the periodic snapshot; returns the step's final :class:`StepResult` (with the
        snapshot's event).

        Raises:
            RuntimeError: no step decided (call :meth:`decide` first).
        """
        m = self.machine
        key = m.phase, Verb.FINISH, m.stepping
        after = m.legal[key] if key in m.legal else self._enter(Verb.FINISH)
        (verdict, result), m.facts.decided = m.facts.decided, None  # type: ignore[misc]
        try:
            if verdict is None:  # the step's data was skipped, or it was empty: nothing more to do
                return result
            if verdict.trains:
                self.updates.applied(self.last_loss)
            return self.decisions.close(verdict, result, self.snapshots.cadence, self.snapshot)
        finally:
            m.phase = after

    # ----------------------------------------------------------------- the step, inside
    def _enter(self, verb: Verb) -> Phase:
        """The phase ``verb`` moves the step to, for a move not in ``machine.legal`` (each verb
        looks there first: the healthy path, one lookup and no call): the first verb fixes the
        driver (``Guard.step`` or the caller's loop); the verb sets the phase once its work is done.

        Raises:
            RuntimeError: closed, another driver's guard, or the move illegal now (the fix named).
        """
        m = self.machine
        if m.claim(verb) and m.driver is Driver.CALLER:
            self._caller_drives()
        return m.move(verb)

    def _caller_drives(self) -> None:
        """The caller's loop runs forward, backward, the optimizer step and the scheduler: the guard
        follows its scheduler; without a ``loss_fn`` or ``step_fn`` it cannot run a step itself."""
        if self.scheduler is not None:
            self.updates.follow(self.scheduler)
        if self.forward.loss_fn is None and self.forward.step_fn is None:
            self.cfg = without_reruns(self.cfg)
            self.rules = dataclasses.replace(self.rules, reruns=False)

    def _leave_out_last(self) -> None:
        p = self._pending
        if not p.micro:  # (it never joined: the forward failed before)
            return
        del p.micro[-1], p.indices[-1], p.places[-1]
        self.machine.facts.window -= 1
        logger.debug("a batch begun without a loss recorded is left out of step %d", self.counters.steps + 1)

    def _arrive(self, batch: Any) -> None:
        """A batch arrives before the run's first step is counted (or a lazy model's parameters are
        still to be made; later batches skip this): the run's first takes the forced snapshot (sound
        by definition), and a run whose parameters or optimizer state are non-finite already stops
        (:mod:`.start`): the snapshot's own check says so (no read of its own). A resumed run's
        state comes from a snapshot, which is never taken of a non-finite state."""
        m = self.machine
        first, m.started = not m.started, True
        if self.lazy.pending:  # a lazy model's parameters exist before its first snapshot (a dry run: :mod:`.lazy`)
            self.lazy.make(batch)
        if self.counters.steps == 0 and m.phase is Phase.READY and len(self.store) == 0:
            if self.snapshot(force=True).action == "refused" and first and self.store.refused:
                self._broken_start(list(self.store.refused), batch)

    def _broken_start(self, bad: List[str], batch: Any) -> None:
        """Stop a run that starts with non-finite state: nothing could restore it (slow path)."""
        if self.plumbing.moves:
            batch = self.plumbing.move(batch)
        modules = start.first_nonfinite_modules(self._named, lambda: self.forward.eager_loss(batch))
        reason = start.broken_start_reason(bad, start.state_names(self._all_params, self.optimizer), modules)
        self.recovery.abort(Kind.WEIGHTS, reason)

    def _start_step(self) -> None:
        self.plumbing.begin_step()
        self._pending = Pending()
        if self.monitor.enabled:
            self.monitor.reset()
        self.diagnoser.rng.begin_step()  # the RNG state the step starts from, for a replay (host-side)
        steps = self.counters.optimizer_steps
        skipping = self.machine.facts.skipping
        self._pending.weights = self.weights.maybe_run(steps) if steps > 0 and not skipping else None

    def _decide(self, window: Optional[int]) -> Tuple[Optional[Verdict], StepResult]:
        """The step's read and decision loop; a step of skipped data or of empty batches has neither."""
        facts = self.machine.facts
        self.counters.steps += 1  # (written here and in _again only: a step counts once, skipped or re-run)
        if facts.skipping:  # the data that led into a restore: the window is one whole step skipped
            self.plumbing.drop_grads()
            if facts.forwarded:  # the caller's forward ran on it: its buffer updates go
                self.forward.buffers.put_back()
            event = self.recovery.skip_data(self.last_loss)
            return None, nan_result(self.counters.steps, "skip_batch", (event,))
        if not self._pending.micro:  # only empty batches: a skipped step
            self.plumbing.drop_grads()
            event = self.recovery.empty_batch(True, self.last_loss)
            return None, nan_result(self.counters.steps, "skip_batch", (event,))
        restores, rules, decisions = self.counters.restores, self.rules, self.decisions
        verdict = decisions.run(self._read(), self._pending, self.last_loss, rules)
        while verdict.rerun is not None:  # a re-run is the next turn: run here, then handed back
            read = self._again(verdict.rerun, verdict.read, window or self.forward.accumulate)
            verdict = decisions.run(read, self._pending, self.last_loss, rules, verdict)
        clipped_to = math.nan
        if verdict.trains:
            clipped_to, clip_event = self.updates.prepare(
                verdict.total_norm, self._pending.micro, verdict.outcome is None
            )
            if clip_event is not None:
                verdict.events.append(clip_event)
        result = StepResult(
            self.counters.steps,
            verdict.trains,
            self.last_loss,
            self.last_grad_norm,
            verdict.action,
            tuple(verdict.events),
            restored=self.counters.restores != restores,
            clipped_to=clipped_to,
        )
        return verdict, result

    def _read(self) -> detect.StepRead:
        p, read = self._pending, self.forward.read(self._pending)  # host sync: the one per step
        self.last_loss = read.loss / (1 if self.loss_shares else len(p.micro)) if read.loss is not None else math.nan
        self.last_grad_norm = read.total_norm if read.total_norm is not None else math.nan
        return read

    def _again(self, rerun: Rerun, read: detect.StepRead, divide: int) -> detect.StepRead:
        """The next turn's read: the step run again on ``rerun.batches`` (its gradients dropped
        first; the same step, counted once), each micro-batch's loss divided by ``divide`` as the
        caller's was; or the same read with the replaced rows' flags cleared."""
        if rerun.batches is None:
            return dataclasses.replace(read, input=False, target=False)
        self.plumbing.drop_grads()
        self.plumbing.before_rerun()
        self._start_step()
        p = self._pending
        self.counters.steps -= 1  # its forward sees the step not yet counted, as the first run's did
        for i, batch in enumerate(rerun.batches):
            p.micro.append(batch)
            p.indices.append(rerun.indices[i] if rerun.indices else [])
            p.places.append(rerun.places[i] if rerun.places else self.position)
            self.forward.run(batch, p, divide)
        self.counters.steps += 1
        return self._read()

    def diagnose(self) -> Diagnosis:
        """Replay the pending step from its pre-step state and say where it goes non-finite.

        Runs on its own when a step trips (``detect.replay``); call it yourself between
        micro-batches to look at a step. Training is left exactly as it was: parameters,
        buffers, gradients and every RNG stream.
        """
        return self.diagnoser.explain(None, micro=self._pending.micro, indices=self._pending.indices)
