"""The end-of-run judgment: a run is never "done" broken, untrained, worse than it started, or
back at its start.

Slow path only, once per ``fit`` (one host sync). It judges; the recovery executor
(:class:`~.recovery.Recovery`) carries out what it asks: putting the last good snapshot back (the
:class:`~safetrain.policy.Decision` comes from :func:`~safetrain.policy.decide_end`, as every
decision comes from the policy) and aborting with the cause and the fix.
"""

from __future__ import annotations

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
    kind, reason, worse = judged
    window = None
    if len(recovery.store):
        try:
            window = _put_back_sound(recovery)
        except SnapshotError as exc:  # the abort below says why the run stops; this is why it stays put
            logger.warning("the last good snapshot could not be put back: %s", exc)
    if worse:
        reason += _worse_fix(recovery, window)
    recovery.abort(kind, reason)


def _put_back_sound(r: "Recovery") -> Optional[Tuple[int, int]]:
    """Put back the newest snapshot that is vouched for (two clean reads after it, while the loss
    stood at its level) and whose model did not already make the run worse than it started, judged
    as the run's end is on the losses that followed it (those the next newer snapshot kept, when
    they are the steps right after it); every rank agrees. Damage that leaves nothing non-finite
    may have been snapshotted before anything was seen to be wrong: such a snapshot is no place to
    end. Returns ``(sound step, first passed-over step)`` when a snapshot was passed over, else
    ``None``. (Followers are counted in steps; a skipped step kept no loss, so across skips a few
    of them are older than the snapshot.)"""
    after_step, after = r.counters.steps, list(r.state.last_losses)  # the losses that followed
    passed: Optional[int] = None
    for older in range(len(r.store)):
        info = r.store.restore(r.train_state, older=older)
        n = after_step - info.step
        followers = after[-n:] if 0 < n <= len(after) else []  # (not the steps right after it: no judgment)
        bad = not r.state.vouched(info.step) or r.state.worse(followers, r.cfg.guard.end_margin) is not None
        if not r.sync.total(int(bad)):
            break
        passed = info.step
        after_step, after = info.step, [float(x) for x in info.extra.get("losses", {}).get("last", ())]
    r.counters.restores += 1  # (every one passed over: the oldest stays put back, the nearest to the start)
    return (info.step, passed) if passed is not None and passed != info.step else None


def _worse_fix(r: "Recovery", window: Optional[Tuple[int, int]]) -> str:
    """The fix an end worse than the start calls for: the damage the cause test found (the step the
    loss jumped), else the step the loss left its level and the snapshots passed over, else an LR
    too high."""
    if r.state.damage is not None:  # the cause test found the model damaged on the way
        began, sound = r.state.damage
        return (
            f"; fix: the model was damaged: its loss jumped at step {began} where the snapshot of step {sound} did "
            "well on the same data; find what changed the weights or buffers then (a bad batch through "
            "running statistics, an observer or an EMA; code outside the step)"
        )
    left = r.state.left_level
    if window is None and left is None:
        fix = (
            "; fix: a smaller learning rate (or LR warmup), targets and inputs in the units the model expects; for a "
            "run whose loss may rise by design (a GAN, RL), guard.end_margin: null"
        )
        return fix + _failed_lr(r)
    when = f"by step {left}: its loss left its level there and never came back to it" if left is not None else ""
    if window is not None:
        sound, damaged = window
        put_back = (
            f"the snapshot of step {sound} was put back, passing over those from step {damaged} on (no clean step "
            "vouched for them, or the losses after them were already worse than the start)"
        )
        when = when or f"between step {sound} and step {damaged}"
    else:
        put_back = "the snapshot put back is from before it (none was taken or vouched for after it)"
    return (
        f"; fix: the model was damaged {when}; {put_back}; find what changed the weights or buffers then (a bad "
        "batch through running statistics, an observer or an EMA; code outside the step; an LR too high then)"
    )


def _judge(r: "Recovery", seen: int, trained: int) -> Optional[Tuple[Union[Kind, str], str, bool]]:
    """``(kind, reason, worse)`` when the run must not end "done": non-finite parameters, no
    trained step, or an end worse than its start (``worse``: the fix is chosen once the snapshot
    put back is known); else ``None``."""
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
        return Kind.WEIGHTS, reason, False
    if seen > 0 and trained == 0:
        c = r.counters
        kind: Union[Kind, str] = Kind.TARGET if r.masked_targets else "run"
        reason = f"run: none of the {seen} steps trained ({c.skipped_batches} skipped, {c.restores} restores)"
        return kind, with_hint(reason, Kind.TARGET, None, r.masked_targets, seen), False
    worse = r.state.ended_worse(r.cfg.guard.end_margin) if seen > 0 else None
    if not worse:
        return None
    return "run", f"run: {worse}", True


def _settle_last_step(r: "Recovery", seen: int) -> None:
    """A run whose last step was an anomaly on the ladder ends on weights nothing vouched for: the
    policy's end decision (:func:`~safetrain.policy.decide_end`) puts the last good snapshot back,
    journaled."""
    if seen == 0:
        return
    decision = decide_end(r.state.for_policy(has_snapshot=bool(len(r.store))))
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
