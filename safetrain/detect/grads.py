"""Gradient and weight checks: one fused pass over many tensors, device-side flags, no sync.

:class:`GradCheck` computes every gradient's L2 norm with ``torch._foreach_norm`` (one
multi-tensor kernel per device and dtype; on the CPU, where that is a single-threaded loop, large
float32/float64 gradients take a multi-threaded BLAS ``dot`` instead), and the total norm from
them: the same number :func:`torch.nn.utils.clip_grad_norm_` would compute, so clipping reuses it
through :func:`torch.nn.utils.clip_grads_with_norm_` instead of a second pass. The
total norm is non-finite exactly when some gradient holds NaN/Inf (or the norms overflow float32,
which the slow path tells apart). :class:`WeightCheck` does the same over the parameters every
``detect.check_weights_every`` steps. Names of the guilty parameters are worked out on the
host, from the kept norm vector, only after the step's single read shows a problem.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .findings import GradFinding, WeightFinding
from .fused import HALF as _LOW
from .fused import DotPlan as _DotPlan
from .fused import DTensor as _DTensor
from .fused import fused_norms
from .fused import local as _local
from .fused import stack_norms as _stack
from .norms import true_norms

__all__ = ["GradNorms", "GradCheck", "WeightCheck", "fused_norms"]

NamedParams = Union[nn.Module, Iterable[Tuple[str, Tensor]]]
Probes = Sequence[Tuple[str, Tensor, Callable[[Tensor], Tensor]]]


def _named(params: NamedParams) -> List[Tuple[str, Tensor]]:
    items = params.named_parameters() if isinstance(params, nn.Module) else params
    return [(name, p) for name, p in items]


def _any_grad(params: List[Tensor]) -> bool:
    for p in params:  # a plain loop: a generator in any() costs 4x as much per step
        if p.grad is not None:
            return True
    return False


class GradNorms:
    """The device-side result of :meth:`GradCheck.run` (nothing read on the host).

    Unpacks as ``norms, total_norm, nonfinite = check.run()``. Only ``norm_list`` is computed
    eagerly: put it on :class:`~safetrain.detect.flags.StepFlags` as ``grad_norms`` and the
    read gives every parameter's norm and the total norm (``math.hypot`` on the host) with no
    further device op; the other attributes are computed on first access (no sync).

    Attributes:
        norm_list: one 0-dim norm per parameter that has a gradient (see ``GradCheck.names``).
    """

    __slots__ = ("norm_list", "_norms", "_total", "_nonfinite")

    def __init__(self, norm_list: List[Tensor]) -> None:
        self.norm_list = norm_list
        self._norms: Optional[Tensor] = None
        self._total: Optional[Tensor] = None
        self._nonfinite: Optional[Tensor] = None

    @property
    def norms(self) -> Tensor:
        """float32 ``[P]``: the per-parameter L2 norms as one vector."""
        if self._norms is None:
            self._norms = _stack(self.norm_list)
        return self._norms

    @property
    def total_norm(self) -> Tensor:
        """0-dim float32: the L2 norm of all gradients together (what clipping uses); NaN/Inf
        exactly when some gradient is (or the squares overflow float32)."""
        if self._total is None:
            self._total = torch.linalg.vector_norm(self.norms, 2.0)
        return self._total

    @property
    def nonfinite(self) -> Tensor:
        """0-dim bool: ``total_norm`` is NaN or Inf."""
        if self._nonfinite is None:
            self._nonfinite = ~torch.isfinite(self.total_norm)
        return self._nonfinite

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.norms, self.total_norm, self.nonfinite))


class GradCheck:
    """One fused pass over all gradients: per-parameter norms, total norm, finiteness.

    Args:
        params: a module (its ``named_parameters()``) or ``(name, parameter)`` pairs; parameters
            without ``requires_grad`` are left out.
        enabled: ``False`` makes :meth:`run` return ``None``.

    Example::

        >>> model = nn.Linear(4, 2)
        >>> check = GradCheck(model)
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> norms, total, bad = check.run()        # no sync (``bad`` is computed on unpacking)
        >>> check.clip_(1.0, total)                 # clipping reuses the total norm
    """

    def __init__(self, params: NamedParams, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._given = _named(params)
        self.replan()

    def replan(self) -> None:
        """Plan the pass again over the parameters given, as they are now: the ones that train
        (``requires_grad``, or a gradient already there) are checked; the frozen ones are watched,
        and the first gradient one of them gets (unfrozen mid-run: progressive unfreezing) plans
        again on its own. Also after a lazy module made its parameters (their sizes are known only
        then). O(parameters), off the healthy path."""
        named = [(n, p) for n, p in self._given if p.requires_grad or p.grad is not None]
        self._frozen = [p for _, p in self._given if not (p.requires_grad or p.grad is not None)]
        self._all_names = tuple(n for n, _ in named)
        self._params = [p for _, p in named]
        #: Names aligned with the last ``run()``'s ``norms`` (parameters with a gradient).
        self.names: Tuple[str, ...] = self._all_names
        self._with_grad: List[Tensor] = self._params
        # Decided once: one device and one dtype means one plain _foreach_norm per step.
        first = self._params[0] if self._params else None
        self._uniform = first is not None and all(
            p.device == first.device and p.dtype == first.dtype for p in self._params
        )
        self._acc = torch.float32 if first is not None and first.dtype in _LOW else None
        # FSDP2: norms of each rank's shard (the step's read sums their squares over ranks).
        self._sharded = any(isinstance(p, _DTensor) for p in self._params)
        self._dots = _DotPlan([_local(p) for p in self._params])  # used when every parameter has a gradient

    def run(self) -> Optional[GradNorms]:
        """Compute the norms of this step's gradients, device-side, with no host sync.

        Returns:
            :class:`GradNorms`, or ``None`` when disabled or no parameter has a gradient.
        """
        if not self.enabled:
            return None
        if self._frozen and _any_grad(self._frozen):  # a frozen parameter unfrozen (none frozen: no cost)
            self.replan()
        params = self._params
        grads = [p.grad for p in params]
        if self._sharded:
            grads = [_local(g) for g in grads]
        missing = False
        for g in grads:  # any gradient missing? (a plain loop: `None in grads` would call Tensor.__eq__)
            if g is None:
                missing = True
                break
        if missing:
            keep = [i for i, g in enumerate(grads) if g is not None]
            self.names = tuple(self._all_names[i] for i in keep)
            self._with_grad = [params[i] for i in keep]
            grads = [grads[i] for i in keep]
        else:
            self.names, self._with_grad = self._all_names, params
            dotted = self._dots.norms(grads) if self._dots.big else None  # (no large gradient: no call)
            if dotted is not None:
                return GradNorms(dotted)
        if not grads:
            return None
        try:
            norms = torch._foreach_norm(grads, 2.0, dtype=self._acc) if self._uniform else fused_norms(grads)
        except RuntimeError:  # sparse gradients (nn.Embedding(sparse=True)) or a gradient on another device
            self._uniform = False  # than its parameter: grouped by fused_norms from now on (no raise a step)
            norms = fused_norms(grads)
        return GradNorms(norms if norms.__class__ is list else list(norms))

    def clip_(self, max_norm: float, total_norm: Union[float, Tensor]) -> None:
        """Scale the gradients so their total norm is at most ``max_norm``, reusing ``total_norm``.

        No second norm pass and no sync. With the host float from the step's read
        (``StepRead.total_norm``) the coefficient is worked out on the host and nothing runs when
        it is 1; a non-finite float (the float32 squares overflowed) is worked out again exactly
        first (slow path), and gradients that hold NaN/Inf are left as they are. With a device
        tensor the coefficient stays on the device (as :func:`torch.nn.utils.clip_grads_with_norm_`),
        and a non-finite one leaves the gradients as they are: clipping never writes NaN into them.

        Args:
            max_norm: ``guard.clip_grad_norm``.
            total_norm: this step's total norm, as a host float or a 0-dim device tensor.
        """
        grads = [_local(p.grad) for p in self._params if p.grad is not None]  # whatever ran since: no run() needed
        if not grads:
            return
        if isinstance(total_norm, Tensor):
            total = total_norm.detach().float()
            coef = torch.where(torch.isfinite(total), (max_norm / (total + 1e-6)).clamp(max=1.0), 1.0)
            for device in {g.device for g in grads}:  # one fused multiply per device
                torch._foreach_mul_([g for g in grads if g.device == device], coef.to(device))
            return
        if not math.isfinite(total_norm):  # slow path: never on a healthy step
            total_norm = math.hypot(*true_norms(grads))
            if not math.isfinite(total_norm):
                return
        coef = max_norm / (total_norm + 1e-6)  # the same coefficient as clip_grad_norm_
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)

    def finding(
        self,
        result: Union[GradNorms, Sequence[float]],
        threshold: Optional[float] = None,
        *,
        step: Optional[int] = None,
        epoch: Optional[int] = None,
        batch_index: Optional[int] = None,
    ) -> GradFinding:
        """Name the parameters with non-finite gradients and those whose norm is above ``threshold``.

        Slow path only (reads the norm vector on the host). ``kind`` is ``gradient`` when a
        gradient holds NaN/Inf, else ``grad_norm``: a float32 norm that overflowed while every
        element is finite is worked out exactly (:func:`~.norms.true_norm`), and the finding's
        ``total_norm`` and ``norms`` are the true ones.

        Args:
            result: this step's :meth:`run` result, or the norms already on the host
                (``StepRead.grad_norms``: then nothing more is read unless a norm is non-finite).
            threshold: ``guard.grad_norm_threshold`` (``None``: no threshold).
            step: the optimizer step, for the finding.
            epoch: the epoch, for the finding.
            batch_index: the batch index, for the finding.

        Returns:
            A :class:`GradFinding`.
        """
        if isinstance(result, GradNorms):
            norms = result.norms.tolist()  # host sync: slow path only
        else:
            norms = [float(n) for n in result]
        nonfinite: Tuple[str, ...] = ()
        overflowing: Tuple[str, ...] = ()
        if any(not math.isfinite(n) for n in norms):
            # A norm that is Inf only because the float32 squares overflowed is no non-finite
            # gradient: the true norm (host sync per such gradient: slow path) tells them apart.
            exact = true_norms([_local(p.grad) for p in self._with_grad], norms)
            nonfinite = tuple(name for name, v in zip(self.names, exact) if not math.isfinite(v))
            overflowing = tuple(
                name for name, v, n in zip(self.names, exact, norms) if math.isfinite(v) and not math.isfinite(n)
            )
            norms = exact
        total = math.hypot(*norms)  # in float64 on the host: the true total when every norm is finite
        above = ()
        if threshold is not None:
            above = tuple(n for n, v in zip(self.names, norms) if math.isfinite(v) and v > threshold)
        listed = set(nonfinite) | set(above) | set(overflowing)
        pairs = sorted(((n, v) for n, v in zip(self.names, norms) if n in listed), key=lambda nv: -_sort_key(nv[1]))
        return GradFinding(
            kind="gradient" if nonfinite else "grad_norm",
            step=step,
            epoch=epoch,
            batch_index=batch_index,
            total_norm=total,
            threshold=threshold,
            nonfinite=nonfinite,
            above_threshold=above,
            overflowing=overflowing,
            norms=tuple(pairs),
        )


def _sort_key(v: float) -> float:
    return math.inf if math.isnan(v) else v


class WeightCheck:
    """Check every parameter for NaN/Inf every ``every`` steps, in one fused pass.

    Args:
        params: a module or ``(name, parameter)`` pairs.
        every: ``detect.check_weights_every`` (0: never).
        enabled: ``False`` makes every call a no-op.

    Example::

        >>> check = WeightCheck(nn.Linear(4, 2), every=100)
        >>> value = check.maybe_run(step=200)   # 0-dim device value (NaN/Inf: poisoned), or None
    """

    def __init__(self, params: NamedParams, every: int = 100, *, enabled: bool = True, probes: Probes = ()) -> None:
        named = _named(params)
        self.names = tuple(n for n, _ in named)
        self._params = [p for _, p in named]
        # (name, tensor, check): check(tensor) is 0, or NaN when the tensor is broken (a buffer
        # non-finite by design whose non-finite pattern changed); added to the check's value.
        self._probes = tuple(probes)
        self.every = every
        self.enabled = enabled and every > 0 and bool(self._params)
        self._dots = _DotPlan([_local(p) for p in self._params])

    def replan(self) -> None:
        """Plan the fused pass again (a lazy module made its parameters: their sizes are known now)."""
        self._dots = _DotPlan([_local(p) for p in self._params])

    def due(self, step: int) -> bool:
        """``True`` when ``step`` is a multiple of ``every`` (host arithmetic, no sync)."""
        return self.enabled and step % self.every == 0

    def run(self, force: bool = False) -> Optional[Tensor]:
        """Check now: one fused L2 norm per parameter, summed.

        Args:
            force: check even when the periodic check is off (``every`` 0): the guard's slow path
                after a trip, to tell weights already broken from a fault of this step.

        Returns:
            A 0-dim float32 device value, NaN/Inf when some parameter is (or, rarely, when
            the norms overflow: :meth:`finding` tells them apart); ``None`` when disabled. Put it
            on :class:`~safetrain.detect.flags.StepFlags` as ``weights``.
        """
        if not (self.enabled or force) or not self._params:
            return None
        with torch.no_grad():
            params = [_local(p).detach() for p in self._params]
            norms = self._dots.norms(params)
            value = _stack(norms if norms is not None else fused_norms(params)).sum()
            return value + sum(check(t) for _, t, check in self._probes) if self._probes else value

    def maybe_run(self, step: int) -> Optional[Tensor]:
        """:meth:`run` when :meth:`due`, else ``None``.

        Args:
            step: the optimizer step.

        Returns:
            The device value, or ``None``.
        """
        return self.run() if self.due(step) else None

    def finding(
        self, *, step: Optional[int] = None, epoch: Optional[int] = None, batch_index: Optional[int] = None
    ) -> Optional[WeightFinding]:
        """Name the poisoned parameters with their NaN/Inf counts (slow path, host syncs).

        Args:
            step: the optimizer step, for the finding.
            epoch: the epoch, for the finding.
            batch_index: the batch index, for the finding.

        Returns:
            A :class:`WeightFinding`, or ``None`` when every parameter is finite.
        """
        counts = []
        with torch.no_grad():
            for name, p in zip(self.names, self._params):
                p = _local(p)
                nan, inf = torch.stack([torch.isnan(p).sum(), torch.isinf(p).sum()]).tolist()  # host sync: slow path
                if nan or inf:
                    counts.append((name, int(nan), int(inf)))
            for name, t, check in self._probes:
                if not math.isfinite(float(check(t))):  # host sync: slow path
                    counts.append((name, int(torch.isnan(t).sum()), int(torch.isinf(t).sum())))
        if not counts:
            return None
        return WeightFinding(
            kind="weights",
            step=step,
            epoch=epoch,
            batch_index=batch_index,
            nonfinite=tuple(n for n, _, _ in counts),
            counts=tuple(counts),
        )
