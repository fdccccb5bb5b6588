"""How ``Guard.step`` moves the optimizer on a trained step: every optimizer, one named (a GAN's
discriminator or generator step), or one that evaluates the loss itself through a closure (LBFGS).

**Named steps** (alternating objectives): one guard over both networks of a GAN, its optimizers a
dict (``{"d": opt_d, "g": opt_g}``) and its ``step_fn`` a dict of the same names; each
``guard.step(batch, name="d")`` computes that step's loss and moves that optimizer only. Both
networks and both optimizers are in every snapshot, so a restore puts them back together, at the
same step, whichever step tripped.

**Closure optimizers.**
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

import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from .. import detect
from ..kinds import Kind
from ..optimizers import Optimizers, needs_closure
from ..policy import Anomaly, Rules
from ..steps import Pending, StepResult
from .forward import Forward
from .outcomes import Verdict

__all__ = ["Stepper", "StepClosure", "NonFiniteEvaluation"]


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


class Stepper:
    """Moves the optimizer on a trained step (``Guard.step``; a caller's loop steps its own).

    Args:
        optimizer: the guard's optimizer (one, or :class:`~safetrain.optimizers.Optimizers`).
        forward: the guard's forward (its ``step_fn`` is the named step's during that step).
        grads: the gradient check (a closure's evaluations are checked with it).
        plumbing: the scaler (a closure optimizer cannot have one) and freeing gradients.
        step_fns: named steps, ``name -> step_fn(model, batch) -> loss``; each name one of the optimizers'.

    Raises:
        ValueError: a closure optimizer with a GradScaler; named steps without several optimizers,
            or a name that is not an optimizer's.
    """

    def __init__(
        self, optimizer: Any, forward: Forward, grads: detect.GradCheck, plumbing: Any, step_fns: Mapping[str, Any]
    ) -> None:
        self.optimizer, self.forward, self.grads, self.plumbing = optimizer, forward, grads, plumbing
        # LBFGS: its step is handed a closure that re-runs the guarded forward and backward.
        self.closure = needs_closure(optimizer)
        if self.closure and plumbing.scaler.enabled:
            raise ValueError(
                f"{type(optimizer).__name__}.step needs a closure, which a GradScaler cannot drive (torch: "
                "'Closure use is not currently supported if GradScaler is enabled'); train in float32 or bfloat16"
            )
        self.named: Dict[str, Callable[..., Any]] = dict(step_fns)
        names = list(optimizer.members) if isinstance(optimizer, Optimizers) else []
        unknown = [n for n in self.named if n not in names]
        if unknown:
            raise ValueError(
                f"step_fn: named steps {unknown} are not among the optimizers' names {names}; give the optimizers "
                "as a dict with the same names as step_fn ({'d': opt_d, 'g': opt_g} and {'d': d_loss, 'g': g_loss})"
            )
        self.target = optimizer  # what a trained step moves: every optimizer, or the named step's

    def select(self, name: Optional[str]) -> None:
        """The step about to run is ``name``'s (``None``: an unnamed step, every optimizer).

        Raises:
            ValueError: named steps without a name, or a name that is not one of them.
        """
        if name is None and not self.named:
            return
        if name not in self.named:
            raise ValueError(f"Guard.step(batch, name={name!r}): expected name= one of {list(self.named)}")
        self.forward.step_fn = self.named[name]
        self.target = self.optimizer.members[name]

    def step(self, pending: Pending) -> Optional[NonFiniteEvaluation]:
        """Step the optimizer (with a closure for LBFGS); returns the evaluation that went
        non-finite inside it, if one did (the update is then not to be trusted)."""
        if not self.closure:
            self.target.step()
            return None
        closure = StepClosure(self.forward, self.grads, self.plumbing.free_grads, pending, self.forward.accumulate)
        try:
            self.optimizer.step(closure)
        except NonFiniteEvaluation as exc:
            return exc
        return None


def after_fault(
    fault: NonFiniteEvaluation,
    decided: Tuple[Verdict, StepResult],
    decisions: Any,
    pending: Pending,
    rules: Rules,
    optimizer: Any,
) -> Tuple[Verdict, StepResult]:
    """A closure's evaluation went non-finite inside the optimizer's step: an anomaly of the update
    (kind ``weights``: the ladder restores the last good snapshot, the optimizer's history with it),
    decided and carried out; returns the step's verdict and result as they end."""
    verdict, result = decided
    restores = decisions.counters.restores
    what = "the step's own evaluation" if fault.evaluation == 1 else "an iteration or line-search trial"
    detail = {
        "where": f"{what} inside {type(optimizer).__name__}.step(closure)",
        "evaluation": fault.evaluation,
        "loss": fault.loss,
    }
    outcome = decisions.after_update(Anomaly(Kind.WEIGHTS, detail), verdict, pending, rules, result.loss)
    verdict = dataclasses.replace(verdict, events=verdict.events + list(outcome.events), outcome=outcome)
    result = dataclasses.replace(
        result,
        trained=verdict.trains,
        action=verdict.action,
        events=tuple(verdict.events),
        restored=decisions.counters.restores != restores,
    )
    return verdict, result
