"""The end-of-run judgment: a run is never "done" broken, untrained, worse than it started, or
back at its start.

Slow path only, once per ``fit`` (one host sync). It judges; the recovery executor
(:class:`~.recovery.Recovery`) carries out what it asks: putting the last good snapshot back (the
:class:`~safetrain.policy.Decision` comes from :func:`~safetrain.policy.decide_end`, as every
decision comes from the policy) and aborting with the cause and the fix.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Optional, Tuple, Union

import torch

from ..diagnose.optim_numerics import explain_optimizer
from ..errors import SnapshotError
from ..kinds import Kind
from ..policy import decide_end
from .messages import with_hint
from .returns import cause_of

if TYPE_CHECKING:  # the executor is only a type here (it calls check_end)
    from .recovery import Recovery

__all__ = ["check_end"]

logger = logging.getLogger(__name__)


def check_end(recovery: "Recovery", seen: int, trained: int) -> None:
    """The end of ``fit``: a run never ends "done" with no trained step, with non-finite
    parameters, or with its last trained losses ``guard.end_margin`` standard deviations above its
    first; each aborts, the model put back at the last good snapshot. A run whose last step was an
    anomaly is put back at the last good snapshot first; a run left at its start aborts.

    Args:
        recovery: the recovery executor (its state, counters, store and journal).
        seen: steps this ``fit`` decided.
        trained: optimizer steps this ``fit`` applied.

    Raises:
        TrainingAborted: naming the cause and the fix.
    """
    judged = _judge(recovery, seen, trained)
    if judged is None:
        _settle_last_step(recovery, seen)
        at_start = _ended_at_start(recovery, seen)
        if at_start is None:
            return
        recovery.abort("run", at_start)  # (the state is the start's already: nothing to restore)
    kind, reason = judged
    if len(recovery.store):
        try:
            recovery.store.restore(recovery.train_state)
            recovery.counters.restores += 1
        except SnapshotError as exc:  # the abort below says why the run stops; this is why it stays put
            logger.warning("the last good snapshot could not be put back: %s", exc)
    recovery.abort(kind, reason)


def _judge(r: "Recovery", seen: int, trained: int) -> Optional[Tuple[Union[Kind, str], str]]:
    """``(kind, reason)`` when the run must not end "done": non-finite parameters, no trained
    step, or an end worse than its start; else ``None``."""
    names = list(r.params)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in r.params.values()]  # FSDP2: own shard
    finite = torch.stack([torch.isfinite(p).all() for p in local]).tolist() if names else []
    broken = [n for n, ok in zip(names, finite) if not ok]  # host sync: once, at the end of the run
    if r.sync.total(len(broken)) and not broken:  # another rank's shard is broken: every rank stops
        broken = ["(on another rank)"]
    if broken:
        known = explain_optimizer(r.train_state.optimizer, [r.params[n] for n in broken if n in r.params])
        reason = (
            f"weights: the run ended with non-finite parameters ({', '.join(broken[:5])}) that no check "
            f"caught on the way (detect.check_weights_every={r.cfg.detect.check_weights_every} steps)"
            + (f"; {known}" if known else "; lower detect.check_weights_every to find the step that broke them")
        )
        return Kind.WEIGHTS, reason
    if seen > 0 and trained == 0:
        c = r.counters
        kind: Union[Kind, str] = Kind.TARGET if r.masked_targets else "run"
        reason = f"run: none of the {seen} steps trained ({c.skipped_batches} skipped, {c.restores} restores)"
        return kind, with_hint(reason, Kind.TARGET, None, r.masked_targets, seen)
    worse = r.state.ended_worse(r.cfg.guard.end_margin) if seen > 0 else None
    if not worse:
        return None
    fix = (
        "a smaller learning rate (or LR warmup), targets and inputs in the units the model expects; for a "
        "run whose loss may rise by design (a GAN, RL), guard.end_margin: null"
    )
    if r.state.damage is not None:  # the cause test found the model damaged on the way
        began, sound = r.state.damage
        fix = (
            f"the model was damaged: its loss jumped at step {began} where the snapshot of step {sound} did "
            "well on the same data; find what changed the weights or buffers then (a bad batch through "
            "running statistics, an observer or an EMA; code outside the step)"
        )
    return "run", f"run: {worse}; fix: {fix}" + (_failed_lr(r) if r.state.damage is None else "")


def _settle_last_step(r: "Recovery", seen: int) -> None:
    """A run whose last step was an anomaly on the ladder ends on weights nothing vouched for: the
    policy's end decision (:func:`~safetrain.policy.decide_end`) puts the last good snapshot back,
    journaled."""
    if seen == 0:
        return
    decision = decide_end(dataclasses.replace(r.state.history, has_snapshot=bool(len(r.store))))
    if decision is None:
        return
    r.restore(decision, why=f"{decision.kind}: the run ended on an anomalous step, on weights nothing vouched for")
    r.state.skip_after_restore = 0  # nothing is left to skip


def _failed_lr(r: "Recovery") -> str:
    """What an end-of-run abort adds when restores answered faults under an LR schedule: the LR the
    failing update used, the schedule's peak to lower (``""`` without a schedule or a restore)."""
    failed, name = r.backoff.failed, r.backoff.scheduler
    if failed is None or not name or not r.counters.restores:
        return ""
    lr = max(failed)
    return (
        f"; {r.counters.restores} restores answered faults that came at lr {lr:.3g} under the LR scheduler "
        f"{name}: lower the schedule's peak LR below {lr:.3g}"
    )


def _ended_at_start(r: "Recovery", seen: int) -> Optional[str]:
    """A run whose last restore put back the snapshot it started from, with no update applied since,
    ends with the start's weights: none of its training was kept, so it is not "done". The reason
    (the cause and the fix: a schedule that climbs back to the LR that failed, else the last fault),
    or ``None``."""
    s, start = r.state, r.counters.steps - seen
    if s.returns.snapshot != start or s.restored_updates != r.counters.optimizer_steps:
        return None
    h = s.history
    kind = h.fault.kind if h.fault is not None else "last"
    b = r.backoff
    now = [lr * b.failed_scale for lr in b.unscaled]  # the restored snapshot's LRs, as the failed update's
    cause = cause_of(kind, failed_lr=b.failed, snapshot_lr=now, scheduler=b.scheduler)
    return (
        f"run: the run ended restored to its start (the snapshot of step {start}, put back at step "
        f"{s.returns.restored_at} after {r.counters.restores} restores): none of its training was kept; {cause}"
    )
