"""One training step's protocol, usable from any loop.

sanitize -> forward (autocast) -> loss -> backward (scaled) -> unscale -> gradient check ->
ONE host sync -> decide -> clip and step, or carry out the policy's action.

Bad input rows are zero-filled on the device before the forward pass of a model with buffers,
so that the optimistic step cannot poison its running statistics; only when the single read
shows them does the guard go back (now allowed more syncs) to describe, drop, skip or raise.
Everything rich is paid for only when a flag trips.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import detect, distributed, snapshot
from .batches import TARGET_KEYS, compute_loss, pageable_tensors, row_findings, split_batch, to_device, without_rows
from .config import TrainConfig, as_config
from .diagnose import Diagnoser, Diagnosis
from .errors import TrainingAborted
from .events import Aborted, AnomalyFound, Event, EventBus, LRChanged, Restored, SnapshotTaken
from .lr import LRBackoff
from .policy import Decision, History, climb_pending, decide, mark_last_skipped, observe_healthy, record_step
from .spike import SpikeDetector
from .steps import Counters, Pending, Phase, StepResult
from .wrappers import can_force_eager, plain_namer, run_eagerly, unwrap_compiled

__all__ = ["Guard", "StepResult", "Phase"]

logger = logging.getLogger("safetrain")


class Guard:
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

    Example::

        guard = Guard(model, optimizer, "configs/default.yaml", loss_fn=F.cross_entropy)
        with guard:
            for batch in loader:
                result = guard.step(batch)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: Any = None,
        *,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        scheduler: Any = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        bus: Optional[EventBus] = None,
        run_dir: Optional[str] = None,
    ) -> None:
        self.cfg: TrainConfig = as_config(cfg)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # The forward runs through the user's model; names, hooks and snapshots use what a
        # torch.compile wrapper holds, so they read as in the user's code (no "_orig_mod." prefix)
        # and a snapshot loads into the model compiled or not.
        self._named = named = unwrap_compiled(model)
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.bus = bus if bus is not None else EventBus()
        self.counters = Counters()
        self._history = History()
        # Healthy steps not yet applied to the policy's history: the history is brought up to
        # date when read (decide, snapshot, a user), not rebuilt at every healthy step.
        self._healthy_run = 0
        c = self.cfg
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # A CPU loader's batches follow a model on an accelerator (no-op for a CPU model).
        self._move = c.guard.to_device and self.device.type != "cpu"
        self._pinned_checked = False
        self.amp_dtype = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}[c.amp.dtype]
        if scaler is None and self.amp_dtype is torch.float16:
            scaler = torch.amp.GradScaler(self.device.type, init_scale=c.amp.init_scale)
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.backoff = LRBackoff(optimizer, c.recovery.min_lr)
        sp = c.guard.spike
        self.spike = SpikeDetector(sp.window, sp.min_history, sp.zscore, sp.enabled, sp.min_ratio)
        self.state = snapshot.TrainState(named, optimizer, scheduler=scheduler, scaler=self.scaler)
        self.store = snapshot.make_store(c.snapshot, run_dir=run_dir)
        plain = plain_namer(named)
        # Every parameter, frozen ones too, for the exact check after a trip (a snapshot restores them).
        all_params = [(plain(n), p) for n, p in named.named_parameters()]
        self._params = [(n, p) for n, p in all_params if p.requires_grad]
        self._by_name = dict(self._params)
        # Two parameters looked at per step for gradients left by someone else (O(1), not O(P)).
        self._probe = (self._params[0][1], self._params[-1][1]) if self._params else ()
        # torch's own zero_grad (not overridden by the optimizer's class or instance): _free_grads
        # may run its set_to_none loop itself.
        # (decided here: a zero_grad patched in later is not seen; a wrapper without the class
        # attribute, forwarding through __getattr__, always goes through optimizer.zero_grad)
        self._plain_zero_grad = (getattr(type(optimizer), "zero_grad", None) is torch.optim.Optimizer.zero_grad
                                 and "zero_grad" not in getattr(optimizer, "__dict__", {}))
        # Gradients are always checked (clipping and the scaler need the norm anyway); the
        # activation and weight checks follow detect.mode. Disabled parts are no-ops, not ifs.
        self.grads = detect.GradCheck(self._params)
        self.weights = detect.WeightCheck(self._params, c.detect.check_weights_every, enabled=c.detect.mode != "off")
        self._all_weights = detect.WeightCheck(all_params, 0)  # run(force=True) only
        self.monitor = detect.ActivationMonitor.from_config(named, c.detect)
        self._hooks = self.monitor.attach()
        # Non-finite input values are zero-filled before the optimistic forward only where the
        # forward updates state (BatchNorm running statistics): a model without buffers changes
        # nothing until the step is judged, and saves a copy of every batch.
        self._clean = any(True for _ in model.buffers())
        self._flags = detect.StepFlags()
        self.diagnoser = Diagnoser(named, self.monitor, c.detect.replay, state=self.state, params=self._params,
                                   loss_of=self._eager_loss, autocast=self._autocast, prepare=self._scan_quiet,
                                   accumulate=c.guard.accumulate_steps, clip=c.guard.clip_grad_norm)
        self._retrying = False
        self.phase = Phase.READY
        self._pending = Pending()
        self._overflows = 0  # fp16 overflows in a row
        self._skip_after_restore = 0
        self._since_snapshot = 0
        # A snapshot taken right after an update is finite but may hold a bad update (an LR
        # blow-up). It counts as good only once the next step's read is healthy; if that read
        # trips, the newest snapshot is passed over on restore.
        self._unverified = False
        self._redo = False  # inside the re-run of an anomalous step: trained, but not healthy
        self._grads_dropped = False  # set_to_none already done at the end of the last step
        self._skipped_micro = 0  # micro-batches of the step being skipped after a restore
        self._weight_flag: Optional[torch.Tensor] = None
        self.epoch_rng: Optional[torch.Tensor] = None  # torch RNG at the start of the current epoch
        # Sum and count of this epoch's trained steps' finite losses: the epoch metric of an
        # epoch-interval scheduler (ReduceLROnPlateau). Snapshotted, so a resume mid-epoch keeps it.
        self._epoch_loss: Tuple[float, int] = (0.0, 0)
        self.last_loss = math.nan
        self.last_grad_norm = math.nan
        # Distributed (a process group of > 1 rank): the one read combines every rank's flags with
        # one collective, and snapshots and replays agree across ranks. None: one process, no cost.
        self._dist = distributed.DistributedSync.from_environment(self.device, named)
        self.rank = distributed.rank()  # stamped on every event
        if self._dist is not None:
            self._flags = detect.StepFlags(reduce=self._dist.reduce)
            self.store = self._dist.wrap_store(self.store)
            self.diagnoser.wrap_step_replay(lambda replay: self._dist.wrap_replayer(replay, named))

    @property
    def history(self) -> History:
        """The recovery policy's memory (:class:`~safetrain.policy.History`), up to this step."""
        if self._healthy_run:
            self._history, _ = observe_healthy(self._history, self.cfg.recovery, self._healthy_run)
            self._healthy_run = 0
        return self._history

    @history.setter
    def history(self, value: History) -> None:
        self._history, self._healthy_run = value, 0

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
            self._epoch_loss = (0.0, 0)

    @property
    def epoch_loss(self) -> Optional[float]:
        """The mean loss of this epoch's trained steps so far (non-finite losses left out), or ``None``."""
        total, n = self._epoch_loss
        return total / n if n else None

    # ----------------------------------------------------------------- the step
    def step(self, batch: Any, indices: Optional[Sequence[int]] = None) -> Optional[StepResult]:
        """Feed one (micro-)batch; returns the :class:`StepResult` when an optimizer step was decided.

        With ``guard.accumulate_steps`` = k, the first k - 1 calls only accumulate gradients and
        return ``None``; the k-th makes the single host sync and decides.

        Args:
            batch: the (micro-)batch. Its CPU tensors are copied to the model's accelerator
                (``guard.to_device``), asynchronously when the loader pins memory.
            indices: the dataset index of each row, when known: a replay then names bad samples
                by dataset index (``SafeTrainer.fit`` passes them from a :class:`QuarantineSampler`).

        Raises:
            TrainingAborted: the policy aborted; the model and optimizer are at the last good snapshot.
            BatchError: the batch fits no convention, or ``sanitize.*: raise`` met a bad row.
        """
        if self.phase is Phase.CLOSED:
            raise RuntimeError("Guard.step() after close(); make a new Guard")
        if self.counters.steps == 0 and self.phase is Phase.READY and len(self.store) == 0:
            self.snapshot(force=True)
        self.counters.batch += 1
        if self._skip_after_restore > 0 and self.phase is Phase.READY:
            return self._skip_data()
        if self._move:
            if not self._pinned_checked:
                self._check_pinned(batch)
            batch = to_device(batch, self.device)
        if self.phase is Phase.READY:
            self._start_step()
        self._pending.micro.append(batch)
        self._pending.indices.append(list(indices) if indices is not None else [])
        self._forward_backward(batch)
        if len(self._pending.micro) < self.cfg.guard.accumulate_steps:
            self.phase = Phase.ACCUMULATING
            return None
        return self._finish()

    def _check_pinned(self, batch: Any) -> None:
        """Say once when the first moved batch comes from pageable memory (its copies are staged
        by the host instead of queued); ``DataLoader(pin_memory=True)`` avoids it."""
        self._pinned_checked = True
        pageable = pageable_tensors(batch) if self.device.type == "cuda" else ()
        if pageable:
            logger.info("batches come from pageable host memory (%s): each copy to %s is staged by the host; "
                        "DataLoader(pin_memory=True) makes it asynchronous", ", ".join(pageable[:3]), self.device)

    def flush(self) -> Optional[StepResult]:
        """Take the step of a partial accumulation now (at the end of an epoch or of the data).

        With ``guard.accumulate_steps`` = k and fewer than k micro-batches pending, their summed
        gradients (each scaled by 1/k) make one step; returns ``None`` when nothing is pending.
        """
        if self.phase is not Phase.ACCUMULATING:
            return None
        return self._finish()

    def _start_step(self) -> None:
        probe = self._probe
        if not self._grads_dropped or (probe and (probe[0].grad is not None or probe[1].grad is not None)):
            # The first step, or gradients made outside the guard since its last step (a user's
            # own backward): dropped, or this step's backward would add to them.
            self._free_grads()
        self._grads_dropped = False
        self._pending = Pending()
        self.monitor.reset()
        self.diagnoser.begin_step()
        steps = self.counters.optimizer_steps
        self._weight_flag = self.weights.maybe_run(steps) if steps > 0 else None

    def _autocast(self) -> Any:
        if self.amp_dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _forward_backward(self, batch: Any) -> None:
        p = self._pending
        clean = self._scan(batch)
        # Every forward starts with empty record lists (a compiled graph depends on their length).
        held = self.monitor.set_aside() if len(p.micro) > 1 and self.monitor.enabled else None
        try:
            if self.amp_dtype is None:  # no context to enter and leave: measurably cheaper in a 0.4 ms step
                loss = compute_loss(self.model, clean, self.loss_fn, self.step_fn)
            else:
                with self._autocast():
                    loss = compute_loss(self.model, clean, self.loss_fn, self.step_fn)
        finally:
            if held is not None:
                self.monitor.put_back(held)
        k = self.cfg.guard.accumulate_steps
        scaled = loss / k if k > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        loss = loss.detach()
        if loss.dtype is not torch.float32:  # an fp16/bf16 loss under autocast
            loss = loss.float()
        p.loss = loss if p.loss is None else p.loss + loss

    def _scan(self, batch: Any) -> Any:
        """Zero-fill (or replace) non-finite values on the device and keep the flags for the read."""
        s, p = self.cfg.sanitize, self._pending
        # A plain (inputs, targets) tuple or list, the common case, is taken apart without split_batch.
        parts = None if type(batch) in _PLAIN_PAIRS and len(batch) == 2 else split_batch(batch)
        if parts is None or parts.style == "pair":
            inputs, targets = batch if parts is None else (parts.inputs, parts.targets)
            new_inputs, new_targets = inputs, targets
            if s.inputs != "off":
                scan = detect.scan_batch(inputs, replace=self._replace(s.inputs), clean=self._clean)
                new_inputs = scan.batch
                p.input_values += scan.values
            if s.targets != "off" and not (type(targets) is Tensor and not targets.is_floating_point()):
                # (class indices, the usual targets, hold no NaN/Inf: nothing to scan)
                scan = detect.scan_batch(targets, replace=self._replace(s.targets), clean=self._clean)
                new_targets = scan.batch
                p.target_values += scan.values
            if new_inputs is inputs and new_targets is targets and type(batch) is tuple:
                return batch  # nothing replaced (a model without buffers): the user's (immutable) batch
            return type(batch)((new_inputs, new_targets)) if parts is None else parts.join(new_inputs, new_targets)
        if s.inputs == "off" and s.targets == "off":
            return batch
        scan = detect.scan_batch(batch, replace=self._replace(s.inputs), target_keys=TARGET_KEYS, clean=self._clean,
                                 target_replace=self._replace(s.targets))
        if s.inputs != "off":
            p.input_values += scan.values
        if s.targets != "off":
            p.target_values += scan.target_values
        return scan.batch

    def _replace(self, action: str) -> Optional[Tuple[float, float, float]]:
        s = self.cfg.sanitize
        return (s.nan, s.posinf, s.neginf) if action == "replace" else None

    def _finish(self) -> StepResult:
        p, flags = self._pending, self._flags
        self.counters.steps += 1
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            # GradScaler keeps found_inf and the scale as device tensors; reading them inside our
            # one sync avoids the extra .item() that scaler.step() and get_scale() would make.
            per_device = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
            flags.put("found_inf", sum(per_device.values()) if per_device else None)
            flags.put("scale", self.scaler._scale)
        grads = self.grads.run()
        flags.put("loss", p.loss)  # the sum over micro-batches; the mean is taken on the host
        flags.put("grad_norms", grads.norm_list if grads is not None else None)
        flags.put("input", p.input_values)
        flags.put("target", p.target_values)
        flags.put("forward", self.monitor.records)
        flags.put("weights", self._weight_flag)
        read = flags.read()  # host sync: the one per step (flags, loss and norms together)
        self.last_loss = read.loss / len(p.micro) if read.loss is not None else math.nan
        self.last_grad_norm = read.total_norm if read.total_norm is not None else math.nan
        self._read = read
        return self._decide(read)

    def _decide(self, read: detect.StepRead) -> StepResult:
        kind, evidence = self._judge(read)
        if kind is None:
            return self._healthy(read)
        return self._anomaly(kind, evidence, read)

    def _where(self) -> Dict[str, int]:
        c = self.counters
        return {"step": c.steps, "epoch": c.epoch, "batch_index": c.batch - 1}

    def _judge(self, read: detect.StepRead) -> Tuple[Optional[str], Dict[str, Any]]:
        """Name the anomaly of this step from the host-side read (the most upstream cause first)."""
        c = self.cfg
        if read.weights:
            finding = self._broken_weights(flagged=True)
            if finding is not None:
                return "weights", {"finding": finding}
        if read.input:
            return "input", {}
        if read.target:
            return "target", {}
        forward_tripped, loss_tripped = read.forward_tripped, read.loss_tripped
        if forward_tripped or loss_tripped or (read.gradient and not self._overflowed(read)):
            # Parameters already NaN/Inf (an earlier update, or code outside the step) make every
            # forward trip: named here, before a replay or the ladder spends a step on a symptom.
            finding = self._broken_weights(flagged=False)
            if finding is not None:
                return "weights", {"finding": finding}
        if forward_tripped:
            # The hooks fold a cheap sum; with a finite loss, confirm by an exact re-run (RNG and
            # buffers kept as they were) before calling it, since a finite sum can overflow.
            rerun = None if loss_tripped else self._rerun
            finding = self.monitor.locate(read.forward, rerun=rerun, **self._where())
            if self._dist is not None and rerun is not None:  # confirmed on some rank: on all
                finding = self._dist.agree_finding(finding, lambda: self.monitor.locate(read.forward, **self._where()))
            if finding is not None:
                return "forward", {"finding": finding}
        if loss_tripped:
            return "loss", {"finding": detect.LossFinding(kind="loss", value=self.last_loss, **self._where())}
        if self.scaler is not None and self._overflowed(read):
            self._overflows += 1
            scale = read.extra["scale"][0]
            new_scale = scale * self.scaler.get_backoff_factor()
            if new_scale < c.amp.min_scale or self._overflows >= c.amp.max_overflows:
                return "scaler", {"scale": new_scale, "overflows_in_a_row": self._overflows}
            return "overflow", {"scale": scale, "new_scale": new_scale}
        self._overflows = 0
        threshold = c.guard.grad_norm_threshold
        if read.gradient:
            return "gradient", {"finding": self.grads.finding(read.grad_norms, threshold, **self._where())}
        if threshold is not None and read.total_norm is not None and read.total_norm > threshold:
            return "grad_norm", {"finding": self.grads.finding(read.grad_norms, threshold, **self._where())}
        evidence = self.spike.check(self.last_loss)
        if evidence is not None:
            return "spike", evidence
        return None, {}

    def _overflowed(self, read: detect.StepRead) -> bool:
        """The fp16 GradScaler found Inf/NaN gradients this step (normal: its scale was too high)."""
        return self.scaler is not None and bool(read.extra.get("found_inf", (0.0,))[0])

    def _broken_weights(self, flagged: bool) -> Optional[detect.WeightFinding]:
        """The parameters' exact check (slow path): a finding when some are NaN/Inf, on every rank
        when on any rank (one small collective under DDP, so every rank takes the same decision).

        Args:
            flagged: the step's periodic weight check tripped; else one fused pass runs first.
        """
        if self.cfg.detect.mode == "off":
            return None
        check = self._all_weights
        bad = flagged
        if not flagged:
            value = check.run(force=True)
            bad = value is not None and not math.isfinite(value.item())  # host sync: slow path
        finding = check.finding(**self._where()) if bad else None  # None: the norms overflowed
        if self._dist is None:
            return finding
        ranks = tuple(r for r, v in enumerate(self._dist.gather_int(finding is not None)) if v)
        if not ranks:
            return None
        if finding is None:
            return detect.WeightFinding(kind="weights", nonfinite=(), ranks=ranks, **self._where())
        return dataclasses.replace(finding, ranks=ranks)

    def _rerun(self) -> None:
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                distributed.local(self._named):
            for batch in self._pending.micro:
                with self._autocast():
                    self._eager_loss(self._scan_quiet(batch))

    def _eager_loss(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch, run eagerly (a replay or re-run, under hooks or a dispatch
        mode that a torch.compile'd model must not trace: the run stays compiled after it). A torch
        without compile stances (before 2.6) runs the module inside a compile wrapper instead."""
        model = self.model if can_force_eager() else self._named
        return run_eagerly(lambda: compute_loss(model, batch, self.loss_fn, self.step_fn))

    def _scan_quiet(self, batch: Any) -> Any:
        pending = self._pending
        self._pending = Pending()
        try:
            return self._scan(batch)
        finally:
            self._pending = pending

    # ----------------------------------------------------------------- outcomes
    def _apply_update(self, total: Optional[float]) -> None:
        """Clip with the norm already read, step the optimizer (and scaler), then the scheduler."""
        clip = self.cfg.guard.clip_grad_norm
        if clip is not None and total is not None:
            self.grads.clip_(clip, total)
        self.diagnoser.record_update(self.counters.steps, self._pending.micro, total)  # references only
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self.counters.optimizer_steps += 1
        if self.scheduler is not None:
            self._step_scheduler()
        self._free_grads()
        self._grads_dropped = True  # the next step need not zero them again

    def _free_grads(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``. For torch's own ``zero_grad`` (not overridden)
        and no profiler running, the same loop without the profiler range it opens (a dispatcher
        call, about 10 us a step in the loop of a small model)."""
        if self._plain_zero_grad and not _profiler_enabled():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _count_loss(self) -> None:
        """Add this trained step's loss to the epoch's mean (a non-finite one is left out)."""
        if math.isfinite(self.last_loss):
            total, n = self._epoch_loss
            self._epoch_loss = (total + self.last_loss, n + 1)

    def _drop_grads(self) -> None:
        """Drop this step's gradients; the scaler is told so it starts clean (its scale is kept)."""
        if self.scaler is not None:
            self.scaler.update()
        self._free_grads()
        self._grads_dropped = True

    def _not_applied(self) -> None:
        """The step's update is not applied: drop the gradients, count it, and step the scheduler
        only when it follows batches (``guard.scheduler_follows: batch``)."""
        self._drop_grads()
        self.counters.skipped_batches += 1
        if self.scheduler is not None and self.cfg.guard.scheduler_follows == "batch":
            self._step_scheduler()

    def _step_scheduler(self) -> None:
        if self.cfg.guard.scheduler_interval == "step":
            self.backoff.step(self.scheduler, self.last_loss)

    def _healthy(self, read: detect.StepRead) -> StepResult:
        self._unverified = False  # this healthy read vouches for the newest snapshot
        self._apply_update(read.total_norm)
        self._count_loss()  # before the snapshot below, which keeps the epoch's losses
        self.spike.add(self.last_loss)
        new_scale = None
        if not self._redo:  # a re-run of an anomalous step trains, but is not a healthy step
            self.counters.healthy_steps += 1
            if climb_pending(self._history, self.cfg.recovery):  # the climb is an event at its step
                self.history, new_scale = observe_healthy(self.history, self.cfg.recovery)
            else:
                self._healthy_run += 1  # applied when the history is next read
        events: List[Event] = []
        if new_scale is not None:
            events.append(self._lr_changed(new_scale, "healthy run: LR scale climbs back one notch"))
        self._since_snapshot += 1
        if self._since_snapshot >= self.cfg.snapshot.every:
            event = self.snapshot()
            if event is not None:
                events.append(event)
        self.phase = Phase.READY
        return StepResult(self.counters.steps, True, self.last_loss, self.last_grad_norm, "", tuple(events))

    def _anomaly(self, kind: str, evidence: Dict[str, Any], read: detect.StepRead) -> StepResult:
        c = self.counters
        if kind == "overflow":  # the GradScaler skips the step and backs off: normal in fp16
            self._not_applied()
            c.scaler_skips += 1
            self.phase = Phase.READY
            event = self._emit(AnomalyFound, "scaler", "skip_batch", "fp16 overflow: GradScaler skipped the step "
                               f"and lowered the scale to {evidence['new_scale']:g} (normal)", evidence)
            return StepResult(c.steps, False, self.last_loss, self.last_grad_norm, "skip_batch", (event,))
        detail = dict(evidence)
        if kind in ("input", "target"):
            detail["rows"] = [f for f in self._describe_rows() if f.kind == kind]
            found = len(detail["rows"]) if self._dist is None else sum(self._dist.gather_int(len(detail["rows"])))
            if not found:  # a finite sum overflowed (on every rank): no value is NaN/Inf, judge the rest
                logger.debug("step %d: %s flag tripped but every value is finite (sum overflow)", c.steps, kind)
                return self._decide(dataclasses.replace(read, **{kind: False}))
            if getattr(self.cfg.sanitize, "inputs" if kind == "input" else "targets") == "raise":
                self._not_applied()
                self.phase = Phase.READY
                error = detect.batch_error(detail["rows"])
                self._emit(AnomalyFound, kind, "raise", str(error), {"rows": [f.to_dict() for f in detail["rows"]]})
                raise error
        if kind in _REPLAYED and self.diagnoser.enabled:  # the parameters were finite (_judge checked)
            diagnosis = self.diagnose()
            detail["diagnosis"] = diagnosis
            if not diagnosis.reproducible and not self._retrying:
                return self._retry_transient(kind, detail)
        if kind == "weights" and self.diagnoser.enabled:  # replayed from the snapshot; never retried
            detail["diagnosis"] = self.diagnoser.explain("weights", store=self.store)
        decision, self.history = decide(kind, self.history, self.cfg.recovery, self.cfg.sanitize)
        if kind in ("input", "target") and decision.action != "abort":
            return self._bad_rows(kind, decision, detail)
        finding = detail.get("finding")
        diagnosis = detail.get("diagnosis")
        replayed = f"; replay: {diagnosis.describe()}" if isinstance(diagnosis, Diagnosis) else ""
        message = f"{kind} anomaly: {_summary(kind, detail)}{replayed} -> {decision.action} ({decision.reason})"
        payload = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in detail.items()}
        event = self._emit(AnomalyFound, kind, decision.action, message, {**payload, "rung": decision.rung})
        events: List[Event] = [event]
        action = decision.action
        if action in ("warn", "zero_grads"):
            total = read.total_norm
            if action == "zero_grads":
                total = self._zero_nonfinite_grads_(finding)
            self._apply_update(total if total is not None and math.isfinite(total) else None)
            self._count_loss()
            self.spike.add(self.last_loss)  # ignores a non-finite loss
            self.phase = Phase.READY
            return StepResult(c.steps, True, self.last_loss, self.last_grad_norm, action, tuple(events))
        self._not_applied()
        self.phase = Phase.READY
        if action in ("restore", "scale_lr", "abort"):
            events.append(self._restore(decision))
        if action == "scale_lr":
            events.append(self._lr_changed(decision.lr_scale, f"backoff after {kind}"))
        if action == "abort":
            aborted = self._emit(Aborted, kind, "abort", f"training aborted: {decision.reason}; "
                                 "model and optimizer left at the last good snapshot", {"reason": decision.reason})
            raise TrainingAborted(decision.reason, result=None, event=aborted)
        return StepResult(c.steps, False, self.last_loss, self.last_grad_norm, action, tuple(events))

    def _zero_nonfinite_grads_(self, finding: Any) -> Optional[float]:
        """Zero the gradients named non-finite; returns the total norm of what is left (slow path)."""
        names = getattr(finding, "nonfinite", ()) if finding is not None else ()
        for name in names:
            grad = self._by_name[name].grad
            if grad is not None:
                grad.zero_()
        self.counters.zeroed_grads += len(names)
        grads = self.grads.run()
        return math.hypot(*(float(n) for n in torch.stack(grads.norm_list).tolist())) if grads else None  # host sync: slow path

    def _bad_rows(self, kind: str, decision: Decision, detail: Dict[str, Any]) -> StepResult:
        """The slow path for non-finite input or target rows: skip, replace (already done) or drop."""
        c, action = self.counters, decision.action
        rows: List[Any] = detail["rows"]
        n_rows = len({(f.path.split("]")[0], r) for f in rows for r in f.rows})
        kept: List[Any] = []
        if action == "drop_rows":  # rebuild each micro-batch without its bad rows, to run the step again
            cleaned = [without_rows(b, self._row_findings(i, b)) for i, b in enumerate(self._pending.micro)]
            kept = [b for b, _ in cleaned if b is not None]
            if (self._dist is not None and not self._dist.same_count(len(kept))) or not kept:  # all ranks or none
                action, kept = "skip_batch", []
                self.history = mark_last_skipped(self.history)
            else:
                c.dropped_rows += sum(d for _, d in cleaned)
        where = "; ".join(f.describe() for f in rows[:4])
        why = " (every row is bad)" if action != decision.action else ""
        event = self._emit(AnomalyFound, kind, action, f"non-finite {kind} rows: {where} -> {action}{why}",
                           {"rows": [f.to_dict() for f in rows], "count": n_rows, "rung": decision.rung})
        if action == "skip_batch":
            self._not_applied()
            self.phase = Phase.READY
            return StepResult(c.steps, False, self.last_loss, self.last_grad_norm, action, (event,))
        if action == "replace":
            c.replaced_rows += n_rows
            return self._rejudge(event)
        return self._run_again(kept, action, (event,))

    def _run_again(self, batches: List[Any], action: str, events: Tuple[Event, ...],
                   indices: Optional[List[List[int]]] = None) -> StepResult:
        """Run the same step again on ``batches`` (slow path): its gradients are dropped first, and
        the re-run counts as the same step, trained but not healthy (the policy already has it)."""
        self._drop_grads()
        self.counters.steps -= 1
        self._start_step()
        for i, batch in enumerate(batches):
            self._pending.micro.append(batch)
            self._pending.indices.append(indices[i] if indices else [])
            self._forward_backward(batch)
        self._redo = True
        try:
            result = self._finish()
        finally:
            self._redo = False
        return StepResult(result.step, result.trained, result.loss, result.grad_norm, result.action or action,
                          events + result.events)

    def _retry_transient(self, kind: str, detail: Dict[str, Any]) -> StepResult:
        """The replay was finite: retry the step once instead of climbing the ladder."""
        payload = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in detail.items()}
        event = self._emit(AnomalyFound, kind, "retry", f"{kind} anomaly: {_summary(kind, detail)} -> transient "
                           "(the replay from the same state was finite): retrying the step once", payload)
        self.history = record_step(self.history, self.cfg.recovery, skipped=False)  # one entry for this step
        self._retrying = True
        try:
            return self._run_again(list(self._pending.micro), "retry", (event,), list(self._pending.indices))
        finally:
            self._retrying = False

    def diagnose(self) -> Diagnosis:
        """Replay the pending step from its pre-step state and say where it goes non-finite.

        Runs on its own when a step trips (``detect.replay``); call it yourself between
        micro-batches to look at a step. Training is left exactly as it was: parameters,
        buffers, gradients and every RNG stream.
        """
        micro = [self._scan_quiet(batch) for batch in self._pending.micro]
        return self.diagnoser.explain(None, micro=micro, indices=self._pending.indices)

    def _rejudge(self, event: Event) -> StepResult:
        """After bad values were replaced before the forward pass, judge the rest of the step as usual."""
        self._redo = True
        try:
            result = self._decide(dataclasses.replace(self._read, input=False, target=False))
        finally:
            self._redo = False
        return StepResult(result.step, result.trained, result.loss, result.grad_norm, result.action or "replace",
                          (event,) + result.events)

    def _row_findings(self, index: int, batch: Any) -> List[Any]:
        root = "batch" if len(self._pending.micro) == 1 else f"micro[{index}]"
        return row_findings(batch, self.cfg.sanitize, root)

    def _describe_rows(self) -> List[Any]:
        return [f for i, batch in enumerate(self._pending.micro) for f in self._row_findings(i, batch)]

    # ----------------------------------------------------------------- recovery
    def _restore(self, decision: Decision) -> Event:
        """Put the last good snapshot back, keeping the LR scale and policy history in force now."""
        if self._unverified and len(self.store) > 1:
            # No healthy step has run since the newest snapshot: it may hold the update that broke
            # the run (an LR blow-up leaves finite but ruined weights). Drop it; go one further back.
            self.store.discard_newest()
        self._unverified = False
        info = self.store.restore(self.state)
        self.diagnoser.rng_reset()  # the snapshot's RNG state is back
        self.diagnoser.clear(info.step)
        self.backoff.load_state_dict({"unscaled": info.extra["lr"]["unscaled"]})
        self.counters.restores += 1
        self._since_snapshot = 0
        self._skip_after_restore = self.cfg.recovery.skip_batches_after_restore
        self._weight_flag = None
        return self._emit(Restored, decision.kind, decision.action,
                          f"restored the snapshot of step {info.step} after {decision.kind}", {"snapshot_step": info.step,
                          "path": str(info.path) if info.path else None})

    def _skip_data(self) -> Optional[StepResult]:
        """Skip the data that led into a restore, a whole step (``accumulate_steps`` batches) at a time."""
        self._skipped_micro += 1
        if self._skipped_micro < self.cfg.guard.accumulate_steps:
            return None
        self._skipped_micro = 0
        self._skip_after_restore -= 1
        self.counters.steps += 1
        self.counters.skipped_batches += 1
        self.history = record_step(self.history, self.cfg.recovery, skipped=True)
        if self.scheduler is not None and self.cfg.guard.scheduler_follows == "batch":
            self._step_scheduler()
        event = self._emit(Restored, "restore", "skip_batch", "skipped a step's batches after a restore "
                           "(recovery.skip_batches_after_restore)", {"remaining": self._skip_after_restore})
        return StepResult(self.counters.steps, False, math.nan, math.nan, "skip_batch", (event,))

    def _lr_changed(self, scale: float, why: str) -> Event:
        old = self.backoff.lrs()
        self.backoff.set_scale(scale)
        return self._emit(LRChanged, "lr", "scale_lr", f"LR scale {scale:g} ({why}); lr {old} -> {self.backoff.lrs()}",
                          {"scale": scale, "old_lr": old, "new_lr": self.backoff.lrs()})

    def snapshot(self, force: bool = False) -> Optional[Event]:
        """Snapshot the whole training state now (the guard also does it every ``snapshot.every`` healthy steps).

        Returns:
            The :class:`SnapshotTaken` event (``action`` ``"saved"`` or ``"refused"`` when not finite).
        """
        self._since_snapshot = 0
        tensors = {"epoch_rng": self.epoch_rng} if self.epoch_rng is not None else {}
        info = self.store.save(self.state, counters={"step": self.counters.steps, **vars(self.counters)}, extra=self.state_dict(),
                               extra_tensors=tensors)
        if info is not None:
            self._unverified = not force
            self.diagnoser.clear(self.counters.steps)
        if info is None:
            return self._emit(SnapshotTaken, "snapshot", "refused",
                              "snapshot refused: the state is not finite; the previous one stays", {})
        return self._emit(SnapshotTaken, "snapshot", "saved", f"snapshot of step {self.counters.steps}",
                          {"path": str(info.path) if info.path else None, "forced": force})

    def state_dict(self) -> Dict[str, Any]:
        """The guard's own state, JSON-ready: counters, policy history, LR backoff, spike window, fp16
        streak, and the epoch's loss sum and count."""
        return {
            "counters": vars(self.counters).copy(),
            "history": self.history.to_dict(),
            "lr": self.backoff.state_dict(),
            "spike": self.spike.state_dict(),
            "overflows": self._overflows,
            "epoch_loss": list(self._epoch_loss),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (on resume)."""
        self.counters = Counters(**state["counters"])
        self.history = History.from_dict(state["history"])
        self.backoff.load_state_dict(state["lr"])
        self.spike.load_state_dict(state["spike"])
        self._overflows = int(state["overflows"])
        total, n = state.get("epoch_loss", (0.0, 0))  # absent from snapshots of earlier versions
        self._epoch_loss = (float(total), int(n))

    def _emit(self, cls: type, kind: str, action: str, message: str, detail: Mapping[str, Any]) -> Event:
        c = self.counters
        if self._dist is not None and cls is AnomalyFound:
            ranks = self._dist.tripped_ranks()  # which ranks' own values tripped: for this kind, when it did
            detail = {**detail, "ranks": {kind: ranks[kind]} if kind in ranks else ranks}
        return self.bus.emit(cls(step=c.steps, epoch=c.epoch, batch=c.batch - 1, kind=kind, action=action,
                                 message=message, detail=detail, rank=self.rank))


#: What ``_autocast`` returns without mixed precision: one reusable no-op context, not one a step.
_NO_AUTOCAST = contextlib.nullcontext()
#: Batch types taken as an (inputs, targets) pair without ``split_batch`` (exact types: a named
#: tuple or another subclass goes through it).
_PLAIN_PAIRS = (tuple, list)

#: Whether a torch profiler is recording (a private torch function; if it is ever missing, assume
#: one is, so that zero_grad's profiler range is never lost).
_profiler_enabled: Callable[[], bool] = getattr(torch.autograd, "_profiler_enabled", lambda: True)

#: Kinds a replay can explain (the others are finite outliers or data problems).
_REPLAYED = frozenset({"forward", "loss", "gradient"})


def _summary(kind: str, detail: Mapping[str, Any]) -> str:
    finding = detail.get("finding")
    if finding is not None and hasattr(finding, "describe"):
        return finding.describe()
    if kind == "spike":
        return f"loss {detail['loss']:.4g} is {detail['z']:.1f} robust sigmas above the median {detail['median']:.4g}"
    if kind == "loss":
        return f"loss is {detail['loss']}"
    return ", ".join(f"{k}={v}" for k, v in detail.items() if not isinstance(v, (list, dict)))
