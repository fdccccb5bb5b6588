"""``SafeTrainer.fit``: the epoch loop around :class:`~safetrain.guard.Guard`, resume, progress and the result."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch

from . import distributed
from .config import ConfigLike, as_config, to_dict
from .diagnose.quarantine import QuarantineKeeper
from .errors import TrainingAborted
from .events import Event, EventBus, Quarantined, RunEnded, RunStarted
from .guard import Guard, StepResult
from .rundir import METRICS_FILE, Journal, MetricsWriter, journal_path
from .steps import Counters

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
        run_dir: the run directory, when ``log.dir`` is set.
        events: every event of the run, in order (the journal holds the same records).
    """

    lr_scale: float = 1.0
    final_loss: float = math.nan
    wall_time: float = 0.0
    aborted: bool = False
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

        Args:
            loader: an iterable of batches, re-iterated each epoch (a ``DataLoader``).
            epochs: number of epochs.
            max_steps: stop after this many steps, whatever the epoch.
            resume: a snapshot file, or a directory whose newest valid snapshot is taken: the
                model, optimizer, scheduler, scaler, RNG, counters and data position come back and
                training continues exactly where it stopped.

        Returns:
            The :class:`FitResult`.

        Raises:
            TrainingAborted: the policy aborted; ``.result`` is the ``FitResult`` so far and the
                model is left at the last good snapshot.
        """
        cfg, started = self.cfg, time.perf_counter()
        logger.setLevel(cfg.log.level)
        run_dir = Path(cfg.log.dir) if cfg.log.dir else None
        rank = distributed.rank()  # under DDP: rank 0 keeps events.jsonl and metrics.csv, rank r events-rank{r}.jsonl
        journal = Journal(journal_path(run_dir, rank)) if run_dir else None
        metrics = MetricsWriter(run_dir / METRICS_FILE) if run_dir and rank == 0 else None
        bus = EventBus(journal)
        guard = self.guard = Guard(
            self.model,
            self.optimizer,
            cfg,
            loss_fn=self.loss_fn,
            step_fn=self.step_fn,
            scheduler=self.scheduler,
            scaler=self.scaler,
            bus=bus,
            run_dir=str(run_dir) if run_dir else None,
        )
        result = FitResult(run_dir=str(run_dir) if run_dir else None, events=bus.events)
        start_epoch, skip, epoch_rng, used = 0, 0, None, {}
        if resume is not None:
            info = distributed.load_snapshot(resume, guard.state)  # every rank, from the same file
            passed = [{"path": p, "why": why} for p, why in info.passed_over]  # newer files not usable
            used = {"resumed_from": info.path, "passed_over": passed}
            guard.load_state_dict(info.extra)
            start_epoch, skip = guard.counters.epoch, guard.counters.batch
            epoch_rng = info.extra_tensors.get("epoch_rng")
        bus.emit(
            RunStarted(
                step=guard.counters.steps,
                epoch=start_epoch,
                batch=skip - 1,
                kind="run",
                rank=rank,
                action="resume" if resume else "start",
                message=f"{_resumed(resume, used) if resume else 'started'}; run dir {run_dir}",
                detail={"config": to_dict(cfg), "resume": str(resume) if resume else None, **used},
            )
        )
        bar = _progress(cfg.log.progress and rank == 0, epochs, loader)

        def quarantined(action: str, message: str, detail: Dict[str, Any]) -> None:
            c = guard.counters
            bus.emit(
                Quarantined(
                    step=c.steps,
                    epoch=c.epoch,
                    batch=c.batch - 1,
                    kind="quarantine",
                    action=action,
                    message=message,
                    detail=detail,
                    rank=rank,
                )
            )

        keeper = QuarantineKeeper(getattr(loader, "sampler", None), run_dir, quarantined)
        try:
            self._epochs(guard, loader, epochs, max_steps, start_epoch, skip, epoch_rng, bar, result, metrics, keeper)
        except TrainingAborted as exc:
            result.aborted = True
            exc.result = result
            raise
        finally:
            self._finish(guard, result, started)
            c = guard.counters
            bus.emit(
                RunEnded(
                    step=c.steps,
                    epoch=c.epoch,
                    batch=c.batch - 1,
                    kind="run",
                    rank=rank,
                    action="aborted" if result.aborted else "done",
                    message=_describe(result),
                    detail=result.summary(),
                )
            )
            guard.close()
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
            if journal is not None:
                journal.close(result.summary())
        return result

    def _epochs(
        self,
        guard: Guard,
        loader: Iterable[Any],
        epochs: int,
        max_steps: Optional[int],
        start_epoch: int,
        skip: int,
        epoch_rng: Optional[torch.Tensor],
        bar: Any,
        result: FitResult,
        metrics: Optional[MetricsWriter],
        keeper: QuarantineKeeper,
    ) -> None:
        cfg = self.cfg
        sampler = getattr(loader, "sampler", None)
        for epoch in range(start_epoch, epochs):
            if hasattr(sampler, "set_epoch"):  # DistributedSampler: a new shuffle each epoch, the same on resume
                sampler.set_epoch(epoch)
            resuming = epoch == start_epoch and (skip > 0 or epoch_rng is not None)
            if resuming and epoch_rng is not None:
                # Re-create the epoch's shuffle exactly: the loader draws its seeds from the RNG
                # as it was at the start of the epoch; then go back to the snapshot's RNG.
                now = torch.get_rng_state()
                torch.set_rng_state(epoch_rng)
                guard.begin_epoch(epoch, resumed=True)
                iterator = iter(loader)
                skipped = _advance(iterator, skip, keeper)
                guard.counters.batch = skipped
                torch.set_rng_state(now)
            else:
                guard.begin_epoch(epoch)
                iterator = iter(loader)

            def record(step: StepResult) -> None:
                keeper.after_step(step.events)
                if metrics is not None:  # an anomaly or a snapshot flushes: a killed run keeps every row up to here
                    c = guard.counters
                    metrics.write(
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
                if step.trained and math.isfinite(step.loss):
                    result.final_loss = step.loss
                if bar is not None:
                    bar.update(1)
                    c = guard.counters
                    bar.set_postfix(
                        loss=f"{step.loss:.4g}",
                        gnorm=f"{step.grad_norm:.3g}",
                        skipped=c.skipped_batches,
                        restored=c.restores,
                        refresh=False,
                    )

            for batch in iterator:
                step = guard.step(batch, keeper.indices_for(batch))
                if step is None:
                    continue
                record(step)
                if max_steps is not None and guard.counters.steps >= max_steps:
                    return
            step = guard.flush()  # a partial accumulation does not leak into the next epoch
            if step is not None:
                record(step)
            keeper.end_epoch()
            if self.scheduler is not None and cfg.guard.scheduler_interval == "epoch":
                guard.backoff.step(self.scheduler, guard.epoch_loss)  # the whole epoch's, across a resume

    def _finish(self, guard: Guard, result: FitResult, started: float) -> None:
        for f in dataclasses.fields(Counters):
            setattr(result, f.name, getattr(guard.counters, f.name))
        result.lr_scale = guard.backoff.scale
        result.wall_time = time.perf_counter() - started


def _advance(iterator: Any, n: int, keeper: QuarantineKeeper) -> int:
    """Consume ``n`` batches of an epoch being resumed; returns how many there were."""
    for i in range(n):
        try:
            keeper.indices_for(next(iterator))
        except StopIteration:
            return i
    return n


def _describe(result: FitResult) -> str:
    return (
        f"{'aborted' if result.aborted else 'finished'}: {result.steps} steps, {result.healthy_steps} healthy, "
        f"{result.skipped_batches} skipped, {result.dropped_rows} rows dropped, {result.zeroed_grads} grads zeroed, "
        f"{result.restores} restores, LR scale {result.lr_scale:g}, final loss {result.final_loss:.4g}"
    )


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
