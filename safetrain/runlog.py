"""The run directory's reader: ``events.jsonl`` and ``metrics.csv`` read back without trusting them.

:func:`read_run` reads what :mod:`safetrain.rundir`'s writers left: a line cut by a crash, a
full disk or a kill is skipped (and only that line), a resumed run's second start is counted,
and ``metrics.csv`` rows are keyed by step. Nothing here imports torch; ``report`` and ``plot``
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
    """

    run_dir: Path
    events: List[Dict[str, Any]] = field(default_factory=list)
    summary: Optional[Dict[str, Any]] = None
    cut_at: Optional[int] = None
    bad_lines: List[int] = field(default_factory=list)
    metrics: Optional[Dict[str, List[Any]]] = None
    runs: int = 0


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
        run.runs += record["event"] == "run_started"
        run.events.append(record)
    run.metrics = _read_metrics(root / METRICS_FILE)
    return run


def _read_metrics(path: Path) -> Optional[Dict[str, List[Any]]]:
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
        for row in reader:
            if len(row) != len(header):
                continue  # a header repeated by a resume, or a row cut by a crash
            try:
                values = [value if name == "action" else float(value) for name, value in zip(header, row)]
            except ValueError:
                continue
            rows[values[key] if key is not None else len(rows)] = (
                values  # keyed by step: a resumed run's rows replace the ones it re-runs
            )
    for values in (rows[k] for k in sorted(rows)):
        for name, value in zip(header, values):
            columns[name].append(value)
    return columns
