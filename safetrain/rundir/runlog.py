"""The run directory's reader: ``events.jsonl`` and ``metrics.csv`` read back without trusting them.

:func:`read_run` reads what :mod:`safetrain.rundir`'s writers left, or what another tool, an
older version or a hand edit made of it: each record is checked once, here
(:mod:`safetrain.rundir.records`), and one that cannot be used is skipped and named with its line and
reason; a last line cut by a full disk or a kill is noted as such. Runs are told apart by the
``run_id`` of their ``run_started`` (a resume continues its run's id), and ``metrics.csv`` rows
are keyed by (run, step). Nothing here imports torch; ``report`` and ``plot`` read what it
returns (also re-exported by :mod:`safetrain.rundir`) and trust it.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..errors import SafetrainError
from .records import METRICS_COLUMNS, Unsound, sound_event, sound_metrics_row, sound_summary
from .safefile import UnsafeFileError, read_own

__all__ = ["JOURNAL_FILE", "METRICS_FILE", "OWN_SUBDIR", "ReportError", "RunLog", "Skipped", "read_run"]

JOURNAL_FILE = "events.jsonl"
METRICS_FILE = "metrics.csv"
#: A framework callback's run directory inside the framework logger's directory (never sharing its files).
OWN_SUBDIR = "safetrain"

PathLike = Union[str, "os.PathLike[str]"]


class ReportError(SafetrainError):
    """A run directory cannot be read or reported on: missing, without a journal, or nothing to plot."""


@dataclass(frozen=True)
class Skipped:
    """A line the reader could not use: its 1-based number in the file and why (``step is not an integer ...``)."""

    line: int
    reason: str


@dataclass
class RunLog:
    """What a run directory holds, read defensively: sound records only, and what was skipped.

    Attributes:
        run_dir: the directory.
        events: the journal's event records in order (the summary line excluded), each checked by
            :func:`safetrain.rundir.records.sound_event`: every known field present and of its type.
        summary: the last sound ``summary`` line (``FitResult.summary()``), or ``None`` if the run
            did not close.
        cut_at: 1-based line number of a last line cut mid-write (no newline after it, and not
            whole JSON: the run ended on a full disk or a kill), else ``None``.
        skipped: the other journal lines that could not be used (not UTF-8, not JSON, a field of
            the wrong type or range), with the reason; a line cut by a crash and then ended by the
            next run's start is one of them.
        metrics: ``metrics.csv`` as columns (:data:`~safetrain.rundir.records.METRICS_COLUMNS`, floats;
            ``action`` as strings) plus ``run``, or ``None`` when absent or unusable.
        metrics_skipped: ``metrics.csv`` lines that could not be used, with the reason.
        metrics_note: why ``metrics.csv`` was not used at all (unreadable, a header without the
            columns), else ``None``.
        runs: how many times ``fit`` started on this directory (more than 1 after a resume).
        run_ids: the distinct runs, in order (a ``run_started`` without a ``run_id``, from an older
            safetrain, is a new run unless it resumed).
        resumes: how many starts continued a run (``run_started`` action ``resume``).
    """

    run_dir: Path
    events: List[Dict[str, Any]] = field(default_factory=list)
    summary: Optional[Dict[str, Any]] = None
    cut_at: Optional[int] = None
    skipped: List[Skipped] = field(default_factory=list)
    metrics: Optional[Dict[str, List[Any]]] = None
    metrics_skipped: List[Skipped] = field(default_factory=list)
    metrics_note: Optional[str] = None
    runs: int = 0
    run_ids: List[str] = field(default_factory=list)
    resumes: int = 0

    @property
    def bad_lines(self) -> List[int]:
        """The numbers of the skipped journal lines (the cut last line excluded)."""
        return [s.line for s in self.skipped]


def read_run(run_dir: PathLike) -> RunLog:
    """Read ``events.jsonl`` and ``metrics.csv`` of a run directory, keeping the sound records.

    A crash can cut the last line of the journal, a resumed run appends a second run to the same
    files, and a journal concatenated, edited or written by another tool can hold anything; none
    of it stops the reading. Each line is checked once (:mod:`safetrain.rundir.records`); what cannot be
    used is skipped and listed with its reason.

    Args:
        run_dir: a run directory (``log.dir`` of a run), or a framework logger's directory whose
            :data:`OWN_SUBDIR` holds the run (the Lightning callback's default).

    Returns:
        The :class:`RunLog`. A cut last line sets ``cut_at``; other unusable lines are in
        ``skipped`` (``metrics_skipped`` for ``metrics.csv``); a missing ``metrics.csv`` leaves
        ``metrics`` as ``None``.

    Raises:
        ReportError: the directory or its ``events.jsonl`` does not exist or cannot be read.

    Example::

        >>> run = read_run("runs/demo")  # doctest: +SKIP
        >>> run.summary["restores"], run.cut_at, run.skipped  # doctest: +SKIP
        (1, None, [])
    """
    root = Path(run_dir)
    if not root.is_dir():
        raise ReportError(f"{root}: no such run directory (expected the log.dir of a run, with events.jsonl)")
    if not (root / JOURNAL_FILE).is_file() and (root / OWN_SUBDIR / JOURNAL_FILE).is_file():
        root = root / OWN_SUBDIR  # a framework logger's directory: the callback's run is beside the logger's files
    path = root / JOURNAL_FILE
    if not path.is_file():
        raise ReportError(f"{path}: no journal here; was the run started with log.dir={root}?")
    try:
        lines = read_own(path).split(b"\n")  # not splitlines(): JSON strings may hold U+2028 and friends
    except UnsafeFileError as exc:  # a link out of the run directory, a FIFO
        raise ReportError(str(exc)) from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot read the journal ({exc.strerror or exc})") from None
    run = RunLog(run_dir=root)
    starts: List[Any] = []  # (run id, start step) of each run_started, in order
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            value = _json(raw)
        except Unsound as exc:
            if number == len(lines):  # no newline after it: the writer was stopped mid-line
                run.cut_at = number
            else:
                run.skipped.append(Skipped(number, str(exc)))
            continue
        try:
            if isinstance(value, dict) and value.get("event") == "summary":
                run.summary = sound_summary(value)
                continue
            record = sound_event(value)
        except Unsound as exc:
            run.skipped.append(Skipped(number, str(exc)))
            continue
        if record["event"] == "run_started":
            starts.append(_note_start(run, record))
        run.events.append(record)
    _read_metrics(run, root / METRICS_FILE, starts)
    return run


def _json(raw: bytes) -> Any:
    """One journal line's JSON value; :class:`Unsound` if it is not UTF-8 or not JSON."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise Unsound(f"not UTF-8 (byte {exc.start + 1})") from None
    except json.JSONDecodeError as exc:
        raise Unsound(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise Unsound("not JSON this reader can hold (nested too deeply)") from None
    except ValueError as exc:  # a number too long to convert
        raise Unsound(f"not JSON this reader can hold ({' '.join(str(exc).split())[:80]})") from None


def _note_start(run: RunLog, record: Dict[str, Any]) -> "tuple[str, int]":
    """Count a (sound) ``run_started``; ``(run id, step it started at)``."""
    run.runs += 1
    resumed = record["action"] == "resume"
    run.resumes += resumed
    rid = record["detail"].get("run_id")
    if rid is None:  # an older journal: a resume continues the run before it
        rid = run.run_ids[-1] if resumed and run.run_ids else f"run-{len(run.run_ids) + 1}"
    if rid not in run.run_ids:
        run.run_ids.append(rid)
    return rid, record["step"]


def _read_metrics(run: RunLog, path: Path, starts: List[Any]) -> None:
    """Set ``run.metrics`` to ``metrics.csv`` as columns, with a ``run`` column: rows keyed by (run, step).

    The file has no run column: a new process starts a new stretch of rows (the step goes back
    down), matched in order to the journal's starts (the one that started one step before its
    first row, else the next); a resume's rows replace its run's rows at the steps it re-ran.
    """
    if not path.is_file():
        return
    try:
        lines = read_own(path).split(b"\n")
    except OSError as exc:  # an UnsafeFileError too: a link out of the run directory, a FIFO
        run.metrics_note = f"cannot read it ({exc.strerror or exc})"
        return
    try:
        header = _cells(lines[0]) if lines[0].strip() else []
    except Unsound as exc:
        header = []
        run.metrics_note = f"its header is {exc}"
    missing = [name for name in METRICS_COLUMNS if name not in header]
    if not header or missing:
        if header:
            run.metrics_note = f"its header lacks {', '.join(missing)} (expected {','.join(METRICS_COLUMNS)})"
        return
    rows: Dict[Any, List[Any]] = {}
    order: List[str] = []  # runs in order of their first row
    current, last, at = "", None, -1
    for number, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        try:
            cells = _cells(raw)
            if cells == header:  # a header repeated by a resume
                continue
            values = sound_metrics_row(header, cells)
        except Unsound as exc:
            run.metrics_skipped.append(Skipped(number, str(exc)))
            continue
        step = values[0]
        if last is None or step <= last:  # a new process: the next start in the journal
            current, at = _next_start(starts, at, step)
            if current not in order:
                order.append(current)
        last = step
        rows[(current, step)] = values  # a resumed run's rows replace the ones it re-runs
    columns: Dict[str, List[Any]] = {name: [] for name in (*METRICS_COLUMNS, "run")}
    for run_key, step in sorted(rows, key=lambda k: (order.index(k[0]), k[1])):
        for name, value in zip(METRICS_COLUMNS, rows[(run_key, step)]):
            columns[name].append(value)
        columns["run"].append(run_key)
    run.metrics = columns


def _cells(raw: bytes) -> List[str]:
    """One ``metrics.csv`` line's cells; :class:`Unsound` if it is not UTF-8 or not one CSV row."""
    try:
        return next(csv.reader([raw.decode("utf-8").rstrip("\r")]), [])
    except UnicodeDecodeError as exc:
        raise Unsound(f"not UTF-8 (byte {exc.start + 1})") from None
    except csv.Error as exc:  # a field over csv's size limit, a stray carriage return
        raise Unsound(f"not a CSV row ({exc})") from None


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
