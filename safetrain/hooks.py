"""What ``SafeTrainer.fit`` tells the code around it: every event and every decided step.

A :class:`RunHook` passed to ``fit(..., hooks=[...])`` receives each event as it is journaled
(:meth:`RunHook.on_event`), each decided step as a :class:`StepRecord` (:meth:`RunHook.on_step`:
the row ``metrics.csv`` gets, with the LR in force and the counters) and the run's
:class:`~safetrain.run.FitResult` once the journal's last word is written (:meth:`RunHook.on_end`).
A hook only observes: it cannot change what the guard decides. A hook that raises is logged and
called no more, so a tracker's outage never stops a run. :class:`TensorBoardHook` is the sink
``log.tensorboard: true`` adds; W&B and MLflow take a few lines on the same hook (docs/hooks.md).
Nothing is built per step unless a hook is there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .errors import ConfigError
from .metrics import PREFIX, step_metrics
from .rundir.safefile import real_dir

if TYPE_CHECKING:
    from .events import Event
    from .run import FitResult

__all__ = ["RunHook", "StepRecord", "TensorBoardHook", "HookCaller"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One decided step, as ``metrics.csv`` has it, plus the LR in force and the counters.

    Attributes:
        step: the guard's step (every decided batch counts, trained or not).
        epoch: the epoch, from 0.
        batch: the batch index in the epoch.
        loss: the step's loss (``nan`` when there was none, for example a skipped batch).
        grad_norm: the total gradient norm (before clipping).
        lr_scale: the LR backoff's scale on top of the schedule.
        lrs: the learning rate in force of every parameter group, of every optimizer in order.
        trained: whether the optimizer step was applied.
        action: what the guard did (``ok``, ``skip_batch``, ``restore``, ...).
        clipped_to: the norm after clipping on a clipped step, else ``nan``.
        counts: the run's counters after this step (``skipped_batches``, ``restores``, ...).
    """

    step: int
    epoch: int
    batch: int
    loss: float
    grad_norm: float
    lr_scale: float
    lrs: Tuple[float, ...]
    trained: bool
    action: str
    clipped_to: float
    counts: Mapping[str, int]


class RunHook:
    """Base class of what ``fit(..., hooks=[...])`` calls; override the methods you need.

    Example::

        class Skips(RunHook):
            def __init__(self):
                self.steps = []

            def on_event(self, event):
                if event.action == "skip_batch":
                    self.steps.append(event.step)

        skips = Skips()
        SafeTrainer(model, optimizer, cfg, loss_fn=loss_fn).fit(loader, hooks=[skips])
    """

    def on_event(self, event: "Event") -> None:
        """Every event, as it is journaled (the run's start and end included)."""

    def on_step(self, record: StepRecord) -> None:
        """Every decided step, after the guard decided it."""

    def on_end(self, result: "FitResult") -> None:
        """The run ended (``result.ended`` says how), its journal closed."""


class HookCaller:
    """Calls a run's hooks, each until it first raises (then it is logged and left out).

    Args:
        hooks: the hooks, called in this order.
    """

    def __init__(self, hooks: Sequence[RunHook]) -> None:
        for hook in hooks:
            if not isinstance(hook, RunHook):
                raise ConfigError(
                    f"fit(hooks=...): {hook!r} is a {type(hook).__name__}; expected a safetrain.hooks.RunHook "
                    "(subclass it and override on_event, on_step or on_end)"
                )
        self.hooks: List[RunHook] = list(hooks)

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def call(self, method: str, arg: Any) -> None:
        """``hook.<method>(arg)`` for every hook still in; one that raises is logged and dropped."""
        for hook in list(self.hooks):
            try:
                getattr(hook, method)(arg)
            except Exception:  # noqa: BLE001 - an observer's failure must not end the run it observes
                logger.exception("hook %r raised in %s; it is called no more in this run", hook, method)
                self.hooks.remove(hook)


class TensorBoardHook(RunHook):
    """Writes a run to TensorBoard (``torch.utils.tensorboard``): loss, LR in force, gradient norm,
    the norm after clipping, the LR scale, the counters when they change (the keys of
    :func:`~safetrain.metrics.step_metrics`, as the callbacks log them), and every event as text.

    ``log.tensorboard: true`` adds one writing to ``<log.dir>/tensorboard``; pass your own to
    ``fit(hooks=...)`` to choose the folder. Scalars are under ``safetrain/``, events under the
    text tag ``safetrain/events``.

    Args:
        log_dir: the folder of the event files.

    Raises:
        ConfigError: the ``tensorboard`` package is not installed (``pip install tensorboard``).
        UnsafeFileError: ``log_dir`` is a link, a FIFO or a file, not a directory of the user's.
    """

    def __init__(self, log_dir: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's module imports the tensorboard package
            raise ConfigError(
                f"log.tensorboard: TensorBoard is not installed ({exc}); pip install tensorboard, "
                "or set log.tensorboard: false"
            ) from exc
        self.log_dir = Path(real_dir(log_dir))  # a link planted in its place is refused, not written through
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self._counts: Dict[str, float] = {}

    def on_step(self, record: StepRecord) -> None:
        """The step's :func:`~safetrain.metrics.step_metrics` (the keys the Lightning and Hugging
        Face callbacks log too), each counter only when it changed."""
        for tag, value in step_metrics(record).items():
            name = tag[len(PREFIX) :]
            if name in record.counts:  # a counter: a point where it moves
                if self._counts.get(name) == value:
                    continue
                self._counts[name] = value
            self.writer.add_scalar(tag, value, record.step)

    def on_event(self, event: "Event") -> None:
        """The event as a line of text at its step."""
        self.writer.add_text(
            "safetrain/events", f"{event.name} ({event.kind}/{event.action}): {event.message}", event.step
        )

    def on_end(self, result: "FitResult") -> None:
        """Flush and close the event files."""
        self.writer.close()


def tensorboard_dir(run_dir: Optional[Path]) -> Path:
    """Where ``log.tensorboard: true`` writes: ``<log.dir>/tensorboard``.

    Raises:
        ConfigError: ``log.dir`` is not set.
    """
    if run_dir is None:
        raise ConfigError("log.tensorboard: true needs log.dir (its event files go to <log.dir>/tensorboard)")
    return run_dir / "tensorboard"
