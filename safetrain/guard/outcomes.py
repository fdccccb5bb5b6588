"""What a step's decision loop comes to: a re-run, the outcome of one action, the step's verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..events import Event

__all__ = ["Rerun", "Outcome", "Verdict"]


@dataclass(frozen=True)
class Rerun:
    """Run the same step again, as the next turn of the decision loop.

    Attributes:
        batches: the micro-batches to run forward and backward again; ``None``: judge the step's
            read again without running anything (bad values were replaced before the forward).
        indices: each micro-batch's dataset indices (empty lists when unknown).
        places: each micro-batch's own ``(epoch, batch index)``.
    """

    batches: Optional[List[Any]] = None
    indices: Optional[List[List[int]]] = None
    places: Optional[List[Tuple[int, int]]] = None


@dataclass(frozen=True)
class Outcome:
    """What carrying out a decision came to.

    Attributes:
        action: what was done (a downgrade is possible: ``drop_rows`` with every row bad skips).
        events: the events it emitted, in order.
        apply: the protocol applies the step's update (``warn``, ``zero_grads``).
        total_norm: the gradient norm to clip with when ``apply`` (``None``: not finite).
        rerun: run the step again (``drop_rows``, ``replace``, ``retry``), else ``None``.
    """

    action: str
    events: Tuple[Event, ...] = ()
    apply: bool = False
    total_norm: Optional[float] = None
    rerun: Optional[Rerun] = None


@dataclass
class Verdict:
    """A step's decision loop as it stands after a turn: its last read, the events so far, the
    re-run's action if one ran, and the outcome of the anomaly it ended on (``None``: the last
    read was clean).

    While ``rerun`` is set the loop is not done: the protocol runs the step again as it says and
    hands the next read back to :meth:`Decisions.run <safetrain.guard.decisions.Decisions.run>`
    with this verdict, which carries what the next turn must know (``rerun_action``, ``retried``).
    """

    read: Any
    events: List[Event]
    rerun_action: str = ""
    outcome: Optional[Outcome] = None
    rerun: Optional[Rerun] = None
    retried: bool = False
    #: Whether the step's update is applied.
    trains: bool = field(init=False)
    #: The action the step comes to (``""``: healthy): the outcome's, else the re-run's.
    action: str = field(init=False)
    #: The gradient norm to clip with.
    total_norm: Optional[float] = field(init=False)

    def __post_init__(self) -> None:  # (set once: the healthy path reads them as attributes)
        outcome = self.outcome
        if outcome is None:
            self.trains, self.action, self.total_norm = True, self.rerun_action, self.read.total_norm
        else:
            self.trains, self.total_norm = outcome.apply, outcome.total_norm
            self.action = str(outcome.action) or self.rerun_action
