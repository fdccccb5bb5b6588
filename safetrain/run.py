"""One training run around the guard's steps, whichever loop drives them: :class:`Run`.

``SafeTrainer.fit``, the Lightning callback and the Hugging Face callback each drive the guard's
step verbs at their own points; what surrounds the steps is the same and lives here: the run
directory (locked by one run at a time), the journal (``events.jsonl``, per rank) and
``metrics.csv`` (rank 0), ``run_started`` (fresh or resumed, with the run's id), each decided
step's record (its metrics row, the final loss, the progress bar), the end check and the close
(``run_ended`` saying how the run ended, whatever ended it). :class:`FitResult` is what a run came to.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .config import TrainConfig, to_dict
from .ending import describe, ending_of
from .errors import TrainingAborted
from .events import Event, EventBus, Quarantined, RunEnded, RunStarted
from .hooks import HookCaller, RunHook, StepRecord, TensorBoardHook, tensorboard_dir
from .rundir import (
    METRICS_FILE,
    Journal,
    MetricsWriter,
    RunDirBusy,
    RunDirError,
    journal_path,
    lock_run_dir,
    prepare_run_dir,
)
from .steps import Counters, StepResult

__all__ = ["Run", "FitResult"]

logger = logging.getLogger(__name__)


@dataclass
class FitResult(Counters):
    """What a run came to; the same numbers as the journal's summary line and the progress bar.

    Attributes:
        (the counters): every field of :class:`~safetrain.steps.Counters` (steps, optimizer_steps,
            healthy_steps, skipped_batches, dropped_rows, replaced_rows, zeroed_grads, restores,
            scaler_skips, warnings, lr_backoffs, retries, rejected_batches, clipped_steps, epoch, batch), as they
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


class Run:
    """A training run's life around the guard's steps: open, start, record each step, end, close.

    Args:
        run_dir: the run directory (made if missing; ``None``: no files, events go to the log only).
        rank: this process's rank (rank 0 locks the directory and writes ``metrics.csv``; every
            rank writes its journal: ``events.jsonl``, ``events-rank{r}.jsonl``).
        cfg: the run's configuration (``snapshot.every`` paces the metrics' flushes; it is journaled).
        hooks: what receives every event, every decided step and the end (:class:`~safetrain.hooks.RunHook`);
            ``log.tensorboard: true`` adds a :class:`~safetrain.hooks.TensorBoardHook` on rank 0.

    Example::

        run = Run(cfg.log.dir, rank=0, cfg=cfg)
        error = None
        try:
            run.open()
            guard = run.attach(Guard(model, optimizer, cfg, bus=run.bus, run_dir=run.dir_name))
            run.start("start", "started")
            ...                      # steps; run.record(result) for each decided one
            guard.end_run()
        except BaseException as exc:
            error = exc
            raise
        finally:
            run.close(error)

    Raises:
        RunDirError: ``run_dir`` cannot be made or written (at once, naming it).
    """

    def __init__(self, run_dir: Any, rank: int, cfg: TrainConfig, hooks: Sequence[RunHook] = ()) -> None:
        self.hooks = HookCaller(hooks)  # checked before anything is made
        self.dir: Optional[Path] = prepare_run_dir(run_dir) if run_dir else None
        self.rank, self.cfg = rank, cfg
        self.result = FitResult(run_dir=str(self.dir) if self.dir else None)
        self.bus = EventBus()
        if cfg.log.tensorboard:
            tensorboard_dir(self.dir)  # a ConfigError now, without log.dir, rather than after the lock
        self.bus.subscribe(lambda event: self.hooks.call("on_event", event) if self.hooks else None)
        self.result.events = self.bus.events
        self.journal: Optional[Journal] = None
        self.metrics: Optional[MetricsWriter] = None
        self.guard: Any = None  # the Guard, once made
        self.bar: Any = None  # a progress bar (tqdm), if any
        self._lock: Any = None  # the run directory's DirLock (rank 0)
        self._started = time.perf_counter()
        self._closed = False

    @property
    def dir_name(self) -> Optional[str]:
        """The run directory as a string (``None``: none)."""
        return str(self.dir) if self.dir is not None else None

    def open(self, share: Optional[Callable[[Any], Any]] = None) -> None:
        """Lock the run directory (rank 0) before writing anything, then open the journal (every
        rank) and ``metrics.csv`` (rank 0) in it, if any; on an error nothing stays open or locked.

        Args:
            share: under a distributed run, gives every rank rank 0's value
                (:func:`safetrain.distributed.from_rank0`): a directory another run holds is refused
                on every rank at once, instead of rank 0 alone while the others wait in a collective.

        Raises:
            RunDirBusy: another run is writing the directory.
            RunDirError: it cannot be written.
        """
        self._started = time.perf_counter()
        if self.dir is None:
            return
        refused: Optional[RunDirError] = None
        if self.rank == 0:  # the other ranks of a distributed run write beside it (events-rank{r}.jsonl)
            try:
                self._lock = lock_run_dir(self.dir)
            except RunDirError as exc:
                refused = exc
        why = share(str(refused) if refused is not None else None) if share is not None else None
        if refused is not None:
            raise refused
        if why is not None:  # rank 0 was refused: so is this rank, with rank 0's reason
            raise RunDirBusy(f"{why} (rank 0 was refused; rank {self.rank} stops with it)")
        try:
            self.journal = Journal(journal_path(self.dir, self.rank))
            self.bus.journal = self.journal
            if self.rank == 0:
                self.metrics = MetricsWriter(self.dir / METRICS_FILE, flush_every=_flush_every(self.cfg))
                if self.cfg.log.tensorboard:
                    self.hooks.hooks.insert(0, TensorBoardHook(tensorboard_dir(self.dir)))
        except BaseException:
            if self.journal is not None:
                with contextlib.suppress(Exception):  # the error that stopped the opening is the one to see
                    self.journal.close()
            self._unlock()
            raise

    def attach(self, guard: Any) -> Any:
        """The run's guard (made with ``bus=run.bus``): the run's counters and end are its. Returns it."""
        self.guard = guard
        return guard

    # ----------------------------------------------------------------- the start
    def start(
        self, action: str, message: str, detail: Optional[Mapping[str, Any]] = None, epoch: int = 0, batch: int = -1
    ) -> None:
        """Journal ``run_started``: ``action`` ``start`` (a fresh run) or ``resume``; the detail
        carries the configuration and the run's id (each of its snapshots carries the same), so
        runs appended to one directory can be told apart."""
        full = {"config": to_dict(self.cfg), "run_id": getattr(self.guard, "run_id", None), **(detail or {})}
        steps = self.guard.steps if self.guard is not None else 0
        dir_note = f"; run dir {self.dir}"
        self.bus.emit(
            RunStarted(
                step=steps,
                epoch=epoch,
                batch=batch,
                kind="run",
                rank=self.rank,
                action=action,
                message=message + dir_note,
                detail=full,
            )
        )

    # ----------------------------------------------------------------- each step
    def record(self, step: StepResult) -> None:
        """A decided step: its row in ``metrics.csv`` (flushed when it carries events: a killed run
        keeps every row up to an anomaly or a snapshot), the final loss, the progress bar."""
        guard = self.guard
        if self.metrics is not None:
            epoch, batch = guard.position
            self.metrics.write(
                step.step,
                epoch,
                batch,
                step.loss,
                step.grad_norm,
                guard.lr_scale,
                step.trained,
                step.action,
                flush=bool(step.events),
                clipped_to=step.clipped_to,
            )
        if step.trained:  # the last trained step's loss, non-finite too (a run of `warn` steps)
            self.result.final_loss = step.loss
        if self.hooks.hooks:  # nothing is built per step without a hook
            self.hooks.call("on_step", self.step_record(step))
        if self.bar is not None:
            counts = guard.counts
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{step.loss:.4g}",
                gnorm=f"{step.grad_norm:.3g}",
                skipped=counts.skipped_batches,
                restored=counts.restores,
                refresh=False,
            )

    def step_record(self, step: StepResult, lrs: Optional[Sequence[float]] = None) -> StepRecord:
        """A decided step as hooks and trackers receive it (:func:`~safetrain.metrics.step_metrics`).

        Args:
            step: the step's result (from ``decide`` or ``finish_step``).
            lrs: the LRs its update used, when the optimizer's have moved on since (a scheduler
                stepped after it); default the guard's now.
        """
        guard = self.guard
        epoch, batch = guard.position
        return StepRecord(
            step=step.step,
            epoch=epoch,
            batch=batch,
            loss=step.loss,
            grad_norm=step.grad_norm,
            lr_scale=guard.lr_scale,
            lrs=tuple(lrs) if lrs is not None else guard.lrs,
            trained=step.trained,
            action=step.action,
            clipped_to=step.clipped_to,
            counts=dict(vars(guard.counts)),
        )

    def quarantined(self, action: str, message: str, detail: Dict[str, Any], at: Any = None) -> None:
        """Journal a quarantine action (the :class:`QuarantineKeeper`'s callback); ``at``: the
        ``(epoch, batch index)`` of the batch it is about, else the step's."""
        self._emit(Quarantined, action, message, detail, kind="quarantine", at=at)

    # ----------------------------------------------------------------- the end
    def end(self, error: Optional[BaseException] = None) -> Optional[BaseException]:
        """The end of a run a framework drove: unless it ended in ``error``, the guard's end check
        (a trained step, finite parameters); then :meth:`close`. Returns what the run ended with:
        ``error``, the end check's :class:`TrainingAborted`, or ``None``."""
        if error is None and self.guard is not None:
            try:
                self.guard.end_run()
            except TrainingAborted as exc:
                error = exc
        self.close(error)
        return error

    def close(self, error: Optional[BaseException]) -> None:
        """Close everything, each part even if another fails; the journal's last word says how the
        run ended. :attr:`result` takes the guard's counters, its LR scale and the wall time;
        a :class:`TrainingAborted` or interruption carries it as ``.result``. Idempotent.

        Raises:
            RunDirError: the journal or metrics could not be closed and nothing else is being raised.
        """
        if self._closed:
            return
        self._closed = True
        failed: List[Exception] = []

        def attempt(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - every part gets closed; the first failure is raised below
                logger.error("closing the run: %s", exc)
                failed.append(exc)

        result, guard, self.guard = self.result, self.guard, None
        if error is not None and hasattr(error, "result"):
            error.result = result
        ending, detail = ending_of(error)
        if guard is not None:
            attempt(guard.close)  # first: the hooks come off the user's model whatever else fails
            for name, value in vars(guard.counts).items():
                setattr(result, name, value)
            result.lr_scale = guard.lr_scale
        result.wall_time = time.perf_counter() - self._started
        result.ended, result.aborted = ending, ending == "aborted"
        result.error = f"{detail['error']}: {detail['error_message']}" if ending == "failed" else None
        bar, self.bar = self.bar, None
        if bar is not None:
            attempt(bar.close)
        # A run refused before it started (another run's snapshots, a bad resume) says nothing in the
        # journal: a run_ended there would read as the end of the previous run.
        began = any(e.name == "run_started" for e in self.bus.events)
        if began:
            attempt(lambda: self._emit(RunEnded, ending, describe(result), {**result.summary(), **detail}))
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            attempt(metrics.close)
        journal, self.journal = self.journal, None
        if journal is not None:
            attempt(lambda: journal.close(result.summary() if began else None))
        attempt(self._unlock)  # the next run may start once all is written
        if self.hooks:  # last: a hook sees the run as it ended, its files closed
            self.hooks.call("on_end", result)
        if failed and error is None:
            raise failed[0]

    def _unlock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _emit(
        self, cls: type, action: str, message: str, detail: Dict[str, Any], kind: str = "run", at: Any = None
    ) -> None:
        guard = self.guard
        step = guard.steps if guard is not None else self.result.steps
        epoch, batch = guard.position if guard is not None else (self.result.epoch, self.result.batch - 1)
        if at is not None:  # the (epoch, batch index) of the batch the event is about
            epoch, batch = at
        self.bus.emit(
            cls(
                step=step,
                epoch=epoch,
                batch=batch,
                kind=kind,
                rank=self.rank,
                action=action,
                message=message,
                detail=detail,
            )
        )


def _flush_every(cfg: TrainConfig) -> int:
    """Rows the metrics writer may hold: ``snapshot.every``, or 100 under ``auto`` (a snapshot's
    own event flushes them anyway)."""
    every = cfg.snapshot.every
    return every if isinstance(every, int) else 100
