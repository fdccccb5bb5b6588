"""Read a run directory back: the journal, the per-step metrics, a summary table and a plot.

A run directory (``log.dir``) holds ``events.jsonl`` (one JSON object per event, then a closing
``{"event": "summary", ...}`` line) and ``metrics.csv`` (one row per step). :func:`read_run` reads
both without trusting them: a crash can cut the last line of the journal, and a resumed run
appends a second run to the same files. :func:`format_report` renders what happened as text;
:func:`plot_run` draws loss, gradient norm and LR scale with a marker per recovery action
(matplotlib, the ``plot`` extra). Nothing here imports torch.

Example::

    >>> run = read_run("runs/demo")                     # doctest: +SKIP
    >>> print(format_report(run))                       # doctest: +SKIP
    >>> plot_run(run)                                   # doctest: +SKIP
    PosixPath('runs/demo/report.png')
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .errors import SafetrainError

__all__ = [
    "ReportError",
    "PlotUnavailable",
    "RunLog",
    "EventRow",
    "read_run",
    "event_table",
    "reconcile",
    "format_report",
    "plot_run",
]

#: The summary counters shown in the report, in order.
_COUNTERS = ("steps", "optimizer_steps", "healthy_steps", "skipped_batches", "dropped_rows", "replaced_rows",
             "zeroed_grads", "restores", "scaler_skips", "lr_scale", "final_loss", "wall_time", "aborted", "events")
#: Records that are bookkeeping, not something that happened to training.
_ROUTINE = frozenset({"run_started", "run_ended", "snapshot"})


class ReportError(SafetrainError):
    """A run directory cannot be reported on: missing, or without a journal."""


class PlotUnavailable(ReportError):
    """matplotlib is not installed; the text report still works."""


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


@dataclass(frozen=True)
class EventRow:
    """One line of the event table: how often (event, kind, action) happened and when first."""

    event: str
    kind: str
    action: str
    count: int
    first_step: int
    first_epoch: int
    first_batch: int


def read_run(run_dir: Union[str, os.PathLike]) -> RunLog:
    """Read ``events.jsonl`` and ``metrics.csv`` of a run directory.

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
    path = root / "events.jsonl"
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
    run.metrics = _read_metrics(root / "metrics.csv")
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
            rows[values[key] if key is not None else len(rows)] = values  # keyed by step: a resumed run's rows replace the ones it re-runs
    for values in (rows[k] for k in sorted(rows)):
        for name, value in zip(header, values):
            columns[name].append(value)
    return columns


def event_table(run: RunLog) -> List[EventRow]:
    """Group the journal by (event, kind, action): count and first occurrence, in order of first occurrence."""
    rows: Dict[Tuple[str, str, str], List[Any]] = {}
    for e in run.events:
        key = (str(e.get("event", "")), str(e.get("kind", "")), str(e.get("action", "")))
        if key in rows:
            rows[key][0] += 1
        else:
            rows[key] = [1, int(e.get("step", -1)), int(e.get("epoch", -1)), int(e.get("batch", -1))]
    return [EventRow(*key, *value) for key, value in rows.items()]


def reconcile(run: RunLog) -> Dict[str, Tuple[Any, Any]]:
    """Compare the summary's counters with what the journal and metrics show; ``{name: (summary, journal)}``.

    Only a single, closed run is compared (a resume replays steps, and a crash has no summary);
    otherwise the result is empty. Checked: ``events`` (journal lines), ``restores`` (restores
    that were not data skips), ``dropped_rows`` and ``replaced_rows`` (rows named by the input and
    target events), ``scaler_skips``, and with ``metrics.csv``: ``steps`` (rows) and
    ``skipped_batches`` (rows not trained).
    """
    s = run.summary
    if s is None or run.runs != 1:
        return {}
    ev = run.events

    def rows(action: str) -> int:
        return sum(int((e.get("detail") or {}).get("count", 0)) for e in ev
                   if e["event"] == "anomaly" and e.get("action") == action and e.get("kind") in ("input", "target"))

    found: Dict[str, Any] = {
        "events": len(ev),
        "restores": sum(1 for e in ev if e["event"] == "restored" and e.get("action") != "skip_batch"),
        "dropped_rows": rows("drop_rows"),
        "replaced_rows": rows("replace"),
        "scaler_skips": sum(1 for e in ev if e["event"] == "anomaly" and e.get("kind") == "scaler"
                            and e.get("action") == "skip_batch"),
    }
    if run.metrics is not None and "trained" in run.metrics:
        found["steps"] = len(run.metrics["trained"])
        found["skipped_batches"] = sum(1 for t in run.metrics["trained"] if not t)
    return {k: (s.get(k), v) for k, v in found.items() if k in s}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return value
    return str(value)


def format_report(run: RunLog) -> str:
    """The text report: journal health, the event table, the summary counters and their cross-check.

    Example::

        >>> print(format_report(read_run("runs/demo")))  # doctest: +SKIP
    """
    out = [f"run {run.run_dir}"]
    if run.runs > 1:
        out.append(f"  {run.runs} runs in this journal (resumed); the summary is the last one's")
    if run.cut_at is not None:
        out.append(f"  journal was cut at line {run.cut_at} (the run crashed while writing it); "
                   "everything before it is reported")
    if run.bad_lines:
        out.append(f"  unreadable journal lines skipped: {', '.join(map(str, run.bad_lines[:10]))}"
                   + (" ..." if len(run.bad_lines) > 10 else ""))
    table = event_table(run)
    shown = [r for r in table if r.event not in _ROUTINE]
    routine = [r for r in table if r.event in _ROUTINE]
    out.append("")
    if shown:
        head = ("event", "kind", "action", "count", "first step", "epoch", "batch")
        cells = [head] + [(r.event, r.kind, r.action or "-", str(r.count), str(r.first_step), str(r.first_epoch),
                           str(r.first_batch)) for r in shown]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        for i, c in enumerate(cells):
            out.append("  " + "  ".join(x.rjust(w) if j >= 3 else x.ljust(w) for j, (x, w) in enumerate(zip(c, widths))))
            if i == 0:
                out.append("  " + "  ".join("-" * w for w in widths))
    else:
        out.append("  no anomalies, restores or LR changes: every step was healthy")
    if routine:
        out.append("  (also: " + ", ".join(f"{r.count} {r.event}" + (f" {r.action}" if r.action else "")
                                           for r in routine) + ")")
    out.append("")
    if run.summary is None:
        out.append("summary: none; the run did not close (it crashed, was killed, or is still running)")
        return "\n".join(out)
    s = run.summary
    status = "aborted by the recovery policy" if s.get("aborted") else "finished"
    out.append(f"summary: {status}")
    pairs = [(k, _fmt(s[k])) for k in _COUNTERS if k in s]
    half = (len(pairs) + 1) // 2
    for left, right in zip(pairs[:half], pairs[half:] + [("", "")] * (2 * half - len(pairs))):
        out.append(f"  {left[0]:<16} {left[1]:>10}    {right[0]:<16} {right[1]:>10}".rstrip())
    checks = reconcile(run)
    if checks:
        wrong = {k: v for k, v in checks.items() if v[0] != v[1]}
        if wrong:
            out.append("journal and summary disagree: " + ", ".join(f"{k} {a} in the summary, {b} in the journal"
                                                                  for k, (a, b) in wrong.items()))
        else:
            out.append(f"journal and summary agree ({', '.join(checks)})")
    return "\n".join(out)


def plot_run(run: RunLog, path: Union[None, str, os.PathLike] = None) -> Path:
    """Draw loss and gradient norm over steps with a marker per recovery action, and the LR scale below.

    Args:
        run: what :func:`read_run` returned.
        path: the PNG to write (default ``<run_dir>/report.png``).

    Returns:
        The path written.

    Raises:
        PlotUnavailable: matplotlib is not installed (``pip install safetrain[plot]``).
        ReportError: the run has no ``metrics.csv`` rows to plot.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed, so no report.png; "
                              "install it with: pip install 'safetrain[plot]'") from None
    if not run.metrics or not run.metrics.get("step"):
        raise ReportError(f"{run.run_dir / 'metrics.csv'}: no per-step metrics to plot")
    from ._plot import draw

    out = Path(path) if path is not None else run.run_dir / "report.png"
    draw(run, out)
    return out
