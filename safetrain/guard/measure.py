"""The level a run starts from: the start model's loss on batches it has not trained on yet.

The loss of the first step has nothing before it to be judged against: a first batch in the wrong
unit (targets x10^4, a loss x10^8) would be taken as the run's level, and the update it makes
ruins the next steps. Any judgment of a loss that holds for a loss of any sign, offset and scale
needs at least two earlier losses (their difference is the scale), so before the first step the
start model is run on two other batches: their losses are the level and the spread the first
step's loss is judged against, exactly as later losses are judged against earlier ones.

Slow path, once per run: forwards without gradients, with the RNG, the buffers (BatchNorm's
running statistics) and the activation monitor's records put back, so the run trains bitwise as it
would have without them; one host read.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Iterator, List, Sequence

import torch

from .. import distributed
from ..detect import ActivationMonitor
from ..stats.spike import SpikeDetector
from .forward import Forward
from .plumbing import Plumbing, put_buffer_
from .state import RecoveryState

logger = logging.getLogger(__name__)

__all__ = ["measure", "start_losses", "measuring", "aside"]

_active = [False]


def measuring() -> bool:
    """Whether the start measurement's forwards are running now: they are no step's forwards, so
    :mod:`safetrain.testing`'s injectors neither count nor spoil them."""
    return _active[0]


@contextlib.contextmanager
def aside(monitor: ActivationMonitor, named: torch.nn.Module) -> Iterator[None]:
    """Forwards that are no step's (the start measurement, a lazy model's dry run): the testing
    injectors leave them alone (:func:`measuring`), the monitor's records they make are dropped,
    and the buffers they change (BatchNorm's statistics, quantization observers, their shapes
    included) are put back; the RNG is the caller's to keep."""
    buffers = [b for b in named.buffers() if b.is_floating_point() or b.numel() == 1]
    saved = [b.detach().clone() for b in buffers]
    held = monitor.set_aside()
    _active[0] = True
    try:
        yield
    finally:
        _active[0] = False
        monitor.set_aside()  # these forwards' records are no step's
        monitor.put_back(held)
        for live, kept in zip(buffers, saved):
            put_buffer_(live, kept)


def measure(
    forward: Forward,
    plumbing: Plumbing,
    monitor: ActivationMonitor,
    named: torch.nn.Module,
    spike: SpikeDetector,
    recovery_state: RecoveryState,
    lazy: Any,
    batches: Sequence[Any],
) -> List[float]:
    """Measure the start model's losses on ``batches`` (:func:`start_losses`) and hand two or more
    finite ones to the spike detector as the first steps' reference (:meth:`SpikeDetector.begin`)
    and to the end-of-run check as the level and spread the run started from. A lazy model's
    parameters are made first (``lazy``: :class:`~.lazy.LazyParams`), on the first of ``batches``.

    A loop of your own calls it as ``guard.measure_start([next_batch, the_one_after])`` before its
    first step. Nothing is trained and nothing changes; one host read, once per run.

    Returns:
        The finite losses measured.
    """
    if batches:
        lazy.make(batches[0])
    losses = start_losses(forward, plumbing, monitor, named, batches) if len(batches) >= 2 else []
    if len(losses) >= 2:
        spike.begin(losses)
        recovery_state.start_losses = list(losses)  # and the end-of-run check's start, with the first trained loss
        logger.info(
            "the start model's loss on %d batches ahead: %s", len(losses), ", ".join(f"{x:.4g}" for x in losses)
        )
    return losses


def start_losses(
    forward: Forward, plumbing: Plumbing, monitor: ActivationMonitor, named: torch.nn.Module, batches: Sequence[Any]
) -> List[float]:
    """The model's loss on each of ``batches`` as it is now (train mode, under the run's autocast),
    changing nothing: the RNG, the buffers and the monitor's records are as before. Non-finite
    losses (a batch with a NaN row) are left out.

    Args:
        forward: the guard's forward (its loss function and step function).
        plumbing: device moves and autocast.
        monitor: the activation monitor, whose hooks fire during these forwards.
        named: the module inside a compile wrapper (its buffers are put back).
        batches: batches the run has not trained on.

    Returns:
        The finite losses, in the order of ``batches``.
    """
    losses = []
    with aside(monitor, named), torch.no_grad(), distributed.keep_rng(), distributed.local(named):
        for batch in batches:
            batch = plumbing.move(batch) if plumbing.moves else batch
            with plumbing.autocast():
                losses.append(forward.eager_loss(batch).detach().float().reshape(()))
    if not losses:
        return []
    values = torch.stack(losses).tolist()  # host sync: once per run, before its first step
    return [float(v) for v in values if math.isfinite(v)]
