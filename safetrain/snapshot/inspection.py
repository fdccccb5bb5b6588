"""``safetrain inspect PATH``: what a snapshot file holds and whether it is sound; for a directory,
each snapshot's step and whether it verifies, newest first."""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List, Optional, Union

from ..errors import SnapshotError
from ..rundir.records import one_line
from .accepted import check_patterns, describe
from .codec import decode
from .disk import list_snapshots, snapshot_step
from .fileformat import read_header, read_tensors
from .optim import is_state_tensor
from .state import validate_meta
from .store import CorruptSnapshotError
from .tensors import nonfinite

__all__ = [
    "inspect_snapshot",
    "format_inspection",
    "inspect_directory",
    "format_directory",
    "created_time",
    "checked_description",
]


def inspect_snapshot(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a snapshot file fully and describe it; never modifies anything, never runs code.

    Args:
        path: a ``snapshot-*.safetensors`` file.

    Returns:
        A JSON-ready dict: ``path``, ``step``, ``epoch``, ``batch``, ``counters``, ``created``
        (ISO time), ``size_bytes``, ``data_bytes``, ``n_tensors``, ``n_model_tensors``,
        ``checksum_ok`` and ``bad_checksums`` (tensor names), ``all_finite`` and ``nonfinite``
        (model and optimizer tensors holding NaN/Inf), ``optimizer``, ``scheduler``, ``scaler``
        (``{"enabled": ..., "scale": ...}`` or ``None``), ``rng`` (bool) and ``extra`` (the
        caller's JSON state) and ``extra_tensors`` (names).

    Raises:
        SnapshotError: the file is missing, empty, truncated, not safetensors or not a
            safetrain snapshot (the message names the file and what is wrong).

    Example::

        >>> path = "runs/a/snapshots/snapshot-0000000100.safetensors"
        >>> print(format_inspection(inspect_snapshot(path)))  # doctest: +SKIP
    """
    path = os.fspath(path)
    header = read_header(path)
    tensors, bad = read_tensors(header, verify=False)
    try:
        return _describe(path, header, tensors, bad)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, OSError) as exc:
        raise CorruptSnapshotError(f"{path}: malformed snapshot metadata ({type(exc).__name__}: {exc})") from None


def _describe(path: str, header: Any, tensors: Dict[str, Any], bad: List[str]) -> Dict[str, Any]:
    meta = header.state()
    validate_meta(meta, path)
    checked = [(n, t) for n, t in tensors.items() if n.startswith("model/") or is_state_tensor(n)]
    accepted = check_patterns(meta["model"].get("accepted", {}), path)  # masks: non-finite by design
    bad_values = nonfinite(checked, accepted)
    counters = meta.get("counters", {})
    scaler = meta.get("scaler")
    scaler_state = decode(scaler["state"], tensors, path) if scaler else None
    created = meta.get("created")
    info = {
        "path": path,
        "step": counters.get("step"),
        "epoch": counters.get("epoch"),
        "batch": counters.get("batch"),
        "counters": counters,
        "created": created_time(created, path),
        "size_bytes": header.size,
        "data_bytes": sum(e.end - e.begin for e in header.entries),
        "n_tensors": len(header.entries),
        "n_model_tensors": sum(1 for e in header.entries if e.name.startswith("model/")),
        "checksum_ok": not bad,
        "bad_checksums": bad,
        "all_finite": not bad_values,
        "nonfinite": bad_values,
        "accepted_nonfinite": describe(accepted),
        "optimizer": (meta.get("optimizer") or {}).get("type"),
        "scheduler": (meta.get("scheduler") or {}).get("type"),
        "scaler": None
        if scaler is None
        else {"enabled": scaler["enabled"], "scale": (scaler_state or {}).get("scale")},
        "rng": meta.get("rng") is not None,
        "extra": decode(meta.get("extra", {}), {}, path),
        "extra_tensors": list(meta.get("extra_tensors", [])),
    }
    return checked_description(info, path)


def checked_description(info: Dict[str, Any], where: str) -> Dict[str, Any]:
    """``info`` (an inspection's dict) if every part read from the file has the type printed:
    counters and extra state maps, extra tensors a list of names.

    Raises:
        CorruptSnapshotError: naming ``where`` and the part (a crafted file can hold anything).
    """
    for key, kind in (("counters", dict), ("extra", dict), ("extra_tensors", list), ("scaler", (dict, type(None)))):
        if not isinstance(info[key], kind):
            raise CorruptSnapshotError(f"{where}: malformed snapshot metadata: {key} is {type(info[key]).__name__}")
    return info


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_inspection(info: Dict[str, Any]) -> str:
    """Render :func:`inspect_snapshot`'s dict as the lines ``safetrain inspect`` prints.

    Every value taken from the file (names, types, counters, the run id) is escaped
    (:func:`safetrain.rundir.records.one_line`): a snapshot cannot print terminal control sequences.
    """
    ok = lambda flag: "ok" if flag else "FAILED"  # noqa: E731
    lines = [
        f"snapshot   {_p(info['path'])}",
        f"step       {_p(info['step'])}  (epoch {_p(info['epoch'])}, batch {_p(info['batch'])})",
        f"created    {_p(info['created'])}",
        f"size       {_size(info['size_bytes'])}  "
        f"({info['n_tensors']} tensors, {info['n_model_tensors']} in the model)",
        f"checksum   {ok(info['checksum_ok'])}"
        + ("" if info["checksum_ok"] else f"  ({_list(info['bad_checksums'][:5])})")
        if info["checksum_ok"] is not None
        else "checksum   - (sharded, written without checksums by an older safetrain; sizes and offsets checked)",
        f"finite     {ok(info['all_finite'])}"
        + ("" if info["all_finite"] else f"  ({_list(info['nonfinite'][:5])})")
        + (
            f"  (non-finite by design, as at the start: {_p(info['accepted_nonfinite'])})"
            if info.get("accepted_nonfinite")
            else ""
        ),
        f"optimizer  {_p(info['optimizer'] or '-')}",
        f"scheduler  {_p(info['scheduler'] or '-')}",
        f"scaler     {_p('-' if info['scaler'] is None else info['scaler'])}",
    ]
    if info.get("world") is not None:
        lines.insert(1, f"sharded    {_p(info['world'])} rank(s), run {_p(info.get('run_id'))}")
    if info["extra"]:
        lines.append(f"extra      {_list(sorted(map(str, info['extra'])))}")
    if info["extra_tensors"]:
        lines.append(f"tensors    {_list(info['extra_tensors'])}")
    others = {k: v for k, v in info["counters"].items() if k not in ("step", "epoch", "batch")}
    if others:
        lines.append(f"counters   {_p(others)}")
    return "\n".join(lines)


def _p(value: Any) -> str:
    """A value read from a file, as printed: one escaped line."""
    return one_line(str(value))


def _list(values: Any) -> str:
    return ", ".join(_p(v) for v in values)


def created_time(created: Any, where: str) -> Optional[str]:
    """A snapshot's ``created`` time (seconds since the epoch) as an ISO date; ``None`` when not recorded.

    Raises:
        CorruptSnapshotError: it is not a number, or not a date (``1e300``: past any calendar).
    """
    if created is None or created == 0:
        return None
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise CorruptSnapshotError(f"{where}: malformed snapshot metadata: created {created!r:.40} is not a time")
    try:
        return datetime.datetime.fromtimestamp(created).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        raise CorruptSnapshotError(
            f"{where}: malformed snapshot metadata: created {created!r:.40} is not a date (seconds since 1970 expected)"
        ) from None


def inspect_directory(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """Read every snapshot of a directory fully and say whether each verifies, newest first.

    Args:
        path: a snapshot directory (``snapshot.dir``, or ``<log.dir>/snapshots``).

    Returns:
        One JSON-ready dict per ``snapshot-*.safetensors`` file: ``path``, ``step`` (from the
        file when it reads, else from its name), ``ok`` (checksums and finiteness), ``problem``
        (why not, or ``None``) and ``info`` (:func:`inspect_snapshot`'s dict, or ``None`` when
        the file cannot be read as a snapshot).

    Raises:
        SnapshotError: the directory holds no snapshot files.
    """
    path = os.fspath(path)
    rows = []
    for file in reversed(list_snapshots(path)):
        try:
            info = inspect_snapshot(file)
        except SnapshotError as exc:
            why = str(exc)
            why = why[len(file) + 2 :] if why.startswith(f"{file}: ") else why
            rows.append({"path": file, "step": snapshot_step(file), "ok": False, "problem": why, "info": None})
            continue
        problems = (
            [f"tensor data fails its checksum ({', '.join(info['bad_checksums'][:3])})"]
            if not info["checksum_ok"]
            else []
        )
        if not info["all_finite"]:
            problems.append(f"non-finite ({', '.join(info['nonfinite'][:3])})")
        rows.append(
            {
                "path": file,
                "step": info["step"],
                "ok": not problems,
                "problem": "; ".join(problems) or None,
                "info": info,
            }
        )
    if not rows:
        raise SnapshotError(f"{path}: no snapshot files (snapshot-*.safetensors) in this directory")
    return rows


def format_directory(path: str, rows: List[Dict[str, Any]]) -> str:
    """Render :func:`inspect_directory`'s rows as the lines ``safetrain inspect DIR`` prints."""
    lines = [f"snapshots  {_p(path)}  ({len(rows)}, newest first)", f"{'step':>10}  {'file':<34} verifies"]
    for row in rows:
        verdict = "ok" if row["ok"] else f"FAILED  {_p(row['problem'])}"
        lines.append(f"{_p(row['step']):>10}  {_p(os.path.basename(row['path'])):<34} {verdict}")
    return "\n".join(lines)
