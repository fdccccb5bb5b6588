"""The guard: one training step's protocol around a user's model and optimizer, usable from any loop.

scan -> forward (autocast) -> loss -> backward (scaled) -> unscale -> gradient check -> ONE host
sync -> judge. A healthy step clips, steps and snapshots; otherwise the decision loop runs:
diagnose, decide (the policy), carry out (the recovery executor), and a re-run is its next turn.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import detect, distributed, snapshot
from ..config import ConfigLike, TrainConfig, as_config
from ..diagnose import Diagnoser, Diagnosis
from ..divergence import DivergenceDetector
from ..events import AnomalyFound, Event, EventBus, LRChanged
from ..kinds import Action, Kind
from ..lr import LRBackoff
from ..policy import Anomaly, History, Rules, decide, newest_taken, raises, read_clean
from ..spike import SpikeDetector
from ..steps import Counters, Pending, Phase, StepResult
from ..wrappers import plain_namer, unwrap_compiled
from . import start
from .caller import CallerSteps, without_reruns
from .forward import Forward
from .judge import Judge
from .measure import measure
from .own import OwnSteps
from .plumbing import Plumbing
from .recovery import Recovery, Rerun, Verdict
from .snapshots import Snapshots
from .state import RecoveryState
from .update import Updates

__all__ = ["Guard"]

logger = logging.getLogger("safetrain")


class Guard(OwnSteps, CallerSteps):
    """The per-step protocol: detect, decide and recover, around a user's model and optimizer.

    Args:
        model: the module to train.
        optimizer: its optimizer.
        cfg: anything :func:`safetrain.as_config` accepts (path, dict, DictConfig, TrainConfig, None).
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
        step_fn: ``step_fn(model, batch) -> loss`` for any other batch.
        scheduler: an LR scheduler, stepped as ``guard.scheduler_interval`` says.
        scaler: a ``torch.amp.GradScaler``; made from ``amp.*`` when ``amp.dtype`` is float16 and none is given.
        bus: where events go; a new :class:`EventBus` (logging only) when omitted.
        run_dir: directory for safetensors snapshots when ``snapshot.dir`` is not set.
        caller_steps: the caller's loop (a framework's) runs forward, backward, ``optimizer.step()``
            and the scheduler, and tells the guard at each point (:class:`~safetrain.guard.caller.CallerSteps`);
            ``step_fn`` lets the guard re-run and replay a step itself.

    Example::

        guard = Guard(model, optimizer, "configs/default.yaml", loss_fn=F.cross_entropy)
        with guard:
            for batch in loader:
                result = guard.step(batch)
    """

    # What the guard is made of (a table of contents; each part takes its own config section).
    cfg: TrainConfig
    counters: Counters  # read by FitResult, the progress bar and the journal
    recovery_state: RecoveryState  # the policy's history and what recovery remembers
    plumbing: Plumbing  # device, autocast, scaler, freeing gradients
    forward: Forward  # one micro-batch through the model
    monitor: detect.ActivationMonitor  # forward hooks (detect.mode)
    grads: detect.GradCheck  # the fused gradient norms
    weights: detect.WeightCheck  # the periodic weight check
    spike: SpikeDetector  # loss spikes
    divergence: DivergenceDetector  # a loss growing geometrically
    judge: Judge  # a step's read -> its anomaly
    recovery: Recovery  # carries out decisions
    updates: Updates  # applies a step's update, or drops it; the scheduler
    state: snapshot.TrainState  # the whole training state, for snapshots
    store: Any  # where snapshots go
    snapshots: Snapshots  # takes them, and records what each owes before it is vouched for
    backoff: LRBackoff  # the LR scale on top of the schedule
    sync: Any  # distributed.LocalSync or DistributedSync

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: ConfigLike = None,
        *,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        scheduler: Any = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        bus: Optional[EventBus] = None,
        run_dir: Optional[str] = None,
        caller_steps: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # The forward runs through the user's model; names, hooks and snapshots use what a
        # torch.compile wrapper holds, so they read as in the user's code (no "_orig_mod." prefix)
        # and a snapshot loads into the model compiled or not.
        self._named = named = unwrap_compiled(model)
        # One process, DDP or FSDP2; anything else is refused here (FSDP2: replays off, sharded snapshots).
        self.layout = layout = distributed.layout_of(named)
        self.cfg = c = distributed.for_layout(layout, as_config(cfg))
        self.caller_steps = caller_steps
        reruns = not caller_steps or loss_fn is not None or step_fn is not None
        if not reruns:
            self.cfg = c = without_reruns(c)
        self.bus = bus if bus is not None else EventBus()
        self.counters = counters = Counters()
        self.rules = dataclasses.replace(Rules.of(c), reruns=reruns)
        self.recovery_state = RecoveryState(c.recovery)
        self.plumbing = pipes = Plumbing(model, optimizer, c.amp, scaler, c.guard.to_device, caller_steps)
        self.device, self.scaler = pipes.device, pipes.scaler
        self.backoff = backoff = LRBackoff(optimizer, c.recovery.min_lr, release_after=c.recovery.reset_after)
        backoff.on_hold = lambda message, detail: self._emit(LRChanged, "lr", Action.SCALE_LR, message, detail)
        sp = c.guard.spike
        self.spike = SpikeDetector(sp.window, sp.min_history, sp.zscore, sp.enabled, sp.min_ratio, sp.hard_ratio)
        self.divergence = DivergenceDetector.from_config(c.guard.divergence, recover_after=c.recovery.reset_after)
        self.state = state = distributed.train_state(layout, named, optimizer, scheduler=scheduler, scaler=self.scaler)
        # Buffers non-finite by design (a -inf causal mask) are part of the model: snapshots take them
        # while their pattern is unchanged (host sync: once, at the start).
        state.accept_nonfinite_buffers()
        plain = plain_namer(named)
        # Every parameter, frozen ones too, for the exact check after a trip (a snapshot restores them).
        self._all_params = all_params = [(plain(n), p) for n, p in named.named_parameters()]
        self._params = params = [(n, p) for n, p in all_params if p.requires_grad]
        # Two parameters looked at per step for gradients left by someone else (O(1), not O(P)).
        self._probe = (params[0][1], params[-1][1]) if params else ()
        # Gradients are always checked (clipping and the scaler need the norm anyway); the
        # activation and weight checks follow detect.mode. Disabled parts are no-ops, not ifs.
        self.grads = grads = detect.GradCheck(params)
        self.monitor = monitor = detect.ActivationMonitor.from_config(named, c.detect)
        monitor.attach()
        # Distributed (a process group of > 1 rank and a DDP model): the one read combines every
        # rank's flags with one collective, and snapshots and replays agree across ranks.
        self.sync = sync = distributed.make_sync(self.device, named)
        self.rank = sync.rank  # stamped on every event
        flags, k = detect.StepFlags(reduce=sync.reduce), c.guard.accumulate_steps
        self.forward = fwd = Forward(flags, grads, model, named, monitor, pipes, c.sanitize, k, loss_fn, step_fn)
        # The weight checks cover floating buffers (BatchNorm statistics), and a mask's -inf by its pattern.
        bufs, probes = fwd.buffers.checked(), fwd.buffers.patterned(state)
        on = c.detect.mode != "off"
        self.weights = detect.WeightCheck(params + bufs, c.detect.check_weights_every, enabled=on, probes=probes)
        self.store = store = distributed.make_store(layout, c.snapshot, run_dir, sync)
        self.diagnoser = diag = Diagnoser(named, monitor, c.detect.replay, state=state, params=params,
                                          loss_of=fwd.eager_loss, autocast=pipes.autocast, prepare=fwd.scan,
                                          accumulate=k, clip=c.guard.clip_grad_norm, sync=sync)  # fmt: skip
        diag.wrap_step_replay(lambda replay: distributed.wrap_replayer(replay, sync, named))
        kept = fwd.buffers.checked(kept=True), fwd.buffers.patterned(state, kept=True)  # as before the step
        all_weights = detect.WeightCheck(all_params + kept[0], 0, probes=kept[1])
        self.judge = Judge(c, counters, monitor, grads, all_weights, self.spike, pipes, sync, fwd.confirm,
                           divergence=self.divergence, lrs=backoff.effective)  # fmt: skip
        self.updates = Updates(c.guard, pipes, grads, counters, scheduler, backoff, diag.record_update, caller_steps)
        if caller_steps and scheduler is not None:
            self.updates.follow(scheduler)
        self.recovery = Recovery(c, counters, self.recovery_state, store, state, backoff, grads, dict(params),
                                 self._emit, self._not_applied, self._after_restore, sync,
                                 put_back=fwd.buffers.put_back)  # fmt: skip
        self.snapshots = Snapshots(store, state, counters, self.recovery_state, diag.clear, self._emit)
        self.phase = Phase.READY
        self._started = False  # the first batch checks that the run does not start broken
        self._pending = Pending()
        self.epoch_rng: Optional[torch.Tensor] = None  # torch RNG at the start of the current epoch
        self.last_loss = math.nan
        self.last_grad_norm = math.nan

    @property
    def loss_fn(self) -> Optional[Callable[..., torch.Tensor]]:
        """``loss_fn(model(inputs), targets)`` for pair batches (may be swapped between steps)."""
        return self.forward.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Optional[Callable[..., torch.Tensor]]) -> None:
        self.forward.loss_fn = fn

    @property
    def step_fn(self) -> Optional[Callable[[torch.nn.Module, Any], torch.Tensor]]:
        """``step_fn(model, batch) -> loss`` for any other batch (may be swapped between steps)."""
        return self.forward.step_fn

    @step_fn.setter
    def step_fn(self, fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]]) -> None:
        self.forward.step_fn = fn

    @property
    def pending(self) -> Pending:
        """The step being accumulated: its micro-batches (as trained), their indices, its loss."""
        return self._pending

    @property
    def history(self) -> History:
        """The recovery policy's memory (:class:`~safetrain.policy.History`), up to this step."""
        return self.recovery_state.history

    @history.setter
    def history(self, value: History) -> None:
        self.recovery_state.history = value

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and release the snapshot store; idempotent."""
        self.monitor.detach()
        if self.phase is not Phase.CLOSED:
            self.store.close()
        self.phase = Phase.CLOSED

    def begin_epoch(self, epoch: int, resumed: bool = False) -> None:
        """Mark the start of an epoch: counters move, the RNG state that shuffles it is kept for
        resume, and the epoch's mean loss starts afresh (kept when ``resumed``: an epoch resumed
        mid-way from a snapshot goes on with the losses of its steps before the snapshot)."""
        self.counters.epoch, self.counters.batch = epoch, 0
        self.epoch_rng = torch.get_rng_state()
        self.diagnoser.rng_reset()  # the loader's shuffle draws from the RNG next
        if not resumed:
            self.recovery_state.epoch_loss = (0.0, 0)

    def measure_start(self, batches: Sequence[Any]) -> List[float]:
        """Before the run's first step, the start model's loss on ``batches`` (two or more the first
        step does not train on) becomes the first steps' reference (:mod:`.measure`); ``fit`` passes
        the two after the first step's. A no-op after the first step and under DDP or FSDP. Returns
        the finite losses measured."""
        if self.counters.steps or self.phase is not Phase.READY or not self.sync.steps_alone:
            return []
        parts = self.forward, self.plumbing, self.monitor, self._named, self.spike, self.recovery_state
        return measure(*parts, batches)

    @property
    def epoch_loss(self) -> Optional[float]:
        """The mean loss of this epoch's trained steps so far (non-finite losses left out), or ``None``."""
        total, n = self.recovery_state.epoch_loss
        return total / n if n else None

    # ----------------------------------------------------------------- the step
    def _arrive(self, batch: Any) -> None:
        """A (micro-)batch arrives: the run's first takes the forced snapshot (sound by definition),
        and a run whose parameters or optimizer state are non-finite already stops (:mod:`.start`):
        the snapshot's own check says so (no read of its own). A resumed run's state comes from a
        snapshot, which is never taken of a non-finite state."""
        first = not self._started
        self._started = True
        if self.counters.steps == 0 and self.phase is Phase.READY and len(self.store) == 0:
            if self.snapshot(force=True).action == "refused" and first and self.store.refused:
                self._broken_start(list(self.store.refused), batch)
        self.counters.batch += 1

    def _broken_start(self, bad: List[str], batch: Any) -> None:
        """Stop a run that starts with non-finite state: nothing could restore it (slow path)."""
        if self.plumbing.moves:
            batch = self.plumbing.move(batch)
        modules = start.first_nonfinite_modules(self._named, lambda: self.forward.eager_loss(batch))
        reason = start.broken_start_reason(bad, start.state_names(self._all_params, self.optimizer), modules)
        self.recovery.abort(Kind.WEIGHTS, reason)

    def _add_micro(self, batch: Any, indices: Optional[Sequence[int]]) -> Tuple[Any, Pending]:
        """The batch on the model's device, added to the pending step (a new one when none is)."""
        if self.plumbing.moves:  # a CPU loader's batch to the model's accelerator
            batch = self.plumbing.move(batch)
        if self.phase is Phase.READY:
            self._start_step()
        p = self._pending
        p.micro.append(batch)
        p.indices.append(list(indices) if indices is not None else [])
        p.places.append((self.counters.epoch, self.counters.batch - 1))  # its own place, for its events
        return batch, p

    def _start_step(self) -> None:
        probe = self._probe
        if not self.plumbing.grads_dropped or (probe and (probe[0].grad is not None or probe[1].grad is not None)):
            # The first step, or gradients made outside the guard since its last step (a user's
            # own backward): dropped, or this step's backward would add to them.
            self.plumbing.free_grads()
        self.plumbing.grads_dropped = False
        self._pending = Pending()
        self.monitor.reset()
        self.diagnoser.begin_step()
        steps = self.counters.optimizer_steps
        self._pending.weights = self.weights.maybe_run(steps) if steps > 0 else None

    def _read(self) -> detect.StepRead:
        self.counters.steps += 1
        p, read = self._pending, self.forward.read(self._pending)  # host sync: the one per step
        self.last_loss = read.loss / (1 if self.loss_shares else len(p.micro)) if read.loss is not None else math.nan
        self.last_grad_norm = read.total_norm if read.total_norm is not None else math.nan
        return read

    def _decide(self, read: detect.StepRead) -> Verdict:
        """The decision loop: each turn judges, diagnoses, decides and carries out; a re-run
        (drop_rows, replace, retry) is the next turn, never a call back into the step."""
        events: List[Event] = []
        rerun_action, retried = "", False
        while (anomaly := self.judge(read, self._pending, self.last_loss)) is not None:
            anomaly = dataclasses.replace(anomaly, retried=retried, again=bool(rerun_action))
            if raises(anomaly.kind, self.rules):
                self.recovery.reject_rows(anomaly)
            diagnosis = self._explain(anomaly) if self.diagnoser.explains(anomaly.kind) else None
            # A typed fact for the policy: is there a snapshot to restore (slow path: lists a directory)?
            history = dataclasses.replace(self.history, has_snapshot=bool(len(self.store)))
            decision, self.history = decide(anomaly, history, self.rules, diagnosis)
            outcome = self.recovery.carry_out(anomaly, decision, read, self._pending, diagnosis)
            events += outcome.events
            if outcome.rerun is None:
                return Verdict(read, events, rerun_action, outcome)
            rerun_action, retried = str(outcome.action), retried or decision.action is Action.RETRY
            read = self._run_again(outcome.rerun, read)
        if not self.divergence.climbing:  # (mid-climb a read vouches for nothing)
            self.backoff.read_clean()  # the last update's LRs are trusted: a restore holds the schedule to them
            self.recovery_state.clean_reads.append(self.counters.steps)
        return Verdict(read, events, rerun_action)

    def _close_step(self, verdict: Verdict) -> StepResult:
        """After the update (applied or not): what a trained step's loss joins, and the snapshot."""
        if verdict.outcome is None:
            return self._healthy(verdict.read, verdict.events, verdict.rerun_action)
        if verdict.trains:
            self.recovery_state.count_loss(self.last_loss)
            self.judge.observe(self.last_loss)  # a trained step's loss joins the spike and divergence windows
        steps, events = self.counters.steps, tuple(verdict.events)
        return StepResult(steps, verdict.trains, self.last_loss, self.last_grad_norm, verdict.action, events)

    def _explain(self, anomaly: Anomaly) -> Diagnosis:
        """The slow path's replay: the step's (its parameters were finite: the judge checked), or
        for weights the updates' since the newest snapshot."""
        p = self._pending
        diagnosis = self.diagnoser.explain(anomaly.kind, micro=p.micro, indices=p.indices, store=self.store)
        where = p.place(diagnosis.micro)  # the micro-batch it reproduced in: its events name that batch
        return dataclasses.replace(diagnosis, epoch=where[0], batch_index=where[1]) if where else diagnosis

    def _run_again(self, rerun: Rerun, read: detect.StepRead) -> detect.StepRead:
        """The next turn's read: the step run again on ``rerun.batches`` (its gradients dropped
        first; it counts as the same step), or the same read with the replaced rows' flags cleared."""
        if rerun.batches is None:
            return dataclasses.replace(read, input=False, target=False)
        self.plumbing.drop_grads()
        self.plumbing.before_rerun()
        self.counters.steps -= 1
        self._start_step()
        p = self._pending
        for i, batch in enumerate(rerun.batches):
            p.micro.append(batch)
            p.indices.append(rerun.indices[i] if rerun.indices else [])
            p.places.append(rerun.places[i] if rerun.places else (self.counters.epoch, self.counters.batch - 1))
            self.forward.run(batch, p)
        return self._read()

    def diagnose(self) -> Diagnosis:
        """Replay the pending step from its pre-step state and say where it goes non-finite.

        Runs on its own when a step trips (``detect.replay``); call it yourself between
        micro-batches to look at a step. Training is left exactly as it was: parameters,
        buffers, gradients and every RNG stream.
        """
        return self.diagnoser.explain(None, micro=self._pending.micro, indices=self._pending.indices)

    # ----------------------------------------------------------------- outcomes
    def _healthy(self, read: detect.StepRead, events: List[Event], rerun_action: str) -> StepResult:
        """Apply a step that read clean; a re-run of an anomalous step trains but is not healthy."""
        rs = self.recovery_state
        rs.count_loss(self.last_loss)  # before the snapshot below, which keeps the epoch's losses
        self.judge.observe(self.last_loss)
        # Mid-climb (divergence.climbing) a read vouches for no snapshot and none is taken: a restore lands before it.
        owed = rs.history.unverified if (climbing := self.divergence.climbing) else 0
        if rerun_action:
            rs.history = read_clean(rs.history)  # vouches for the newest snapshot, ends an fp16 overflow run
        else:
            self.counters.healthy_steps += 1
            new_scale = rs.healthy()  # also vouches for the newest snapshot
            if new_scale is not None:  # the climb is an event at its step
                events.append(self.recovery.lr_changed(new_scale, "healthy run: LR scale climbs back one notch"))
        if owed:
            rs.history = newest_taken(rs.history, owed)
        rs.since_snapshot += 1
        if rs.since_snapshot >= self.cfg.snapshot.every and not climbing:
            events.append(self.snapshot())
        return StepResult(self.counters.steps, True, self.last_loss, self.last_grad_norm, rerun_action, tuple(events))

    def _not_applied(self) -> None:
        self.updates.not_applied(self.last_loss)

    def _after_restore(self, step: int) -> None:
        self.diagnoser.rng_reset()  # the snapshot's RNG state is back
        self.diagnoser.clear(step)
        self._pending.weights = None

    def snapshot(self, force: bool = False) -> Event:
        """Snapshot the whole training state now (the guard also does it every ``snapshot.every`` healthy steps).

        Returns:
            The :class:`SnapshotTaken` event (``action`` ``"saved"`` or ``"refused"`` when not finite).
        """
        return self.snapshots.take(self.state_dict(), self.epoch_rng, force)

    def state_dict(self) -> Dict[str, Any]:
        """The guard's own state, JSON-ready: counters, policy history (with the fp16 overflow
        streak), LR backoff, spike window, divergence window and episode, and the epoch's loss sum and count."""
        return {
            "counters": vars(self.counters).copy(),
            "lr": self.backoff.state_dict(),
            **self.judge.state_dict(),
            **self.recovery_state.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (on resume)."""
        vars(self.counters).update(vars(Counters(**state["counters"])))  # in place: the parts hold it
        self.backoff.load_state_dict(state["lr"])
        self.judge.load_state_dict(state)
        self.recovery_state.load_state_dict(state)

    def _emit(
        self,
        cls: type,
        kind: str,
        action: str,
        message: str,
        detail: Mapping[str, Any],
        at: Optional[Tuple[int, int]] = None,
    ) -> Event:
        """Journal an event at the step; ``at``: the ``(epoch, batch index)`` of the micro-batch it
        is about (an accumulated step's micro-batches each have their own), else the step's last batch."""
        c, kind = self.counters, str(kind)  # the journal holds plain strings
        if cls is AnomalyFound:  # under DDP: which ranks' own values tripped
            detail = self.sync.annotate(detail, kind)
        epoch, batch = at if at is not None else (c.epoch, c.batch - 1)
        return self.bus.emit(
            cls(
                step=c.steps,
                epoch=epoch,
                batch=batch,
                kind=kind,
                action=str(action),
                message=message,
                detail=detail,
                rank=self.rank,
            )
        )
