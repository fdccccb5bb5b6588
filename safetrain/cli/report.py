"""The text report of a run directory: the event table, the summary counters and their cross-check.

:func:`format_report` renders what :func:`safetrain.rundir.read_run` read: the lines it had to
skip and why, what happened, how often and first when, the summary counters, and whether the
journal and the metrics agree with them. The reader hands over sound records only (every known
field present and of its type), so nothing here checks them again. Pure string work on plain
records; nothing here imports torch or matplotlib (the plot is :func:`safetrain.cli.plot.plot_run`).

Example::

    >>> from safetrain.rundir import read_run
    >>> print(format_report(read_run("runs/demo")))    # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from ..rundir.records import SUMMARY_COUNTERS
from ..rundir.runlog import RunLog, Skipped

__all__ = [
    "EventRow",
    "event_table",
    "reconcile",
    "format_report",
]

#: The summary fields shown in the report, in order.
_COUNTERS = (*SUMMARY_COUNTERS, "lr_scale", "final_loss", "wall_time", "aborted", "ended", "events")
#: Records that are bookkeeping, not something that happened to training.
_ROUTINE = frozenset({"run_started", "run_ended", "snapshot"})


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


def event_table(run: RunLog) -> List[EventRow]:
    """Group the journal by (event, kind, action): count and first occurrence, in order of first occurrence."""
    rows: Dict[Tuple[str, str, str], List[Any]] = {}
    for e in run.events:
        key = (e["event"], e["kind"], e["action"])
        if key in rows:
            rows[key][0] += 1
        else:
            rows[key] = [1, e["step"], e["epoch"], e["batch"]]
    return [EventRow(*key, *value) for key, value in rows.items()]


def reconcile(run: RunLog) -> Dict[str, Tuple[Any, Any]]:
    """Compare the summary's counters with what the journal and metrics show; ``{name: (summary, journal)}``.

    Only a single, closed run that did not fail is compared (a resume replays steps, a crash has
    no summary, and an exception can leave its step counted but not recorded);
    otherwise the result is empty. Checked: ``events`` (journal lines), ``restores`` (restores
    that were not data skips), ``dropped_rows`` and ``replaced_rows`` (rows named by the input and
    target events), ``scaler_skips``, and with ``metrics.csv``: ``steps`` (rows) and
    ``skipped_batches`` (rows not trained).
    """
    s = run.summary
    if s is None or run.runs != 1 or s.get("ended") == "failed":  # a failed step may be counted, not recorded
        return {}
    ev = run.events

    def rows(action: str) -> int:
        return sum(
            e["detail"]["count"]
            for e in ev
            if e["event"] == "anomaly" and e["action"] == action and e["kind"] in ("input", "target")
        )

    found: Dict[str, Any] = {
        "events": len(ev),
        "restores": sum(1 for e in ev if e["event"] == "restored" and e["action"] != "skip_batch"),
        "dropped_rows": rows("drop_rows"),
        "replaced_rows": rows("replace"),
        "scaler_skips": sum(
            1 for e in ev if e["event"] == "anomaly" and e["kind"] == "scaler" and e["action"] == "skip_batch"
        ),
    }
    if run.metrics is not None:
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


def _status(s: Dict[str, Any]) -> str:
    """How the run ended, from its summary (``ended``; older journals have only ``aborted``)."""
    ended = s.get("ended") or ("aborted" if s.get("aborted") else "done")
    if ended == "aborted":
        return "aborted by the recovery policy"
    if ended == "failed":
        return f"failed: {s.get('error') or 'an exception'}"
    if ended == "interrupted":
        return "interrupted (a signal or Ctrl-C); resume from its snapshot to go on"
    return "finished" if ended == "done" else str(ended)


def _run_lines(run: RunLog) -> List[str]:
    """One line per run: its id, its starts (and resumes) and how each start ended."""
    lines = []
    for rid in run.run_ids:
        starts, ends, current = [], [], None
        for e in run.events:
            if e["event"] == "run_started":
                current = e["detail"].get("run_id")
                if current == rid or (current is None and rid.startswith("run-")):
                    starts.append(f"{e['action'] or 'start'} at step {e['step']}")
            elif e["event"] == "run_ended" and (current == rid or (current is None and rid.startswith("run-"))):
                ends.append(f"{e['action'] or '?'} at step {e['step']}")
        steps = ""
        if run.metrics is not None:
            steps = f", {run.metrics['run'].count(rid)} metric rows"
        lines.append(f"  run {rid[:12]}: {', '.join(starts) or 'no start'}; ended {', '.join(ends) or '?'}{steps}")
    return lines


def _skipped(what: str, skipped: List[Skipped], shown: int = 3) -> str:
    """``3 journal lines skipped: line 41: step is not an integer ...; ...; and 1 more``."""
    n = len(skipped)
    first = "; ".join(f"line {s.line}: {s.reason}" for s in skipped[:shown])
    return f"  {n} {what}{'s' if n != 1 else ''} skipped: {first}" + (f"; and {n - shown} more" if n > shown else "")


def format_report(run: RunLog) -> str:
    """The text report: journal health, the event table, the summary counters and their cross-check.

    Example::

        >>> from safetrain.rundir import read_run
        >>> print(format_report(read_run("runs/demo")))  # doctest: +SKIP
    """
    out = [f"run {run.run_dir}"]
    if run.runs > 1:
        n = len(run.run_ids)
        out.append(
            f"  {n} run{'s' if n != 1 else ''} in this journal ({run.runs} starts, {run.resumes} resumed); "
            "the summary is the last one's"
        )
        out.extend(_run_lines(run))
    if run.cut_at is not None:
        out.append(
            f"  the last line was cut; the run ended on a full disk or a kill (line {run.cut_at}; "
            "everything before it is reported)"
        )
    if run.skipped:
        out.append(_skipped("journal line", run.skipped))
    if run.metrics_note is not None:
        out.append(f"  metrics.csv not used: {run.metrics_note}")
    if run.metrics_skipped:
        out.append(_skipped("metrics.csv line", run.metrics_skipped))
    table = event_table(run)
    shown = [r for r in table if r.event not in _ROUTINE]
    routine = [r for r in table if r.event in _ROUTINE]
    out.append("")
    if shown:
        head = ("event", "kind", "action", "count", "first step", "epoch", "batch")
        cells = [head] + [
            (r.event, r.kind, r.action or "-", str(r.count), str(r.first_step), str(r.first_epoch), str(r.first_batch))
            for r in shown
        ]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        for i, c in enumerate(cells):
            out.append(
                "  " + "  ".join(x.rjust(w) if j >= 3 else x.ljust(w) for j, (x, w) in enumerate(zip(c, widths)))
            )
            if i == 0:
                out.append("  " + "  ".join("-" * w for w in widths))
    else:
        out.append("  no anomalies, restores or LR changes: every step was healthy")
    if routine:
        out.append(
            "  (also: "
            + ", ".join(f"{r.count} {r.event}" + (f" {r.action}" if r.action else "") for r in routine)
            + ")"
        )
    out.append("")
    if run.summary is None:
        out.append("summary: none; the run did not close (it crashed, was killed, or is still running)")
        return "\n".join(out)
    s = run.summary
    status = _status(s)
    out.append(f"summary: {status}")
    pairs = [(k, _fmt(s[k])) for k in _COUNTERS if k in s]
    half = (len(pairs) + 1) // 2
    for left, right in zip(pairs[:half], pairs[half:] + [("", "")] * (2 * half - len(pairs))):
        out.append(f"  {left[0]:<16} {left[1]:>10}    {right[0]:<16} {right[1]:>10}".rstrip())
    checks = reconcile(run)
    if checks:
        wrong = {k: v for k, v in checks.items() if v[0] != v[1]}
        if wrong:
            out.append(
                "journal and summary disagree: "
                + ", ".join(f"{k} {a} in the summary, {b} in the journal" for k, (a, b) in wrong.items())
            )
        else:
            out.append(f"journal and summary agree ({', '.join(checks)})")
    return "\n".join(out)
