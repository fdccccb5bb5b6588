"""What a decision becomes when its action cannot be carried out: a restore with no snapshot.

Pure (no torch, no I/O), beside :mod:`safetrain.policy`, which applies it when
``History.has_snapshot`` is false: no snapshot was taken yet, or every one was refused as
non-finite. A restore requested then is never an internal error; it is decided here:

========================  ====================================================
wanted                    instead
========================  ====================================================
any, ``weights`` fault    ``abort``: only a snapshot repairs non-finite weights
``restore``               ``skip_batch``: the step is not applied
``scale_lr``              ``scale_lr`` without the restore
========================  ====================================================

Example::

    >>> without_snapshot(Kind.LOSS, Action.RESTORE, "loss: first action restore")[0]
    <Action.SKIP_BATCH: 'skip_batch'>
"""

from __future__ import annotations

from typing import Tuple

from ..kinds import Action, Kind

__all__ = ["without_snapshot"]


def without_snapshot(kind: Kind, action: Action, reason: str) -> Tuple[Action, str]:
    """The action and reason that replace a ``restore`` or ``scale_lr`` when no usable snapshot exists.

    Args:
        kind: the anomaly's kind.
        action: ``restore`` or ``scale_lr``, as the ladder chose it.
        reason: the ladder's reason, which the returned one extends.

    Returns:
        ``(action, reason)``: ``abort`` for a ``weights`` fault, ``skip_batch`` for a restore,
        ``scale_lr`` (without a restore) for a backoff.
    """
    if kind is Kind.WEIGHTS:
        return Action.ABORT, (
            f"{reason}; the weights are non-finite and there is no usable snapshot to restore (none was taken "
            "yet, or each was refused as non-finite or found damaged); fix: start from finite weights (reload "
            "the checkpoint, convert it in float32) and look for the code that edits the weights between steps"
        )
    if action is Action.RESTORE:
        return Action.SKIP_BATCH, f"{reason}; no usable snapshot to restore yet: the step is skipped instead"
    return action, f"{reason}; no usable snapshot to restore yet: the LR is backed off without a restore"
