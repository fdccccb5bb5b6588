"""The step's single host read: every device flag, the loss and the total norm in one tensor.

The guard puts each device-side value of the step here (the sanitizer's sums, the activation
monitor's per-call sums, the loss, the gradients' total norm, the weight check) and calls
:meth:`StepFlags.read` once: one ``stack`` of every 0-dim value (a ``cat`` only if a vector was
put) and one ``tolist()``, the step's only host sync. Each value is judged on the host, with no
device op spent on it: a **bool** value trips when ``True``, a **floating** value trips when it
is NaN or Inf. What comes back is a small frozen :class:`StepRead` of plain Python numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["StepFlags", "StepRead", "FLAG_KINDS", "Layout", "Reduce", "parse_read", "packed_order"]

#: The kinds :class:`StepRead` knows by name, in the order a step meets them.
FLAG_KINDS = ("input", "target", "forward", "loss", "gradient", "weights")
_NUMBERS = ("loss", "total_norm")
_VECTORS = ("forward", "grad_norms")
_ROWS = ("input_rows", "target_rows")
_BOOL = torch.bool
_INF = math.inf
_FLOATS = (torch.float32, torch.float64)


@dataclass(frozen=True)
class StepRead:
    """One step's flags and numbers, on the host.

    Attributes:
        loss: the loss value (``None`` when not put).
        total_norm: the gradients' total L2 norm (``None`` when not put).
        input: some input value is NaN/Inf.
        target: some target value is NaN/Inf.
        gradient: some gradient is NaN/Inf (set when ``total_norm`` is non-finite).
        weights: the weight check tripped.
        forward: the activation monitor's per-call values, aligned with its ``calls`` (empty in lazy mode).
        grad_norms: per-parameter gradient norms, aligned with ``GradCheck.names``, when put.
        input_rows: the per-row input mask, when it was put (else empty).
        target_rows: the per-row target mask, likewise.
        extra: raw values of any other name that was put.
        extra_tripped: the names in ``extra`` that tripped.
    """

    loss: Optional[float] = None
    total_norm: Optional[float] = None
    input: bool = False
    target: bool = False
    gradient: bool = False
    weights: bool = False
    forward: Tuple[float, ...] = ()
    grad_norms: Tuple[float, ...] = ()
    input_rows: Tuple[bool, ...] = ()
    target_rows: Tuple[bool, ...] = ()
    extra: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)
    extra_tripped: Tuple[str, ...] = ()

    @property
    def forward_tripped(self) -> bool:
        """Some monitored module's value is NaN/Inf."""
        return bool(self.forward) and not -_INF < sum(self.forward) < _INF  # (finite: see _parse)

    @property
    def loss_tripped(self) -> bool:
        """The loss is NaN or Inf."""
        return self.loss is not None and not -_INF < self.loss < _INF  # (finite: see _parse)

    def tripped(self) -> Tuple[str, ...]:
        """The kinds that tripped, in step order (input, target, forward, loss, gradient, weights),
        then the extra names that tripped.

        Returns:
            A tuple of kinds; empty on a healthy step.
        """
        kinds = [k for k in ("input", "target") if getattr(self, k)]
        if self.forward_tripped:
            kinds.append("forward")
        if self.loss_tripped:
            kinds.append("loss")
        kinds += [k for k in ("gradient", "weights") if getattr(self, k)]
        return tuple(kinds) + self.extra_tripped

    @property
    def healthy(self) -> bool:
        """Nothing tripped."""
        if self.input or self.target or self.gradient or self.weights or self.extra_tripped:
            return False
        return not (self.loss_tripped or self.forward_tripped)

    def rows(self, which: str = "input") -> Tuple[int, ...]:
        """Indices of the bad rows, from a per-row mask that was put (``"input"`` or ``"target"``)."""
        mask = self.input_rows if which == "input" else self.target_rows
        return tuple(i for i, b in enumerate(mask) if b)


Value = Union[None, Tensor, Sequence[Tensor]]
#: One entry per name put, in put order: ``(name, count, is_bool, is_vector)``. The packed
#: vector holds every scalar entry first, then every vector entry, each group in put order.
Layout = List[Tuple[str, int, bool, bool]]
#: ``reduce(packed, layout) -> host values``: brings the packed vector to the host itself (the
#: one sync), combined across processes; see :class:`safetrain.distributed.DistributedSync`.
Reduce = Callable[[Tensor, Layout], List[float]]


class StepFlags:
    """Collects the step's device values and reads them all with ONE host sync.

    Names: ``loss`` and ``total_norm`` are numbers (a non-finite ``total_norm`` sets
    ``gradient``); ``grad_norms`` is :attr:`GradNorms.norm_list` (the read then gives every norm
    and ``total_norm = math.hypot(*norms)``, computed on the host); ``input``, ``target``,
    ``forward``, ``gradient``, ``weights`` are checks;
    ``input_rows`` / ``target_rows`` are optional per-row bool masks; any other name lands in
    ``StepRead.extra``. A value is a 0-dim tensor, a 1-D tensor, or a list of 0-dim tensors (the
    sanitizer's ``values``, the monitor's ``records``: they join the single ``stack`` as they
    are). Bool values trip when ``True``, floating ones when NaN/Inf. ``None`` is ignored, so a
    disabled detector needs no ``if`` in the caller. Reusable: ``read()`` clears it.

    The healthy step, as the guard composes it (no host sync until the read)::

        scan = scan_batch(batch, replace=...)          # inputs: row mask + flag, bad rows zero-filled
        monitor.reset()                                # eager mode: hooks attached once, records per step
        loss = loss_fn(model(scan.batch), ...)         # hooks fold each output into a 0-dim sum
        loss.backward()
        grads = grad_check.run()                       # one fused norm pass: per-param, total, flag
        flags.put("input", scan.flag); flags.put("loss", loss.detach()); flags.put("total_norm", grads.total_norm)
        flags.put("forward", monitor.values()); flags.put("weights", weight_check.maybe_run(step))
        read = flags.read()                            # host sync: the one per step
        if read.healthy: grad_check.clip_(max_norm, grads.total_norm); optimizer.step()

    Args:
        reduce: ``None`` (one process): ``read()`` is one ``tolist()``. Under data parallelism,
            a :data:`Reduce` that combines the packed vector across ranks with one collective
            and returns the combined host values; it then makes the read's only host sync.

    Example::

        >>> flags = StepFlags()
        >>> flags.put("loss", torch.tensor(0.5))          # device values, no host sync yet
        >>> flags.put("total_norm", torch.tensor(2.0))
        >>> read = flags.read()                           # one host sync
        >>> read.healthy, read.loss, read.total_norm
        (True, 0.5, 2.0)
    """

    def __init__(self, reduce: Optional[Reduce] = None) -> None:
        self._scalars: List[Tensor] = []
        self._vectors: List[Tensor] = []
        self._layout: Layout = []  # (name, count, is_bool, is_vector)
        self._reduce = reduce
        self._last: Tuple[Layout, Plan] = ([], ())  # the last read's layout and plan (each step puts the same)

    def put(self, name: str, value: Value) -> None:
        """Add a device value; ``None`` (and an empty list) is ignored.

        Args:
            name: what it is (see the class docstring).
            value: a 0-dim or 1-D tensor, or a list of 0-dim tensors; never read here.
        """
        if value is None:
            return
        if isinstance(value, Tensor):
            if value.requires_grad:
                value = value.detach()
            if value.ndim == 0:
                self._scalars.append(value)
                self._layout.append((name, 1, value.dtype is _BOOL, False))
            else:
                value = value.reshape(-1)
                self._vectors.append(value)
                self._layout.append((name, value.shape[0], value.dtype is _BOOL, True))
            return
        n = len(value)
        if n:
            self._scalars.extend(value)
            self._layout.append((name, n, value[0].dtype is _BOOL, False))

    def put_many(self, entries: Sequence[Tuple[str, Value]]) -> None:
        """:meth:`put` each ``(name, value)`` in order; a list or tuple of 0-dim tensors (the step's
        usual value) and a lone 0-dim tensor (the loss) are taken without a call of their own: the
        lists grow by ``+=``, not ``append`` (the healthy path puts a handful each step)."""
        scalars, layout = self._scalars, self._layout
        for name, value in entries:
            if type(value) is list or type(value) is tuple:
                if value:
                    scalars += value
                    layout += ((name, len(value), value[0].dtype is _BOOL, False),)
            elif value.__class__ is Tensor and value.ndim == 0 and not value.requires_grad:  # (the loss)
                scalars += (value,)
                layout += ((name, 1, value.dtype is _BOOL, False),)
            elif value is not None:
                self.put(name, value)

    def clear(self) -> None:
        """Drop everything put so far (``read()`` does it too)."""
        self._scalars.clear()
        self._vectors.clear()
        self._layout.clear()

    def read(self) -> StepRead:
        """Pack every value into one tensor and bring it to the host: the step's single sync.

        Returns:
            A :class:`StepRead`; the flags are cleared for the next step.
        """
        scalars, vectors, layout = self._scalars, self._vectors, self._layout
        if not scalars and not vectors:
            self.clear()
            return StepRead()
        self._scalars, self._vectors, self._layout = [], [], []  # (cleared for the next step)
        try:
            packed = torch.stack(scalars) if scalars else None
            if vectors:
                packed = torch.cat(([packed] if packed is not None else []) + vectors)
        except RuntimeError:  # values on several devices: gather on an accelerator, read once from there
            device = gather_device([*scalars, *vectors])
            packed = torch.stack(gathered(scalars, device)) if scalars else None
            if vectors:
                packed = torch.cat(([packed] if packed is not None else []) + gathered(vectors, device))
        if packed.dtype not in _FLOATS:  # type: ignore[union-attr]
            packed = packed.float()  # type: ignore[union-attr]
        if self._reduce is None:
            host = packed.tolist()  # type: ignore[union-attr]  # host sync: the step's one read
        else:  # host sync: the step's one read, after one collective (inside the hook)
            host = self._reduce(packed, layout)  # type: ignore[arg-type]
        last = self._last
        if layout != last[0]:  # (compared by value: no lookup of the plan while the names stay the same)
            last = self._last = (layout, _plan(layout))
        return _parse(host, layout, last[1])


def gather_device(tensors: Sequence[Tensor]) -> torch.device:
    """Where to gather values that live on several devices: an accelerator holding one of them,
    else the CPU. Never the host when an accelerator is involved: a ``non_blocking`` copy to the
    host is not waited for by a later host read, which could see the memory before the copy lands;
    copies towards the accelerator are ordered on its stream, and its read waits for them."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return tensors[0].device


def gathered(tensors: Sequence[Tensor], device: Optional[torch.device] = None) -> List[Tensor]:
    """``tensors`` copied to one device (``device``, else :func:`gather_device`'s choice), ready
    to stack: asynchronously towards CUDA, which orders the copies before its read."""
    device = device if device is not None else gather_device(tensors)
    non_blocking = device.type == "cuda"
    return [t.to(device, non_blocking=non_blocking) for t in tensors]


def parse_read(host: Sequence[float], layout: Layout) -> StepRead:
    """Turn packed host values (one rank's row, say) into a :class:`StepRead`, as ``read()`` does."""
    return _parse(host, layout)


# How each name is read back, decided once per layout (the guard puts the same names every step).
_NUMBER, _VECTOR, _ROW, _FLAG, _EXTRA = range(5)
#: ``(name, start, stop, role, is_bool)`` per entry, in packed order.
Plan = Tuple[Tuple[str, int, int, int, bool], ...]
_PLANS: Dict[Tuple[Tuple[str, int, bool, bool], ...], Plan] = {}
_MAX_PLANS = 64  # layouts seen in one process are few (a step's names, plus micro-batch counts)


def packed_order(layout: Layout) -> Layout:
    """The layout's entries in the order :meth:`StepFlags.read` packs them: every scalar entry
    first, then every vector entry, each group in put order."""
    return [e for e in layout if not e[3]] + [e for e in layout if e[3]]


def _plan(layout: Layout) -> Plan:
    key = tuple(layout)
    plan = _PLANS.get(key)
    if plan is None:
        entries, pos = [], 0
        for name, n, is_bool, _ in packed_order(layout):
            role = (
                _NUMBER
                if name in _NUMBERS
                else _VECTOR
                if name in _VECTORS
                else _ROW
                if name in _ROWS
                else _FLAG
                if name in FLAG_KINDS
                else _EXTRA
            )
            entries.append((name, pos, pos + n, role, is_bool))
            pos += n
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = tuple(entries)
    return plan


def _parse(host: Sequence[float], layout: Layout, plan: Optional[Plan] = None) -> StepRead:
    """Slice the packed host values back into named fields (scalars first, then vectors);
    ``plan``: the layout's, when known."""
    out: Dict[str, Any] = {}
    extra: Dict[str, Tuple[float, ...]] = {}
    extra_tripped: List[str] = []
    # A value v is finite when -_INF < v < _INF (NaN fails both comparisons): a test with no call,
    # made for every flag of every step's read.
    for name, lo, hi, role, is_bool in plan if plan is not None else _plan(layout):
        if role == _NUMBER:
            out[name] = host[lo] if hi - lo == 1 else sum(host[lo:hi])
        elif role == _FLAG:
            if is_bool:
                bad = any(host[lo:hi])
            else:
                value = host[lo] if hi - lo == 1 else sum(host[lo:hi])
                bad = not -_INF < value < _INF
            out[name] = (name in out and out[name]) or bad
        elif role == _VECTOR:
            vals = tuple(host[lo:hi])
            if is_bool:
                vals = tuple(math.nan if v else 0.0 for v in vals)
            out[name] = out[name] + vals if name in out else vals
        elif role == _ROW:
            out[name] = tuple(bool(v) for v in host[lo:hi])
        else:
            vals = tuple(host[lo:hi])
            extra[name] = vals
            if any(vals) if is_bool else not -_INF < sum(vals) < _INF:
                extra_tripped.append(name)
    if "total_norm" in out:
        total = out["total_norm"]
    elif "grad_norms" in out:
        total = out["total_norm"] = math.hypot(*out["grad_norms"])
    else:
        total = None
    if total is not None and not -_INF < total < _INF:
        out["gradient"] = True
    if "input_rows" in out and any(out["input_rows"]):
        out["input"] = True
    if "target_rows" in out and any(out["target_rows"]):
        out["target"] = True
    if extra:
        return StepRead(**out, extra=extra, extra_tripped=tuple(extra_tripped))
    return StepRead(**out)
