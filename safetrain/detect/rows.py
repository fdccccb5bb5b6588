"""The batch scan's slow path: name the bad rows of a batch, drop them, or raise.

Called only after the step's single read showed a non-finite input or target (host syncs are
allowed here, and each is marked ``# host sync:``). See the docstring of :func:`scan_batch`
(:mod:`safetrain.detect.batch_scan`) for the batch-size and target-key rules these functions share with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Collection, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..errors import BatchError
from .findings import RowFinding
from .walk import batch_size_of, is_dataclass_instance, iter_tensors, rebuild_dataclass, rebuild_map, rebuild_seq

__all__ = ["describe_rows", "drop_rows", "batch_error", "rows_to_drop"]


def describe_rows(
    batch: Any,
    path: str = "batch",
    kind: str = "input",
    *,
    target_keys: Optional[Collection[str]] = None,
    batch_size: Optional[int] = None,
) -> List[RowFinding]:
    """Name every floating tensor of a batch that holds NaN/Inf, with its bad rows and counts.

    Slow path only (host syncs): call it on the ORIGINAL batch after the step's read showed a
    bad row. Counts are exact, so a row flagged only because its sum overflowed is not listed.

    Args:
        batch: the original (unsanitized) nested batch.
        path: the name of the root in paths, e.g. ``"batch"`` gives ``batch["pixels"]``.
        kind: ``"input"`` or ``"target"`` for every finding.
        target_keys: as :func:`scan_batch`; top-level keys listed there are reported as ``target``.
        batch_size: as :func:`scan_batch`.

    Returns:
        One :class:`RowFinding` per poisoned tensor, in batch order (empty when all is finite).
    """
    size = batch_size_of(batch, batch_size)
    targets = set(target_keys or ())
    out: List[RowFinding] = []
    for p, t in iter_tensors(batch, path):
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        d = t.detach()
        nan, inf = torch.isnan(d), torch.isinf(d)
        if d.dim() > 0 and d.shape[0] == size:
            per_row = torch.stack([nan.reshape(size, -1).sum(1), inf.reshape(size, -1).sum(1)], 1)
        else:  # checked as a whole: every row is bad
            whole = torch.stack([nan.sum(), inf.sum()])
            per_row = whole.expand(size if size is not None else 1, 2)
        counts = per_row.tolist()  # host sync: slow path only
        bad = [(i, n, f) for i, (n, f) in enumerate(counts) if n or f]
        if not bad:
            continue
        key_kind = kind
        if targets and any(p.startswith(f'{path}["{k}"]') or p.startswith(f"{path}.{k}") for k in targets):
            key_kind = "target"
        whole_nan, whole_inf = (int(x) for x in torch.stack([nan.sum(), inf.sum()]).tolist())  # host sync: slow path
        out.append(
            RowFinding(
                kind=key_kind,
                path=p,
                rows=tuple(i for i, _, _ in bad),
                nan_count=whole_nan,
                inf_count=whole_inf,
                shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
                row_counts=tuple((i, int(n), int(f)) for i, n, f in bad),
            )
        )
    return out


def drop_rows(batch: Any, rows: Sequence[int], *, batch_size: Optional[int] = None) -> Any:
    """Rebuild a nested batch without the given rows, keeping every tensor's rows aligned.

    Slow path only. Every tensor whose leading size is ``B`` (floating or not, so integer
    targets follow their inputs) loses those rows; other tensors are kept whole; a ``list`` of
    ``B`` non-tensor items is filtered too. Call it on the inputs and the targets with the same
    ``rows`` (or once on a whole dict batch).

    Args:
        batch: the original nested batch.
        rows: indices along dim 0 to drop (duplicates and order do not matter).
        batch_size: as :func:`scan_batch`.

    Returns:
        A new batch of the same structure with ``B - len(set(rows))`` rows.

    Raises:
        BatchError: a row index is outside ``[0, B)``.
    """
    size = batch_size_of(batch, batch_size)
    if size is None:
        return batch
    drop = set(int(r) for r in rows)
    bad = [r for r in drop if not 0 <= r < size]
    if bad:
        raise BatchError(f"drop_rows: rows {sorted(bad)} are outside the batch of {size} rows")
    keep = [i for i in range(size) if i not in drop]
    index_by_device: dict = {}

    def take(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != size:
            return t
        idx = index_by_device.get(t.device)
        if idx is None:
            idx = index_by_device[t.device] = torch.tensor(keep, dtype=torch.long, device=t.device)
        return t.index_select(0, idx)

    def walk(obj: Any) -> Any:
        if (
            isinstance(obj, list)
            and len(obj) == size
            and obj
            and not any(isinstance(o, (Tensor, list, tuple, Mapping)) or is_dataclass_instance(o) for o in obj)
        ):
            return [obj[i] for i in keep]
        if isinstance(obj, Tensor):
            return take(obj)
        if isinstance(obj, (list, tuple)):
            new = [walk(o) for o in obj]
            return obj if all(n is o for n, o in zip(new, obj)) else rebuild_seq(obj, new)
        if is_dataclass_instance(obj):
            changes = {f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            changes = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
            return rebuild_dataclass(obj, changes) if changes else obj
        if isinstance(obj, Mapping):
            new_items = {k: walk(v) for k, v in obj.items()}
            return obj if all(new_items[k] is v for k, v in obj.items()) else rebuild_map(obj, new_items)
        return obj

    return walk(batch)


def batch_error(findings: Sequence[RowFinding]) -> BatchError:
    """The :class:`~safetrain.errors.BatchError` for ``sanitize.*: raise``, naming every tensor.

    Args:
        findings: from :func:`describe_rows`.

    Returns:
        A ``BatchError`` whose message names each tensor path, its bad rows and NaN/Inf counts,
        e.g. ``non-finite values in the batch: batch["pixels"]: rows [3] hold 2 NaN and 0 Inf ...``.
    """
    if not findings:
        return BatchError("non-finite values in the batch, but no tensor holds NaN/Inf on a second look")
    lines = "; ".join(f.describe() for f in findings)
    hint = "set sanitize.inputs / sanitize.targets to skip_batch, drop_rows or replace to train through them"
    return BatchError(f"non-finite values in the batch: {lines}. ({hint})")


def rows_to_drop(findings: Sequence[RowFinding]) -> List[int]:
    """The sorted union of the rows named by :func:`describe_rows` findings (for :func:`drop_rows`).

    Args:
        findings: row findings of one batch (inputs and targets together).

    Returns:
        Sorted row indices.
    """
    return sorted({r for f in findings for r in f.rows})
