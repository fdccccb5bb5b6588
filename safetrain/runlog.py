"""The run directory's reader: ``events.jsonl`` and ``metrics.csv`` read back without trusting them.

:func:`read_run` reads what :mod:`safetrain.rundir`'s writers left: a line cut by a crash, a
full disk or a kill is skipped (and only that line), runs are told apart by the ``run_id`` of
their ``run_started`` (a resume continues its run's id), and ``metrics.csv`` rows are keyed by
(run, step). Nothing here imports torch; ``report`` and ``plot``
read what it returns (also re-exported by :mod:`safetrain.rundir`).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from .errors import SafetrainError

__all__ = ["JOURNAL_FILE", "METRICS_FILE", "ReportError", "RunLog", "read_run"]

JOURNAL_FILE = "events.jsonl"
METRICS_FILE = "metrics.csv"

PathLike = Union[str, "os.PathLike[str]"]


class ReportError(SafetrainError):
    """A run directory cannot be read or reported on: missing, without a journal, or nothing to plot."""


@dataclass
class RunLog:
    """What a run directory holds, read defensively.

    Attributes:
        run_dir: the directory.
        events: the journal's event records in order (the summary line excluded).
        summary: the last ``summary`` line (``FitResult.summary()``), or ``None`` if the run did not close.
        cut_at: 1-based line number of a truncated last line (the run crashed mid-write), else ``None``.
        bad_lines: 1-based numbers of unreadable lines before the last one (a crash, then a resume).
        metrics: ``metrics.csv`` as columns (floats; ``action`` as strings), or ``None`` when absent.
        runs: how many times ``fit`` started on this directory (more than 1 after a resume).
        run_ids: the distinct runs, in order (a ``run_started`` without a ``run_id``, from an older
            safetrain, is a new run unless it resumed).
        resumes: how many starts continued a run (``run_started`` action ``resume``).
    """

    run_dir: Path
    events: List[Dict[str, Any]] = field(default_factory=list)
    summary: Optional[Dict[str, Any]] = None
    cut_at: Optional[int] = None
    bad_lines: List[int] = field(default_factory=list)
    metrics: Optional[Dict[str, List[Any]]] = None
    runs: int = 0
    run_ids: List[str] = field(default_factory=list)
    resumes: int = 0


def read_run(run_dir: PathLike) -> RunLog:
    """Read ``events.jsonl`` and ``metrics.csv`` of a run directory.

    A crash can cut the last line of the journal, and a resumed run appends a second run to the
    same files; neither stops the reading.

    Args:
        run_dir: a run directory (``log.dir`` of a run).

    Returns:
        The :class:`RunLog`. A cut last line sets ``cut_at``; unreadable earlier lines are listed
        in ``bad_lines`` and skipped; a missing ``metrics.csv`` leaves ``metrics`` as ``None``.

    Raises:
        ReportError: the directory or its ``events.jsonl`` does not exist or cannot be read.

    Example::

        >>> run = read_run("runs/demo")  # doctest: +SKIP
        >>> run.summary["restores"], run.cut_at  # doctest: +SKIP
        (1, None)
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory (expected the log.dir of a run, with events.jsonl)")
    path = root / JOURNAL_FILE
    if not path.is_file():
        raise ReportError(f"{path}: no journal here; was the run started with log.dir={root}?")
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read the journal ({exc.strerror or exc})") from None
    run = RunLog(run_dir=root)
    starts: List[Any] = []  # (run id, start step) of each run_started, in order
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "event" not in record:
                raise ValueError("not an event record")
        except ValueError:
            if number == len(lines):
                run.cut_at = number
            else:
                run.bad_lines.append(number)
            continue
        if record["event"] == "summary":
            run.summary = {k: v for k, v in record.items() if k != "event"}
            continue
        if record["event"] == "run_started":
            starts.append(_note_start(run, record))
        run.events.append(record)
    run.metrics = _read_metrics(root / METRICS_FILE, starts)
    return run


def _note_start(run: RunLog, record: Dict[str, Any]) -> "tuple[str, int]":
    """Count a ``run_started``; ``(run id, step it started at)``."""
    run.runs += 1
    resumed = record.get("action") == "resume"
    run.resumes += resumed
    rid = (record.get("detail") or {}).get("run_id")
    if not isinstance(rid, str):  # an older journal: a resume continues the run before it
        rid = run.run_ids[-1] if resumed and run.run_ids else f"run-{len(run.run_ids) + 1}"
    if rid not in run.run_ids:
        run.run_ids.append(rid)
    step = record.get("step", 0)
    return rid, int(step) if isinstance(step, (int, float)) else 0


def _read_metrics(path: Path, starts: List[Any]) -> Optional[Dict[str, List[Any]]]:
    """``metrics.csv`` as columns, with a ``run`` column: rows keyed by (run, step).

    The file has no run column: a new process starts a new stretch of rows (the step goes back
    down), matched in order to the journal's starts (the one that started one step before its
    first row, else the next); a resume's rows replace its run's rows at the steps it re-ran.
    """
    if not path.is_file():
        return None
    columns: Dict[str, List[Any]] = {}
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            return None
        columns = {name: [] for name in header}
        key = header.index("step") if "step" in header else None
        rows: Dict[Any, List[Any]] = {}
        order: List[str] = []  # runs in order of their first row
        current, last, at = "", None, -1
        for row in reader:
            if len(row) != len(header):
                continue  # a header repeated by a resume, or a row cut by a crash
            try:
                values = [value if name == "action" else float(value) for name, value in zip(header, row)]
            except ValueError:
                continue
            step = values[key] if key is not None else len(rows)
            if last is None or step <= last:  # a new process: the next start in the journal
                current, at = _next_start(starts, at, step)
                if current not in order:
                    order.append(current)
            last = step
            rows[(current, step)] = values  # a resumed run's rows replace the ones it re-runs
    columns["run"] = []
    for run_key, step in sorted(rows, key=lambda k: (order.index(k[0]), k[1])):
        for name, value in zip(header, rows[(run_key, step)]):
            columns[name].append(value)
        columns["run"].append(run_key)
    return columns


def _next_start(starts: List[Any], at: int, first_step: float) -> "tuple[str, int]":
    """The start a stretch of rows beginning at ``first_step`` belongs to: after ``at``, the one
    that started at the step before (else the next; else the last)."""
    rest = range(at + 1, len(starts))
    for i in rest:
        if starts[i][1] == first_step - 1:
            return starts[i][0], i
    if rest:
        return starts[at + 1][0], at + 1
    return (starts[-1][0], at) if starts else ("", at)
