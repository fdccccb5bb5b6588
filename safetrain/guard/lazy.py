"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...): parameters that the first forward makes.

A lazy module's parameters are ``UninitializedParameter``s until a forward tells it its input's
size; anything that reads them before (a norm, a snapshot) raises ``ValueError: Attempted to use an
uninitialized parameter``. The ``LazyModuleMixin`` docs ask for a "dry run" before the parameters
are used (their example, pytorch/pytorch#150404); ``torch.optim`` accepts them uninitialized
(tested since lazy modules came in, pytorch/pytorch#44538), so a model and its optimizer can both be
built before any data is seen, and a guard built then must wait for the parameters.

The guard does the dry run itself, before its first snapshot: one forward of the run's first batch
(or of the start measurement's) in eval mode, without gradients, the monitor's records and the
buffers put back. Eval mode draws no dropout mask, so the RNG moves by the parameters'
initialization only, as a dry run before the loop would move it: a model without a stochastic layer
before a lazy one starts from the same weights as a plain loop that builds its optimizer on the
uninitialized parameters. Then the gradient and weight checks plan their fused passes again over
the parameters made (the same objects: the optimizer and every check already hold them), and the
buffers kept before each step are taken again; a lazy module's buffers (``LazyBatchNorm``'s running
statistics) are kept and snapshotted from then on, but left out of the periodic weight check.
Slow path, once per run.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Sequence

import torch
from torch.nn.parameter import is_lazy

from .. import distributed
from ..detect import ActivationMonitor
from ..errors import SafetrainError
from .forward import Forward
from .measure import aside
from .plumbing import Plumbing

__all__ = ["uninitialized", "dry_run", "LazyParams"]

logger = logging.getLogger(__name__)


def uninitialized(model: torch.nn.Module) -> List[str]:
    """The names of ``model``'s parameters and buffers that a lazy module has not made yet.

    Example::

        >>> uninitialized(torch.nn.Sequential(torch.nn.LazyLinear(2)))
        ['0.weight', '0.bias']
    """
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [n for n, t in named if is_lazy(t)]


def dry_run(model: torch.nn.Module, run: Callable[[], Any]) -> None:
    """Run ``run()`` (a forward of ``model``) in eval mode without gradients, so that its lazy
    modules make their parameters; every module's train/eval mode is put back after.

    Raises:
        SafetrainError: some parameters are still not made after the forward (a module the
            forward does not reach), naming them.
    """
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            run()
    finally:
        for module, training in modes:
            module.training = training
    left = uninitialized(model)
    if left:
        raise SafetrainError(
            f"lazy parameters still not made after a forward of the first batch: {', '.join(left[:6])}; the "
            "forward does not reach their modules: run a forward that does (a dry run) before building the Guard"
        )


class LazyParams:
    """A guard's part that makes a lazy model's parameters before anything uses them.

    Args:
        named: the model (inside a compile wrapper).
        forward: the guard's forward (its loss function or step function runs the dry run).
        plumbing: device moves and autocast.
        monitor: the activation monitor (the dry run's records are dropped).
        state: the training state (buffers non-finite by design are accepted again once made).
        checks: the gradient and weight checks, planned again once the parameters exist.

    Attributes:
        pending: the names of the parameters and buffers not made yet (empty for any other model).
    """

    def __init__(
        self,
        named: torch.nn.Module,
        forward: Forward,
        plumbing: Plumbing,
        monitor: ActivationMonitor,
        state: Any,
        checks: Sequence[Any],
    ) -> None:
        self.named, self.forward, self.plumbing, self.monitor = named, forward, plumbing, monitor
        self.state, self.checks = state, tuple(checks)
        self.pending = uninitialized(named)

    def make(self, batch: Any) -> None:
        """The dry run on ``batch`` (the run's first, or the start measurement's), then every check
        planned again; nothing when nothing is pending (slow path, once per run).

        Raises:
            SafetrainError: the guard cannot run a forward (a caller's loop without ``loss_fn`` or
                ``step_fn``), or the forward did not make them all; the message says what to do.
        """
        if not self.pending:
            return
        fwd = self.forward
        if fwd.loss_fn is None and fwd.step_fn is None:
            raise SafetrainError(
                f"the model's lazy modules have not made their parameters yet ({', '.join(self.pending[:4])}) and "
                "the guard cannot run a forward to make them (no loss_fn or step_fn): run one forward (a dry run) "
                "before building the Guard, or give it step_fn"
            )
        batch = self.plumbing.move(batch)
        with aside(self.monitor, self.named), distributed.local(self.named), self.plumbing.autocast():
            dry_run(self.named, lambda: fwd.eager_loss(fwd.scan(batch)))
        logger.info("lazy modules made their parameters on a dry run of the first batch: %s", ", ".join(self.pending))
        self.pending = []
        for check in self.checks:
            check.replan()
        fwd.buffers.recollect()
        self.state.accept_nonfinite_buffers()
