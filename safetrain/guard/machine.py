"""The step as a state machine: where a guard's step stands, which verb may come next, who drives.

A step moves through five states (and a guard ends in a sixth)::

    READY --begin--> BEGUN --record--> RECORDED --decide--> DECIDED --finish--> READY
                       |                  |  ^
                       |                  +--+ begin (the next micro-batch of an accumulated step)
                       +-- untrained --> SKIPPED (its loss optional: record, begin or decide)

    any state --close()--> CLOSED (every verb refused)

:data:`MOVES` is the whole table: ``(phase, verb) -> the phase after it``, or the sentence an
illegal call raises (the fix named in it). Each verb asks for its move before it touches
anything, so a refused call changes nothing; the verb sets the phase once its work is done. The
healthy path asks :attr:`Machine.legal`, the legal moves of the guard's driver (one dict lookup,
no call); anything else (the first verb, another driver, an illegal move) goes through
:meth:`Machine.claim` and :meth:`Machine.move`, which fix the driver or raise. The per-step facts that are not a
phase (how many micro-batches began, whether the step's data is skipped, ``decide()``'s verdict
while ``finish_step()`` is due) are one :class:`StepFacts`, renewed with each step the way
:class:`~safetrain.steps.Pending` is. The model is ``torch.amp.GradScaler``'s per-optimizer
``OptState``: an explicit state, consulted by each call, an illegal call a sentence.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

if TYPE_CHECKING:
    from ..steps import StepResult
    from .outcomes import Verdict

__all__ = ["Phase", "Verb", "Driver", "MOVES", "MID_STEP", "StepFacts", "Machine"]


class Phase(enum.Enum):
    """Where a guard's step stands between calls."""

    __hash__ = object.__hash__  # (members are singletons; Enum's own hash is a Python call on each lookup)

    READY = "ready"  # no micro-batch pending: the next begin_batch starts a step
    BEGUN = "begun"  # a micro-batch begun, its loss due (record_loss)
    SKIPPED = (
        "skipped"  # a micro-batch begun that is not trained (data skipped after a restore, or empty): its loss optional
    )
    RECORDED = "recorded"  # every micro-batch begun has its loss: another may begin, or the step be decided
    DECIDED = "decided"  # decide() gave the verdict: the optimizer step (or not), then finish_step()
    CLOSED = "closed"  # hooks removed: no more steps


class Verb(enum.Enum):
    """What moves a step on: the four public verbs, and the guard's own finding that the micro-batch
    begun is not trained (``UNTRAINED``)."""

    BEGIN = "begin_batch"
    RECORD = "record_loss"
    DECIDE = "decide"
    FINISH = "finish_step"
    UNTRAINED = "(untrained)"

    __hash__ = object.__hash__  # (as Phase's)


class Driver(enum.Enum):
    """Who drives a guard's steps; fixed by the first verb, one for a guard's life."""

    GUARD = "Guard.step"  # Guard.step runs forward, backward and the optimizer step itself
    CALLER = "the verbs"  # the caller's loop (or a framework's hooks) runs them between the verbs


_FINISH_FIRST = (
    "after decide(): call finish_step() after the optimizer step (or where it would have been) first, then begin "
    "the next batch"
)
_BEGIN_FIRST = (
    "without a batch begun: call begin_batch(batch) first, run the forward on what it returns, then "
    "record_loss(loss) once for that batch"
)
_DECIDE_FIRST = "without decide(): call decide() after the step's backward, then step the optimizer, then finish_step()"
_CLOSED = "after close(); make a new Guard"
_INTERNAL = "(internal: a micro-batch found untrained outside begin_batch)"

#: ``(phase, verb) -> the phase after it``, or the words of the ``RuntimeError`` an illegal call raises.
MOVES: Dict[Tuple[Phase, Verb], Union[Phase, str]] = {
    (Phase.READY, Verb.BEGIN): Phase.BEGUN,
    (Phase.READY, Verb.RECORD): _BEGIN_FIRST,
    (Phase.READY, Verb.DECIDE): "without a batch begun: call begin_batch(batch) first",
    (Phase.READY, Verb.FINISH): _DECIDE_FIRST,
    (Phase.READY, Verb.UNTRAINED): _INTERNAL,
    (Phase.BEGUN, Verb.BEGIN): Phase.BEGUN,  # the batch before gave no loss: it is left out of the step
    (Phase.BEGUN, Verb.RECORD): Phase.RECORDED,
    (Phase.BEGUN, Verb.DECIDE): "before the last batch's loss: call record_loss(loss) first",
    (Phase.BEGUN, Verb.FINISH): _DECIDE_FIRST,
    (Phase.BEGUN, Verb.UNTRAINED): Phase.SKIPPED,
    (Phase.SKIPPED, Verb.BEGIN): Phase.BEGUN,
    (Phase.SKIPPED, Verb.RECORD): Phase.RECORDED,  # (a loss of untrained data is no part of the step)
    (Phase.SKIPPED, Verb.DECIDE): Phase.DECIDED,
    (Phase.SKIPPED, Verb.FINISH): _DECIDE_FIRST,
    (Phase.SKIPPED, Verb.UNTRAINED): Phase.SKIPPED,
    (Phase.RECORDED, Verb.BEGIN): Phase.BEGUN,
    (Phase.RECORDED, Verb.RECORD): _BEGIN_FIRST,
    (Phase.RECORDED, Verb.DECIDE): Phase.DECIDED,
    (Phase.RECORDED, Verb.FINISH): _DECIDE_FIRST,
    (Phase.RECORDED, Verb.UNTRAINED): _INTERNAL,
    (Phase.DECIDED, Verb.BEGIN): _FINISH_FIRST,
    (Phase.DECIDED, Verb.RECORD): _BEGIN_FIRST,
    (Phase.DECIDED, Verb.DECIDE): "twice for one step: call finish_step() after the optimizer step",
    (Phase.DECIDED, Verb.FINISH): Phase.READY,
    (Phase.DECIDED, Verb.UNTRAINED): _INTERNAL,
    **{(Phase.CLOSED, verb): _CLOSED for verb in Verb},
}

#: The phases of a step under way: some micro-batch begun, the step not finished.
MID_STEP = frozenset({Phase.BEGUN, Phase.SKIPPED, Phase.RECORDED, Phase.DECIDED})


@dataclass
class StepFacts:
    """What the step under way knows besides its phase; a new one with each step.

    Attributes:
        window: micro-batches begun in this step, skipped ones included (empty ones left out).
        skipping: this step's data is skipped (it led into a restore).
        forwarded: a skipped micro-batch went forward in the caller's loop (its buffer updates are put back).
        decided: ``decide()``'s verdict and result, while ``finish_step()`` is due.
    """

    window: int = 0
    skipping: bool = False
    forwarded: bool = False
    decided: Optional[Tuple[Optional["Verdict"], "StepResult"]] = None


class Machine:
    """A guard's step state: its phase, its driver, and the facts of the step under way.

    Attributes:
        phase: where the step stands (:class:`Phase`).
        driver: who drives the steps, fixed by the first verb (``None`` before it).
        stepping: inside ``Guard.step``: the verbs called are the guard's own.
        started: a batch has arrived (the first checks that the run does not start broken).
        facts: the step under way's :class:`StepFacts`.
        legal: the moves the driver may make, ``(phase, verb, stepping) -> the phase after it``
            (:data:`MOVES`' legal entries, ``stepping`` the driver's); empty until the first verb
            fixes the driver. A key missing is a call to refuse, or the first.
    """

    def __init__(self) -> None:
        self.phase = Phase.READY
        self.driver: Optional[Driver] = None
        self.stepping = False
        self.started = False
        self.facts = StepFacts()
        self.legal: Dict[Tuple[Phase, Verb, bool], Phase] = {}

    def driver_now(self) -> Driver:
        """Who is calling now: the guard itself (inside ``Guard.step``) or the caller's loop."""
        return Driver.GUARD if self.stepping else Driver.CALLER

    def claim(self, verb: Verb) -> bool:
        """The driver of this call drives the guard's steps: returns whether this is its first
        call (the driver is fixed by it).

        Raises:
            RuntimeError: the guard is closed, or another driver drives its steps.
        """
        if self.phase is Phase.CLOSED:
            raise RuntimeError(f"Guard.{verb.value}() {_CLOSED}")
        who = self.driver_now()
        if self.driver is None:
            self.driver = who
            stepping = who is Driver.GUARD
            self.legal = {
                (phase, verb, stepping): after for (phase, verb), after in MOVES.items() if type(after) is Phase
            }
            return True
        if self.driver is not who:
            raise RuntimeError(
                f"Guard.{verb.value}(): this guard's steps are driven by {self.driver.value}; use one of them for a "
                "run (Guard.step(batch) runs forward, backward and the optimizer step itself; begin_batch, "
                "record_loss, decide and finish_step are for a loop that runs them)"
            )
        return False

    def move(self, verb: Verb) -> Phase:
        """The phase ``verb`` moves the step to now.

        Raises:
            RuntimeError: the move is illegal now; the sentence names the fix.
        """
        after = MOVES[self.phase, verb]
        if isinstance(after, str):
            raise RuntimeError(f"Guard.{verb.value}() {after}")
        return after
