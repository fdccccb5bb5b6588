"""The recovery policy: a pure state machine from (anomaly, diagnosis, history, rules) to a decision.

No torch and no I/O: :func:`decide` and :func:`observe_healthy` take the history and the rules and
return a new history with the decision, so every path is a table test that runs in microseconds.
The guard's recovery executor carries the decisions out.

The ladder. The n-th anomalous step in a row (n = 1, 2, ...) gets:

* n = 1: the kind's first action (``recovery.actions[kind]``; input and target kinds take
  ``sanitize.inputs`` / ``sanitize.targets``);
* n >= 2: ``recovery.escalate[n - 2]``, the last entry repeating;
* n > ``recovery.max_retries`` + 1: ``abort``.

``warn``, ``drop_rows`` and ``replace`` still train the step and do not climb the ladder, and
input and target anomalies never climb it (bad data is not fixed by rolling the model back);
``recovery.reset_after`` healthy steps in a row put it back at the first rung. Independently, a
run aborts when more than ``recovery.max_skip_fraction`` of the last ``recovery.skip_window``
steps were not trained (of the steps so far, once :data:`MIN_SKIP_STEPS` have run, while the
window has not filled), so it never reaches its end by skipping.

A ``weights`` fault found at step k was made by an earlier update (the weight replay names it):
the steps from that update on were counted healthy but were not, so they are taken back (a ladder
reset they made is undone, and an update that broke the weights right after an anomalous step is
one more anomalous step in a row). A fault that comes back at the same place right after a
restore is persistent (:mod:`safetrain.policy.faults`): it aborts at once when its cause is known to be
beyond any recovery action (an optimizer ``eps`` the dtype cannot hold), else after a few.

Rules beside the ladder: an fp16 overflow is normal (skip the step) until the scale would fall
below ``amp.min_scale`` or ``amp.max_overflows`` come in a row (then it is a ``scaler`` anomaly);
a forward, loss or gradient fault whose replay was finite (transient) is retried once; a restore
with no usable snapshot (``History.has_snapshot``) falls back as :mod:`safetrain.policy.fallbacks` says; a restore
passes over the newest snapshot (it is kept, never restored) when no healthy step has vouched for
it since it was taken and the fault may lie in the weights its update made:

=====================================================  ==========================
fault that restores (newest snapshot unverified)       pass over the newest?
=====================================================  ==========================
weights, divergence, spike, grad_norm, scaler          yes (the update is suspect)
forward, loss, gradient with no diagnosis              yes (nothing clears the weights)
... replay: reproducible, no bad rows isolated          yes (the whole batch fails)
... replay: the weights at fault (``kind: weights``)    yes
... replay: reproducible in some rows (``bad_rows``)    no: a data fault; its update was skipped
... replay: transient (retried, failed again)           no: the weights read clean in the replay
=====================================================  ==========================

A spike the cause test explained (``Anomaly.cause``, :mod:`safetrain.policy.causes`) takes the cause's
action from :data:`~safetrain.kinds.CAUSE_ACTIONS`: a data change trains and clears the ladder
(the anomalies that led to it were no fault); damage restores the snapshot the test found sound,
whatever the rung (an abort stays an abort); an unknown cause climbs the ladder as before. A level
rise (a spike of rule ``level``) that is neither damage nor a data change is trained on (``warn``).

Divergence (a loss growing geometrically) is fixed only by a smaller LR: every rung after its
first is ``scale_lr`` (a restore or a skip alone replays the same climb), a climb back within
the same episode is the same anomaly again (the detector's ``episode`` keeps the ladder going
even after ``reset_after`` healthy steps), and when one more backoff would take every LR below
``recovery.min_lr`` (or ``max_retries`` is spent) it aborts, the reason naming the LR and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Tuple

from ..kinds import (
    CAUSE_ACTIONS,
    DATA_KINDS,
    NON_CLIMBING,
    REPLAYED_KINDS,
    RESTORING,
    TRAINING_ACTIONS,
    Action,
    Cause,
    Kind,
)
from .causes import Verdict
from .fallbacks import without_snapshot
from .faults import broken_for, persistent_reason, signature_of
from .history import (
    MIN_SKIP_STEPS,
    VOUCH_READS,
    History,
    climb_pending,
    mark_last_skipped,
    observe_healthy,
    push_recent,
    read_clean,
    record_step,
    skip_denominator,
)

if TYPE_CHECKING:  # config imports no torch either; only its types are needed here
    from ..config import RecoveryConfig, TrainConfig

__all__ = [
    "Anomaly",
    "Rules",
    "History",
    "Decision",
    "decide",
    "decide_end",
    "raises",
    "observe_healthy",
    "climb_pending",
    "record_step",
    "mark_last_skipped",
    "read_clean",
    "MIN_SKIP_STEPS",
    "VOUCH_READS",
]


@dataclass(frozen=True)
class Anomaly:
    """What the judge found in a step's read: the most upstream kind, and its evidence.

    Attributes:
        kind: what went wrong (:class:`~safetrain.kinds.Kind`).
        detail: the evidence for the journal (a finding, rows, a scale...); the policy reads
            ``new_scale`` of an ``overflow``, and the finding's place for a fault's signature.
        retried: found in the retry of a transient fault (it is not retried again).
        again: found in a re-run of the same step (a retry, ``drop_rows`` or ``replace``): the
            step already has its entry in the recent window, which this decision replaces.
        episode: a ``divergence``: 1 for a first one, n for the n-th of an episode not yet
            recovered from (the ladder goes on from there).
        lrs: a ``divergence``: the schedule's own LRs, one per group (an abort names them; a
            backoff that would take them below ``recovery.min_lr`` aborts).
        cause: the cause test's verdict (:mod:`safetrain.policy.causes`), when it ran: a data change
            trains and leaves the ladder; damage restores the snapshot that does well.
    """

    kind: Kind
    detail: Mapping[str, Any] = field(default_factory=dict)
    retried: bool = False
    again: bool = False
    episode: int = 1
    lrs: Tuple[float, ...] = ()
    cause: Optional[Verdict] = None


class Diagnosed(Protocol):
    """What the policy reads of a replay's diagnosis: whether the fault came back."""

    reproducible: bool


@dataclass(frozen=True)
class Rules:
    """The parts of the configuration the policy decides by, typed and read once.

    Attributes:
        recovery: the ``recovery`` section (first actions, ladder, limits).
        inputs: ``sanitize.inputs``: the first action for bad input rows.
        targets: ``sanitize.targets``: the first action for bad target rows.
        min_scale: ``amp.min_scale``: an fp16 loss scale below this is a ``scaler`` anomaly.
        max_overflows: ``amp.max_overflows``: this many overflows in a row are a ``scaler`` anomaly.
        reruns: whether a step can be run again (``drop_rows``, ``retry``); not in a loop the caller
            owns without a ``loss_fn`` or ``step_fn``, where those become ``skip_batch``.
    """

    recovery: "RecoveryConfig"
    inputs: str = "drop_rows"
    targets: str = "skip_batch"
    min_scale: float = 0.0
    max_overflows: int = 10
    reruns: bool = True

    @classmethod
    def of(cls, cfg: "TrainConfig") -> "Rules":
        """The rules of a whole configuration."""
        return cls(cfg.recovery, cfg.sanitize.inputs, cfg.sanitize.targets, cfg.amp.min_scale, cfg.amp.max_overflows)

    def first_action(self, kind: Kind) -> str:
        """The kind's first action (``sanitize`` for data kinds, where ``raise`` decides ``abort``)."""
        if kind in DATA_KINDS:
            first = self.inputs if kind is Kind.INPUT else self.targets
            if first == "raise":
                return Action.ABORT
            return Action.SKIP_BATCH if first == Action.DROP_ROWS and not self.reruns else first
        return self.recovery.actions[kind]


@dataclass(frozen=True)
class Decision:
    """What to do about one anomalous step.

    Attributes:
        kind: the anomaly kind that was decided on (``scaler`` for an overflow too many).
        action: an :class:`~safetrain.kinds.Action`.
        rung: 1-based position on the ladder (1: the kind's first action; 0: off the ladder).
        restore: roll back to the last good snapshot (true for ``restore`` and ``scale_lr``).
        lr_scale: the LR scale in force after this decision.
        trains: whether the step's update is still applied.
        reason: one line for the journal.
        pass_over_newest: restore from the snapshot before the newest (see ``History.unverified``).
        older: restore the snapshot this many usable ones back (damage: the newest the cause
            test found sound), passing over the newer ones.
    """

    kind: Kind
    action: Action
    rung: int
    restore: bool
    lr_scale: float
    trains: bool
    reason: str
    pass_over_newest: bool = False
    older: int = 0


def _off_ladder(kind: Kind, action: Action, history: History, reason: str) -> Decision:
    return Decision(kind, action, 0, False, history.lr_scale, action in TRAINING_ACTIONS, reason)


def raises(kind: Kind, rules: Rules) -> bool:
    """Whether bad rows of ``kind`` raise :class:`~safetrain.errors.BatchError` (``sanitize.*: raise``)
    before any decision: the step is not applied and the history does not move."""
    return kind in DATA_KINDS and (rules.inputs if kind is Kind.INPUT else rules.targets) == "raise"


def decide(
    anomaly: Anomaly, history: History, rules: Rules, diagnosis: Optional[Diagnosed] = None
) -> Tuple[Decision, History]:
    """Decide what to do about an anomalous step, and how the history moves on.

    Args:
        anomaly: what the judge found (kind and evidence).
        history: the policy's memory before this step.
        rules: the configuration's recovery rules.
        diagnosis: the step replay's verdict, when one ran (a transient fault is retried once).

    Returns:
        ``(decision, new_history)``.

    Example::

        >>> from safetrain import load_config
        >>> d, h = decide(Anomaly(Kind.LOSS), History(), Rules.of(load_config()))
        >>> d.action, h.consecutive
        (<Action.SKIP_BATCH: 'skip_batch'>, 1)
    """
    kind = Kind(anomaly.kind)
    if kind is Kind.OVERFLOW:
        history = replace(history, overflows=history.overflows + 1)
        if anomaly.detail["new_scale"] >= rules.min_scale and history.overflows < rules.max_overflows:
            return _off_ladder(kind, Action.SKIP_BATCH, history, "fp16 overflow: GradScaler skips the step"), history
        kind = Kind.SCALER
    elif kind in (Kind.GRADIENT, Kind.GRAD_NORM, Kind.DIVERGENCE, Kind.SPIKE):  # judged after the scaler's check passed
        history = replace(history, overflows=0)
    if anomaly.again:  # this step's entry is already in the window: the decision below replaces it
        history = replace(history, recent=history.recent[:-1])
    transient = diagnosis is not None and not diagnosis.reproducible
    if kind in REPLAYED_KINDS and transient and not anomaly.retried and rules.reruns:
        decision = _off_ladder(
            kind, Action.RETRY, history, "transient (the replay from the same state was finite): retrying the step once"
        )
        return decision, record_step(history, rules.recovery, skipped=False)
    if anomaly.cause is not None and anomaly.cause.cause is Cause.DATA_CHANGE:
        return _level_shift(kind, anomaly.cause, history, rules)
    if anomaly.detail.get("rule") == "level" and (anomaly.cause is None or anomaly.cause.cause is not Cause.DAMAGE):
        reason = f"{kind}: the loss rose to a new level and stays, no cause found (no snapshot told): training on"
        return _off_ladder(kind, Action.WARN, history, reason), record_step(history, rules.recovery, skipped=False)
    return _climb(kind, history, rules, anomaly, diagnosis)


def _level_shift(kind: Kind, verdict: Verdict, history: History, rules: Rules) -> Tuple[Decision, History]:
    """The data changed: the step trains, and the anomalies that led here were no fault (the
    ladder and the fault it remembers are cleared)."""
    action = CAUSE_ACTIONS[Cause.DATA_CHANGE]
    reason = (
        f"{kind}: the data changed (level {verdict.level:.4g} -> {verdict.current:.4g}; the snapshots' models do "
        "as badly on it): training on, the loss references re-based at the new level"
    )
    decision = _off_ladder(kind, action, history, reason)
    history = replace(record_step(history, rules.recovery, skipped=False), consecutive=0, fault=None, restored=False)
    return decision, history


#: Kinds whose fault may lie in the weights the last update made (see the module's table).
_WEIGHT_KINDS = frozenset({Kind.WEIGHTS, Kind.DIVERGENCE, Kind.SPIKE, Kind.GRAD_NORM, Kind.SCALER})


def _implicates_weights(kind: Kind, diagnosis: Optional[Diagnosed]) -> bool:
    """Whether the newest (unverified) snapshot may hold the fault: not when a replay pinned it on
    some rows of the batch (a data fault) or found it transient."""
    if kind in _WEIGHT_KINDS or diagnosis is None:
        return True
    if getattr(diagnosis, "kind", None) == "weights":
        return True
    return bool(diagnosis.reproducible) and not getattr(diagnosis, "bad_rows", ())


def _take_back(history: History, steps: int, reset_after: int) -> History:
    """A ``weights`` fault: the last ``steps`` steps counted healthy ran on (or made) broken weights.
    A ladder reset they made is undone; an update that broke the weights right after an anomalous
    step is one more anomalous step in a row."""
    if steps <= 0 or history.healthy_streak <= 0:
        return history
    kept = max(0, history.healthy_streak - steps)
    consecutive = history.consecutive
    if history.healthy_streak >= reset_after > kept:
        consecutive = history.reset_from
    if kept == 0 and consecutive > 0:
        consecutive += 1
    return replace(history, consecutive=consecutive, healthy_streak=kept)


def _climb(
    kind: Kind, history: History, rules: Rules, anomaly: Anomaly, diagnosis: Any = None
) -> Tuple[Decision, History]:
    recovery, detail = rules.recovery, anomaly.detail
    first = Action(rules.first_action(kind))
    climbs = kind not in DATA_KINDS and first not in NON_CLIMBING
    if climbs and kind is Kind.WEIGHTS:
        history = _take_back(history, broken_for(detail, diagnosis), recovery.reset_after)
    signature = signature_of(kind, detail, diagnosis) if climbs else None
    again = signature is not None and signature == history.fault and history.restored
    recurrences = history.recurrences + 1 if again else 0
    n = history.consecutive + 1 if climbs else 1
    diverging = kind is Kind.DIVERGENCE and climbs
    if diverging:  # the same episode climbing back: the ladder goes on
        n = max(n, anomaly.episode)
    if not climbs:
        action, reason = first, f"{kind}: {first}"
    elif n > recovery.max_retries + 1:
        action = Action.ABORT
        reason = f"{kind}: {n} anomalous steps in a row, more than recovery.max_retries={recovery.max_retries} retries"
    elif n == 1:
        action, reason = first, f"{kind}: first action {first}"
    else:
        ladder = recovery.escalate or (first,)
        action = Action(ladder[min(n - 2, len(ladder) - 1)])
        reason = f"{kind}: anomalous step {n} in a row, escalated to {action}"
    if diverging and n >= 2 and action in (Action.SKIP_BATCH, Action.ZERO_GRADS, Action.RESTORE):
        action, reason = Action.SCALE_LR, f"{kind}: still growing at step {n} of the episode, backing the LR off again"
    if diverging:
        action, reason = _divergence_limit(action, reason, n, history, recovery, anomaly.lrs)
    damage = anomaly.cause if anomaly.cause is not None and anomaly.cause.cause is Cause.DAMAGE else None
    if damage is not None and action is not Action.ABORT:
        action = CAUSE_ACTIONS[Cause.DAMAGE]
        reason = (
            f"{kind}: damage: the loss stands at {damage.current:.4g}, far above its level {damage.level:.4g}, "
            f"where the snapshot of step {damage.step} does well on the same batch: the model was damaged after "
            "that step; restoring it"
        )
    persistent = persistent_reason(signature, recurrences, diagnosis) if signature is not None else ""
    if persistent and action is not Action.ABORT:
        action, reason = Action.ABORT, persistent
    if action in (Action.RESTORE, Action.SCALE_LR) and not history.has_snapshot:
        action, reason = without_snapshot(kind, action, reason)

    lr_scale, since = history.lr_scale, history.since_lr_change
    if action is Action.SCALE_LR:
        lr_scale, since = lr_scale * recovery.lr_factor, 0
    trains = action in TRAINING_ACTIONS
    recent = push_recent(history.recent, not trains, recovery.skip_window)
    if action is not Action.ABORT and replace(history, recent=recent).skipped_fraction(recovery.skip_window) > (
        recovery.max_skip_fraction
    ):
        action = Action.ABORT
        over = skip_denominator(len(recent), recovery.skip_window)
        last = f"the last {over}" if over == recovery.skip_window else f"the first {len(recent)}"
        reason = (
            f"{kind}: {sum(recent)} of {last} steps were not trained, more than "
            f"recovery.max_skip_fraction={recovery.max_skip_fraction}"
        )
        trains = False
    restoring = action in RESTORING and history.has_snapshot
    new = replace(
        history,
        consecutive=n if climbs else history.consecutive,
        healthy_streak=0 if climbs else history.healthy_streak,
        recent=recent,
        lr_scale=lr_scale,
        since_lr_change=since,
        unverified=0 if restoring else history.unverified,
        fault=signature if climbs else history.fault,
        restored=restoring if climbs else history.restored,
        recurrences=recurrences if climbs else history.recurrences,
        reset_from=0 if climbs else history.reset_from,
    )
    decision = Decision(
        kind=kind,
        action=action,
        rung=n,
        restore=action in (Action.RESTORE, Action.SCALE_LR) and history.has_snapshot,
        lr_scale=lr_scale,
        trains=trains,
        reason=reason,
        pass_over_newest=restoring
        and damage is None
        and history.unverified > 0
        and _implicates_weights(kind, diagnosis),
        older=damage.older if damage is not None and restoring else 0,
    )
    return decision, new


def decide_end(history: History) -> Optional[Decision]:
    """The end of a run: a run whose last step was an anomaly on the ladder (no healthy step read
    clean after it) ends on weights nothing vouched for (a skipped spike after an LR blow-up leaves
    them ruined), so the last good snapshot goes back, passing over an unverified newest one.
    ``None`` when the run ended on a healthy step, or there is no snapshot to go back to.

    Example::

        >>> decide_end(History(consecutive=1)).action
        <Action.RESTORE: 'restore'>
        >>> decide_end(History(consecutive=1, healthy_streak=3)) is None
        True
    """
    if history.consecutive == 0 or history.healthy_streak > 0 or not history.has_snapshot:
        return None
    kind = Kind(history.fault.kind) if history.fault is not None else Kind.LOSS  # the last fault on the ladder
    return Decision(
        kind=kind,
        action=Action.RESTORE,
        rung=0,
        restore=True,
        lr_scale=history.lr_scale,
        trains=False,
        reason="the run ended on an anomalous step",
        pass_over_newest=history.unverified > 0,
    )


def _divergence_limit(
    action: Action, reason: str, n: int, history: History, recovery: "RecoveryConfig", lrs: Tuple[float, ...]
) -> Tuple[Action, str]:
    """Abort a divergence when one more backoff would take every LR below ``recovery.min_lr``; an
    abort says which LR the loss still grew at and what to change."""
    now = max(lrs) * history.lr_scale if lrs else None
    if action is Action.SCALE_LR and now is not None and recovery.min_lr > 0:
        if now * recovery.lr_factor < recovery.min_lr:
            action = Action.ABORT
            reason = (
                f"divergence: the loss still grows at lr {now:.3g} and one more backoff "
                f"(x{recovery.lr_factor:g}) would go below recovery.min_lr={recovery.min_lr:g}"
            )
    if action is Action.ABORT:
        at = f"at lr {now:.3g}" if now is not None else f"at LR scale {history.lr_scale:g}"
        backoffs = f" after {n - 1} LR backoffs" if n > 1 else ""
        if "recovery.min_lr" not in reason:
            reason = f"{reason}; the loss still grows geometrically {at}{backoffs}"
        reason += (
            f"; fix: start from a smaller learning rate (below {now * recovery.lr_factor:.3g})"
            if now is not None
            else "; fix: start from a smaller learning rate"
        )
        reason += ", normalize the inputs and targets, or add LR warmup or guard.clip_grad_norm"
    return action, reason
