"""``SafeTrainer.fit``: the epoch loop around :class:`~safetrain.guard.Guard`, resume, progress and the result."""

from __future__ import annotations

import collections.abc
import itertools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Sequence, Union

import torch

from . import distributed, snapshot
from .adapters.compiled import unwrap_compiled
from .config import ConfigLike, as_config
from .diagnose.quarantine import QuarantineKeeper
from .ending import SignalStop, interruption
from .errors import SafetrainError, SnapshotError, TrainingInterrupted
from .guard import Guard, StepResult
from .hooks import RunHook
from .run import FitResult, Run

__all__ = ["SafeTrainer", "FitResult"]

logger = logging.getLogger(__name__)


class SafeTrainer:
    """Train a model with detection and recovery on every step.

    Args:
        model: the module to train.
        optimizer: its optimizer, or several stepped together: a list or a dict ``name ->
            optimizer`` (Muon + AdamW; :mod:`safetrain.optimizers`). One whose ``step`` needs a
            closure (LBFGS) is handed one that re-runs the guarded forward and backward.
        cfg: a YAML path, dict, DictConfig or TrainConfig (see :func:`safetrain.load_config`).
        loss_fn: ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches.
        scheduler: an LR scheduler (or a list or dict of them, one per optimizer); it follows
            optimizer steps, and LR backoff holds on top of it.
        step_fn: ``step_fn(model, batch) -> loss`` for any other batch.
        scaler: a ``torch.amp.GradScaler`` to use instead of the one ``amp.dtype: float16`` makes.

    Example::

        trainer = SafeTrainer(model, optimizer, "configs/default.yaml", loss_fn=F.cross_entropy)
        result = trainer.fit(loader, epochs=3)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
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
        hooks: Sequence[RunHook] = (),
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
            hooks: :class:`~safetrain.hooks.RunHook` objects that receive every event as it is
                journaled, every decided step (a :class:`~safetrain.hooks.StepRecord`) and the
                :class:`FitResult` at the end, on every rank (``log.tensorboard: true`` adds a
                TensorBoard writer on rank 0). They observe; a hook that raises is logged and dropped.

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
        cfg = self.cfg
        _check_counts(epochs, max_steps)
        # under DDP: rank 0 keeps events.jsonl and metrics.csv, rank r events-rank{r}.jsonl
        run = Run(cfg.log.dir, distributed.rank(), cfg, hooks)  # RunDirError naming it, not an OSError later
        stop, error = SignalStop(cfg.log.signals), None
        try:
            with stop:  # the previous handlers come back on every way out
                run.open(share=lambda value: distributed.from_rank0(value, unwrap_compiled(self.model)))
                guard = self.guard = run.attach(
                    Guard(
                        self.model,
                        self.optimizer,
                        cfg,
                        loss_fn=self.loss_fn,
                        step_fn=self.step_fn,
                        scheduler=self.scheduler,
                        scaler=self.scaler,
                        bus=run.bus,
                        run_dir=run.dir_name,
                    )
                )
                start_epoch, skip, epoch_rng, resumed = self._resume(guard, resume, run)
                _check_loader(loader, epochs, max_steps, start_epoch)
                run.bar = _progress(cfg.log.progress and run.rank == 0, epochs, loader)
                keeper = QuarantineKeeper.for_loader(loader, run.dir, run.quarantined, sync=guard.sync)
                first = guard.steps
                loop = _Loop(loader, epochs, max_steps, run, keeper, stop)
                self._epochs(guard, loop, start_epoch, skip, epoch_rng)
                if not stop.requested:  # never "done" untrained or with non-finite parameters: aborts
                    guard.end_run()
                if guard.steps == first and resumed is not None:
                    logger.warning(
                        "nothing left to train: resumed from %s at step %d (epoch %d, batch %d), where "
                        "epochs=%d, max_steps=%s end; pass a larger epochs= or max_steps= to train on",
                        resumed,
                        first,
                        start_epoch + 1,
                        skip,
                        epochs,
                        max_steps,
                    )
                if stop.requested:
                    error = self._stopped(guard, stop)
        except BaseException as exc:
            error = exc
            raise
        finally:
            run.close(error)
        if error is not None:  # a caught signal
            if cfg.log.on_signal == "raise":
                raise error
        return run.result

    def _resume(self, guard: Guard, resume: Any, run: Run) -> tuple:
        """Load the snapshot ``resume`` names, journal the start; ``(start_epoch, skip, epoch_rng, resumed_from)``."""
        auto = isinstance(resume, str) and resume == "auto"
        if auto:
            resume = _auto_resume(self.cfg, run.dir)
        start_epoch, skip, epoch_rng, used = 0, 0, None, {}
        if resume is not None:
            try:
                info = guard.resume(resume)  # every rank, from the same file
            except SnapshotError as exc:  # checked before the live state is touched: nothing changed
                if not auto:
                    raise
                logger.warning("resume='auto': no valid snapshot (%s); starting fresh", exc)
                return self._resume(guard, None, run)
            passed = [{"path": p, "why": why} for p, why in info.passed_over]  # newer files not usable
            used = {"resumed_from": info.path, "passed_over": passed}
            if info.changed_since:  # the model or optimizer changed layout since the snapshot
                used["changed_since"] = list(info.changed_since)
            start_epoch, skip = guard.position[0], guard.position[1] + 1
            epoch_rng = info.extra_tensors.get("epoch_rng")
        else:  # a fresh run: refuse a directory holding another run's snapshots (or overwrite them)
            dropped = guard.check_fresh()
            if dropped:
                used = {"overwritten": dropped}
        message = _resumed(resume, used) if resume else "started"
        run.start(
            "resume" if resume else "start",
            message,
            {"resume": str(resume) if resume else None, **used},
            epoch=start_epoch,
            batch=skip - 1,
        )
        return start_epoch, skip, epoch_rng, resume

    def _stopped(self, guard: Guard, stop: SignalStop) -> TrainingInterrupted:
        """After a caught signal: snapshot the step the run stopped at (a disk store), for resume."""
        guard.snapshot_for_resume()
        epoch, batch = guard.position
        return interruption(
            f"{stop.name}: stopped after step {guard.steps} (epoch {epoch + 1}, batch {batch + 1}); "
            "resume with fit(..., resume='auto') or resume=<snapshot dir>",
            stop.signum,
        )

    def _epochs(
        self, guard: Guard, run: "_Loop", start_epoch: int, skip: int, epoch_rng: Optional[torch.Tensor]
    ) -> None:
        cfg, keeper = self.cfg, run.keeper
        sampler = getattr(run.loader, "sampler", None)
        for epoch in range(start_epoch, run.epochs):
            if run.over(guard):
                return
            if hasattr(sampler, "set_epoch"):  # DistributedSampler: a new shuffle each epoch, the same on resume
                sampler.set_epoch(epoch)
            resuming = epoch == start_epoch and (skip > 0 or epoch_rng is not None)
            if resuming and epoch_rng is not None:
                # Re-create the epoch's shuffle exactly: the loader draws its seeds from the RNG
                # as it was at the start of the epoch; then go back to the snapshot's RNG.
                now = torch.get_rng_state()
                torch.set_rng_state(epoch_rng)
                iterator = iter(run.loader)
                guard.begin_epoch(epoch, resumed=True, batch=_advance(iterator, skip, keeper))
                torch.set_rng_state(now)
            else:
                guard.begin_epoch(epoch)
                iterator = iter(run.loader)
                if guard.steps == 0:  # a fresh run: the start level, before its first step
                    iterator = _measure_start(guard, iterator, cfg.guard.accumulate_steps)
            seen = 0
            for batch in iterator:
                seen += 1
                indices = None  # the rows' dataset indices, when a quarantine sampler knows them
                if keeper.sampler is not None:
                    indices = keeper.indices_for(batch, (epoch, guard.position[1] + 1))  # (its place, once it arrives)
                step = guard.step(batch, indices)
                if step is not None and run.record(guard, step):  # over: a caught signal stops within one step
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
            guard.end_epoch()  # an epoch-interval scheduler steps on the whole epoch's loss, across a resume


def _measure_start(guard: Guard, iterator: Iterator[Any], accumulate: int) -> Iterator[Any]:
    """The first epoch's iterator, after the guard measured the start model's loss on the two
    batches after the first step's (:meth:`Guard.measure_start`); the batches come in the same order."""
    head = list(itertools.islice(iterator, accumulate + 2))
    if len(head) == accumulate + 2:
        guard.measure_start(head[accumulate:])
    return itertools.chain(head, iterator)


@dataclass
class _Loop:
    """What the epoch loop carries: its bounds, the run it records into, the quarantine, the stop."""

    loader: Iterable[Any]
    epochs: int
    max_steps: Optional[int]
    run: Run
    keeper: QuarantineKeeper
    stop: SignalStop

    def record(self, guard: Guard, step: StepResult) -> bool:
        """One decided step into the quarantine and the run's record (metrics, result, progress);
        returns whether the run is over after it (:meth:`over`)."""
        if self.keeper.sampler is not None:  # (no quarantine sampler: nothing to quarantine, no call)
            self.keeper.after_step(step.events)
        self.run.record(step)
        # over(), without a call of its own: read after every step
        return self.stop.requested or (self.max_steps is not None and guard.steps >= self.max_steps)

    def over(self, guard: Guard) -> bool:
        """Whether the run is over: a caught signal asked it to stop, or it took ``max_steps`` steps."""
        return self.stop.requested or (self.max_steps is not None and guard.steps >= self.max_steps)


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


def _interactive() -> bool:
    """Whether a person watches the output: a terminal, or a Jupyter kernel (where ``tqdm.auto``
    draws its widget although stderr is no terminal). Piped or logged output gets no bar."""
    if sys.stderr.isatty():
        return True
    if "IPython" not in sys.modules:  # a kernel has imported it long before fit; never import it here
        return False
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None  # a terminal IPython has no kernel


def _progress(enabled: bool, epochs: int, loader: Any) -> Any:
    if not enabled or not _interactive():
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
