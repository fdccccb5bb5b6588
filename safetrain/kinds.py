"""The closed vocabulary: what can go wrong in a step (:class:`Kind`) and what is done about it (:class:`Action`).

Both are ``str`` enums, so a member is equal to the string the journal and the YAML config use
(``Kind.LOSS == "loss"``). The tables beside them are the rules that config validation, the
policy, the guard and the journal share. No torch here: a leaf every layer may import.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import FrozenSet, Mapping, Tuple

__all__ = [
    "Kind",
    "Action",
    "ANOMALY_KINDS",
    "ACTIONS",
    "DATA_KINDS",
    "REPLAYED_KINDS",
    "TRAINING_ACTIONS",
    "NON_CLIMBING",
    "RESTORING",
    "ALLOWED_FIRST",
    "DEFAULT_FIRST",
    "ESCALATION",
    "DEFAULT_ESCALATE",
    "SANITIZE_ACTIONS",
    "Cause",
    "CAUSE_TESTED",
    "CAUSE_ACTIONS",
]


class Kind(str, enum.Enum):
    """What went wrong in a step. The judge names the most upstream one: weights, input, target,
    forward, loss, an fp16 overflow or scaler, gradient, grad_norm, divergence, spike."""

    INPUT = "input"  # non-finite values in the batch's inputs
    TARGET = "target"  # non-finite values in the batch's targets
    FORWARD = "forward"  # a module's output went non-finite
    LOSS = "loss"  # the loss is non-finite
    GRADIENT = "gradient"  # non-finite gradients
    GRAD_NORM = "grad_norm"  # finite gradients whose norm is above guard.grad_norm_threshold or overflows float32
    DIVERGENCE = "divergence"  # a finite loss growing geometrically over consecutive steps (guard.divergence)
    SPIKE = "spike"  # a finite loss far above the recent ones
    WEIGHTS = "weights"  # non-finite parameters (an update broke them, or code outside the step)
    SCALER = "scaler"  # fp16: the loss scale fell below amp.min_scale, or overflows kept repeating
    OVERFLOW = "overflow"  # fp16: one GradScaler overflow (normal; journaled as scaler / skip_batch)

    def __str__(self) -> str:
        return self.value


class Action(str, enum.Enum):
    """What the guard does about an anomalous step."""

    WARN = "warn"  # journal it and apply the step anyway
    SKIP_BATCH = "skip_batch"  # drop the step's gradients; no update
    DROP_ROWS = "drop_rows"  # run the step again without the bad rows
    REPLACE = "replace"  # the bad values were replaced (nan_to_num) before the forward; train
    ZERO_GRADS = "zero_grads"  # zero the non-finite gradients and apply the rest
    RESTORE = "restore"  # roll back to the last good snapshot
    SCALE_LR = "scale_lr"  # restore, then scale the learning rate by recovery.lr_factor
    ABORT = "abort"  # restore, then raise TrainingAborted
    RETRY = "retry"  # a transient fault (its replay was finite): run the step once more
    RAISE = "raise"  # sanitize.*: raise met a bad row: BatchError, the step not applied

    def __str__(self) -> str:
        return self.value


#: The kinds the recovery policy decides on (``recovery.actions`` keys, input/target from ``sanitize``).
ANOMALY_KINDS: Tuple[Kind, ...] = tuple(k for k in Kind if k is not Kind.OVERFLOW)
#: The actions the recovery policy can choose (``retry`` and ``raise`` come from rules, not the ladder).
ACTIONS: Tuple[Action, ...] = tuple(a for a in Action if a not in (Action.RETRY, Action.RAISE))
#: Bad data: fixed by skipping or cleaning it, never by rolling the model back (they do not climb).
DATA_KINDS: FrozenSet[Kind] = frozenset({Kind.INPUT, Kind.TARGET})
#: Kinds a step replay can explain (the others are finite outliers, data, or the weights' own replay).
REPLAYED_KINDS: FrozenSet[Kind] = frozenset({Kind.FORWARD, Kind.LOSS, Kind.GRADIENT})
#: Actions after which the step's update is still applied.
TRAINING_ACTIONS: FrozenSet[Action] = frozenset({Action.WARN, Action.DROP_ROWS, Action.REPLACE, Action.ZERO_GRADS})
#: Actions that do not count as a failed attempt on the ladder.
NON_CLIMBING: FrozenSet[Action] = frozenset({Action.WARN, Action.DROP_ROWS, Action.REPLACE})
#: Actions that put the last good snapshot back.
RESTORING: FrozenSet[Action] = frozenset({Action.RESTORE, Action.SCALE_LR, Action.ABORT})

_ALWAYS = (Action.WARN, Action.SKIP_BATCH, Action.RESTORE, Action.SCALE_LR, Action.ABORT)
#: The first actions that make sense for each kind (``recovery.actions``).
ALLOWED_FIRST: Mapping[Kind, Tuple[Action, ...]] = MappingProxyType(
    {
        Kind.FORWARD: _ALWAYS,
        Kind.LOSS: _ALWAYS,
        Kind.GRADIENT: _ALWAYS[:2] + (Action.ZERO_GRADS,) + _ALWAYS[2:],
        Kind.GRAD_NORM: _ALWAYS[:2] + (Action.ZERO_GRADS,) + _ALWAYS[2:],
        Kind.DIVERGENCE: (Action.WARN, Action.RESTORE, Action.SCALE_LR, Action.ABORT),  # a skip changes no climb
        Kind.SPIKE: _ALWAYS,
        Kind.WEIGHTS: (Action.WARN, Action.RESTORE, Action.SCALE_LR, Action.ABORT),
        Kind.SCALER: _ALWAYS,
    }
)
#: The default first action of each kind (``recovery.actions`` in ``configs/default.yaml``).
DEFAULT_FIRST: Mapping[Kind, Action] = MappingProxyType(
    {
        Kind.FORWARD: Action.SKIP_BATCH,
        Kind.LOSS: Action.SKIP_BATCH,
        Kind.GRADIENT: Action.ZERO_GRADS,
        Kind.GRAD_NORM: Action.SKIP_BATCH,
        Kind.DIVERGENCE: Action.SCALE_LR,
        Kind.SPIKE: Action.SKIP_BATCH,
        Kind.WEIGHTS: Action.RESTORE,
        Kind.SCALER: Action.RESTORE,
    }
)
#: Actions allowed on the escalation ladder (``recovery.escalate``).
ESCALATION: Tuple[Action, ...] = (Action.SKIP_BATCH, Action.ZERO_GRADS, Action.RESTORE, Action.SCALE_LR, Action.ABORT)
#: The default ladder after the first action.
DEFAULT_ESCALATE: Tuple[Action, ...] = (Action.RESTORE, Action.SCALE_LR)
#: What ``sanitize.inputs`` / ``sanitize.targets`` may say (``raise`` aborts the step with BatchError).
SANITIZE_ACTIONS: Tuple[str, ...] = ("skip_batch", "drop_rows", "replace", "raise", "off")


class Cause(str, enum.Enum):
    """Why a step's loss stands far above its level, as the cause test tells it (see
    :func:`safetrain.policy.cause_of`): the step's data, the model, or the data from now on."""

    BAD_BATCH = "bad_batch"  # the next fresh batch is normal: this batch alone was bad
    DAMAGE = "damage"  # an older snapshot does well where the current model does badly
    DATA_CHANGE = "data_change"  # old and current model both do badly on fresh data: the data is harder now
    UNKNOWN = "unknown"  # the test could not tell (no snapshot with a level, or in between): the ladder decides

    def __str__(self) -> str:
        return self.value


#: Kinds the cause test runs for before the ladder escalates: a finite loss far above its level
#: (a non-finite value, or a gradient, names its own cause).
CAUSE_TESTED: FrozenSet[Kind] = frozenset({Kind.SPIKE})
#: What each cause calls for (``warn``: the step trains; a data change is journaled as a level shift).
CAUSE_ACTIONS: Mapping[Cause, Action] = MappingProxyType(
    {Cause.BAD_BATCH: Action.SKIP_BATCH, Cause.DAMAGE: Action.RESTORE, Cause.DATA_CHANGE: Action.WARN}
)
