"""What a :class:`~safetrain.guard.Guard` is made of, and what its drivers ask of it around the steps.

:class:`Parts` builds every part from the configuration (each takes its own section) and answers
the drivers (``SafeTrainer.fit``, the Lightning and Hugging Face callbacks) about the run: where
it stands (:attr:`~Parts.counts`, :attr:`~Parts.position`, :attr:`~Parts.lr_scale`), resume or a
fresh start, the epoch's end, the run's end (:meth:`~Parts.end_run`), a stop after an abort
(:meth:`~Parts.stop`), schedulers the caller steps. The step itself, its four verbs and
``Guard.step``, is :mod:`.protocol`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch

from .. import detect, distributed, snapshot
from ..adapters.compiled import plain_namer, unwrap_compiled
from ..config import ConfigLike, TrainConfig, as_config
from ..diagnose import Diagnoser
from ..events import Event, EventBus
from ..optimizers import as_optimizer, as_scheduler
from ..policy import History, Rules
from ..snapshot import SnapshotInfo
from ..stats.divergence import DivergenceDetector
from ..stats.gradclip import NormStats
from ..stats.spike import SpikeDetector
from ..steps import Counters, Pending
from .context import Context, Detectors
from .decisions import Decisions
from .forward import Forward
from .journal import StepJournal
from .judge import Judge
from .lazy import LazyParams
from .lr import LRBackoff
from .machine import MID_STEP, Machine, Phase
from .measure import measure
from .plumbing import Buffers, Plumbing
from .recovery import Recovery
from .snapshots import Snapshots
from .state import RecoveryState
from .stepping import Stepper
from .update import Updates

__all__ = ["Parts"]

logger = logging.getLogger(__name__)

_Self = TypeVar("_Self", bound="Parts")  # ``with Guard(...) as guard``: a Guard


class Parts:
    """A guard's parts, built from its configuration, and the run-level calls its drivers make.

    The arguments are :class:`~safetrain.guard.Guard`'s (documented there).
    """

    # What the guard is made of, in the order it is built (each part from its config section, the
    # context and the parts it reads; no part is handed a callable into another).
    cfg: TrainConfig
    plumbing: Plumbing  # device, autocast, scaler, freeing gradients
    sync: Any  # distributed.LocalSync or DistributedSync
    counters: Counters  # one writer each; read by FitResult, the progress bar and the journal (through counts)
    context: Context  # what every part shares: the counters, the journal, the sync
    state: snapshot.TrainState  # the whole training state, for snapshots
    recovery_state: RecoveryState  # the policy's history and what recovery remembers
    detectors: Detectors  # what the step's read holds values of, and the loss and norm statistics:
    monitor: detect.ActivationMonitor  # forward hooks (detect.mode)
    grads: detect.GradCheck  # the fused gradient norms
    weights: detect.WeightCheck  # the periodic weight check
    spike: SpikeDetector  # loss spikes
    divergence: DivergenceDetector  # a loss growing geometrically
    norm_stats: NormStats  # the gradient norm's EMA statistics (adaptive clipping, the adaptive grad_norm anomaly)
    backoff: LRBackoff  # the LR scale on top of the schedule
    forward: Forward  # one micro-batch through the model
    stepper: Stepper  # moves the optimizer: every one, a named step's, or with a closure (LBFGS)
    diagnoser: Diagnoser  # the slow path's replays and the cause test
    lazy: LazyParams  # a lazy module's parameters, once its first forward made them
    store: Any  # where snapshots go
    snapshots: Snapshots  # takes them, and records what each owes before it is vouched for
    updates: Updates  # applies a step's update, or drops it; the scheduler
    judge: Judge  # a step's read -> its anomaly
    recovery: Recovery  # carries out decisions
    decisions: Decisions  # the decision loop: judge, diagnose, decide, carry out
    machine: Machine  # the step's state machine: its phase, its driver, the facts of the step under way

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        cfg: ConfigLike = None,
        *,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        step_fn: Union[None, Callable[[torch.nn.Module, Any], torch.Tensor], Mapping[str, Callable[..., Any]]] = None,
        scheduler: Any = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        bus: Optional[EventBus] = None,
        run_dir: Optional[str] = None,
    ) -> None:
        # Several optimizers (a sequence or a dict: Muon + AdamW, a GAN's two) step as one, and
        # several schedulers; one is itself (its path and snapshot format unchanged).
        optimizer, scheduler = as_optimizer(optimizer), as_scheduler(scheduler)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # The forward runs through the user's model; names, hooks and snapshots use what a
        # torch.compile wrapper holds, so they read as in the user's code (no "_orig_mod." prefix)
        # and a snapshot loads into the model compiled or not.
        self._named = named = unwrap_compiled(model)
        # One process, DDP or FSDP2; anything else is refused here (FSDP2: replays off, sharded snapshots).
        self.layout = layout = distributed.layout_of(named)
        self.cfg = c = distributed.for_layout(layout, as_config(cfg))
        self.rules = Rules.of(c)
        self.bus = bus if bus is not None else EventBus()

        # The run every part works in: device, autocast and scaler; the sync (under DDP one
        # collective combines every rank's flags, and snapshots and replays agree across ranks);
        # the counters and the journal.
        self.plumbing = pipes = Plumbing(model, optimizer, c.amp, scaler, c.guard.to_device)
        self.device = pipes.device
        self.scaler: Optional[torch.amp.GradScaler] = pipes.scaler.scaler  # the GradScaler in use (snapshots keep it)
        self.sync = sync = distributed.make_sync(self.device, named)
        self.rank = sync.rank  # stamped on every event
        self.counters = counters = Counters()
        self.context = ctx = Context(counters, StepJournal(self.bus, counters, sync), sync)

        # What a snapshot holds, and what the checks watch: every parameter, frozen ones too (one
        # may be unfrozen mid-run; a snapshot restores them), by the name the user's code gives it.
        self.state = state = distributed.train_state(layout, named, optimizer, scheduler=scheduler, scaler=self.scaler)
        state.accept_nonfinite_buffers()  # a -inf causal mask is part of the model (host sync: once)
        plain = plain_namer(named)
        self._all_params = all_params = [(plain(n), p) for n, p in named.named_parameters()]
        self._params = [(n, p) for n, p in all_params if p.requires_grad]
        buffers = Buffers(named, plain)  # what a forward changes before the step is judged (BatchNorm's)

        # The parts, each from its section, the context and the parts it reads.
        self.recovery_state = rs = RecoveryState(c.recovery)
        self.detectors = det = Detectors.of(c, named, all_params, buffers, state)
        self.monitor, self.grads, self.weights = det.monitor, det.grads, det.weights  # (by name: read every step)
        self.spike, self.divergence, self.norm_stats = det.spike, det.divergence, det.norm_stats
        self.backoff = backoff = LRBackoff(optimizer, c.recovery.min_lr, ctx.journal, c.recovery.reset_after)
        steps = dict(step_fn) if isinstance(step_fn, Mapping) else {}  # named steps: a GAN's "d" and "g"
        self.forward = fwd = Forward(
            detect.StepFlags(reduce=sync.reduce),
            det.grads,
            model,
            named,
            det.monitor,
            pipes,
            buffers,
            c.sanitize,
            c.guard.accumulate_steps,
            loss_fn=loss_fn,
            step_fn=None if steps else step_fn,
        )
        self.stepper = Stepper(optimizer, fwd, det.grads, pipes, steps)  # plain, a named step's, or a closure (LBFGS)
        self.diagnoser = diag = self._diagnoser(bool(steps))
        self.lazy = LazyParams(named, fwd, pipes, det.monitor, state, (det.grads, det.weights, det.all_weights))
        self.store = store = distributed.make_store(layout, c.snapshot, run_dir, sync)
        self.snapshots = snaps = Snapshots(c.snapshot, ctx, store, state, rs, diag)
        self.updates = updates = Updates(c.guard, ctx, det, pipes, scheduler, backoff, diag)
        self.judge = judge = Judge(c, ctx, det, pipes, fwd, backoff)
        params = dict(all_params)
        self.recovery = recovery = Recovery(c, ctx, rs, snaps, det, backoff, updates, buffers, diag, params)
        self.decisions = Decisions(ctx, judge, recovery, diag, rs, backoff)

        self.machine = Machine()  # the step's phase, its driver, the facts of the step under way
        self._pending = Pending()
        self.epoch_rng: Optional[torch.Tensor] = None  # torch RNG at the start of the current epoch
        self.last_loss = math.nan
        self.last_grad_norm = math.nan
        self._run_start = (0, 0)  # steps and optimizer steps when this run (or its resume) began

    def _diagnoser(self, named_steps: bool) -> Diagnoser:
        """The slow path's replays (:mod:`safetrain.diagnose`), over the parts that run a step;
        under DDP a replay runs on every rank and they agree."""
        c, fwd, sync = self.cfg, self.forward, self.sync
        diag = Diagnoser(
            self._named,
            self.detectors.monitor,
            c.detect.replay,
            state=self.state,
            params=self._params,
            loss_of=fwd.eager_loss,
            autocast=self.plumbing.autocast,
            prepare=fwd.scan,
            accumulate=c.guard.accumulate_steps,
            clip=c.guard.clip_grad_norm,
            sync=sync,
        )
        diag.wrap_step_replay(lambda replay: distributed.wrap_replayer(replay, sync, self._named))
        if named_steps:  # each update has its own loss and optimizer: the weight replay cannot redo them in order
            diag.weight_replay.never = "named steps (each update its own loss and optimizer) are not replayed"
        return diag

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
    def phase(self) -> Phase:
        """Where the step stands (:class:`~safetrain.guard.machine.Phase`): ``READY`` between steps."""
        return self.machine.phase

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

    # ----------------------------------------------------------------- where the run stands
    @property
    def counts(self) -> Counters:
        """A copy of the guard's counters now (steps, skips, restores, ..., epoch and batch)."""
        return dataclasses.replace(self.counters)

    @property
    def steps(self) -> int:
        """Step attempts so far (one per ``accumulate_steps`` micro-batches)."""
        return self.counters.steps

    @property
    def position(self) -> Tuple[int, int]:
        """``(epoch, batch index)`` of the last batch that arrived (``-1``: none yet this epoch)."""
        return self.counters.epoch, self.counters.batch - 1

    @property
    def lr_scale(self) -> float:
        """The LR scale in force on top of the schedule (1.0 unless the policy backed the LR off)."""
        return self.backoff.scale

    @property
    def lrs(self) -> Tuple[float, ...]:
        """The LR in force of every parameter group, of every optimizer in order (the backoff included)."""
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups)

    @property
    def run_id(self) -> Optional[str]:
        """The run's id, stamped into each of its snapshots (``None``: a store without one)."""
        return getattr(self.store, "run_id", None)

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and release the snapshot store; idempotent."""
        self.monitor.detach()
        if self.machine.phase is not Phase.CLOSED:
            self.store.close()
        self.machine.phase = Phase.CLOSED

    def begin_epoch(self, epoch: int, resumed: bool = False, batch: int = 0) -> None:
        """Mark the start of an epoch: counters move, the RNG state that shuffles it is kept for
        resume, and the epoch's mean loss starts afresh (kept when ``resumed``: an epoch resumed
        mid-way from a snapshot goes on with the losses of its steps before the snapshot);
        ``batch``: the batches of it consumed already (a resume that skipped them)."""
        self.counters.epoch, self.counters.batch = epoch, batch
        self.epoch_rng = torch.get_rng_state()
        self.diagnoser.rng_reset()  # the loader's shuffle draws from the RNG next
        if not resumed:
            self.recovery_state.epoch_loss = (0.0, 0)

    def end_epoch(self) -> None:
        """The epoch's end: a scheduler stepped once an epoch (``guard.scheduler_interval: epoch``)
        steps, on the whole epoch's mean loss, the LR backoff holding on top of it."""
        if self.scheduler is not None and self.cfg.guard.scheduler_interval == "epoch":
            self.backoff.step(self.scheduler, self.epoch_loss)

    @property
    def epoch_loss(self) -> Optional[float]:
        """The mean loss of this epoch's trained steps so far (non-finite losses left out), or ``None``."""
        total, n = self.recovery_state.epoch_loss
        return total / n if n else None

    def measure_start(self, batches: Sequence[Any]) -> List[float]:
        """Before the run's first step, the start model's loss on ``batches`` (two or more the first
        step does not train on) becomes the first steps' reference (:mod:`.measure`); ``fit`` passes
        the two after the first step's. A no-op after the first step and under DDP or FSDP. Returns
        the finite losses measured."""
        if self.counters.steps or self.machine.phase is not Phase.READY or not self.sync.steps_alone:
            return []
        parts = self.forward, self.plumbing, self.monitor, self._named, self.spike, self.recovery_state, self.lazy
        return measure(*parts, batches)

    # ----------------------------------------------------------------- resume or a fresh start
    def resume(self, path: Any) -> SnapshotInfo:
        """Load the snapshot ``path`` names (a file, or a directory's newest valid one) into the
        model, optimizer, scheduler, scaler, RNG and the guard's own state; the run goes on, so its
        snapshots are this guard's from now on. Every rank of a distributed run reads the same one.

        Raises:
            SnapshotError: nothing usable there; checked before the live state is touched.
        """
        info = distributed.load_snapshot(path, self.state)
        self.load_state_dict(info.extra)
        self.store.adopt(info.run_id)
        return info

    def check_fresh(self) -> List[str]:
        """A fresh run: refuse a snapshot directory holding another run's snapshots (or, as
        configured, overwrite them); returns the files overwritten."""
        return list(self.store.check_fresh() or [])

    def snapshot_for_resume(self) -> Optional[Event]:
        """After a stop signal: snapshot the step the run stopped at, unless a disk snapshot of it
        exists or a step is half accumulated (``snapshot.on_signal``, safetensors store only)."""
        snap = self.cfg.snapshot
        if not snap.on_signal or snap.store != "safetensors" or self.machine.phase in MID_STEP:
            return None
        latest = self.store.latest()
        if latest is not None and latest.step == self.counters.steps:
            return None
        return self.snapshot()

    # ----------------------------------------------------------------- schedulers the caller steps
    def follow_scheduler(self, scheduler: Any) -> None:
        """A scheduler the caller's loop steps (a framework's): it does not advance after a step
        whose update was not applied (unless ``guard.scheduler_follows: batch``), and the LR
        backoff holds on top of it. The guard's own scheduler, once followed, is no longer stepped
        by the guard."""
        self.updates.follow(scheduler)

    def keep_schedule(self, lrs: Sequence[float]) -> None:
        """Take ``lrs`` as the schedule's LRs now (the backoff's scale stays on top): after a
        restore put the snapshot's LR back under a scheduler that is not in the snapshot."""
        self.backoff.load_state_dict({"unscaled": list(lrs)})

    # ----------------------------------------------------------------- the end
    def stop(self) -> None:
        """The run stopped (an abort the framework winds down): the gradients are dropped and the
        followed scheduler does not advance, so an optimizer step the caller still takes changes nothing."""
        self.updates.stopped()

    def end_run(self) -> None:
        """The end of a run that was not stopped: it must have trained (a step since it began or
        resumed, an update applied) and end with finite parameters, else it aborts.

        Raises:
            TrainingAborted: nothing trained, or the model ends non-finite (restored first when it can be).
        """
        steps, trained = self._run_start
        self.recovery.check_end(self.counters.steps - steps, self.counters.optimizer_steps - trained)

    # ----------------------------------------------------------------- state
    def snapshot(self, force: bool = False) -> Event:
        """Snapshot the whole training state now (the guard also does it every ``snapshot.every`` healthy steps).

        Returns:
            The :class:`SnapshotTaken` event (``action`` ``"saved"`` or ``"refused"`` when not finite).
        """
        return self.snapshots.take(self.state_dict(), self.epoch_rng, force)

    def state_dict(self) -> Dict[str, Any]:
        """The guard's own state, JSON-ready: the run's id, counters, policy history (with the fp16
        overflow streak), LR backoff, spike window, divergence window and episode, the gradient
        norm's EMA statistics (``grad_norm``), whether a clip episode is open (``clip_episode``: a resumed
        run's next clipped step goes on it, not journaled again), and the epoch's loss sum and count."""
        return {
            "run_id": self.run_id,
            "counters": vars(self.counters).copy(),
            "lr": self.backoff.state_dict(),
            "grad_norm": self.norm_stats.state_dict(),
            "clip_episode": self.updates.episode,
            **self.judge.state_dict(),
            **self.recovery_state.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (on resume); the run's end is judged from here,
        and the run goes on under its id (a framework's checkpoint resumed: the same run in the journal)."""
        if state.get("run_id"):
            self.store.adopt(state["run_id"])
        vars(self.counters).update(vars(Counters(**state["counters"])))  # in place: the parts hold it
        self.backoff.load_state_dict(state["lr"])
        self.norm_stats.load_state_dict(state.get("grad_norm", {}))  # (absent from earlier snapshots)
        self.updates.episode = bool(state.get("clip_episode", False))
        self.judge.load_state_dict(state)
        self.recovery_state.load_state_dict(state)
        self._run_start = (self.counters.steps, self.counters.optimizer_steps)
