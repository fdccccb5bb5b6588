"""The metrics every driver sends to a tracker, from one function: :func:`step_metrics`.

``fit``'s TensorBoard sink, the Lightning callback (its ``Trainer``'s loggers) and the Hugging Face
callback (the ``Trainer``'s logs, hence its reporters and ``log_history``) all log a decided step
through :func:`step_metrics`, so the keys and the counters are the same wherever a run is watched:

* ``safetrain/loss``, ``safetrain/grad_norm`` (before clipping), ``safetrain/clipped_to`` (the norm
  after clipping, on a clipped step), ``safetrain/lr_scale`` (the LR backoff's scale) and
  ``safetrain/trained`` (1.0 when the update was applied); a value that is not finite is left out
  (a skipped step's NaN loss): the journal says what happened there;
* ``safetrain/lr``: the LR in force of the first parameter group (the schedule's times the backoff);
  with several groups, ``safetrain/lr/group{i}`` for each of them too;
* one key per intervention counter, ``safetrain/<counter>`` (:data:`COUNTERS`: every field of
  :class:`~safetrain.steps.Counters` but the run's position and progress), totals so far.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, Tuple

from .steps import Counters

if TYPE_CHECKING:
    from .hooks import StepRecord

__all__ = ["PREFIX", "COUNTERS", "step_metrics", "metric_keys"]

#: What every key starts with.
PREFIX = "safetrain/"

#: Counters fields that are the run's position or progress, not interventions: trackers have the step.
_PROGRESS = frozenset({"steps", "optimizer_steps", "healthy_steps", "epoch", "batch"})

#: The counters logged as ``safetrain/<name>``: every intervention :class:`~safetrain.steps.Counters`
#: has (a counter added there is logged by every driver without a change here).
COUNTERS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Counters) if f.name not in _PROGRESS)


def step_metrics(record: "StepRecord") -> Dict[str, float]:
    """The tracker metrics of one decided step, keyed ``safetrain/<name>`` (see the module's docstring).

    Args:
        record: the step, as :class:`~safetrain.hooks.RunHook` hooks receive it.

    Returns:
        Plain floats (host values: no sync), non-finite ones left out.

    Example::

        >>> from safetrain.hooks import StepRecord
        >>> from safetrain.steps import Counters
        >>> import dataclasses
        >>> record = StepRecord(step=3, epoch=0, batch=3, loss=0.5, grad_norm=2.0, lr_scale=1.0, lrs=(0.1,),
        ...                     trained=True, action="", clipped_to=float("nan"),
        ...                     counts=dataclasses.asdict(Counters(restores=1)))
        >>> metrics = step_metrics(record)
        >>> metrics["safetrain/lr"], metrics["safetrain/restores"], "safetrain/clipped_to" in metrics
        (0.1, 1.0, False)
    """
    out: Dict[str, float] = {}
    for name, value in (
        ("loss", record.loss),
        ("grad_norm", record.grad_norm),
        ("clipped_to", record.clipped_to),
        ("lr_scale", record.lr_scale),
    ):
        if math.isfinite(value):
            out[PREFIX + name] = float(value)
    out[PREFIX + "trained"] = float(record.trained)
    if record.lrs:
        out[PREFIX + "lr"] = float(record.lrs[0])
    if len(record.lrs) > 1:
        for i, lr in enumerate(record.lrs):
            out[f"{PREFIX}lr/group{i}"] = float(lr)
    for name in COUNTERS:
        out[PREFIX + name] = float(record.counts[name])
    return out


def metric_keys(groups: int = 1) -> Tuple[str, ...]:
    """Every key :func:`step_metrics` can return, for an optimizer with ``groups`` parameter groups.

    Example::

        >>> "safetrain/skipped_batches" in metric_keys() and "safetrain/lr/group1" in metric_keys(2)
        True
    """
    keys = [PREFIX + name for name in ("loss", "grad_norm", "clipped_to", "lr_scale", "trained", "lr")]
    if groups > 1:
        keys += [f"{PREFIX}lr/group{i}" for i in range(groups)]
    return tuple(keys + [PREFIX + name for name in COUNTERS])
