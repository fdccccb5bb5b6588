"""Hugging Face ``transformers.Trainer``: :class:`SafeTrainingCallback`, safetrain's guard as a callback.

The Trainer owns the loop; the callback drives the guard's step verbs at its points, and a
:class:`~safetrain.run.Run` around them:

* each micro-batch: a forward pre-hook on the model (training mode) hands the batch to
  ``guard.begin_batch`` and runs the forward on the scanned copy; a forward hook gives the
  model's ``output.loss`` to ``guard.record_loss``;
* the step's decision (``guard.decide``: the one host read, the policy, the
  action carried out) runs at the end of the last micro-batch's backward, queued on the autograd
  engine from a hook on that loss. It must come before the Trainer's clipping: the Trainer clips
  (``accelerator.clip_grad_norm_``, even with ``max_grad_norm=0``, where it measures the norm
  with ``max_norm=inf``) with a non-finite norm as a NaN factor, which turns every gradient NaN
  and hides the parameters that went bad. The Trainer then clips gradients that are finite (or
  dropped: a skipped step), and its ``optimizer.step()`` changes nothing on a skipped step;
* ``on_step_end`` (after the scheduler stepped): ``guard.finish_step`` (counters, the
  periodic snapshot). The Trainer's scheduler follows the guard: it does not advance on a step
  whose update was not applied, and an LR backoff stays a scale on top of it.

The guard's own forwards (re-runs through ``step_fn`` and replays) pass through the hooks, as do
evaluation forwards. An abort (``on_abort="raise"``, the default) raises
:class:`~safetrain.errors.TrainingAborted` out of ``trainer.train()`` at the step's
``on_pre_optimizer_step``, before the Trainer's ``optimizer.step()``, with the journal closed
``aborted``; ``on_abort="stop"`` sets ``control.should_training_stop`` instead, logs one line and
keeps the exception on :attr:`SafeTrainingCallback.aborted` (:meth:`~SafeTrainingCallback.raise_if_aborted`
raises it). Either way the model is at the last good snapshot. The guard's state goes into the Trainer's checkpoints
(``TrainerState.stateful_callbacks``) and ``trainer.train(resume_from_checkpoint=...)`` puts it
back. The journal (``events.jsonl``, ``metrics.csv``) lands in ``log.dir`` or ``args.output_dir``.

Many processes (``torchrun --nproc_per_node N``, ``accelerate launch``): the Trainer wraps the
model in accelerate's ``DistributedDataParallel`` and hands callbacks the model inside it; the
guard is given the wrapper (:func:`~safetrain.adapters.huggingface_private.ddp_wrapper_of`), so
its sync is a :class:`~safetrain.distributed.DistributedSync` (one collective inside the step's
one read: every rank takes the same action at the same step) and its own re-runs all-reduce
their gradients. The decision waits for DDP's reducer to finish the all-reduce (it runs after
every other final callback of the backward). Each rank journals (rank 0 ``events.jsonl`` and
``metrics.csv``, rank r ``events-rank{r}.jsonl``). FSDP through accelerate is refused at start
(accelerate runs it on accelerators only, so it is untested here); DeepSpeed is refused: its
engine owns the backward, the partitioned gradients and the step.

It agrees with the Lightning callback (:mod:`safetrain.integrations.lightning`): the same name,
the same ``on_abort``, the same metric keys (:func:`~safetrain.metrics.step_metrics`, added to the
Trainer's logs at its logging steps and at every step the guard acted on).

Supported: transformers >= 4.46 (``on_pre_optimizer_step``, ``ExportableState``) with accelerate;
tested with transformers 5.24 and accelerate 1.15.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import torch

from .. import distributed
from ..adapters.huggingface_private import (
    gradient_state,
    log_before_reporters,
    optimizer_scaler,
    takes_loss_kwargs,
    unscale_once,
    unwrap_optimizer,
)
from ..adapters.torch_private import after_backward_end
from ..config import ConfigLike, as_config, to_dict
from ..errors import SafetrainError, TrainingAborted
from ..guard import Guard, StepResult
from ..metrics import step_metrics
from ..run import FitResult, Run
from .huggingface_logs import TrainerLogs
from .huggingface_setup import guarded_model, loss_of, model_loss, with_accumulation

__all__ = ["SafeTrainingCallback", "MIN_TRANSFORMERS", "model_loss"]

logger = logging.getLogger(__name__)

#: The oldest transformers with every hook the callback needs (``on_pre_optimizer_step``: 4.46).
MIN_TRANSFORMERS = (4, 46)


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise ImportError(
            "safetrain.integrations.huggingface needs transformers>=4.46 and accelerate: "
            "pip install 'safetrain[huggingface]'"
        ) from exc
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise RuntimeError(
            f"safetrain.integrations.huggingface supports transformers>=4.46 (on_pre_optimizer_step, "
            f"ExportableState); found transformers {transformers.__version__}: pip install -U 'safetrain[huggingface]'"
        )
    return transformers


_transformers = _require_transformers()
from transformers.trainer_callback import ExportableState, TrainerCallback  # noqa: E402


class SafeTrainingCallback(TrainerCallback, ExportableState):
    """safetrain's detection, diagnosis and recovery inside a ``transformers.Trainer``.

    Args:
        cfg: anything :func:`safetrain.as_config` accepts (path, dict, TrainConfig, None).
        step_fn: ``step_fn(model, batch) -> loss`` for the guard's own re-runs and replays; the
            default runs ``model(**batch)`` and takes its ``loss``.
        resume_state: the guard's state to start from (the Trainer passes it back on resume).
        restored: set by the Trainer when ``restore_callback_states_from_checkpoint=True`` rebuilds
            the callback from a checkpoint (``state()``'s args): the new instance takes the place
            of the last one made in this process, whose :attr:`aborted`, :attr:`result` and
            :meth:`raise_if_aborted` then answer for it (and whose ``step_fn``, ``on_abort`` and
            ``log_metrics`` it keeps).
        on_abort: ``"raise"`` (default): :class:`~safetrain.TrainingAborted` propagates out of
            ``trainer.train()`` (raised at the step's ``on_pre_optimizer_step``, the journal closed
            ``aborted``); ``"stop"``: ``control.should_training_stop`` is set, ``train()`` returns,
            and :meth:`raise_if_aborted` raises it. Either way it is kept in :attr:`aborted` and the
            model is at the last good snapshot. The Lightning callback takes the same argument.
        log_metrics: add :func:`~safetrain.metrics.step_metrics` of the last step (``safetrain/loss``,
            ``safetrain/grad_norm``, ``safetrain/lr``, ``safetrain/lr_scale``, ``safetrain/trained``,
            every intervention counter: the Lightning callback's keys) to the Trainer's training
            logs, at its logging steps and at every step the guard acted on (``control.should_log``).
            The Trainer's own ``loss``, ``learning_rate`` and ``grad_norm`` are corrected either way.

    Attributes:
        guard: the :class:`~safetrain.Guard` while training (made in ``on_train_begin``).
        aborted: the :class:`~safetrain.TrainingAborted` that stopped training, or ``None``.
        result: the :class:`~safetrain.FitResult` of the last ``train()`` (set at its end).

    Example::

        callback = SafeTrainingCallback({"snapshot": {"every": 50}})
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()  # raises TrainingAborted if the guard had to stop the run
    """

    _latest: "Optional[weakref.ref[SafeTrainingCallback]]" = None  # the last instance a user made

    def __init__(
        self,
        cfg: ConfigLike = None,
        step_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
        resume_state: Optional[Dict[str, Any]] = None,
        restored: bool = False,
        *,
        on_abort: Literal["raise", "stop"] = "raise",
        log_metrics: bool = True,
    ) -> None:
        if on_abort not in ("raise", "stop"):
            raise ValueError(f"SafeTrainingCallback(on_abort={on_abort!r}): expected 'raise' or 'stop'")
        self.on_abort, self.log_metrics = on_abort, log_metrics
        self.cfg = as_config(cfg)
        self.step_fn = step_fn if step_fn is not None else model_loss
        self.resume_state = resume_state
        self.guard: Optional[Guard] = None
        self._aborted: Optional[TrainingAborted] = None
        self._result: Optional[FitResult] = None
        self._survivor: Optional[SafeTrainingCallback] = None  # made by the Trainer in this one's place
        self._adopt(restored, step_fn)
        self.last: Optional[StepResult] = None  # the last decided step
        self._run: Optional[Run] = None
        self._handles: List[Any] = []
        self._undo: List[Callable[[], None]] = []  # what on_train_begin changed on the Trainer's objects
        self._gradient_state: Any = None
        self._optimizer: Optional[torch.optim.Optimizer] = None  # the torch optimizer inside accelerate's wrapper
        self._lr: Optional[float] = None  # the LR in force at the last update
        self._lrs: Optional[Sequence[float]] = None  # ... of every parameter group
        self._busy = False  # the guard runs forwards of its own: the hooks pass through
        self._open = False  # a micro-batch begun, its loss not yet seen
        self._undecided = False  # the step's last micro-batch seen, its decision not yet made
        self._snapshot_due = False  # resumed: the first training forward snapshots the checkpoint's state
        self._finish_due = False  # decided: finish_step() at the step's end
        self._window = 0  # training forwards begun since the last decision (fewer at an epoch's end)
        self._accumulates = False  # gradient accumulation: each micro-batch's loss divided by the window's size
        self._logs = TrainerLogs()  # what the Trainer's logs show of the steps since its last log

    def _adopt(self, restored: bool, step_fn: Any) -> None:
        """Made by the Trainer from a checkpoint: take the place of the last instance the user made
        (its answers follow this one); made by the user: be that instance."""
        cls = SafeTrainingCallback
        if not restored:
            cls._latest = weakref.ref(self)
            return
        origin = cls._latest() if cls._latest is not None else None
        if origin is not None and origin is not self:  # (a later resume's instance replaces an earlier one)
            origin._survivor = self
            self.on_abort, self.log_metrics = origin.on_abort, origin.log_metrics  # the user's, not the checkpoint's
            if step_fn is None:
                self.step_fn = origin.step_fn

    @property
    def aborted(self) -> Optional[TrainingAborted]:
        """The :class:`~safetrain.TrainingAborted` that stopped training, or ``None`` (the
        instance the Trainer restored in this one's place answers, if it did)."""
        return self._survivor.aborted if self._survivor is not None else self._aborted

    @aborted.setter
    def aborted(self, value: Optional[TrainingAborted]) -> None:
        self._aborted = value

    @property
    def result(self) -> Optional[FitResult]:
        """The :class:`~safetrain.FitResult` of the last ``train()`` (the restored instance's, if any)."""
        return self._survivor.result if self._survivor is not None else self._result

    @result.setter
    def result(self, value: Optional[FitResult]) -> None:
        self._result = value

    # ----------------------------------------------------------------- the Trainer's events
    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **kwargs: Any,
    ) -> None:
        """Make the guard around the Trainer's model, optimizer, scheduler and fp16 scaler."""
        self.close()
        self._survivor = None  # this instance trains: it answers for itself
        self.aborted, self.result, self.last = None, None, None
        self._logs, self._lr, self._lrs = TrainerLogs(), None, None
        if getattr(args, "deepspeed", None):
            raise SafetrainError(
                "SafeTrainingCallback cannot guard a DeepSpeed Trainer: DeepSpeed's engine owns the backward, "
                "the (ZeRO-partitioned) gradients and the optimizer step, so the guard can neither judge a step "
                "before it is applied nor restore it; use DDP (torchrun / accelerate launch), or safetrain.SafeTrainer "
                "(DDP or FSDP2 with fully_shard)"
            )
        if model is None or optimizer is None:
            raise RuntimeError("SafeTrainingCallback: the Trainer gave no model or optimizer to on_train_begin")
        guarded = guarded_model(model, int(getattr(args, "world_size", 1)))
        cfg = with_accumulation(self.cfg, model, args.gradient_accumulation_steps)
        self._run = run = Run(cfg.log.dir or args.output_dir, int(getattr(args, "process_index", 0)), cfg)
        run.open(share=lambda value: distributed.from_rank0(value, guarded))  # a refused directory stops every rank
        log_before_reporters(self)
        try:
            self._start(state, guarded, model, optimizer, lr_scheduler, run)
        except BaseException as exc:  # the journal says why the run never trained
            self.close(error=exc)
            raise

    def _start(self, state: Any, guarded: Any, model: Any, optimizer: Any, lr_scheduler: Any, run: Run) -> None:
        self._accumulates, self._window = run.cfg.guard.accumulate_steps > 1, 0
        self._gradient_state = gradient_state(optimizer)
        scaler = optimizer_scaler(optimizer)  # fp16: accelerate's GradScaler
        if scaler is not None and scaler.is_enabled():
            self._undo.append(unscale_once(scaler))
        self._optimizer = torch_optimizer = unwrap_optimizer(optimizer)
        guard = self.guard = run.attach(
            Guard(
                guarded,  # under DDP the wrapper: the guard's sync agrees across ranks, its re-runs all-reduce
                torch_optimizer,
                run.cfg,
                step_fn=self._step_fn,
                scheduler=lr_scheduler,
                scaler=scaler,
                bus=run.bus,
                run_dir=run.dir_name,
            )
        )
        if lr_scheduler is not None:  # the Trainer steps it: it follows the guard's steps
            guard.follow_scheduler(lr_scheduler)
        guard.loss_shares = takes_loss_kwargs(model)  # its micro-batches' losses sum to the step's
        saved = self._saved_state(state)
        if saved is not None:
            guard.load_state_dict(saved)
            # The checkpoint's state is the first good one: snapshot it at the first forward, once
            # the Trainer has put back the checkpoint's RNG state too (at its first batch, not yet).
            self._snapshot_due = True
        elif run.dir is not None:
            guard.check_fresh()
        self._handles = [  # on the model inside a DDP wrapper: it runs the forward the batch reaches
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward),
        ]
        how = f"resumed at step {state.global_step}" if saved is not None else "started"
        run.start(
            "resume" if saved is not None else "start",
            f"{how} in a transformers.Trainer",
            {"integration": f"transformers {_transformers.__version__}"},
            epoch=int(state.epoch or 0),
        )

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The guard's epoch (its counters and the epoch's mean loss)."""
        if self.guard is not None:
            epoch = int(state.epoch or 0)
            self.guard.begin_epoch(epoch, resumed=state.epoch != epoch)  # a checkpoint's mid-epoch: its losses kept

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Decide now if the backward's end did not (no loss hook fired); on an abort, raise it out
        of ``train()`` (``on_abort="raise"``, the journal closed first) or stop training and make
        the optimizer step that follows change nothing (``"stop"``)."""
        if self._undecided:  # (the loss did not require grad: decided after the Trainer's clipping)
            self._decide()
        if self.guard is not None:
            self._lrs = self.guard.lrs  # the LRs this step's update uses (the scheduler moves them after)
            self._lr = self._lrs[0] if self._lrs else None
        aborted = self.aborted
        if aborted is not None and self.guard is not None:
            self.guard.stop()  # no gradient: the Trainer's optimizer.step() moves nothing, nor its scheduler.step()
            control.should_training_stop = True
            if self.on_abort == "raise":
                self.close(error=aborted)  # the journal ends `aborted`; the hooks come off the model
                raise aborted
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After the optimizer and the scheduler: the guard's counters and periodic snapshot."""
        if self.guard is None or self.aborted is not None or not self._finish_due:
            return control
        self._finish_due = False
        self.last = self.guard.finish_step()
        self._logs.step(self.last.trained, self.last.loss, self._lr)
        if self._run is not None:
            self._run.record(self.last)
        if self.log_metrics and self.last.action:  # the guard acted: the step's figures logged now (as Lightning's)
            control.should_log = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        """The guard's figures into the Trainer's training logs and ``state.log_history``: the
        Trainer's own keys corrected (the LR in force, the loss of the applied steps, the gradient
        norm it read: :mod:`.huggingface_logs`) and, with ``log_metrics``, the last step's
        :func:`~safetrain.metrics.step_metrics`. The callback runs before the Trainer's reporters
        (W&B, TensorBoard), so they log the same."""
        if self.guard is None or logs is None or "loss" not in logs:
            return
        changed = self._logs.fill(logs, self.guard)
        if self.log_metrics and self.last is not None and self._run is not None:
            metrics = step_metrics(self._run.step_record(self.last, lrs=self._lrs))
            logs.update(metrics)
            changed.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            entry = state.log_history[-1]
            for key, value in changed.items():
                if value is None:
                    entry.pop(key, None)
                else:
                    entry[key] = value

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The end-of-run checks (a trained step, finite parameters), then the journal's ``run_ended``."""
        self._unhook()
        run, self._run = self._run, None
        if run is None:
            return
        ended = run.end(self.aborted)
        self.result = run.result
        if self.aborted is None and isinstance(ended, TrainingAborted):
            self._abort(ended)
            if self.on_abort == "raise":
                raise ended  # the journal already says so

    # ----------------------------------------------------------------- checkpoints
    def state(self) -> Dict[str, Any]:
        """What the Trainer's checkpoint keeps (``TrainerState.stateful_callbacks``): the config and
        the guard's state (counters, LR backoff, spike and divergence windows, policy history)."""
        guard_state = self.guard.state_dict() if self.guard is not None else self.resume_state
        settings = {"on_abort": self.on_abort, "log_metrics": self.log_metrics}
        return {
            "args": {"cfg": to_dict(self.cfg), "restored": True, **settings},
            "attributes": {"resume_state": guard_state},
        }

    def _saved_state(self, state: Any) -> Optional[Dict[str, Any]]:
        """The guard's state of the checkpoint being resumed (``global_step`` > 0), if it has one."""
        if state.global_step <= 0:
            return None
        if self.resume_state is not None:  # restore_callback_states_from_checkpoint made this instance
            return self.resume_state
        stored = (state.stateful_callbacks or {}).get(type(self).__name__)
        if isinstance(stored, list):
            stored = stored[0] if stored else None
        return (stored or {}).get("attributes", {}).get("resume_state")

    # ----------------------------------------------------------------- the caller
    def raise_if_aborted(self) -> None:
        """Raise the :class:`~safetrain.TrainingAborted` that stopped training, if any (after a
        ``train()`` with ``on_abort="stop"``; with ``"raise"``, ``train()`` raised it already)."""
        if self.aborted is not None:
            raise self.aborted

    def close(self, error: Optional[BaseException] = None) -> None:
        """Take the hooks off the model and close the guard and the journal (``run_ended``); idempotent.
        ``on_train_end`` calls it; call it yourself with the exception when ``trainer.train()`` raised
        (the journal then ends ``failed``, naming it)."""
        self._unhook()
        run, self._run = self._run, None
        if run is None:
            return
        run.close(error if error is not None else self.aborted)
        self.result = run.result

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        while self._undo:
            self._undo.pop()()
        self._handles, self._open, self._undecided, self._finish_due = [], False, False, False

    # ----------------------------------------------------------------- the hooks
    def _step_fn(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self.step_fn(model, batch)  # (the guard's own forwards run inside _decide: hooks pass through)

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Any:
        if self._busy or not module.training or self.guard is None or self.aborted is not None:
            return None
        if self._snapshot_due:
            self._snapshot_due = False
            self.guard.snapshot(force=True)
        if args:
            raise RuntimeError(
                f"SafeTrainingCallback: the model was called with {len(args)} positional argument(s); "
                "expected model(**batch), as transformers.Trainer calls it"
            )
        self._open = True
        self._window += 1
        return args, self.guard.begin_batch(dict(kwargs))

    def _after_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not self._open:
            return
        self._open = False
        loss = loss_of(output)
        if loss is None:
            raise RuntimeError(
                "SafeTrainingCallback: the model's output has no loss; expected the model to compute it "
                "(labels in the batch); a compute_loss_func or label smoothing outside the model is not supported"
            )
        self.guard.record_loss(loss)
        gs = self._gradient_state
        if gs is None or gs.sync_gradients:  # the step's last micro-batch: decide at the end of its backward
            self._undecided = True
            if loss.requires_grad:
                loss.register_hook(self._at_backward)

    def _at_backward(self, grad: torch.Tensor) -> None:
        after_backward_end(self._decide)  # after DDP's reducer wrote the all-reduced gradients

    def _decide(self) -> None:
        """The step's decision, before the Trainer clips (the end of the last backward)."""
        if not self._undecided or self.guard is None:
            return
        self._undecided, self._busy = False, True
        window, self._window = self._window, 0  # the Trainer divides a short last window's losses by its size
        try:
            with torch.enable_grad():  # (the autograd engine runs its callbacks with grad off)
                self.last = self.guard.decide(window if self._accumulates else None)
            self._finish_due = True
        except TrainingAborted as exc:
            self._abort(exc)
        finally:
            self._busy = False

    def _abort(self, exc: TrainingAborted) -> None:
        self.aborted = exc
        if self.on_abort == "stop":  # (raised, it says so itself)
            steps = self.guard.steps if self.guard is not None else 0
            logger.error("safetrain: training stopped at step %d, the model at the last good snapshot: %s", steps, exc)
