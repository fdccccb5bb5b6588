"""The run directory (``log.dir``): its one writer and its one reader, and atomic file writes.

A run directory holds ``events.jsonl`` (one JSON object per event, then a closing
``{"event": "summary", ...}`` line; rank r of a distributed run writes ``events-rank{r}.jsonl``),
``metrics.csv`` (one row per step), and beside them ``quarantine.json`` and ``snapshots/``.
:class:`Journal` appends and flushes one line per event (a crash loses at most the line being
written); :class:`MetricsWriter` buffers rows and flushes on eventful steps; :func:`read_run`
reads both back without trusting them. :func:`atomic_write_text` and :class:`AtomicFile` (also
used by snapshots) leave a file whole or absent: the cost is an fsync of the file and of its
directory per write. Nothing here imports torch; ``report`` and ``plot`` read what ``read_run`` returns.
"""

from __future__ import annotations

import csv
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from .errors import SafetrainError
from .events import jsonable

__all__ = [
    "JOURNAL_FILE",
    "METRICS_FILE",
    "journal_path",
    "fsync_dir",
    "AtomicFile",
    "atomic_write_bytes",
    "atomic_write_text",
    "Journal",
    "MetricsWriter",
    "ReportError",
    "RunLog",
    "read_run",
]

JOURNAL_FILE = "events.jsonl"
METRICS_FILE = "metrics.csv"

PathLike = Union[str, "os.PathLike[str]"]


def journal_path(run_dir: PathLike, rank: int = 0) -> Path:
    """The journal of ``rank`` in ``run_dir``: ``events.jsonl`` for rank 0, ``events-rank{r}.jsonl`` for the others."""
    return Path(run_dir) / (JOURNAL_FILE if rank == 0 else f"events-rank{rank}.jsonl")


# -- atomic writes ---------------------------------------------------------------------------------


def fsync_dir(directory: PathLike) -> None:
    """Flush a directory's entries to disk, so that a rename or unlink in it survives a power cut.

    A no-op on Windows, where a directory cannot be opened to be fsynced.
    """
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file that is whole or absent: write :attr:`tmp`, then :meth:`commit` renames it over :attr:`path`.

    The temporary file is in the same directory (a rename across filesystems is not atomic).
    Leaving the ``with`` block without ``commit`` (an exception, or a write given up) removes
    it, and ``path`` keeps its old content or stays absent. The caller writes and fsyncs ``tmp``;
    ``commit`` renames and fsyncs the directory.

    Args:
        path: the final file.
        tmp: the temporary file to use; default ``<dir>/<prefix><name>.<pid>.<random>``.
        prefix: the temporary file's name prefix (a reader of the directory can skip or clean
            up names starting with it).

    Example::

        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "state.bin")
        >>> with AtomicFile(path) as target:
        ...     with open(target.tmp, "xb") as f:
        ...         _ = f.write(b"whole"); f.flush(); os.fsync(f.fileno())
        ...     target.commit()
        >>> open(path, "rb").read()
        b'whole'
    """

    def __init__(self, path: PathLike, tmp: Optional[PathLike] = None, prefix: str = ".tmp-") -> None:
        self.path = os.fspath(path)
        directory, name = os.path.split(self.path)
        self.directory = directory or "."
        self.tmp = (
            os.fspath(tmp)
            if tmp is not None
            else os.path.join(self.directory, f"{prefix}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
        )
        self.committed = False

    def commit(self, replace: Optional[Callable[[str, str], None]] = None) -> None:
        """Rename the (written and fsynced) temporary file over ``path``, then fsync the directory.

        Args:
            replace: the rename, ``os.replace`` by default; a caller may pass its own that ends
                in an atomic rename of its first argument over its second.
        """
        (replace or os.replace)(self.tmp, self.path)
        self.committed = True
        fsync_dir(self.directory)

    def discard(self) -> None:
        """Remove the temporary file if it is there (idempotent)."""
        try:
            os.remove(self.tmp)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.discard()


def atomic_write_bytes(path: PathLike, data: bytes, prefix: str = ".tmp-") -> None:
    """Replace ``path`` with ``data`` atomically: temp file beside it, write, fsync, rename, fsync the directory.

    A crash or an error at any moment leaves either the old file (or none) or the new one whole,
    and no temporary file after an error. The directory must exist.

    Args:
        path: the file to write.
        data: its new content.
        prefix: the temporary file's name prefix.

    Raises:
        OSError: the file could not be written; ``path`` is unchanged.
    """
    with AtomicFile(path, prefix=prefix) as target:
        with open(target.tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        target.commit()


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8", prefix: str = ".tmp-") -> None:
    """Replace ``path`` with ``text`` atomically (see :func:`atomic_write_bytes`); for small JSON or text files.

    Example::

        >>> import json, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "quarantine.json")
        >>> atomic_write_text(path, json.dumps({"indices": [3, 7]}, indent=1))
        >>> json.loads(open(path).read())["indices"]
        [3, 7]
    """
    atomic_write_bytes(path, text.encode(encoding), prefix=prefix)


# -- writers ---------------------------------------------------------------------------------------


class Journal:
    """Append-only JSONL file: one line per event, flushed per line, and a closing summary line.

    Args:
        path: the ``events.jsonl`` file (see :func:`journal_path`); its directory is created.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record as a JSON line and flush it to the OS."""
        if self._file.closed:
            raise ValueError(f"{self.path}: journal is closed")
        self._file.write(json.dumps(jsonable(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self, summary: Optional[Mapping[str, Any]] = None) -> None:
        """Write the closing summary line (if given), fsync and close; idempotent."""
        if self._file.closed:
            return
        if summary is not None:
            self.write({"event": "summary", **summary})
        os.fsync(self._file.fileno())
        self._file.close()


class MetricsWriter:
    """Per-step ``metrics.csv`` (buffered; ``report`` and ``plot`` read it). Appends after a resume.

    Columns: step, epoch, batch, loss, grad_norm, lr_scale, trained, action.

    Args:
        path: the ``metrics.csv`` file; its directory is created, and the header written when it is new.
    """

    COLUMNS = ("step", "epoch", "batch", "loss", "grad_norm", "lr_scale", "trained", "action")

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if self._file.tell() == 0:
            self._file.write(",".join(self.COLUMNS) + "\n")

    def write(
        self,
        step: int,
        epoch: int,
        batch: int,
        loss: float,
        grad_norm: float,
        lr_scale: float,
        trained: bool,
        action: str,
        flush: bool = False,
    ) -> None:
        """Append one row; ``flush`` (an anomaly or a snapshot) hands every row so far to the OS,
        so that a killed run keeps them."""
        self._file.write(f"{step},{epoch},{batch},{loss:.6g},{grad_norm:.6g},{lr_scale:.6g},{int(trained)},{action}\n")
        if flush:
            self._file.flush()

    def close(self) -> None:
        """Flush and close; idempotent."""
        self._file.close()


# -- reader ----------------------------------------------------------------------------------------


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
