"""``MemoryStore``: a ring of ``keep`` snapshots held in preallocated tensors.

Cost: a snapshot is one grouped copy per device pair into reused buffers, no allocation, plus the
finiteness check (on the CPU in the same pass, when another snapshot is kept). One of the two stores of
``snapshot`` (with :mod:`.disk`), on :class:`~.store.SnapshotStore`; :func:`~.make.make_store`
builds it for ``snapshot.store: memory``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Literal, Optional, Set

import torch

from ..errors import SnapshotError
from .state import Captured, TrainState
from .store import SnapshotInfo, SnapshotStore, make_info
from .tensors import (
    Chunks,
    alloc_like,
    chunks_of,
    copy_all_,
    copy_chunks_checked_,
    layout_of,
    streamable,
    unpinned_array,
)

__all__ = ["MemoryStore"]

log = logging.getLogger(__name__)

# Threads for the one-pass copy and check: torch's intra-op thread count, at most this many.
# Memory bandwidth is usually saturated well before; more threads would queue on the GIL.
_MAX_THREADS = 8


@dataclass
class _Plan:
    """How a capture of one layout is copied into a slot, kept while the layout holds: the fit of
    each buffer and the route of each tensor are then worked out once, not at every snapshot."""

    layout: List[Any]  # (name, shape, dtype, device, stride) of each tensor captured
    streamed: Set[str]  # the names copied and checked in one pass (``copy_chunks_checked_``)
    checked: List[str] = field(default_factory=list)  # those names, in capture order
    copied: List[str] = field(default_factory=list)  # the others, copied by ``copy_all_`` ...
    dst: List[torch.Tensor] = field(default_factory=list)  # ... into these buffers
    sources: List[int] = field(default_factory=list)  # data_ptr of each live tensor ``chunks`` reads
    chunks: Optional[Chunks] = None


@dataclass
class _Slot:
    """One snapshot's buffers; ``meta is None`` while empty or being overwritten."""

    index: int
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)
    homes: Dict[str, torch.device] = field(default_factory=dict)  # device each tensor was captured on
    meta_json: Optional[str] = None
    seq: int = -1
    step: Any = "?"  # the step of the snapshot it holds or last held, for messages
    plan: Optional[_Plan] = None  # how the last capture was copied in (None: none since the buffers were cleared)

    def meta(self) -> Dict[str, Any]:
        return json.loads(self.meta_json or "{}")


def _fits(buf: torch.Tensor, t: torch.Tensor, target: torch.device) -> bool:
    """Whether ``buf`` can hold ``t`` as :func:`alloc_like` would have laid it out."""
    if buf.shape != t.shape or buf.dtype != t.dtype or buf.device != target:
        return False
    return tuple(buf.stride()) == layout_of(t)


class MemoryStore(SnapshotStore):
    """Snapshots in memory: fast, lost with the process, ``keep`` of them in a ring.

    Each slot allocates its buffers on its first use and reuses them afterwards: a snapshot is one
    grouped ``_foreach_copy_`` per device pair, no allocation, and from CUDA into pinned host memory
    it is asynchronous (``non_blocking``; stream order keeps the next optimizer step behind it). A
    buffer is reallocated only when the tensor it mirrors changed shape, dtype or device, or appeared
    (Adam creates its state on the first step). The JSON part is kept as JSON text, so a memory
    snapshot holds exactly what a file would and shares nothing with the live objects.

    A snapshot of non-finite state is refused and never becomes restorable. On the CPU, checking
    first and copying after reads every value twice; so when another snapshot is kept (``keep >= 2``
    after the first save), the slot being overwritten is given up for the check instead: float
    tensors are copied and checked in one pass (:func:`copy_checked_`), and a refusal leaves that
    slot empty and every other snapshot intact. Without another snapshot to fall back on, everything
    is checked before any buffer is touched.

    Args:
        keep: number of snapshots kept (each one a full copy of the state).
        device: ``"cpu"`` keeps copies in host memory (pinned when the model is on CUDA, so
            copies are asynchronous); ``"model"`` keeps them on each tensor's own device (fastest
            restore, costs accelerator memory).
        run_id: the run stamped into each snapshot (default: a fresh uuid); a memory store's
            snapshots are all its own.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> store = MemoryStore(keep=2)
        >>> store.save(state, {"step": 0, "epoch": 0, "batch": 0}).step
        0
        >>> store.restore(state).step
        0
    """

    def __init__(self, keep: int = 2, device: Literal["cpu", "model"] = "cpu", run_id: Optional[str] = None) -> None:
        super().__init__(keep, run_id)
        if device not in ("cpu", "model"):
            raise SnapshotError(f"snapshot.device: got {device!r}; expected 'cpu' or 'model'")
        self.device = device
        self._slots: List[_Slot] = [_Slot(i) for i in range(keep)]
        self._seq = 0
        self._pool: Optional[ThreadPoolExecutor] = None  # started by the first one-pass copy, if threads > 1
        self._layout: List[Any] = []  # the last capture's layout (see _Plan) and its streamable names
        self._streamable: Set[str] = set()

    def _target(self, t: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.device == "cpu" else t.device

    def _save(self, captured: Captured) -> Optional[SnapshotInfo]:
        # the empty slot, else one passed over (never restored again), else the oldest
        slot = min(self._slots, key=lambda s: (s.seq >= 0 and self._key(s) not in self._passed, s.seq))
        captured.meta["run_id"] = self.run_id
        meta_json = json.dumps(captured.meta, separators=(",", ":"), allow_nan=False)
        # Another snapshot survives whatever happens to this slot: check while copying (see the class docstring).
        fallback = any(s.meta_json is not None for s in self._slots if s is not slot)
        tensors = captured.tensors
        layout = [(n, t.shape, t.dtype, t.device, t.stride()) for n, t in tensors.items()]
        if layout != self._layout:  # (what streamable says depends on the layout only: asked once per layout)
            self._layout = layout
            self._streamable = {n for n, t in tensors.items() if streamable(t, self._target(t))}
        streamed = {n for n in captured.checked if n not in captured.accepted and n in self._streamable}
        if not fallback:
            streamed.clear()
        if self._refused(captured, [n for n in captured.checked if n not in streamed]):
            return None  # before any buffer is touched: older snapshots stay intact
        lost = f"; {self._slot_name(slot)} was being overwritten and is dropped" if slot.meta_json else ""
        step = captured.meta["counters"]["step"]
        slot.meta_json, slot.seq = None, -1  # not restorable while its buffers are overwritten
        plan = slot.plan
        if plan is None or plan.layout != layout or plan.streamed != streamed:
            slot.plan = None  # (until the buffers fit again: a failed reallocation leaves no stale plan)
            plan = slot.plan = self._plan(slot, tensors, layout, streamed)
        copy_all_(plan.dst, [tensors[n] for n in plan.copied])
        if plan.checked:
            sources = [tensors[n].data_ptr() for n in plan.checked]
            if plan.chunks is None or sources != plan.sources:  # (first copy, or a live tensor moved)
                pairs = [(slot.buffers[n].view(-1).numpy(), unpinned_array(tensors[n])) for n in plan.checked]
                plan.chunks, plan.sources = chunks_of(pairs), sources
            threads = min(torch.get_num_threads(), _MAX_THREADS)
            if threads > 1 and self._pool is None:
                self._pool = ThreadPoolExecutor(_MAX_THREADS - 1, thread_name_prefix="safetrain-memory-snapshot")
            bad = copy_chunks_checked_(plan.chunks, self._pool, threads)
            if bad:
                self._warn_refused(captured, [plan.checked[i] for i in bad], lost)
                return None  # the slot stays empty: its buffers hold the non-finite copy
        slot.meta_json, slot.seq, slot.step = meta_json, self._seq, step
        self._seq += 1
        log.debug("memory snapshot at step %d in slot %d", step, slot.index)
        return self._info(slot, captured.meta)  # what meta_json holds, without parsing it back

    def _plan(self, slot: _Slot, tensors: Dict[str, torch.Tensor], layout: List[Any], streamed: Set[str]) -> _Plan:
        """Fit the slot's buffers to a new layout (reallocating those that no longer fit) and route
        each tensor: copied and checked in one pass when streamed, else copied by ``copy_all_``."""
        plan = _Plan(layout, set(streamed))
        for name, t in tensors.items():
            target = self._target(t)
            buf = slot.buffers.get(name)
            if buf is None or not _fits(buf, t, target):
                buf = slot.buffers[name] = alloc_like(t, target)
            slot.homes[name] = t.device
            if name in streamed:
                plan.checked.append(name)
            else:
                plan.copied.append(name)
                plan.dst.append(buf)
        for name in set(slot.buffers) - set(tensors):
            del slot.buffers[name], slot.homes[name]
        return plan

    def _candidates(self) -> Iterable[_Slot]:
        return sorted((s for s in self._slots if s.meta_json is not None), key=lambda s: -s.seq)

    def _key(self, slot: _Slot) -> Any:
        return (slot.index, slot.seq)

    def _name(self, slot: _Slot) -> str:
        return self._slot_name(slot)

    def _slot_name(self, slot: _Slot) -> str:
        return f"memory snapshot at step {slot.step} (slot {slot.index})"

    def _restore(self, slot: _Slot, state: TrainState) -> SnapshotInfo:
        meta, where = slot.meta(), self._slot_name(slot)
        specs = {n: (tuple(b.shape), b.dtype) for n, b in slot.buffers.items()}
        state.check_compatible(specs, meta, where)
        state.apply(slot.buffers, meta, owned=False, where=where, homes=slot.homes)
        log.debug("restored %s", where)
        return dataclasses.replace(self._info(slot), changed_since=tuple(state.changed))

    def _info(self, slot: _Slot, meta: Optional[Dict[str, Any]] = None) -> SnapshotInfo:
        homes = slot.homes

        def fresh(name: str, t: torch.Tensor) -> torch.Tensor:
            # Back to the device it came from; from pinned memory this stays stream-ordered.
            return t.to(device=homes.get(name, t.device), copy=True, non_blocking=True)

        return make_info(slot.meta() if meta is None else meta, slot.buffers, None, self._slot_name(slot), copy=fresh)

    def _where(self) -> str:
        return "MemoryStore"

    def _set_aside(self, slot: _Slot) -> None:
        slot.meta_json, slot.seq = None, -1

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for slot in self._slots:
            slot.buffers.clear()
            slot.homes.clear()
            slot.plan = None
            slot.meta_json = None

    def nbytes(self) -> int:
        """Bytes held in buffers across all slots."""
        return sum(b.numel() * b.element_size() for s in self._slots for b in s.buffers.values())
