"""The activation monitor: forward hooks that fold each module's output into a device-side value.

Cost: per monitored module call, one hook dispatch and one memory-bound ``sum`` of the fresh output; no
host sync, the values ride in the step's one read. Part of ``detect``: the guard attaches one
:class:`ActivationMonitor` in eager mode (``detect.mode``); :meth:`~ActivationMonitor.locate` and
:meth:`~ActivationMonitor.inspect` (:mod:`safetrain.detect.exact`) run on the slow path only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..adapters.compiled import is_compiled, plain_namer
from ..config import DetectConfig
from .blocks import inside, repeated_blocks
from .exact import ExactTrace, exact_hooks
from .findings import ModuleFinding
from .flags import gathered
from .hooks import PASSTHROUGH, HookHandle, make_hook

__all__ = ["ActivationMonitor", "GRANULARITIES"]

#: ``detect.granularity``: ``module`` hooks every monitored module; ``block`` hooks each repeated
#: block (:mod:`safetrain.detect.blocks`) instead of the modules inside it.
GRANULARITIES = ("module", "block")

logger = logging.getLogger(__name__)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _redundant_sequentials(named: List[Tuple[str, nn.Module]]) -> set:
    """Ids of exact ``nn.Sequential`` modules whose output is a monitored module's output.

    ``nn.Sequential.forward`` returns its last child's output object, so when that child is
    covered (monitored, or itself such a Sequential) the container's hook could only repeat the
    child's value: the hook dispatch is saved.
    """
    kept = {id(m) for _, m in named}
    covered: set = set()
    redundant: set = set()
    for _, module in reversed(named):  # preorder reversed: children are decided before parents
        if type(module) is nn.Sequential and len(module) and id(module[-1]) in covered:
            redundant.add(id(module))
            covered.add(id(module))
        elif id(module) in kept:
            covered.add(id(module))
    return redundant


def _inner_nan_only(name: str, block: nn.Module, nan_only: Sequence[str]) -> bool:
    return any(_matches(f"{name}.{sub}", nan_only) for sub, _ in block.named_modules() if sub)


def _plain_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``named_modules()`` without ``torch.compile`` wrappers (whose inner module runs the same
    forward) and with names as in the user's code (``module._orig_mod.fc`` -> ``module.fc``)."""
    plain = plain_namer(model)
    return [(plain(name), module) for name, module in model.named_modules() if not is_compiled(module)]


class ActivationMonitor:
    """Forward hooks that turn every monitored module's output into a device-side value.

    Eager mode puts a forward hook on every module whose forward runs (``detect.include`` /
    ``detect.exclude`` globs on qualified names, ``""`` being the root), not only on leaves: a module
    such as ``nn.MultiheadAttention`` uses its children's weights without calling them, so only its
    own hook sees its output. Children's hooks fire before their parents', so the first non-finite
    value in call order names the deepest module where it appeared. Modules that cannot turn finite
    inputs into NaN/Inf (:data:`~safetrain.detect.hooks.PASSTHROUGH`: ReLU, dropout, pooling,
    flatten...) are never the origin of a real fault, so ``skip_passthrough=True`` leaves them out:
    reducing a fresh activation is memory-bound, and this halves the hook cost of an MLP or a CNN
    (figures in ``benchmarks/README.md``). The constructor's default is off (every module hooked);
    the engine follows ``detect.skip_passthrough`` (on by default). The price: a fault forced into
    such a module's output (a test's injection hook) is named at the next monitored module. An exact
    ``nn.Sequential`` returns its last child's output object: when that child is monitored the
    container gets no hook of its own (it could only repeat the child's value).

    ``granularity="block"`` (the engine's default, ``detect.granularity``) hooks each repeated
    block (:func:`~safetrain.detect.blocks.repeated_blocks`: a transformer's layers) instead of the
    modules inside it: on a tiny GPT-2, 8 hooked calls a step instead of 26. Whatever a module
    inside makes that the rest of the model sees leaves through the block's output, so the step
    still trips; :meth:`locate` with a ``rerun`` then names the module inside by the exact hooks
    of :meth:`inspect`, which cover every module in either granularity, as does the guard's step
    replay (without a ``rerun`` the block is named: the guard re-runs only to confirm a flag the
    loss did not confirm, and its replay names the module otherwise). A model without repeated
    blocks is hooked as in ``module`` granularity. On a model with blocks an
    output that is the very tensor reduced just before, unchanged, is not reduced again (a model
    returning its head's logits).

    The hot hook is two list appends and one reduction: ``out.detach().sum()`` (fp16 summed in
    float32 so a finite activation cannot overflow the half range): several times cheaper than
    ``isnan``/``isinf`` masks or an inf-norm. NaN and Inf always propagate through the sum; a finite
    output whose sum overflows float32 would be a false alarm, which :meth:`ActivationMonitor.locate`
    reports as unconfirmed and an exact re-run under :meth:`ActivationMonitor.inspect`
    (:mod:`safetrain.detect.exact`) clears. The hook keeps no reference to the output: holding
    every activation until the step's read would defeat activation checkpointing and raise peak memory.

    Per step the monitor holds a Python list of 0-dim tensors (:attr:`ActivationMonitor.records`)
    and the matching module indices. The list joins the single ``stack`` of
    :meth:`~safetrain.detect.flags.StepFlags.read`, so the whole per-call vector rides in the step's
    one host read and attribution needs no further sync. Call :meth:`reset` once per step.
    Modules in ``nan_only`` globs (attention masks with legitimate ``-inf``) record
    ``clamp(amax(out), -1, 1)`` instead: NaN-propagating, blind to infinities.

    Args:
        model: the model; every submodule (the root included, named ``""``) is a candidate.
        include: module-name globs to monitor (``detect.include``).
        exclude: module-name globs never monitored; wins over ``include`` (``detect.exclude``).
        nan_only: globs of modules whose outputs may hold +-Inf legitimately: only NaN counts there.
        enabled: ``False`` makes the monitor a no-op: no hooks, no values.
        skip_passthrough: leave out modules of the exact types in
            :data:`~safetrain.detect.hooks.PASSTHROUGH` (finite in, finite out: never the origin
            of a real fault); saves their hook cost.
        granularity: ``"module"`` (every monitored module) or ``"block"`` (repeated blocks in
            place of their insides, see above).

    Raises:
        ValueError: an unknown ``granularity``.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> monitor = ActivationMonitor(model)
        >>> with monitor.attach():
        ...     out = model(torch.randn(3, 4))
        ...     vals = monitor.values()          # device tensor, one value per call, no sync
        ...     finding = monitor.locate(vals.tolist())  # None: all finite
        >>> monitor.order                        # the root Sequential repeats '2': not hooked
        ('0', '1', '2')
    """

    def __init__(
        self,
        model: nn.Module,
        include: Sequence[str] = ("*",),
        exclude: Sequence[str] = (),
        nan_only: Sequence[str] = (),
        *,
        enabled: bool = True,
        skip_passthrough: bool = False,
        granularity: str = "module",
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"ActivationMonitor: granularity={granularity!r}; expected one of {GRANULARITIES}")
        self.model = model
        self.enabled = enabled
        self.granularity = granularity
        self.nan_only = tuple(nan_only)
        skip = PASSTHROUGH if skip_passthrough else ()
        everything = _plain_modules(model)
        watched = [(n, m) for n, m in everything if _matches(n, include) and not _matches(n, exclude)]
        named = [(n, m) for n, m in watched if type(m) not in skip]
        self._exact = self._listed(named, ())
        blocks = dict(repeated_blocks(everything)) if granularity == "block" else {}
        self._blocks = frozenset(n for n, _ in watched if n in blocks)  # a block left out keeps its insides
        inner = {n: blocks[n] for n in self._blocks}
        hot = [(n, m) for n, m in named if not inside(n, inner)]
        self._modules: List[Tuple[str, nn.Module, bool]] = self._listed(hot, self._blocks)
        # block granularity, on a model with blocks: an output that is the tensor reduced just
        # before, unchanged, is not reduced again (hooks.make_hook's ``last``; not while
        # torch.compile traces the hooks). A model without blocks is hooked as in module granularity.
        self._last: Optional[List[Any]] = [None] if self._blocks else None
        self._ids: List[int] = []
        self._vals: List[Tensor] = []
        #: This step's per-call 0-dim values, live (aligned with :attr:`calls`); put this list on
        #: :class:`~safetrain.detect.flags.StepFlags` as ``forward``: it joins the read's single stack.
        #: The hooks' own list, emptied in place and never replaced: a plain attribute (read every step).
        self.records: List[Tensor] = self._vals
        self._order: Optional[Tuple[str, ...]] = None
        self._handle: Optional[HookHandle] = None

    def _listed(self, named: List[Tuple[str, nn.Module]], blocks: frozenset) -> List[Tuple[str, nn.Module, bool]]:
        """``(name, module, nan_only)`` of the modules to hook, without redundant Sequentials; a
        block is ``nan_only`` when it or a module inside it is (its output carries their -inf)."""
        redundant = _redundant_sequentials(named)
        return [
            (n, m, _matches(n, self.nan_only) or (n in blocks and _inner_nan_only(n, m, self.nan_only)))
            for n, m in named
            if id(m) not in redundant
        ]

    @classmethod
    def from_config(cls, model: nn.Module, cfg: DetectConfig, **kwargs: Any) -> "ActivationMonitor":
        """Build a monitor from a :class:`~safetrain.config.DetectConfig` (enabled in ``eager`` mode only).

        Args:
            model: the model.
            cfg: the ``detect`` section.
            kwargs: other keyword arguments of the constructor (``skip_passthrough`` overrides
                ``detect.skip_passthrough``).

        Returns:
            An (unattached) monitor.
        """
        kwargs.setdefault("skip_passthrough", cfg.skip_passthrough)
        kwargs.setdefault("granularity", cfg.granularity)
        return cls(model, cfg.include, cfg.exclude, cfg.nan_only, enabled=cfg.mode == "eager", **kwargs)

    @property
    def names(self) -> Tuple[str, ...]:
        """Qualified names of the monitored modules, in ``named_modules()`` order."""
        return tuple(name for name, _, _ in self._modules)

    @property
    def blocks(self) -> Tuple[str, ...]:
        """Names of the repeated blocks hooked in place of the modules inside them (``block``
        granularity; empty in ``module`` granularity or when the model has none)."""
        return tuple(n for n, _, _ in self._modules if n in self._blocks)

    @property
    def attached(self) -> bool:
        """``True`` while the hooks are registered."""
        return self._handle is not None

    def attach(self) -> HookHandle:
        """Register the hooks; the returned handle (or :meth:`detach`, or ``with``) removes them.

        Returns:
            A :class:`HookHandle`; it is also a context manager.

        Raises:
            RuntimeError: the monitor is already attached.
        """
        if self._handle is not None:
            raise RuntimeError("ActivationMonitor.attach(): already attached; remove the handle first")
        if not self.enabled:
            self._handle = HookHandle((), self._detached)
            return self._handle
        handles = [
            module.register_forward_hook(make_hook(i, self._ids, self._vals, nan_only, i == 0, self._last))
            for i, (name, module, nan_only) in enumerate(self._modules)
        ]
        self._handle = HookHandle(handles, self._detached)
        return self._handle

    def _detached(self) -> None:
        self._handle = None

    def detach(self) -> None:
        """Remove the hooks (a no-op when not attached)."""
        if self._handle is not None:
            self._handle.remove()

    def __enter__(self) -> "ActivationMonitor":
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def reset(self) -> None:
        """Forget this step's records (call once per step, after the read). The first forward's
        call order is kept as :attr:`order`."""
        if self._order is None and self._ids:
            self._order = self._order_of(self._ids)
        del self._ids[:], self._vals[:]  # emptied in place (the hooks append to them): a statement, no call
        if self._last is not None:
            self._last[0] = None

    def set_aside(self) -> Tuple[List[int], List[Tensor]]:
        """Take the records made so far this step out of the lists the hooks append to, so the
        next forward starts from empty ones; give them back with :meth:`put_back` after it.

        Under ``torch.compile`` the hooks are traced into the graph, which depends on how many
        records those lists hold: a second micro-batch of one step would compile a graph of its own.
        """
        held = (self._ids[:], self._vals[:])
        self._ids.clear()
        self._vals.clear()
        return held

    def put_back(self, held: Tuple[List[int], List[Tensor]]) -> None:
        """Put records taken by :meth:`set_aside` back, before those made since (call order kept)."""
        self._ids[:0] = held[0]
        self._vals[:0] = held[1]

    def _order_of(self, ids: Sequence[int]) -> Tuple[str, ...]:
        seen = dict.fromkeys(ids)
        return tuple(self._modules[i][0] for i in seen)

    @property
    def order(self) -> Tuple[str, ...]:
        """Monitored module names in the order their hooks first fired (children before parents),
        recorded once, from the first forward after :meth:`attach`."""
        if self._order is None and self._ids:
            self._order = self._order_of(self._ids)
        return self._order or ()

    @property
    def calls(self) -> Tuple[Tuple[str, int], ...]:
        """``(module name, call index)`` of every call recorded this step, in call order."""
        counts: dict = {}
        out = []
        for i in self._ids:
            counts[i] = counts.get(i, -1) + 1
            out.append((self._modules[i][0], counts[i]))
        return tuple(out)

    @property
    def recorded(self) -> int:
        """How many calls were recorded so far this step (a host-side count: no sync)."""
        return len(self._ids)

    def values(self) -> Optional[Tensor]:
        """This step's per-call values as one device vector (one ``stack``, no sync).

        Returns:
            A 1-D tensor aligned with :attr:`calls` (non-finite where an output was), or ``None``
            when nothing was recorded.
        """
        vals = self._vals
        if not vals:
            return None
        try:
            return torch.stack(vals)
        except RuntimeError:  # values on several devices (model parallel): gather on an accelerator
            return torch.stack(gathered(vals))

    @property
    def flag(self) -> Optional[Tensor]:
        """0-dim bool device tensor: some output this step was non-finite (``None``: no records)."""
        vals = self.values()
        return None if vals is None else ~torch.isfinite(vals).all()

    def locate(
        self,
        values: Union[Sequence[float], Tensor],
        *,
        rerun: Any = None,
        step: Optional[int] = None,
        epoch: Optional[int] = None,
        batch_index: Optional[int] = None,
    ) -> Optional[ModuleFinding]:
        """Name the first monitored call whose value is non-finite (slow path, host side).

        Args:
            values: the per-call values as read on the host (``StepRead.forward``), or the
                device vector from :meth:`values` (then read here, an extra sync).
            rerun: optional callable that re-runs the forward (e.g. ``lambda: model(x)``); it is
                run under ``torch.no_grad()`` and :meth:`inspect` (buffers restored) to confirm the
                finding with an exact check and fill in input/output statistics. A call of a block
                (:attr:`blocks`) is named there at the module inside it that made the value.
            step: the optimizer step, for the finding.
            epoch: the epoch, for the finding.
            batch_index: the batch index, for the finding.

        Returns:
            A :class:`ModuleFinding`, or ``None`` when every value is finite (or, with ``rerun``,
            when the exact re-run finds every output finite: the cheap sum overflowed).

        Raises:
            ValueError: ``values`` does not match this step's records (``reset()`` ran in between).
        """
        if isinstance(values, Tensor):
            values = values.tolist()  # host sync: slow path only
        ids = self._ids
        if len(values) != len(ids):
            raise ValueError(
                f"locate(): got {len(values)} values for {len(ids)} recorded calls; "
                "call it before reset(), with this step's values"
            )
        found = None
        for k, v in enumerate(values):
            if not math.isfinite(v):
                i = ids[k]
                name, module, _ = self._modules[i]
                found = ModuleFinding(
                    kind="forward",
                    step=step,
                    epoch=epoch,
                    batch_index=batch_index,
                    module=name,
                    module_type=type(module).__name__,
                    call_index=ids[:k].count(i),
                    position=k,
                    value=float(v),
                )
                break
        if found is None or rerun is None:
            return found
        with torch.no_grad(), self.inspect() as seen:
            rerun()
        if seen.finding is None:
            logger.info(
                "forward flag at '%s' not confirmed by an exact re-run (sum overflow or transient)", found.module
            )
            return None
        # position: where in this step's records the value was (which micro-batch made it)
        return dataclasses.replace(seen.finding.with_context(step, epoch, batch_index), position=found.position)

    @contextlib.contextmanager
    def inspect(self, restore_buffers: bool = True) -> Iterator[ExactTrace]:
        """Exact, slow hooks for one re-run: every output is checked on the host.

        Use it on the slow path only (each hook syncs). The hot hooks' records of the re-run
        are discarded; buffers (BatchNorm running statistics) are restored on exit.

        Args:
            restore_buffers: put every buffer of the model back as it was on entry.

        Returns:
            A context manager yielding an :class:`~safetrain.detect.exact.ExactTrace`, filled in
            as the forward runs.
        """
        mark = len(self._ids)
        saved = [(b, b.detach().clone()) for b in self.model.buffers()] if restore_buffers else []
        try:
            with exact_hooks(self._exact) as seen:
                yield seen
        finally:
            del self._ids[mark:]
            del self._vals[mark:]
            with torch.no_grad():
                for buf, copy in saved:
                    buf.copy_(copy)
