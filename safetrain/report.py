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
        for row in reader:
            if len(row) != len(header):
                continue  # a header repeated by a resume, or a row cut by a crash
            try:
                values = [value if name == "action" else float(value) for name, value in zip(header, row)]
            except ValueError:
                continue
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


# --------------------------------------------------------------------------------------- plot
_MARKERS = {  # action -> (marker, colour); the order is the legend's
    "drop_rows": ("v", "#1f77b4"),
    "replace": ("D", "#17becf"),
    "skip_batch": ("X", "#d62728"),
    "zero_grads": ("o", "#ff7f0e"),
    "warn": ("P", "#bcbd22"),
    "restore": ("^", "#2ca02c"),
    "scale_lr": ("s", "#9467bd"),
    "abort": ("*", "#000000"),
}


def _marks(run: RunLog) -> List[Tuple[int, str, str]]:
    """(step, action, kind) of every anomaly and recovery worth a marker."""
    marks = []
    for e in run.events:
        if e["event"] in ("anomaly", "restored", "lr_changed", "aborted", "quarantine") and e.get("action"):
            action = str(e["action"])
            if e["event"] == "restored" and action not in ("restore", "scale_lr", "abort"):
                continue  # a data skip after a restore: the restore itself is already marked
            marks.append((int(e.get("step", 0)), action, str(e.get("kind", ""))))
    return marks


def _positive(values: List[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 20


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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed, so no report.png; "
                              "install it with: pip install 'safetrain[plot]'") from None
    m = run.metrics
    if not m or not m.get("step"):
        raise ReportError(f"{run.run_dir / 'metrics.csv'}: no per-step metrics to plot")
    out = Path(path) if path is not None else run.run_dir / "report.png"
    steps, loss, gnorm, lr = m["step"], m["loss"], m["grad_norm"], m["lr_scale"]
    by_step = {int(s): i for i, s in enumerate(steps)}
    fig, (ax_loss, ax_grad, ax_lr) = plt.subplots(
        3, 1, sharex=True, figsize=(11, 7.5), dpi=110, gridspec_kw={"height_ratios": [3, 2, 1.1], "hspace": 0.08})
    trained = m.get("trained") or [1.0] * len(steps)
    _series(ax_loss, steps, loss, trained, "loss", "#4c72b0")
    _series(ax_grad, steps, gnorm, trained, "gradient norm", "#55a868")
    marks = _marks(run)
    for ax, values in ((ax_loss, loss), (ax_grad, gnorm)):
        _markers(ax, marks, values, by_step, annotate=ax is ax_loss and len(marks) <= 30)
    ax_lr.step(steps, lr, where="post", color="#8172b2", lw=1.6)
    ax_lr.set_ylabel("LR scale")
    finite_lr = [v for v in lr if math.isfinite(v)] or [1.0]
    ax_lr.set_ylim(0, max(1.05, max(finite_lr) * 1.1))
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_grad, ax_lr):
        ax.grid(True, which="major", alpha=0.25)
        for step, action, _ in marks:
            if action in ("restore", "scale_lr", "abort"):
                ax.axvline(step, color=_MARKERS[action][1], lw=0.8, ls="--", alpha=0.5, zorder=0)
    _epochs(ax_loss, m)
    seen = [a for a in _MARKERS if any(a == mark[1] for mark in marks)]
    seen += sorted({a for _, a, _ in marks if a not in _MARKERS})
    handles = [Line2D([], [], ls="", marker=_MARKERS.get(a, ("o", "gray"))[0], color=_MARKERS.get(a, ("o", "gray"))[1],
                      markersize=8, label=a) for a in seen]
    if handles:
        ax_loss.legend(handles=handles, title="action", loc="upper right", fontsize=8, title_fontsize=8, framealpha=0.9)
    s = run.summary or {}
    title = f"{run.run_dir.name}: {len(steps)} steps"
    if s:
        title += (f", {s.get('healthy_steps', '?')} healthy, {s.get('skipped_batches', '?')} skipped, "
                  f"{s.get('dropped_rows', '?')} rows dropped, {s.get('restores', '?')} restores"
                  + (" - ABORTED" if s.get("aborted") else ""))
    elif run.cut_at is not None or not s:
        title += " (run did not close)"
    ax_loss.set_title(title, fontsize=10, loc="left")
    fig.align_ylabels()
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def _series(ax: Any, steps: List[float], values: List[float], trained: List[float], label: str, colour: str) -> None:
    """The raw per-step values, thin, and an EMA over trained steps only (skipped steps don't drag it)."""
    finite = [v if math.isfinite(v) else math.nan for v in values]
    ax.plot(steps, finite, color=colour, lw=0.7, alpha=0.45)
    ema, xs, smooth = math.nan, [], []
    for x, v, t in zip(steps, finite, trained):
        if t and not math.isnan(v):
            ema = v if math.isnan(ema) else 0.9 * ema + 0.1 * v
            xs.append(x)
            smooth.append(ema)
    ax.plot(xs, smooth, color=colour, lw=1.6)
    if _positive(values):
        ax.set_yscale("log")
    ax.set_ylabel(label + (" (log)" if ax.get_yscale() == "log" else ""))


def _markers(ax: Any, marks: List[Tuple[int, str, str]], values: List[float], by_step: Dict[int, int],
             annotate: bool) -> None:
    """One marker per action at the step's value; non-finite values go on the top edge, labelled NaN/Inf.

    Several actions at (nearly) the same step are stacked upwards so that none hides another.
    """
    from matplotlib.transforms import offset_copy

    top = ax.get_xaxis_transform()  # x in data, y in axes fraction
    span = max((s for s, _, _ in marks), default=1) - min((s for s, _, _ in marks), default=0) or 1
    any_top, last_step, stacked = False, None, 0
    for step, action, kind in sorted(marks, key=lambda m: m[0]):
        near = last_step is not None and step - last_step <= span / 150
        stacked = stacked + 1 if near else 0
        last_step = step if not near else last_step
        marker, colour = _MARKERS.get(action, ("o", "gray"))
        i = by_step.get(step)
        y = values[i] if i is not None else math.nan
        base, xy = (ax.transData, (step, y)) if math.isfinite(y) else (top, (step, 0.93))
        any_top |= not math.isfinite(y)
        where = offset_copy(base, fig=ax.figure, x=0, y=-11 * stacked, units="points")
        ax.scatter([xy[0]], [xy[1]], transform=where, marker=marker, color=colour, s=60, edgecolors="black",
                   linewidths=0.5, zorder=5, clip_on=False)
        if annotate:
            ax.annotate(kind, xy, xycoords=where, xytext=(6, 2), textcoords="offset points", fontsize=7,
                        color=colour, bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.75))
    if any_top:
        ax.text(0.005, 0.93, "NaN/Inf", transform=ax.transAxes, fontsize=7, va="center", color="#444444")


def _epochs(ax: Any, m: Dict[str, List[Any]]) -> None:
    epochs, steps = m.get("epoch"), m["step"]
    if not epochs:
        return
    starts = [(steps[i], int(e)) for i, e in enumerate(epochs) if i > 0 and e != epochs[i - 1]]
    if len(starts) > 30:
        return
    for step, epoch in starts:
        ax.axvline(step, color="gray", lw=0.6, alpha=0.35, zorder=0)
        ax.text(step, 0.02, f" epoch {epoch}", transform=ax.get_xaxis_transform(), fontsize=7, color="gray")
