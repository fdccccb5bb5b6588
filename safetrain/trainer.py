"""``SafeTrainer.fit``: the epoch loop around :class:`~safetrain.guard.Guard`, resume, progress and the result."""

from __future__ import annotations

import collections.abc
import itertools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import torch

from . import distributed, snapshot
from .config import ConfigLike, as_config, to_dict
from .diagnose.quarantine import QuarantineKeeper
from .ending import RunWriters, SignalStop, interruption
from .errors import SafetrainError, SnapshotError, TrainingAborted, TrainingInterrupted
from .events import Event, RunStarted
from .guard import Guard, StepResult
from .rundir import MetricsWriter, prepare_run_dir
from .steps import Counters, Phase

__all__ = ["SafeTrainer", "FitResult"]

logger = logging.getLogger("safetrain")


@dataclass
class FitResult(Counters):
    """What a run came to; the same numbers as the journal's summary line and the progress bar.

    Attributes:
        (the counters): every field of :class:`~safetrain.steps.Counters` (steps, optimizer_steps,
            healthy_steps, skipped_batches, dropped_rows, replaced_rows, zeroed_grads, restores,
            scaler_skips, warnings, lr_backoffs, retries, rejected_batches, epoch, batch), as they
            stood at the end: every action the guard took is counted in one of them.
        lr_scale: the LR scale in force at the end.
        final_loss: the loss of the last trained step (``nan`` if none).
        wall_time: seconds spent in ``fit``.
        aborted: whether the run ended in ``TrainingAborted``.
        ended: how the run ended, as the journal's ``run_ended`` says: ``done`` (it trained to the
            end), ``aborted``, ``interrupted`` (a signal, Ctrl-C) or ``failed`` (an exception).
        error: for ``failed``, the exception's type and message.
        run_dir: the run directory, when ``log.dir`` is set.
        events: every event of the run, in order (the journal holds the same records).
    """

    lr_scale: float = 1.0
    final_loss: float = math.nan
    wall_time: float = 0.0
    aborted: bool = False
    ended: str = "done"
    error: Optional[str] = None
    run_dir: Optional[str] = None
    events: List[Event] = field(default_factory=list)

    def summary(self) -> Dict[str, Any]:
        """Every field but ``events``, JSON-ready."""
        out = {k: v for k, v in vars(self).items() if k != "events"}
        out["events"] = len(self.events)
        return out


class SafeTrainer:
    """Train a model with detection and recovery on every step.

    Args:
        model: the module to train.
        optimizer: its optimizer.
        cfg: a YAML path, dict, DictConfig or TrainConfig (see :func:`safetrain.load_config`).
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
        scheduler: an LR scheduler; it follows optimizer steps, and LR backoff holds on top of it.
        step_fn: ``step_fn(model, batch) -> loss`` for any other batch.
        scaler: a ``torch.amp.GradScaler`` to use instead of the one ``amp.dtype: float16`` makes.

    Example::

        trainer = SafeTrainer(model, optimizer, "configs/default.yaml", loss_fn=F.cross_entropy)
        result = trainer.fit(loader, epochs=3)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: ConfigLike = None,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        scheduler: Any = None,
        step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> None:
        self.cfg = as_config(cfg)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.step_fn, self.scaler = loss_fn, step_fn, scaler
        self.guard: Optional[Guard] = None

    def fit(
        self,
        loader: Iterable[Any],
        epochs: int = 1,
        max_steps: Optional[int] = None,
        resume: Union[None, str, Path] = None,
    ) -> FitResult:
        """Train for ``epochs`` over ``loader`` (or until ``max_steps`` steps), surviving anomalies.

        While it runs, SIGTERM and SIGINT (``log.signals``) stop it cleanly after the current step:
        a snapshot of that step (``snapshot.on_signal``, safetensors store), the journal closed
        ``interrupted``, then :class:`~safetrain.errors.TrainingInterrupted` (``log.on_signal``);
        for Ctrl-C a :class:`~safetrain.errors.TrainingKeyboardInterrupt`, a ``KeyboardInterrupt``
        too, so a script's ``except KeyboardInterrupt:`` runs as it always did. A run directory
        (``log.dir``) is written by one run at a time: a second run started on it is refused at once.
        Whatever ends it, the journal's ``run_ended`` says how (``done``, ``aborted``,
        ``interrupted`` or ``failed``) and the guard's hooks come off the model.

        Args:
            loader: an iterable of batches, re-iterated each epoch (a ``DataLoader``, not a generator).
            epochs: number of epochs.
            max_steps: stop after this many steps, whatever the epoch (0: train none).
            resume: a snapshot file, or a directory whose newest valid snapshot is taken: the
                model, optimizer, scheduler, scaler, RNG, counters and data position come back and
                training continues exactly where it stopped. ``"auto"``: resume from
                ``snapshot.dir`` (or ``<log.dir>/snapshots``) if it holds a valid snapshot, else
                start fresh (the form a requeued job needs).

        Returns:
            The :class:`FitResult`.

        Raises:
            TrainingAborted: the policy aborted; ``.result`` is the ``FitResult`` so far and the
                model is left at the last good snapshot.
            TrainingInterrupted: a caught signal stopped the run (``log.on_signal: raise``); ``.result``.
                For SIGINT a ``TrainingKeyboardInterrupt`` (a ``KeyboardInterrupt`` too).
            RunDirError: ``log.dir`` cannot be written (at the start, or a full disk mid-run);
                ``RunDirBusy`` when another run is writing it.
            SafetrainError: ``epochs`` or ``max_steps`` out of range, or a one-shot iterator for several epochs.
        """
        cfg, started = self.cfg, time.perf_counter()
        _check_counts(epochs, max_steps)
        logger.setLevel(cfg.log.level)
        run_dir = prepare_run_dir(cfg.log.dir) if cfg.log.dir else None  # RunDirError naming it, not an OSError later
        rank = distributed.rank()  # under DDP: rank 0 keeps events.jsonl and metrics.csv, rank r events-rank{r}.jsonl
        result = FitResult(run_dir=str(run_dir) if run_dir else None)
        stop, writers, error = SignalStop(cfg.log.signals), RunWriters(), None
        try:
            with stop:  # the previous handlers come back on every way out
                writers.open(run_dir, rank, cfg.snapshot.every)
                result.events = writers.bus.events
                guard = self.guard = writers.guard = Guard(
                    self.model,
                    self.optimizer,
                    cfg,
                    loss_fn=self.loss_fn,
                    step_fn=self.step_fn,
                    scheduler=self.scheduler,
                    scaler=self.scaler,
                    bus=writers.bus,
                    run_dir=str(run_dir) if run_dir else None,
                )
                start_epoch, skip, epoch_rng, resumed = self._resume(guard, resume, run_dir, rank)
                _check_loader(loader, epochs, max_steps, start_epoch)
                writers.bar = _progress(cfg.log.progress and rank == 0, epochs, loader)
                keeper = QuarantineKeeper.for_loader(loader, run_dir, writers.quarantined)
                first, trained = guard.counters.steps, guard.counters.optimizer_steps
                run = _Loop(loader, epochs, max_steps, writers.bar, result, writers.metrics, keeper, stop)
                self._epochs(guard, run, start_epoch, skip, epoch_rng)
                if not stop.requested:  # never "done" untrained or with non-finite parameters: aborts
                    guard.recovery.check_end(guard.counters.steps - first, guard.counters.optimizer_steps - trained)
                if guard.counters.steps == first and resumed is not None:
                    logger.warning(
                        "nothing left to train: resumed from %s at step %d (epoch %d, batch %d), where "
                        "epochs=%d, max_steps=%s end; pass a larger epochs= or max_steps= to train on",
                        resumed, first, start_epoch + 1, skip, epochs, max_steps,
                    )  # fmt: skip
                if stop.requested:
                    error = self._stopped(guard, stop)
        except BaseException as exc:
            error = exc
            if isinstance(exc, (TrainingAborted, TrainingInterrupted)):
                exc.result = result
            raise
        finally:
            writers.close(result, started, error)
        if error is not None:  # a caught signal
            error.result = result
            if cfg.log.on_signal == "raise":
                raise error
        return result

    def _resume(self, guard: Guard, resume: Any, run_dir: Optional[Path], rank: int) -> tuple:
        """Load the snapshot ``resume`` names; ``(start_epoch, skip, epoch_rng, resumed_from)``."""
        auto = isinstance(resume, str) and resume == "auto"
        if auto:
            resume = _auto_resume(self.cfg, run_dir)
        start_epoch, skip, epoch_rng, used = 0, 0, None, {}
        if resume is not None:
            try:
                info = distributed.load_snapshot(resume, guard.state)  # every rank, from the same file
            except SnapshotError as exc:  # checked before the live state is touched: nothing changed
                if not auto:
                    raise
                logger.warning("resume='auto': no valid snapshot (%s); starting fresh", exc)
                return self._resume(guard, None, run_dir, rank)
            guard.load_state_dict(info.extra)
            guard.store.adopt(info.run_id)  # the run goes on: its snapshots are this store's
            passed = [{"path": p, "why": why} for p, why in info.passed_over]  # newer files not usable
            used = {"resumed_from": info.path, "passed_over": passed}
            start_epoch, skip = guard.counters.epoch, guard.counters.batch
            epoch_rng = info.extra_tensors.get("epoch_rng")
        else:  # a fresh run: refuse a directory holding another run's snapshots (or overwrite them)
            dropped = guard.store.check_fresh()
            if dropped:
                used = {"overwritten": dropped}
        guard.bus.emit(
            RunStarted(
                step=guard.counters.steps,
                epoch=start_epoch,
                batch=skip - 1,
                kind="run",
                rank=rank,
                action="resume" if resume else "start",
                message=f"{_resumed(resume, used) if resume else 'started'}; run dir {run_dir}",
                detail={
                    "config": to_dict(self.cfg),
                    "resume": str(resume) if resume else None,
                    "run_id": guard.store.run_id,
                    **used,
                },
            )
        )
        return start_epoch, skip, epoch_rng, resume

    def _stopped(self, guard: Guard, stop: SignalStop) -> TrainingInterrupted:
        """After a caught signal: snapshot the step the run stopped at (a disk store), for resume."""
        c, snap = guard.counters, self.cfg.snapshot
        if snap.on_signal and snap.store == "safetensors" and guard.phase is not Phase.ACCUMULATING:
            latest = guard.store.latest()
            if latest is None or latest.step != c.steps:
                guard.snapshot()
        return interruption(
            f"{stop.name}: stopped after step {c.steps} (epoch {c.epoch + 1}, batch {c.batch}); "
            "resume with fit(..., resume='auto') or resume=<snapshot dir>",
            stop.signum,
        )

    def _epochs(
        self, guard: Guard, run: "_Loop", start_epoch: int, skip: int, epoch_rng: Optional[torch.Tensor]
    ) -> None:
        cfg, keeper, max_steps = self.cfg, run.keeper, run.max_steps
        sampler = getattr(run.loader, "sampler", None)

        def over() -> bool:  # checked after each step: a caught signal stops within one step
            return run.stop.requested or (max_steps is not None and guard.counters.steps >= max_steps)

        for epoch in range(start_epoch, run.epochs):
            if over():
                return
            if hasattr(sampler, "set_epoch"):  # DistributedSampler: a new shuffle each epoch, the same on resume
                sampler.set_epoch(epoch)
            resuming = epoch == start_epoch and (skip > 0 or epoch_rng is not None)
            if resuming and epoch_rng is not None:
                # Re-create the epoch's shuffle exactly: the loader draws its seeds from the RNG
                # as it was at the start of the epoch; then go back to the snapshot's RNG.
                now = torch.get_rng_state()
                torch.set_rng_state(epoch_rng)
                guard.begin_epoch(epoch, resumed=True)
                iterator = iter(run.loader)
                skipped = _advance(iterator, skip, keeper)
                guard.counters.batch = skipped
                torch.set_rng_state(now)
            else:
                guard.begin_epoch(epoch)
                iterator = iter(run.loader)
                if guard.counters.steps == 0:  # a fresh run: the start level, before its first step
                    iterator = _measure_start(guard, iterator, cfg.guard.accumulate_steps)
            seen = 0
            for batch in iterator:
                seen += 1
                at = (guard.counters.epoch, guard.counters.batch)  # the batch's place, once it arrives
                step = guard.step(batch, keeper.indices_for(batch, at))
                if step is None:
                    continue
                run.record(guard, step)
                if over():
                    return
            step = guard.flush()  # a partial accumulation does not leak into the next epoch
            if step is not None:
                run.record(guard, step)
            if seen == 0 and not resuming:
                logger.warning(
                    "epoch %d: the loader gave no batch (an exhausted iterator or an empty dataset); nothing trained",
                    epoch + 1,
                )
            keeper.end_epoch()
            if self.scheduler is not None and cfg.guard.scheduler_interval == "epoch":
                guard.backoff.step(self.scheduler, guard.epoch_loss)  # the whole epoch's, across a resume


def _measure_start(guard: Guard, iterator: Iterator[Any], accumulate: int) -> Iterator[Any]:
    """The first epoch's iterator, after the guard measured the start model's loss on the two
    batches after the first step's (:meth:`Guard.measure_start`); the batches come in the same order."""
    head = list(itertools.islice(iterator, accumulate + 2))
    if len(head) == accumulate + 2:
        guard.measure_start(head[accumulate:])
    return itertools.chain(head, iterator)


@dataclass
class _Loop:
    """What the epoch loop carries: its bounds, the result it fills and the writers of each step."""

    loader: Iterable[Any]
    epochs: int
    max_steps: Optional[int]
    bar: Any
    result: FitResult
    metrics: Optional[MetricsWriter]
    keeper: QuarantineKeeper
    stop: SignalStop

    def record(self, guard: Guard, step: StepResult) -> None:
        """One decided step into the quarantine, ``metrics.csv``, the result and the progress bar."""
        self.keeper.after_step(step.events)
        c = guard.counters
        if self.metrics is not None:  # an anomaly or a snapshot flushes: a killed run keeps every row up to here
            self.metrics.write(
                step.step,
                c.epoch,
                c.batch - 1,
                step.loss,
                step.grad_norm,
                guard.backoff.scale,
                step.trained,
                step.action,
                flush=bool(step.events),
            )
        if step.trained:  # the last trained step's loss, non-finite too (a run of `warn` steps)
            self.result.final_loss = step.loss
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{step.loss:.4g}",
                gnorm=f"{step.grad_norm:.3g}",
                skipped=c.skipped_batches,
                restored=c.restores,
                refresh=False,
            )


def _check_counts(epochs: Any, max_steps: Any) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise SafetrainError(f"fit(epochs={epochs!r}): expected an int >= 0")
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 0):
        raise SafetrainError(f"fit(max_steps={max_steps!r}): expected None or an int >= 0")


def _check_loader(loader: Any, epochs: int, max_steps: Optional[int], start_epoch: int) -> None:
    """A one-shot iterator (a generator) is empty after its first epoch: refuse it for several."""
    if not isinstance(loader, collections.abc.Iterator) or epochs - start_epoch <= 1:
        return
    what = (
        f"the loader is a one-shot iterator ({type(loader).__name__}): epochs {start_epoch + 2}..{epochs} get no batch"
    )
    if max_steps is None:
        raise SafetrainError(f"{what}; pass a re-iterable loader (a DataLoader, a list) or epochs=1")
    logger.warning("%s if it runs out before max_steps=%d", what, max_steps)


def _auto_resume(cfg: Any, run_dir: Optional[Path]) -> Optional[str]:
    """``resume="auto"``: the snapshot directory if it holds a valid snapshot, else ``None`` (start fresh)."""
    directory = cfg.snapshot.dir or (str(run_dir / "snapshots") if run_dir is not None else None)
    if directory is None or cfg.snapshot.store != "safetensors":
        logger.warning("resume='auto': no snapshot directory (snapshot.store is not safetensors); starting fresh")
        return None
    if os.path.isdir(directory) and (snapshot.list_snapshots(directory) or distributed.sharded_snapshots(directory)):
        return directory  # safetensors files, or FSDP2's sharded snapshot directories
    logger.info("resume='auto': no snapshot in %s; starting fresh", directory)
    return None


def _advance(iterator: Any, n: int, keeper: QuarantineKeeper) -> int:
    """Consume ``n`` batches of an epoch being resumed; returns how many there were."""
    for i in range(n):
        try:
            keeper.indices_for(next(iterator))
        except StopIteration:
            return i
    return n


def _progress(enabled: bool, epochs: int, loader: Any) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm.auto import tqdm

    try:
        total = epochs * len(loader)
    except TypeError:
        total = None
    return tqdm(total=total, desc="safetrain", unit="step", dynamic_ncols=True)


def _resumed(resume: Any, used: Dict[str, Any]) -> str:
    """``resumed from FILE`` (of ``resume``), naming the newer files passed over and why."""
    text = f"resumed from {used.get('resumed_from') or resume}"
    for p in used.get("passed_over", []):
        text += f"; passed over {p['path']} ({p['why']})"
    return text
