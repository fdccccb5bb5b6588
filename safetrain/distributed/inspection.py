"""``safetrain inspect`` of sharded (FSDP2) snapshots: a ``step-*`` directory, or a snapshot
directory of them, described as :func:`safetrain.snapshot.inspect_snapshot` describes a file.

Every rank's shards are read in one process (no process group), through DCP's
``HuggingFaceStorageReader``, into tensors allocated from :func:`.layout.shard_layout` (every
shard's size and offsets checked against the bytes present first), every file is checked
against the checksums in the completion mark (:mod:`.verify`; a snapshot written before they
were recorded says so), and the model and optimizer tensors are checked for NaN/Inf. Nothing is written.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Union

import torch

from ..errors import SnapshotError
from ..snapshot.accepted import check_patterns
from ..snapshot.codec import decode
from ..snapshot.inspection import checked_description, created_time
from ..snapshot.store import CorruptSnapshotError
from ..snapshot.tensors import nonfinite
from .layout import shard_layout
from .snapdir import MARK, rank_path, read_json, sharded_snapshots, step_of
from .verify import bad_files, mark_algorithm

__all__ = ["is_sharded", "inspect_sharded", "inspect_sharded_directory"]

INCOMPLETE = f"incomplete (no {MARK}): a save cut short, never loaded"


def is_sharded(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a sharded snapshot (``step-*`` directory) or a directory holding some."""
    path = os.fspath(path)
    if step_of(path) is not None and os.path.isdir(path):
        return True
    return bool(sharded_snapshots(path, complete=False))


def inspect_sharded(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a sharded snapshot fully (every rank's shards) and describe it.

    Args:
        path: a complete ``step-*`` snapshot directory.

    Returns:
        :func:`safetrain.snapshot.inspect_snapshot`'s dict (``checksum_ok``: every file matches
        the checksum in the completion mark; ``bad_checksums`` names the files that do not;
        ``None``: a snapshot written without checksums) with ``world`` (the number of ranks that
        wrote it) and ``run_id``.

    Raises:
        SnapshotError: incomplete (no completion mark), or its shards cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    snap = os.fspath(path)
    if not os.path.isfile(os.path.join(snap, MARK)):
        raise CorruptSnapshotError(f"{snap}: {INCOMPLETE}")
    mark, meta = read_json(os.path.join(snap, MARK)), read_json(rank_path(snap, 0))
    recorded = mark.get("files") if isinstance(mark, dict) else None
    # names checked: nothing outside snap is read; the mark's own algorithm (0.1.0 wrote blocksum64)
    bad = None if recorded is None else bad_files(snap, recorded, algorithm=mark_algorithm(snap, mark))
    try:
        full = {k: torch.zeros(size, dtype=dtype) for k, (size, dtype) in shard_layout(snap).items()}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(full, storage_reader=HuggingFaceStorageReader(snap), no_dist=True)
    except Exception as exc:  # DCP and safetensors raise their own types
        damaged = f" ({', '.join(bad)} fail(s) its checksum)" if bad else ""
        raise CorruptSnapshotError(f"{snap}: cannot read the shards{damaged}: {exc}") from None
    try:
        described = _describe(snap, mark, meta, full)
        return {**described, "checksum_ok": None if bad is None else not bad, "bad_checksums": bad or []}
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise CorruptSnapshotError(f"{snap}: malformed snapshot metadata ({type(exc).__name__}: {exc})") from None


def _describe(snap: str, mark: Dict[str, Any], meta: Dict[str, Any], full: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    counters = mark["counters"]
    checked = [(n, t) for n, t in full.items() if n.startswith(("model/", "optim/")) and t.is_floating_point()]
    bad = nonfinite(checked, check_patterns(meta.get("accepted", {}), snap))  # masks: non-finite by design
    scaler = meta.get("scaler")
    scaler_state = decode(scaler["state"], {}, snap) if scaler else None
    created = mark.get("created")
    files = [os.path.join(snap, f) for f in os.listdir(snap)]
    info = {
        "path": snap,
        "step": counters.get("step"),
        "epoch": counters.get("epoch"),
        "batch": counters.get("batch"),
        "counters": counters,
        "created": created_time(created, snap),
        "size_bytes": sum(os.path.getsize(f) for f in files if os.path.isfile(f)),
        "data_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "n_tensors": len(full),
        "n_model_tensors": sum(1 for n in full if n.startswith("model/")),
        "checksum_ok": None,
        "bad_checksums": [],
        "all_finite": not bad,
        "nonfinite": bad,
        "optimizer": meta.get("optimizer_type"),
        "scheduler": (meta.get("scheduler") or {}).get("type"),
        "scaler": None
        if scaler is None
        else {"enabled": scaler["enabled"], "scale": (scaler_state or {}).get("scale")},
        "rng": meta.get("rng") is not None,
        "extra": decode(meta.get("extra", {}), {}, snap),
        "extra_tensors": list(meta.get("extra_tensors", [])),
        "world": mark.get("world"),
        "run_id": mark.get("run_id"),
    }
    return checked_description(info, snap)


def inspect_sharded_directory(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """Every ``step-*`` snapshot of a directory, newest first, read fully: the rows of
    :func:`safetrain.snapshot.inspect_directory` (an incomplete one is a row that does not verify).

    Raises:
        SnapshotError: the directory holds no ``step-*`` snapshot directory.
    """
    path = os.fspath(path)
    rows = []
    for snap in reversed(sharded_snapshots(path, complete=False)):
        step = step_of(snap)
        try:
            info = inspect_sharded(snap)
        except SnapshotError as exc:
            why = str(exc)
            why = why[len(snap) + 2 :] if why.startswith(f"{snap}: ") else why
            rows.append({"path": snap, "step": step, "ok": False, "problem": why, "info": None})
            continue
        problems = (
            [f"fails its checksum ({', '.join(info['bad_checksums'][:3])})"] if info["checksum_ok"] is False else []
        )
        if not info["all_finite"]:
            problems.append(f"non-finite ({', '.join(info['nonfinite'][:3])})")
        problem = "; ".join(problems) or None
        rows.append({"path": snap, "step": info["step"], "ok": problem is None, "problem": problem, "info": info})
    if not rows:
        raise SnapshotError(f"{path}: no sharded snapshot (step-*/) in this directory")
    return rows
