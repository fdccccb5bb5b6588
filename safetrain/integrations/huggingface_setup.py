"""What the Hugging Face callback gives the guard from the Trainer's objects: the model (the DDP
wrapper under torchrun / accelerate launch), the loss of a model's output, and the accumulation
the Trainer divides each micro-batch's loss by. Used by :mod:`.huggingface` only."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..adapters.huggingface_private import ddp_wrapper_of, takes_loss_kwargs
from ..config import TrainConfig
from ..errors import SafetrainError

__all__ = ["loss_of", "model_loss", "with_accumulation", "guarded_model"]


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss in a model's output: ``output.loss`` / ``output["loss"]``, or a tuple's first item."""
    if isinstance(output, Mapping):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0] if output[0].dim() == 0 else None
    return loss


def model_loss(model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
    """The default ``step_fn``: ``model(**batch)``'s loss, as the Trainer computes it (labels in the batch)."""
    loss = loss_of(model(**batch))
    if loss is None:
        raise RuntimeError("model(**batch) returned no loss; SafeTrainingCallback needs labels in the batch")
    return loss


def with_accumulation(cfg: TrainConfig, model: torch.nn.Module, k: int) -> TrainConfig:
    """The config with ``guard.accumulate_steps`` as the Trainer divides each micro-batch's loss for
    its backward (the guard's re-runs and replays do the same): by ``gradient_accumulation_steps``,
    or not at all for a model that takes ``num_items_in_batch`` (its loss is already normalized over
    the whole step; the Trainer's rule: ``accepts_loss_kwargs``, else a ``**kwargs`` forward)."""
    k = 1 if takes_loss_kwargs(model) else max(int(k), 1)
    if cfg.guard.accumulate_steps == k:
        return cfg
    return dataclasses.replace(cfg, guard=dataclasses.replace(cfg.guard, accumulate_steps=k))


def guarded_model(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The model the guard is given: under DDP, the wrapper around the one the Trainer hands
    callbacks; in one process, ``model``.

    Raises:
        SafetrainError: FSDP (refused, with the reason), or many processes with a model that is
            neither DDP nor FSDP (the ranks could not agree).
    """
    if world <= 1:
        return model
    wrapper = ddp_wrapper_of(model)
    if wrapper is not None:
        return wrapper
    if any(type(m).__module__.startswith("torch.distributed.fsdp") for m in model.modules()):
        raise SafetrainError(
            "SafeTrainingCallback does not guard FSDP through accelerate yet: accelerate runs FSDP on accelerators "
            "only (on the CPU it falls back to DDP), so this path is untested and a sharded restore could not be "
            "vouched for; use DDP (torchrun / accelerate launch without an FSDP plugin), or safetrain.SafeTrainer "
            "with torch.distributed.fsdp.fully_shard (FSDP2, sharded snapshots)"
        )
    raise SafetrainError(
        f"SafeTrainingCallback: world_size={world} but the model the Trainer trains is not inside a "
        "DistributedDataParallel, so the ranks could not agree on each step; expected the Trainer under torchrun "
        "or accelerate launch with DDP"
    )
