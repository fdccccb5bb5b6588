"""The batch scan, the ``sanitize`` section's detector: non-finite rows of a nested batch found on
the device, fixed on the host.

Cost: two device ops per floating tensor and no host sync on the healthy path; op count is what
matters on small models. Part of ``detect``: the guard scans every batch with :func:`scan_batch`
(its docstring holds the rules users rely on); the slow path is :mod:`safetrain.detect.rows`.
"""

from __future__ import annotations

from typing import Any, Collection, List, Optional, Tuple

import torch
from torch import Tensor

from .walk import is_dataclass_instance, map_tensors, rebuild_dataclass, rebuild_map, top_items

__all__ = ["TARGET_KEYS", "BatchScan", "scan_batch"]

#: Top-level keys (or dataclass fields) of a dict batch that hold targets: the guard scans a whole
#: dict batch with ``scan_batch(batch, target_keys=TARGET_KEYS)``, and :mod:`safetrain.guard.batches`
#: splits a mapping batch into inputs and targets by the same keys.
TARGET_KEYS = frozenset({"labels", "label", "targets", "target", "y"})

_Replace = Optional[Tuple[float, float, float]]
_F16, _BF16, _F32 = torch.float16, torch.bfloat16, torch.float32
_ZERO_FILL = (0.0, 0.0, 0.0)


class BatchScan:
    """The device-side result of :func:`scan_batch`; nothing in it has been read on the host.

    A *value* here is a 0-dim floating device tensor that is non-finite exactly when the tensor
    it sums holds NaN/Inf (or, rarely, when a finite sum overflows; the slow path's exact
    :func:`describe_rows` tells). Put ``values`` on :class:`~safetrain.detect.flags.StepFlags`
    as they are: they join the step's single ``stack``, no extra op.

    Attributes:
        batch: the batch to run the forward on, every non-finite value zero-filled (or replaced
            under ``replace``). The same object as the input when it holds no floating tensor.
        values: one 0-dim sum per floating input tensor (empty: nothing floating).
        target_values: the same for the target part (``target_keys``), else empty.
        batch_size: ``B`` (a host int, read off shapes, no sync); ``None`` when no tensor has a dim.
    """

    __slots__ = ("batch", "values", "target_values", "batch_size", "_sources", "_target_sources", "_cache")

    def __init__(
        self,
        batch: Any,
        values: List[Tensor],
        sources: List[Tensor],
        batch_size: Optional[int],
        target_values: Optional[List[Tensor]] = None,
        target_sources: Optional[List[Tensor]] = None,
    ) -> None:
        self.batch = batch
        self.values = values
        self.target_values = target_values or []
        self.batch_size = batch_size
        self._sources = sources
        self._target_sources = target_sources or []
        self._cache: dict = {}

    @property
    def flag(self) -> Optional[Tensor]:
        """0-dim bool device tensor: some input value is non-finite (``None``: nothing floating).

        Computed on first access (two small ops, no sync); the guard puts ``values`` instead."""
        return self._lazy("flag", self.values, None)

    @property
    def target_flag(self) -> Optional[Tensor]:
        """As :attr:`flag`, for the target part."""
        return self._lazy("target_flag", self.target_values, None)

    @property
    def row_bad(self) -> Optional[Tensor]:
        """Bool device tensor ``[B]``: rows with NaN/Inf in an input tensor (``None``: nothing floating).

        Computed on first access from the original tensors (one sum per row, no sync): the
        healthy path never pays for it."""
        return self._lazy("row_bad", None, self._sources)

    @property
    def target_row_bad(self) -> Optional[Tensor]:
        """As :attr:`row_bad`, for the target part."""
        return self._lazy("target_row_bad", None, self._target_sources)

    def _lazy(self, key: str, values: Optional[List[Tensor]], sources: Optional[List[Tensor]]) -> Optional[Tensor]:
        if key not in self._cache:
            if values is not None:
                self._cache[key] = ~torch.isfinite(torch.stack(values)).all() if values else None
            else:
                self._cache[key] = _row_mask(sources or [], self.batch_size)
        return self._cache[key]


def _row_mask(sources: List[Tensor], size: Optional[int]) -> Optional[Tensor]:
    """Per-row bad mask over dim 0 (device-side, no sync); whole-tensor checks mark every row."""
    rows = None
    for t in sources:
        d = t.detach()
        acc = _F32 if d.dtype in (_F16, _BF16) else None
        if d.dim() > 0 and d.shape[0] == size:
            per_row = d.sum(dim=tuple(range(1, d.dim())), dtype=acc) if d.dim() > 1 else d
            bad = ~torch.isfinite(per_row)
        else:
            bad = ~torch.isfinite(d.sum(dtype=acc))
            bad = bad.expand(size) if size is not None else bad.reshape(1)
        rows = bad if rows is None else rows | bad
    return rows


def _value(d: Tensor) -> Tensor:
    """The 0-dim real sum of a floating or complex tensor: non-finite when any value (part) is."""
    if d.dtype.is_complex:  # (dtype attributes, not methods: no call a tensor on the healthy path)
        return torch.view_as_real(d.resolve_conj()).sum(dtype=_F32 if d.dtype is torch.complex32 else None)
    return d.sum(dtype=_F32) if d.dtype is _F16 else d.sum()


class _Scanner:
    """One walk over a batch: one sum per floating tensor, one ``nan_to_num`` copy of it."""

    __slots__ = ("size", "fill", "values", "sources")

    def __init__(self, size: Optional[int], replace: _Replace, clean: bool = True) -> None:
        self.size = size
        self.fill = (_ZERO_FILL if clean else None) if replace is None else tuple(float(v) for v in replace)
        self.values: List[Tensor] = []
        self.sources: List[Tensor] = []

    def tensor(self, t: Tensor) -> Tensor:
        if self.size is None and t.ndim > 0:
            self.size = t.shape[0]
        if not t.dtype.is_floating_point and not t.dtype.is_complex:
            return t
        d = t.detach() if t.requires_grad else t
        self.values.append(_value(d))
        self.sources.append(t)
        fill = self.fill
        if fill is None:
            return t
        return torch.nan_to_num(t, fill[0], fill[1], fill[2])


def scan_batch(
    batch: Any,
    path: str = "batch",
    replace: _Replace = None,
    *,
    target_keys: Optional[Collection[str]] = None,
    target_replace: _Replace = None,
    batch_size: Optional[int] = None,
    clean: bool = True,
) -> BatchScan:
    """Find the rows of a nested batch that hold NaN/Inf, on the device, with no host sync.

    Healthy path: walk the batch (tensors inside tuples, lists, named tuples, dicts and dataclasses)
    and, for every floating tensor, take two device ops and no host sync: a 0-dim ``sum`` (NaN/Inf
    propagate into it) and a ``nan_to_num`` copy with every non-finite value zero-filled (or
    replaced under ``sanitize.*: replace``). The sums ride along in the step's single host read
    (:class:`~safetrain.detect.flags.StepFlags`); the forward runs on the cleaned batch, so
    BatchNorm statistics are not poisoned while the flags are in flight. Op count is what matters
    on small models, so the per-row mask (:attr:`BatchScan.row_bad`) and the bool flag are
    computed only when asked for.

    Slow path (:mod:`safetrain.detect.rows`), only when the read shows a bad row (host syncs
    allowed): :func:`~safetrain.detect.rows.describe_rows` names each tensor by path with its bad
    rows and NaN/Inf counts, :func:`~safetrain.detect.rows.drop_rows` rebuilds the batch without
    those rows (inputs and targets together), :func:`~safetrain.detect.rows.batch_error` builds the
    ``BatchError`` for ``sanitize.*: raise``.

    Rules (documented for users):

    * The batch dimension is dim 0. The batch size ``B`` is ``batch_size`` when given, else the
      leading size of the first tensor (any dtype, at least 1-D) met depth-first (dicts in insertion
      order). Floating tensors whose leading size is not ``B`` (and 0-dim ones) are checked as a
      whole: a non-finite value there marks every row bad (it cannot be dropped row by row).
    * Complex tensors are scanned like floating ones, real and imaginary parts both (the sum is
      taken over ``view_as_real``, so the value joining the read is real).
    * Integer and bool tensors are never scanned or changed;
      :func:`~safetrain.detect.rows.drop_rows` still drops their rows so targets stay aligned.
      Non-tensor leaves are left alone, except that a ``list`` of ``B`` non-tensor items (ids, file
      names) is filtered by :func:`~safetrain.detect.rows.drop_rows` as per-sample data.
    * A whole dict batch can carry its targets: with ``target_keys`` (the guard passes
      :data:`TARGET_KEYS`: ``labels``, ``label``, ``targets``, ``target``, ``y``) the top-level keys
      (or dataclass fields) with those names are scanned as targets, everything else as inputs.
    * The check is a sum (fp16 summed in float32): NaN and Inf always show; a finite tensor whose
      sum overflows would be a false alarm, which :func:`~safetrain.detect.rows.describe_rows`
      (exact counts) clears on the slow path. Every non-finite VALUE is zero-filled (not the whole
      row): the optimistic forward only has to stay finite, and the slow path redoes the batch anyway.

    Args:
        batch: a tensor, or tuples / lists / named tuples / dicts / dataclasses of them.
        path: the name of the batch in messages (kept for symmetry with :func:`describe_rows`).
        replace: ``None`` to zero-fill non-finite values; ``(nan, posinf, neginf)`` to replace
            them with these (``sanitize.nan/posinf/neginf`` under ``replace``), on the device.
        target_keys: top-level keys / fields of a dict or dataclass batch to scan as targets
            (see :data:`TARGET_KEYS`); ``None``: the whole batch is one role.
        target_replace: ``replace`` for the target part.
        batch_size: force ``B`` (e.g. the inputs' batch size when scanning the targets).
        clean: zero-fill non-finite values (one ``nan_to_num`` copy per floating tensor) so the
            optimistic forward cannot poison state it updates (BatchNorm running statistics).
            A model without buffers has no such state: the guard may pass
            ``clean=any(True for _ in model.buffers())`` and save the copy. Ignored under ``replace``.

    Returns:
        A :class:`BatchScan`; read its flags with the step's single host read.

    Example::

        >>> x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0]])
        >>> scan = scan_batch({"pixels": x, "label": torch.tensor([0, 1])})
        >>> scan.row_bad.tolist(), scan.batch["pixels"][1].tolist()
        ([False, True], [0.0, 0.0])
        >>> len(scan.values)   # one 0-dim sum per floating tensor, for StepFlags.put("input", ...)
        1
    """
    del path  # the hot path builds no strings; paths are for describe_rows
    if type(batch) is Tensor and replace is None:  # the common case, without the walk or a helper call
        dtype = batch.dtype
        if batch_size is None and batch.ndim > 0:
            batch_size = batch.shape[0]
        if not dtype.is_floating_point and not dtype.is_complex:
            return BatchScan(batch, [], [], batch_size)
        d = batch.detach() if batch.requires_grad else batch
        value = _value(d) if dtype is _F16 or dtype.is_complex else d.sum()  # (what _value takes)
        return BatchScan(torch.nan_to_num(batch, 0.0, 0.0, 0.0) if clean else batch, [value], [batch], batch_size)
    items = top_items(batch) if target_keys else None
    if not items or not any(k in target_keys for k, _ in items):
        scanner = _Scanner(batch_size, replace, clean)
        new = map_tensors(batch, scanner.tensor)
        return BatchScan(new, scanner.values, scanner.sources, scanner.size)
    inputs = _Scanner(batch_size, replace, clean)
    targets = _Scanner(batch_size, target_replace, clean)
    changes = {}
    size = batch_size
    for key, value in items:  # one shared B: the first tensor of either role fixes it
        scanner = targets if key in target_keys else inputs
        scanner.size = size
        new_value = map_tensors(value, scanner.tensor)
        size = scanner.size
        if new_value is not value:
            changes[key] = new_value
    if changes:
        batch = (
            rebuild_dataclass(batch, changes)
            if is_dataclass_instance(batch)
            else rebuild_map(batch, {k: changes.get(k, v) for k, v in items})
        )
    return BatchScan(batch, inputs.values, inputs.sources, size, targets.values, targets.sources)
