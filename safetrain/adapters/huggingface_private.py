"""What the Hugging Face callback reaches inside accelerate's and transformers' objects, each
behind one function.

One module for the two libraries: the Trainer (transformers) drives its step through accelerate
(the optimizer wrapper, the fp16 scaler, the clip), and the integration that needs these,
:mod:`safetrain.integrations.huggingface`, is one. Imported by that integration only; accelerate
is imported inside the function that needs it, so the core never needs either installed. Each
entry says what it is, since when (checked in transformers 5.24 and accelerate 1.15) and what
breaks in safetrain if it goes; ``tests/unit/adapters/test_adapters.py`` fails when one changes.

accelerate: ``AcceleratedOptimizer.optimizer`` (:func:`unwrap_optimizer`)
    The torch optimizer inside the wrapper the Trainer hands to callbacks. The fp16 GradScaler
    keys its per-optimizer state by the inner optimizer's ``id``, and the guard snapshots and
    restores the inner one. If it goes: the guard keys the scaler's state by the wrapper, an
    entry accelerate's unscale never fills (the overflow flags are never read).

accelerate: ``AcceleratedOptimizer.scaler`` and ``.gradient_state`` (:func:`optimizer_scaler`,
:func:`gradient_state`)
    The fp16 GradScaler accelerate scales the loss with, and the object whose
    ``sync_gradients`` says a micro-batch is the step's last. If they go: the guard makes no
    scaler of its own for an fp16 Trainer (overflows judged as gradient anomalies), or decides at
    every micro-batch.

accelerate: ``Accelerator.clip_grad_norm_`` calls ``scaler.unscale_(optimizer)`` (:func:`unscale_once`)
    The guard unscales at the end of the last backward, before it reads; the Trainer's clip then
    unscales again, which GradScaler refuses ("unscale_() has already been called on this
    optimizer since the last update()"). :func:`unscale_once` replaces ``unscale_`` on that
    scaler instance with one that does nothing for an optimizer already unscaled, and returns the
    undo. If accelerate stops unscaling there, nothing breaks; if torch's stage goes, see
    :mod:`.torch_private`.

transformers: callbacks get ``Trainer.model``, not ``Trainer.model_wrapped`` (:func:`ddp_wrapper_of`)
    Under torchrun/accelerate DDP the Trainer hands callbacks the model inside accelerate's
    ``DistributedDataParallel``; the guard needs the wrapper (its re-runs all-reduce their
    gradients through it, and its sync agrees across ranks because the model is DDP). The wrapper
    is found once per ``train()`` among the objects that refer to the model (``gc``: the DDP's
    ``_modules`` dict, held by the DDP or by its ``__dict__``). If transformers starts passing the
    wrapper, it is used as it is; if the wrapper holds the model otherwise, the callback refuses
    to start under DDP, naming it.

transformers: ``CallbackHandler.callbacks`` runs reporters first (:func:`log_before_reporters`)
    The Trainer puts its reporting callbacks (W&B, TensorBoard, ... from ``report_to``) before the
    user's, so values a callback adds in ``on_log`` never reach them. The callback moves itself
    in that list, once per ``train()``, to just before the first reporter. If the list is not
    found, the values still reach the Trainer's ``log_history`` and its printed logs.

transformers: ``Trainer.model_accepts_loss_kwargs`` (:func:`takes_loss_kwargs`; since 4.46)
    The Trainer's rule for whether a model's loss is already normalized over the whole step (it
    gets ``num_items_in_batch``) or is divided by ``gradient_accumulation_steps``: the model's
    ``accepts_loss_kwargs``, else a ``**kwargs`` forward. Mirrored here because it is decided
    inside ``Trainer.__init__``; if the rule changes, the guard's re-runs and replays divide the
    loss differently from the Trainer (a re-run's gradients off by the accumulation factor).
"""

from __future__ import annotations

import gc
import inspect
from typing import Any, Callable, Optional

import torch

from . import torch_private

__all__ = [
    "unwrap_optimizer",
    "optimizer_scaler",
    "gradient_state",
    "unscale_once",
    "takes_loss_kwargs",
    "ddp_wrapper_of",
    "log_before_reporters",
]


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (however deeply wrapped),
    or ``optimizer`` itself when it is not one."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_scaler(optimizer: Any) -> Optional[torch.amp.GradScaler]:
    """The fp16 GradScaler accelerate scales the loss with (``AcceleratedOptimizer.scaler``), or
    ``None`` (no fp16, or a plain optimizer)."""
    return getattr(optimizer, "scaler", None)  # a plain torch optimizer has none


def gradient_state(optimizer: Any) -> Any:
    """accelerate's ``GradientState`` of the wrapped optimizer (``.sync_gradients``: the step's
    last micro-batch), or ``None`` for a plain optimizer (every micro-batch is a step's last)."""
    return getattr(optimizer, "gradient_state", None)  # a plain torch optimizer has none


def unscale_once(scaler: torch.amp.GradScaler) -> Callable[[], None]:
    """Make ``scaler.unscale_(optimizer)`` do nothing for an optimizer already unscaled since the
    scaler's last ``update()`` (on this instance only; other scalers are untouched).

    Returns:
        The undo: puts the class's ``unscale_`` back (nothing if someone replaced it since).

    Example::

        >>> undo = unscale_once(accelerator.scaler)  # doctest: +SKIP
        >>> # the guard, then the Trainer's clip, unscale: only the first one unscales
        >>> undo()                                   # doctest: +SKIP
    """
    original = scaler.unscale_

    def unscale_(optimizer: torch.optim.Optimizer) -> None:
        if not torch_private.unscaled(scaler, optimizer):
            original(optimizer)

    scaler.unscale_ = unscale_  # type: ignore[method-assign]

    def undo() -> None:
        if vars(scaler).get("unscale_") is unscale_:
            del scaler.unscale_

    return undo


def takes_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the Trainer gives ``model`` ``num_items_in_batch`` (then its loss is normalized over
    the whole step and the Trainer does not divide it by the accumulation): the model's
    ``accepts_loss_kwargs``, else whether its ``forward`` takes ``**kwargs``."""
    accepts = getattr(model, "accepts_loss_kwargs", None)  # transformers' models set it; others may not
    if accepts is None:
        params = inspect.signature(model.forward).parameters.values()
        accepts = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return bool(accepts)


def ddp_wrapper_of(model: torch.nn.Module) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` whose ``.module`` is ``model`` (the Trainer's
    ``model_wrapped``), ``model`` itself when it is one, or ``None``. Three ``gc`` scans of the
    heap: call it once per run, not per step.

    Raises:
        RuntimeError: more than one live wrapper holds ``model`` (an earlier Trainer's still alive).
    """
    ddp = torch.nn.parallel.DistributedDataParallel
    if isinstance(model, ddp):
        return model
    found = []
    for modules in gc.get_referrers(model):  # the wrapper's _modules dict holds the model as "module"
        if not isinstance(modules, dict) or modules.get("module") is not model:
            continue
        for owner in gc.get_referrers(modules):  # the wrapper, or its __dict__ (Python 3.11+)
            owners = gc.get_referrers(owner) if isinstance(owner, dict) else [owner]
            found += [o for o in owners if isinstance(o, ddp) and o.module is model]
    if len({id(w) for w in found}) > 1:
        raise RuntimeError(
            f"SafeTrainingCallback: found {len(found)} DistributedDataParallel wrappers around the model; "
            "expected one (this Trainer's): let an earlier Trainer of the same model go (del trainer) or wrap it once"
        )
    return found[0] if found else None


def log_before_reporters(callback: Any) -> bool:
    """Move ``callback`` in its Trainer's ``CallbackHandler.callbacks`` to just before the first
    reporting callback (``report_to``: W&B, TensorBoard, MLflow, ...), so what it adds to the logs
    in ``on_log`` reaches them. Returns whether it found the list (it then holds ``callback`` once)."""
    from transformers.trainer_callback import DefaultFlowCallback

    for holder in gc.get_referrers(callback):
        if isinstance(holder, list) and any(isinstance(c, DefaultFlowCallback) for c in holder):
            reporters = [i for i, c in enumerate(holder) if type(c).__module__.startswith("transformers.integrations")]
            mine = holder.index(callback)
            if reporters and reporters[0] < mine:
                holder.insert(reporters[0], holder.pop(mine))
            return True
    return False
