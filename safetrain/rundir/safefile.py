"""Every file safetrain writes goes through here, so that no write follows a link planted at its path.

A run directory or snapshot directory may be shared (a team's scratch space, a cluster's
project folder): someone else may have put a symbolic link, a FIFO or a directory where
safetrain is about to write a file. Three ways to write, and nothing in safetrain writes otherwise:

* a whole file replaced atomically (:mod:`safetrain.rundir.atomicfile`: ``AtomicFile``,
  ``atomic_write_bytes``, ``atomic_write_text``, ``atomic_save``): a temporary file is created new beside the
  path (``O_CREAT | O_EXCL | O_NOFOLLOW``; a library that insists on a file name writes into a
  private ``0700`` temporary directory instead), written, fsynced and renamed over the path. A
  rename replaces a link or a FIFO there; it never writes through it. A directory there is an error.
* a file appended to (:func:`open_append`: the journal, ``metrics.csv``): opened with
  ``O_NOFOLLOW | O_APPEND``; a link, a FIFO, a device or a directory at the path is refused
  with an :class:`UnsafeFileError` that names it, without blocking.
* a file created new (:func:`create_new`: a snapshot's temporary file): ``O_CREAT | O_EXCL |
  O_NOFOLLOW``, so nothing planted there is ever opened.

Directories safetrain writes into are checked to be real directories (:func:`real_dir`), so
that a link planted in place of a snapshot's ``step-*`` directory is refused rather than
written through. Modes: created files get ``0o664`` (``0o600`` for a lock file, :func:`open_private`)
before the umask, so they follow the umask and are never writable by others (a snapshot, a
journal, a mark); directories get ``0o775`` before the umask.

Reading back follows no link out of the directory either: the journal, ``metrics.csv`` and the
quarantine list are read with :func:`read_own` (``O_NOFOLLOW | O_NONBLOCK``, a regular file or
a sentence), and the snapshot listings leave links out, each named once (:func:`skip_links`).

:data:`WRITERS` names every place in safetrain that writes a file through these helpers; the
planted-link test suite (``tests/unit/rundir/test_safefile_links.py``) has one case per name, and an
AST scan fails on a call site of these helpers not listed there (or a write that bypasses them).
Nothing here imports torch.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from typing import IO, Iterable, List, Optional, Union

from ..errors import SafetrainError

__all__ = [
    "UnsafeFileError",
    "FILE_MODE",
    "DIR_MODE",
    "WRITERS",
    "open_append",
    "open_private",
    "read_own",
    "skip_links",
    "create_new",
    "real_dir",
    "remove_tree",
    "file_kind",
]

PathLike = Union[str, "os.PathLike[str]"]

logger = logging.getLogger(__name__)

#: Mode of created files before the umask: read-write for the user and group, never for others.
FILE_MODE = 0o664
#: Mode of created directories before the umask.
DIR_MODE = 0o775

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

#: Every writer of a file in safetrain (module:function -> what it writes). The planted-link
#: suite has a case per entry, and its AST scan checks this table against the call sites.
WRITERS = {
    "safetrain.rundir.dirlock:DirLock.take": "the lock file of a run or snapshot directory",
    "safetrain.rundir:prepare_run_dir": "the write probe of log.dir",
    "safetrain.rundir:_open_appending": "events.jsonl, events-rank{r}.jsonl (Journal) and metrics.csv (MetricsWriter)",
    "safetrain.diagnose.quarantine:write_quarantine": "quarantine.json",
    "safetrain.cli.plot:plot_run": "report.png (safetrain report, the demo)",
    "safetrain.cli.demo:run_demo": "report.txt of the demo",
    "safetrain.snapshot.fileformat:FileWriter.__init__": "a snapshot file (new, renamed over snapshot-*)",
    "safetrain.distributed.snapdir:write_json": "a sharded snapshot's rank-{r}.json and its mark safetrain.json",
    "safetrain.distributed.checkpoint:save_sharded": "a sharded snapshot's step-* directory",
    "safetrain.distributed.export:export_model": "the model file of safetrain export",
    "safetrain.hooks:TensorBoardHook.__init__": "the folder of TensorBoard's event files (log.tensorboard)",
}


class UnsafeFileError(SafetrainError, OSError):
    """A path safetrain was about to write (or read in a run directory) is not a plain file of the
    user's: a symbolic link, a FIFO, a device, a directory, or a file with other hard links.

    It is an ``OSError`` too (``strerror`` holds the sentence), so each caller's ``except OSError``
    turns it into its own error (``RunDirError``, ``SnapshotError``, ``ReportError``) naming the file.
    """

    def __init__(self, path: PathLike, what: str, fix: str = "", does: str = "write through it") -> None:
        sentence = f"{os.fspath(path)}: {what}; safetrain does not {does}" + (f": {fix}" if fix else "")
        super().__init__(errno.EPERM, sentence, os.fspath(path))
        self.args = (sentence,)

    def __str__(self) -> str:
        return self.strerror


def file_kind(mode: int) -> str:
    """A file's type in words: ``a symbolic link``, ``a FIFO``, ``a directory``... (``a regular file``)."""
    for test, kind in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return "not a plain file"


def _kind_at(path: PathLike) -> str:
    """What is at ``path``, without following a link: ``a symbolic link``, ``a FIFO``..."""
    try:
        return file_kind(os.lstat(path).st_mode)
    except OSError:
        return "not a plain file"


def _refusal(path: PathLike) -> UnsafeFileError:
    """The error for a path that is not a regular file, read without following it."""
    kind = _kind_at(path)
    return UnsafeFileError(
        path, f"is {kind}, where safetrain writes a file of its own", "remove it, or choose another directory"
    )


def create_new(path: PathLike, mode: int = FILE_MODE) -> int:
    """Create ``path`` as a new file and open it for writing: a descriptor (``O_EXCL | O_NOFOLLOW``).

    Raises:
        UnsafeFileError: something (a file, a link, a FIFO) is at ``path`` already; nothing was opened.
    """
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    except FileExistsError:
        kind = _kind_at(path)
        raise UnsafeFileError(path, f"is {kind} already, where safetrain creates a new file", "remove it") from None


def open_append(path: PathLike, encoding: str = "utf-8") -> IO[str]:
    """Open ``path`` to append text, creating it if needed; a regular file of its own or nothing.

    Opened with ``O_NOFOLLOW | O_NONBLOCK``: a symbolic link at ``path`` fails the open, a FIFO
    does not block it, and anything but a regular file with one link is refused. The file is
    write-only as Python sees it (the same buffered writer as ``open(path, "a")``: no cost per
    line), and its descriptor is readable (``os.pread``), so a caller can look at what is there.

    Raises:
        UnsafeFileError: ``path`` is a link, a FIFO, a device, a directory or a hard-linked file.
        OSError: it cannot be opened (permissions, a full disk).
    """
    fd = _open_checked(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, FILE_MODE, "appends to")
    return os.fdopen(fd, "a", encoding=encoding)


def open_private(path: PathLike, encoding: str = "utf-8") -> IO[str]:
    """Open (or create, mode ``0o600``) ``path`` to read and write, as :func:`open_append` checks
    it, and also owned by this user: for a lock file in a folder of the user's own.

    Raises:
        UnsafeFileError: ``path`` is a link, not a regular file, hard-linked or another user's.
        OSError: it cannot be opened.
    """
    fd = _open_checked(path, os.O_RDWR | os.O_CREAT, 0o600, "keeps", owned=True)
    return os.fdopen(fd, "r+", encoding=encoding)


def _open_checked(path: PathLike, flags: int, mode: int, does: str, owned: bool = False) -> int:
    """Open ``path`` with ``flags | O_NOFOLLOW | O_NONBLOCK``: a descriptor of a regular file with
    one link (and, ``owned``, this user's), else :class:`UnsafeFileError` and nothing stays open."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            raise _refusal(path) from None
        raise
    try:
        st = os.fstat(fd)
        fix = "remove it, or choose another directory"
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(path, f"is {file_kind(st.st_mode)}, where safetrain {does} a file of its own", fix)
        if st.st_nlink > 1:
            raise UnsafeFileError(path, f"has {st.st_nlink} hard links (another name shares its content)", fix)
        if owned and hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise UnsafeFileError(path, f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})", fix)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_own(path: PathLike, limit: Optional[int] = None) -> bytes:
    """The content of a file safetrain wrote in a run or snapshot directory, read without following
    a link out of it (``O_NOFOLLOW``) and without blocking on a FIFO (``O_NONBLOCK``).

    Args:
        path: the file.
        limit: read at most this many bytes (default: all).

    Raises:
        UnsafeFileError: a link, a FIFO, a device or a directory is at ``path``.
        OSError: it cannot be read (missing, permissions).
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise _read_refusal(path, _kind_at(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _read_refusal(path, file_kind(st.st_mode))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit)
    finally:
        os.close(fd)


_WARNED: set = set()  # links already named by skip_links (once per path and process)


def skip_links(directory: PathLike, names: Iterable[str], what: str) -> List[str]:
    """``names`` in ``directory`` less the symbolic links, each named once in a warning: a listing
    of a run or snapshot directory never leads a reader out of it.

    Args:
        directory: where the names are.
        names: the entries found there (already filtered to the reader's pattern).
        what: what such an entry would be, for the warning (``"a snapshot"``).
    """
    kept = []
    for name in names:
        path = os.path.join(os.fspath(directory), name)
        if not os.path.islink(path):
            kept.append(name)
        elif path not in _WARNED:
            _WARNED.add(path)
            logger.warning(
                "%s: a symbolic link where %s would be; safetrain does not follow links out of the directory, "
                "so it is ignored (replace it with the file itself to use it)",
                path,
                what,
            )
    return kept


def _read_refusal(path: PathLike, kind: str) -> UnsafeFileError:
    return UnsafeFileError(
        path,
        f"is {kind}, where a run or snapshot directory holds a file safetrain wrote",
        "replace it with the file itself",
        does="follow links out of a run directory, nor read a FIFO or device there",
    )


def real_dir(path: PathLike) -> str:
    """Create the directory ``path`` (with its parents) if needed and check it is a real directory.

    Raises:
        UnsafeFileError: ``path`` is a symbolic link (to a directory or not) or another non-directory.
        OSError: it cannot be created.
    """
    path = os.fspath(path)
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except FileExistsError:  # a file, or a link to nothing: refused below
        pass
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(
            path,
            f"is {file_kind(mode)}, where safetrain makes a directory of its own",
            "remove it, or choose another directory",
        )
    return path


def remove_tree(path: PathLike) -> None:
    """Remove a directory tree safetrain wrote, or the link or file someone put in its place
    (the link only, never what it points to); errors are ignored."""
    path = os.fspath(path)
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.remove(path)
            return
    except OSError:
        return
    shutil.rmtree(path, ignore_errors=True)
