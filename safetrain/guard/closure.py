"""The step of an optimizer that evaluates the loss itself (``torch.optim.LBFGS``), through a closure.

LBFGS calls its closure once at the start of a step and again at every iteration and line-search
trial (``max_iter``, ``max_eval``; ``line_search_fn="strong_wolfe"``). Users have asked PyTorch
for a guard around exactly that (pytorch/pytorch#5953: "when a NaN is detected, reset ...
starting point = best visited point before nan"): a trial point where the loss or a gradient goes
non-finite makes LBFGS step to NaN parameters, or leaves its curvature history poisoned.

:class:`StepClosure` is the closure ``Guard.step`` hands to ``optimizer.step``. Its first call
returns the guarded evaluation the step was judged on (its gradients are in place: no second
forward), so a healthy run is bitwise the plain LBFGS loop; each later call re-runs the guarded
forward and backward on the step's same cleaned micro-batches and checks the loss and the
gradients. A non-finite evaluation raises :class:`NonFiniteEvaluation` out of LBFGS's step (its
state is then half-written: the guard restores the last good snapshot, LBFGS's history with it).
Cost: one host read per later evaluation, where LBFGS reads each evaluation's loss (``float``) anyway.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor

from .. import detect
from ..steps import Pending
from .forward import Forward

__all__ = ["StepClosure", "NonFiniteEvaluation"]


class NonFiniteEvaluation(Exception):
    """An evaluation inside ``optimizer.step(closure)`` gave a non-finite loss or gradient.

    Attributes:
        evaluation: which call of the closure (1: the step's own; 2 and later: iterations and the line search).
        loss: the loss it gave (NaN or Inf, or finite with non-finite gradients).
    """

    def __init__(self, evaluation: int, loss: float) -> None:
        super().__init__(f"evaluation {evaluation} inside optimizer.step(closure) gave loss {loss:g}")
        self.evaluation, self.loss = evaluation, loss


class StepClosure:
    """The closure for one step of a closure optimizer.

    Args:
        forward: runs a micro-batch forward and backward (the guard's own: autocast, hooks).
        grads: the gradient check (every trained parameter's norm, fused).
        free_grads: clears the gradients before a re-evaluation (``zero_grad(set_to_none=True)``).
        pending: the step as judged: its micro-batches (rows dropped, values replaced) and its loss.
        divide: what each micro-batch's loss is divided by (``guard.accumulate_steps``; 1 for the
            sum of shares, ``Guard.loss_shares``).
    """

    def __init__(self, forward: Forward, grads: detect.GradCheck, free_grads: Any, pending: Pending, divide: int):
        self.forward, self.grads, self.free_grads = forward, grads, free_grads
        self.micro: List[Any] = list(pending.micro)
        self.divide = divide
        first = pending.loss
        self.first = first if first is None or divide == 1 else first / divide
        self.calls = 0

    def __call__(self) -> Tensor:
        """The loss at the optimizer's current parameters, its gradients in ``.grad``.

        Raises:
            NonFiniteEvaluation: the loss or a gradient is NaN or Inf (a later evaluation's).
        """
        self.calls += 1
        if self.calls == 1 and self.first is not None:
            return self.first  # the step's own evaluation, judged clean (gradients in place)
        self.free_grads()
        losses = []
        for batch in self.micro:
            loss = self.forward.loss(self.forward.scan(batch), Pending())
            self.forward.backward(loss)
            losses.append(loss.float() if loss.dtype is not torch.float32 else loss)
        total = losses[0] if len(losses) == 1 else torch.stack([x.detach() for x in losses]).sum()
        value = total / self.divide if self.divide != 1 else total
        norms = self.grads.run()
        bad = ~torch.isfinite(value.detach())
        if norms is not None:
            bad = bad | norms.nonfinite
        if bool(bad):  # host sync: LBFGS reads each evaluation's loss (float) right after anyway
            raise NonFiniteEvaluation(self.calls, float(value.detach()))
        return value
