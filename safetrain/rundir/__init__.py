"""The run directory (``log.dir``): its one writer and its one reader, and atomic file writes.

A run directory holds ``events.jsonl`` (one JSON object per event, then a closing
``{"event": "summary", ...}`` line; rank r of a distributed run writes ``events-rank{r}.jsonl``),
``metrics.csv`` (one row per step), and beside them ``quarantine.json`` and ``snapshots/``.
:class:`Journal` appends and flushes one line per event (a crash loses at most the line being
written, and the next run ends a cut line before appending); :class:`MetricsWriter` buffers rows
and flushes on eventful steps, every ``snapshot.every`` rows and on close; :func:`read_run` (in
:mod:`safetrain.rundir.runlog`) reads both back without trusting them. :func:`atomic_write_text` and
:class:`AtomicFile` (from :mod:`safetrain.rundir.atomicfile`, re-exported here) leave a file whole or absent:
the cost is an fsync of the file and of its directory per write. No write follows a link planted in
the directory: the journal and ``metrics.csv`` are opened with ``O_NOFOLLOW`` and must be regular
files (:func:`safetrain.rundir.safefile.open_append`). :func:`prepare_run_dir` checks, when ``fit`` starts, that
the directory can be written, and :func:`lock_run_dir` makes the run its one writer (a second run
started on it is refused at once, naming the process that holds it). Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import IO, Any, Mapping, Optional, Union

from ..errors import SafetrainError
from ..events import jsonable
from .atomicfile import AtomicFile, atomic_write_bytes, atomic_write_text, fsync_dir
from .dirlock import DirLock
from .records import METRICS_COLUMNS
from .runlog import JOURNAL_FILE, METRICS_FILE, ReportError, RunLog, Skipped, read_run
from .safefile import UnsafeFileError, create_new, open_append

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
    "RunDirError",
    "RunDirBusy",
    "prepare_run_dir",
    "lock_run_dir",
    "RunLog",
    "Skipped",
    "read_run",
]


PathLike = Union[str, "os.PathLike[str]"]


def journal_path(run_dir: PathLike, rank: int = 0) -> Path:
    """The journal of ``rank`` in ``run_dir``: ``events.jsonl`` for rank 0, ``events-rank{r}.jsonl`` for the others."""
    return Path(run_dir) / (JOURNAL_FILE if rank == 0 else f"events-rank{rank}.jsonl")


# -- writers ---------------------------------------------------------------------------------------


class RunDirError(SafetrainError):
    """The run directory (``log.dir``) cannot be created or written: the message names it and why."""


def prepare_run_dir(path: PathLike) -> Path:
    """Create the run directory if needed and check that a file can be written in it.

    Called when ``fit`` starts, so that a ``log.dir`` that is a file, read-only or not permitted
    fails at once, naming the directory, rather than as an ``OSError`` from deep inside.

    Raises:
        RunDirError: the directory cannot be created, is not a directory, or is not writable.
    """
    root = Path(path)
    fix = "set log.dir to a writable directory (or null to keep the journal in memory)"
    if root.exists() and not root.is_dir():
        raise RunDirError(f"log.dir={root}: exists and is not a directory; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = create_new(probe)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as exc:
        raise RunDirError(f"log.dir={root}: cannot write the run directory ({exc.strerror or exc}); {fix}") from None
    return root


class RunDirBusy(RunDirError):
    """Another run (another process, or another run of this one) is writing the run directory."""


def lock_run_dir(path: PathLike) -> DirLock:
    """Take the run directory's lock, for the run about to write in it; :meth:`DirLock.release` it at the end.

    One run writes a run directory at a time (its journal, ``metrics.csv``, quarantine file and,
    by default, its snapshots). The lock is the snapshot directory's kind
    (:class:`safetrain.rundir.dirlock.DirLock`, per host); a lock whose holder was killed or crashed is
    taken over with a warning, so the same command resumes after a crash.

    Raises:
        RunDirBusy: another run holds the directory; the message names it and the holder (pid, host, start).
        RunDirError: the lock file cannot be made.
    """
    root = os.fspath(path)
    lock = DirLock(root, "run", _busy)
    try:
        lock.take()
    except OSError as exc:
        raise RunDirError(f"log.dir={root}: cannot take the run directory's lock ({exc.strerror or exc})") from None
    return lock


def _busy(directory: str, holder: str) -> RunDirBusy:
    return RunDirBusy(
        f"log.dir={directory}: another run is writing this run directory ({holder}); two runs cannot share "
        "one: let that run end (or stop it) and start this one again, or give this run its own log.dir"
    )


def _open_appending(path: Path) -> IO[str]:
    """Open a journal or ``metrics.csv`` to append (never through a link: :func:`open_append`),
    first ending a last line that a kill or a full disk cut, so that the next record starts a line of its own."""
    try:
        f = open_append(path)
    except UnsafeFileError as exc:
        raise RunDirError(str(exc)) from None
    except OSError as exc:
        raise RunDirError(f"{path}: cannot open ({exc.strerror or exc}); set log.dir to a writable directory") from None
    try:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")  # O_APPEND: at the end
    except BaseException:
        f.close()
        raise
    return f


def _disk_error(path: Path, exc: OSError) -> RunDirError:
    return RunDirError(f"{path}: cannot write ({exc.strerror or exc}); is the disk full or the directory gone?")


class Journal:
    """Append-only JSONL file: one line per event, flushed per line, and a closing summary line.

    Args:
        path: the ``events.jsonl`` file (see :func:`journal_path`); its directory is created.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = _open_appending(self.path)  # a cut last line (a kill, a full disk) would swallow this run's first

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record as a JSON line and flush it to the OS.

        Raises:
            RunDirError: the line could not be written (a full disk); the message names the file.
        """
        if self._file.closed:
            raise ValueError(f"{self.path}: journal is closed")
        try:
            self._file.write(json.dumps(jsonable(record), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as exc:
            raise _disk_error(self.path, exc) from exc

    def close(self, summary: Optional[Mapping[str, Any]] = None) -> None:
        """Write the closing summary line (if given), fsync and close; idempotent."""
        if self._file.closed:
            return
        try:
            if summary is not None:
                self.write({"event": "summary", **summary})
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise _disk_error(self.path, exc) from exc
        finally:
            _close_quietly(self._file)


def _close_quietly(f: Any) -> None:
    """Close a file whose buffered bytes may not fit on the disk any more (they are lost, the file is closed)."""
    try:
        f.close()
    except OSError:
        try:
            f.close()  # the second close frees the descriptor without flushing again
        except OSError:
            pass


class MetricsWriter:
    """Per-step ``metrics.csv`` (buffered; ``report`` and ``plot`` read it). Appends after a resume.

    Columns: step, epoch, batch, loss, grad_norm, lr_scale, trained, action, clipped_to (the
    norm after clipping on a clipped step, else ``nan``; a file an earlier version began keeps its
    header, and its rows go on without that column). Rows go to the OS on every eventful step (an
    anomaly or a snapshot), at least every ``flush_every`` rows, and on :meth:`close`.

    Args:
        path: the ``metrics.csv`` file; its directory is created, and the header written when it is new.
        flush_every: hand the rows to the OS after at most this many (``fit`` passes ``snapshot.every``).
    """

    COLUMNS = (*METRICS_COLUMNS, "clipped_to")

    def __init__(self, path: PathLike, flush_every: int = 100) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_every, self._unflushed = max(1, int(flush_every)), 0
        self._file = _open_appending(self.path)
        self._clip_column = True
        head = os.pread(self._file.fileno(), 4096, 0)
        if not head:
            self._file.write(",".join(self.COLUMNS) + "\n")
        else:  # appending after a resume: the rows follow the file's own header
            first = head.split(b"\n", 1)[0].decode("utf-8", errors="replace")
            self._clip_column = "clipped_to" in first.strip().split(",")

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
        clipped_to: float = math.nan,
    ) -> None:
        """Append one row; ``flush`` (an anomaly or a snapshot), or ``flush_every`` rows since the
        last flush, hands every row so far to the OS, so that a killed run keeps them.

        Raises:
            RunDirError: the rows could not be written (a full disk); the message names the file.
        """
        try:
            row = f"{step},{epoch},{batch},{loss:.6g},{grad_norm:.6g},{lr_scale:.6g},{int(trained)},{action}"
            self._file.write(f"{row},{clipped_to:.6g}\n" if self._clip_column else row + "\n")
            self._unflushed += 1
            if flush or self._unflushed >= self.flush_every:
                self._file.flush()
                self._unflushed = 0
        except OSError as exc:
            raise _disk_error(self.path, exc) from exc

    def close(self) -> None:
        """Flush and close; idempotent.

        Raises:
            RunDirError: the last rows could not be written (the file is closed all the same).
        """
        if self._file.closed:
            return
        try:
            self._file.flush()
        except OSError as exc:
            raise _disk_error(self.path, exc) from exc
        finally:
            _close_quietly(self._file)
