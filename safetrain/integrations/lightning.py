"""PyTorch Lightning: :class:`SafeTrainingCallback`, a callback that guards a ``Trainer``'s own steps.

Lightning keeps its loop (automatic optimization, gradient accumulation, clipping, precision
plugins, LR schedulers, checkpoints); the callback drives the guard's step verbs at the hooks
Lightning offers, and a :class:`~safetrain.run.Run` around them::

    on_train_batch_start      -> guard.begin_batch (the batch's tensors pointed at the cleaned values)
    on_before_backward(loss)  -> guard.record_loss (the loss as computed: times the accumulation,
                                 and ``scaled``: Lightning multiplied it by the fp16 loss scale)
    on_before_optimizer_step  -> guard.decide (the one host read and the decision; a step that
                                 must not train has its gradients dropped, so the optimizer's step
                                 is a no-op), the gradient norm to the loggers
    on_train_batch_end        -> guard.finish_step (counters, the periodic snapshot), the metrics row

The guard's state (counters, LR backoff, spike and divergence windows, policy history) travels in
Lightning's checkpoint through :meth:`SafeTrainingCallback.state_dict`, so ``trainer.fit(ckpt_path=...)``
resumes it. Under ``strategy="ddp"`` the guard wraps the strategy's ``DistributedDataParallel``:
its sync combines every rank's read in the step's one collective, so every rank takes the same
action at the same step and restores the same snapshot; rank 0 journals to ``events.jsonl``, rank
r to ``events-rank{r}.jsonl``. Requires ``lightning>=2.2`` (``pip install safetrain[lightning]``).

It agrees with the Hugging Face callback (:mod:`safetrain.integrations.huggingface`): the same name,
the same ``on_abort`` (by default :class:`~safetrain.TrainingAborted` out of ``fit``), the same
metric keys (:func:`~safetrain.metrics.step_metrics`). ``SafeTraining``, its name before 0.2, still
works and warns once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Literal, Mapping, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy
from lightning_utilities.core.apply_func import apply_to_collection

from .. import distributed
from ..adapters.lightning_private import precision_scaler, silenced_logging
from ..config import ConfigLike, TrainConfig, as_config, to_dict
from ..deprecation import warn_once
from ..distributed import FSDP2, layout_of
from ..errors import TrainingAborted
from ..guard import Guard
from ..metrics import COUNTERS, step_metrics
from ..run import FitResult, Run
from ..rundir.runlog import OWN_SUBDIR

__all__ = ["SafeTrainingCallback"]

logger = logging.getLogger(__name__)

#: The guard's counters sent to Lightning's loggers as ``safetrain/<name>`` (kept for code that
#: read it: :data:`safetrain.metrics.COUNTERS`, which both callbacks log).
LOGGED_COUNTS = COUNTERS

#: The checkpoint key (``Callback.state_key``: the class's name) of the callback's state before 0.2.
_OLD_STATE_KEY = "SafeTraining"

#: Lightning's mixed-precision settings -> the autocast dtype the guard's re-runs and replays use.
AMP_DTYPES = {"16-mixed": "float16", "bf16-mixed": "bfloat16"}


class SafeTrainingCallback(Callback):
    """Detect, diagnose and recover from NaN/Inf and loss spikes inside a Lightning ``Trainer``.

    Add it to the trainer's callbacks; the ``LightningModule`` is unchanged, in one process or
    under DDP::

        trainer = Trainer(callbacks=[SafeTrainingCallback("configs/default.yaml")], max_steps=1000)
        trainer = Trainer(callbacks=[SafeTrainingCallback()], accelerator="cpu", devices=2, strategy="ddp")
        trainer.fit(model, loader)

    When training starts it builds a :class:`~safetrain.Guard` on the module and
    ``trainer.optimizers[0]`` with the step-interval scheduler (followed: it does not advance on
    a step that was not applied), Lightning's fp16 GradScaler and the matching ``amp.dtype``,
    ``guard.accumulate_steps`` = ``accumulate_grad_batches``, and a ``step_fn`` that runs
    ``training_step`` (so drop_rows, retry and the replays work). Epoch-interval schedulers keep
    the LR backoff on top of them.

    Args:
        cfg: anything :func:`safetrain.as_config` accepts.
        run_dir: where ``events.jsonl`` and ``metrics.csv`` go (default ``log.dir``, else the
            subdirectory ``safetrain`` of ``trainer.log_dir``: never a file a Lightning logger
            writes, such as the CSV logger's ``metrics.csv``); also the snapshot directory when
            ``snapshot.store`` is ``safetensors`` and ``snapshot.dir`` is unset.
        on_abort: ``"raise"`` (default): :class:`~safetrain.TrainingAborted` propagates out of
            ``trainer.fit`` (Lightning tears down and re-raises it); ``"stop"``: ``trainer.should_stop``
            is set, ``fit`` returns, and :meth:`raise_if_aborted` raises it. Either way it is kept in
            :attr:`aborted`, the model and optimizer are at the last good snapshot and the journal
            ends ``aborted``. The Hugging Face callback takes the same argument.
        log_metrics: send :func:`~safetrain.metrics.step_metrics` (``safetrain/loss``,
            ``safetrain/grad_norm``, ``safetrain/lr``: the LR in force, ``safetrain/lr_scale``,
            ``safetrain/trained``, ``safetrain/clipped_to`` and every intervention counter,
            ``safetrain/skipped_batches``, ``safetrain/restores``, ...: the Hugging Face callback's
            keys) to the trainer's loggers every ``log_every_n_steps`` steps and at every step the
            guard acted on (straight to the loggers: not in ``callback_metrics``; host values, no sync).
        log_grad_norm: the old name of ``log_metrics`` (deprecated).

    Attributes:
        guard: the :class:`~safetrain.Guard` of the current (or last) ``fit``.
        result: a :class:`~safetrain.FitResult` with the guard's counters and how the run ended.
        aborted: the :class:`~safetrain.TrainingAborted` that stopped the run, or ``None``.

    Raises:
        ValueError: (when training starts) manual optimization, several optimizers, several
            step-interval schedulers, or a multi-process strategy other than DDP and FSDP2
            (Lightning's ``strategy="fsdp"`` is FSDP1: refused, naming the alternatives).
    """

    def __init__(
        self,
        cfg: ConfigLike = None,
        run_dir: Optional[str] = None,
        *,
        on_abort: Literal["raise", "stop"] = "raise",
        log_metrics: bool = True,
        log_grad_norm: Optional[bool] = None,
    ) -> None:
        if on_abort not in ("raise", "stop"):
            raise ValueError(f"SafeTrainingCallback(on_abort={on_abort!r}): expected 'raise' or 'stop'")
        if log_grad_norm is not None:
            warn_once(
                "SafeTrainingCallback(log_grad_norm=)",
                "SafeTrainingCallback(log_grad_norm=...) is deprecated: use log_metrics=... (the same switch)",
            )
            log_metrics = log_grad_norm
        self.cfg: TrainConfig = as_config(cfg)
        self.run_dir, self.on_abort, self.log_metrics = run_dir, on_abort, log_metrics
        self.guard: Optional[Guard] = None
        self.result: Optional[FitResult] = None
        self.aborted: Optional[TrainingAborted] = None
        self._run: Optional[Run] = None
        self._loaded: Optional[Dict[str, Any]] = None  # a checkpoint's guard state, until the guard exists
        self._batch_idx = 0
        self._decided = False  # decide() ran for this batch

    def __getstate__(self) -> Dict[str, Any]:
        """What ``strategy="ddp_spawn"`` pickles into each spawned rank: the settings and the
        configuration (as a plain dict: the validated config holds read-only mappings), never a
        fit's guard or open run."""
        state = dict(self.__dict__)
        state.update(cfg=to_dict(self.cfg), guard=None, _run=None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, cfg=as_config(state["cfg"]))

    # ------------------------------------------------------------------ building the guard
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Build the guard (after Lightning restored the optimizer, schedulers and loops)."""
        self._close(None)  # a previous fit's guard, if the callback is reused
        self.aborted, self._decided = None, False
        model, optimizer, scheduler = self._check(trainer, pl_module)
        scaler = precision_scaler(trainer)
        cfg = self._config(trainer)
        self._run = run = Run(self._run_dir(trainer, cfg), trainer.global_rank, cfg)
        self.result = run.result
        run.open(share=lambda value: distributed.from_rank0(value, model))  # a refused directory stops every rank
        guard = self.guard = run.attach(
            Guard(
                model,
                optimizer,
                cfg,
                step_fn=self._step_fn(trainer, pl_module),
                scheduler=scheduler,
                scaler=scaler,
                bus=run.bus,
                run_dir=run.dir_name,
            )
        )
        for config in trainer.lr_scheduler_configs:  # Lightning steps them: the LR backoff holds on top
            guard.follow_scheduler(config.scheduler)
        resumed = self._loaded is not None
        if resumed:
            guard.load_state_dict(self._loaded)
            self._loaded = None
        lightning = {
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val,
        }
        how = "resumed" if resumed else "started"
        run.start(
            "resume" if resumed else "start",
            f"{how} in Lightning",
            {"lightning": lightning},
            epoch=trainer.current_epoch,
        )
        if resumed:
            guard.snapshot(force=True)  # the resumed state is the first good one a restore goes back to

    def _check(self, trainer: Trainer, pl_module: LightningModule) -> tuple:
        """The module the guard wraps (the strategy's: the ``DistributedDataParallel`` around the
        ``LightningModule`` under DDP, so that the ranks agree), the optimizer and the scheduler."""
        if not pl_module.automatic_optimization:
            raise ValueError(
                "SafeTrainingCallback guards Lightning's automatic optimization; this module sets "
                "automatic_optimization = False (manual optimization: Lightning's way to write a GAN or "
                "several optimizers). Drop the callback and guard the steps in training_step with a "
                "safetrain.Guard built once over the networks and optimizers: for a GAN, "
                "Guard(self, {'d': opt_d, 'g': opt_g}, step_fn={'d': d_loss, 'g': g_loss}) and "
                "guard.step(batch, name='d') then name='g' (docs/own-loop.md: alternating objectives)"
            )
        if len(trainer.optimizers) != 1:
            raise ValueError(f"SafeTrainingCallback: got {len(trainer.optimizers)} optimizers; expected exactly one")
        model = _guarded_module(trainer, pl_module)
        per_step = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"]
        if len(per_step) > 1:
            raise ValueError(
                f"SafeTrainingCallback: got {len(per_step)} step-interval LR schedulers; expected at most one"
            )
        return model, trainer.optimizers[0], (per_step[0] if per_step else None)

    def _run_dir(self, trainer: Trainer, cfg: TrainConfig) -> Optional[str]:
        """``run_dir=``, else ``log.dir``, else :data:`OWN_SUBDIR` in Lightning's log directory: the
        journal and ``metrics.csv`` never share a file with a Lightning logger (the CSV logger
        writes its own ``metrics.csv`` in ``trainer.log_dir``). ``trainer.log_dir`` is the same on
        every rank (Lightning broadcasts rank 0's)."""
        if self.run_dir or cfg.log.dir:
            return self.run_dir or cfg.log.dir
        base = trainer.log_dir or trainer.default_root_dir
        return os.path.join(base, OWN_SUBDIR) if base else None

    def _config(self, trainer: Trainer) -> TrainConfig:
        """The configuration, with what Lightning decides: accumulation and the autocast dtype."""
        cfg = self.cfg
        guard = dataclasses.replace(cfg.guard, accumulate_steps=trainer.accumulate_grad_batches)
        amp = dataclasses.replace(cfg.amp, dtype=AMP_DTYPES.get(str(trainer.precision)))
        if cfg.guard.clip_grad_norm is not None and trainer.gradient_clip_val:
            logger.warning("guard.clip_grad_norm and Trainer(gradient_clip_val=...) are both set: both clip")
        return dataclasses.replace(cfg, guard=guard, amp=amp)

    def _step_fn(self, trainer: Trainer, pl_module: LightningModule) -> Any:
        """The guard's own forward (re-runs, replays): ``training_step`` as Lightning's strategy
        runs it (under the precision plugin's autocast, and through the DDP wrapper's forward so
        that a re-run's gradients are all-reduced like the step's), with ``self.log`` silenced (a
        replay's values are not the run's)."""

        def step_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
            with silenced_logging(pl_module):
                out = trainer.strategy.training_step(batch, self._batch_idx)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise ValueError(
                    f"training_step returned {type(out).__name__}; expected a loss tensor or a dict with 'loss'"
                )
            return loss

        return step_fn

    # ------------------------------------------------------------------ the step
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.guard is not None:
            self.guard.begin_epoch(trainer.current_epoch, resumed=trainer.current_epoch == self.guard.position[0])

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.guard is None or self.aborted is not None:
            return
        self._batch_idx = batch_idx
        # Lightning hands this same batch object to training_step: its tensors are pointed at the
        # cleaned values, while the guard keeps aliases of the values as they came (its slow path
        # finds the bad rows in them).
        _point_at(batch, self.guard.begin_batch(_aliases(batch)))

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.guard is None or self.aborted is not None:
            return
        # Lightning divided the loss by the accumulation and (fp16) multiplied it by the loss scale.
        loss = loss.detach()
        k = trainer.accumulate_grad_batches
        self.guard.record_loss(loss * k if k > 1 else loss, scaled=True)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        guard = self.guard
        if guard is None:
            return
        if self.aborted is not None:  # stopped: nothing more trains while Lightning winds down
            guard.stop()
            return
        try:
            result = guard.decide()
        except TrainingAborted as exc:
            self.aborted = exc
            if self.on_abort == "raise":
                raise  # Lightning calls on_exception (the journal ends `aborted`), tears down, re-raises
            logger.error(
                "safetrain aborted the run; trainer.should_stop set, the model at the last good state: %s", exc
            )
            trainer.should_stop = True
            guard.stop()
            return
        self._decided = True
        if result.restored:
            self._keep_epoch_lr(trainer)
        if self.log_metrics and trainer.loggers and self._run is not None:
            step = trainer.global_step
            if result.action or (step + 1) % max(trainer.log_every_n_steps, 1) == 0:
                metrics = step_metrics(self._run.step_record(result))
                for lg in trainer.loggers:  # (Lightning's loggers write on rank 0 only)
                    lg.log_metrics(metrics, step=step)

    def _keep_epoch_lr(self, trainer: Trainer) -> None:
        """A restore put the snapshot's LR back; an epoch-interval scheduler is not in the snapshot
        and stays at the current epoch: with no step-interval one, its LR holds (else a chained
        schedule would lag from here on)."""
        guard = self.guard
        epoch = [c.scheduler for c in trainer.lr_scheduler_configs if c.interval != "step"]
        if guard is not None and guard.scheduler is None and len(epoch) == 1 and hasattr(epoch[0], "get_last_lr"):
            guard.keep_schedule(epoch[0].get_last_lr())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is None or not self._decided or self._run is None:
            return
        self._decided = False
        self._run.record(self.guard.finish_step())

    # ------------------------------------------------------------------ the end
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The end checks of ``fit`` (a trained step, finite parameters), then the journal's ``run_ended``."""
        run, self._run = self._run, None
        if self.guard is None or run is None:
            return
        ended = run.end(self.aborted)
        if self.aborted is None and isinstance(ended, TrainingAborted):
            self.aborted = ended
            if self.on_abort == "raise":
                raise ended  # the journal already says so

    def raise_if_aborted(self) -> None:
        """Raise the :class:`~safetrain.TrainingAborted` that stopped training, if any (after a
        ``fit`` with ``on_abort="stop"``; with ``"raise"``, ``fit`` raised it already)."""
        if self.aborted is not None:
            raise self.aborted

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close(None)

    def _close(self, error: Optional[BaseException]) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.close(error)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """The guard's state (JSON-ready), saved in Lightning's checkpoint."""
        if self.guard is not None:
            return {"guard": self.guard.state_dict()}
        return {"guard": self._loaded} if self._loaded is not None else {}

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: Dict[str, Any]) -> None:
        """A checkpoint written before 0.2 keeps the guard's state under the old class name
        (``SafeTraining``): take it from there (Lightning looks up :attr:`state_key` only)."""
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states and isinstance(states.get(_OLD_STATE_KEY), Mapping):
            self.load_state_dict(dict(states[_OLD_STATE_KEY]))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Take the guard's state from a checkpoint; applied when the guard is built (training starts)."""
        state = state_dict.get("guard")
        if state is not None and self.guard is not None and self._run is not None:
            self.guard.load_state_dict(state)
        else:
            self._loaded = state


def _guarded_module(trainer: Trainer, pl_module: LightningModule) -> torch.nn.Module:
    """What the guard wraps: the ``LightningModule`` in one process; under DDP the strategy's
    ``DistributedDataParallel`` around it (the guard's sync then combines every rank's read in the
    step's one collective, and its snapshots and replays agree across ranks); under FSDP2
    (``ModelParallelStrategy`` with ``fully_shard`` on the module) the module itself.

    Raises:
        ValueError: a multi-process strategy safetrain cannot guard, naming it and what works.
    """
    model = trainer.strategy.model
    if trainer.world_size <= 1 or model is None:
        return pl_module
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.module is pl_module:
        return model
    strategy = type(trainer.strategy).__name__
    if isinstance(trainer.strategy, FSDPStrategy):
        raise ValueError(
            "SafeTrainingCallback: strategy='fsdp' is Lightning's FSDPStrategy, which wraps the module in "
            "FullyShardedDataParallel (FSDP1): its flattened parameters cannot be checked, named or "
            "snapshotted per layer. Use strategy='ddp', or FSDP2: strategy=ModelParallelStrategy("
            "data_parallel_size=N, tensor_parallel_size=1) with fully_shard(...) in configure_model"
        )
    if model is pl_module and layout_of(pl_module) == FSDP2:
        return pl_module
    raise ValueError(
        f"SafeTrainingCallback: strategy {strategy} with world_size={trainer.world_size} is not supported; "
        "supported: one process, strategy='ddp' (or DDPStrategy), and FSDP2 through ModelParallelStrategy "
        "with fully_shard(...) on the LightningModule in configure_model"
    )


def _aliases(batch: Any) -> Any:
    """The batch with each tensor a new tensor object on the same storage (no copy)."""
    return apply_to_collection(batch, torch.Tensor, torch.Tensor.detach)


def _point_at(dst: Any, src: Any) -> None:
    """Make each tensor of ``dst`` (the batch Lightning hands to ``training_step``) hold the values
    of ``src``'s tensor in its place (``set_``: no copy); the guard keeps the aliases it was given,
    so its slow path still sees the values as they came."""
    if isinstance(dst, torch.Tensor):
        if isinstance(src, torch.Tensor) and src is not dst:
            with torch.no_grad():
                dst.set_(src)
    elif isinstance(dst, Mapping):
        for key in dst:
            _point_at(dst[key], src[key])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _point_at(d, s)
    elif dataclasses.is_dataclass(dst) and not isinstance(dst, type):
        for f in dataclasses.fields(dst):
            _point_at(getattr(dst, f.name), getattr(src, f.name))


if TYPE_CHECKING:  # the old name, for type checkers (at run time through __getattr__, which warns)
    SafeTraining = SafeTrainingCallback


def __getattr__(name: str) -> Any:
    if name == "SafeTraining":
        warn_once(
            "SafeTraining",
            "safetrain.integrations.lightning.SafeTraining is now SafeTrainingCallback (the Hugging Face "
            "callback's name); the old name still works, and will be removed in a later version",
        )
        return SafeTrainingCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
