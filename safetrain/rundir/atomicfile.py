"""Files that are whole or absent: a temporary file beside the path, fsynced, renamed over it.

The temporary file is created new (:func:`safetrain.rundir.safefile.create_new`: ``O_CREAT | O_EXCL |
O_NOFOLLOW``), so nothing planted at its name is opened; the rename replaces whatever is at the
path (a symbolic link or a FIFO someone planted there is replaced, what it pointed to is never
written); a directory there is refused (:class:`~safetrain.rundir.safefile.UnsafeFileError`). The cost is
an fsync of the file and of its directory per write. Used by the run directory (quarantine list,
report, the demo's report.txt), the snapshots and ``safetrain export``. Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from typing import IO, Any, Callable, Optional

from .safefile import PathLike, UnsafeFileError, create_new

__all__ = ["fsync_dir", "AtomicFile", "atomic_write_bytes", "atomic_write_text", "atomic_save"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(directory: PathLike) -> None:
    """Flush a directory's entries to disk, so that a rename or unlink in it survives a power cut.

    A no-op on Windows, where a directory cannot be opened to be fsynced.
    """
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file that is whole or absent: write :attr:`tmp`, then :meth:`commit` renames it over :attr:`path`.

    The temporary file is in the same directory (a rename across filesystems is not atomic) and
    is created new (:meth:`open`: ``O_EXCL | O_NOFOLLOW``); the rename replaces whatever is at
    ``path`` (a planted link is replaced, never written through). Leaving the ``with`` block
    without ``commit`` (an exception, or a write given up) removes it, and ``path`` keeps its old
    content or stays absent. The caller writes and fsyncs ``tmp``; ``commit`` renames and fsyncs
    the directory.

    Args:
        path: the final file.
        tmp: the temporary file to use; default ``<dir>/<prefix><name>.<pid>.<random>``.
        prefix: the temporary file's name prefix (a reader of the directory can skip or clean
            up names starting with it).

    Example::

        >>> path = os.path.join(tempfile.mkdtemp(), "state.bin")
        >>> with AtomicFile(path) as target:
        ...     with target.open("wb") as f:
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

    def open(self, mode: str = "wb", encoding: Optional[str] = None) -> IO[Any]:
        """Create :attr:`tmp` new (:func:`create_new`) and open it with ``mode`` (``"wb"`` or ``"w"``)."""
        return os.fdopen(create_new(self.tmp), mode, encoding=encoding if "b" not in mode else None)

    def commit(self, replace: Optional[Callable[[str, str], None]] = None) -> None:
        """Rename the (written and fsynced) temporary file over ``path``, then fsync the directory.

        Args:
            replace: the rename, ``os.replace`` by default; a caller may pass its own that ends
                in an atomic rename of its first argument over its second.

        Raises:
            UnsafeFileError: a directory is at ``path``.
        """
        if os.path.isdir(self.path) and not os.path.islink(self.path):
            raise UnsafeFileError(
                self.path,
                "is a directory, where safetrain writes a file of its own",
                "remove it, or choose another name",
            )
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
    and no temporary file after an error. The directory must exist. A link at ``path`` is
    replaced by the file, never written through.

    Args:
        path: the file to write.
        data: its new content.
        prefix: the temporary file's name prefix.

    Raises:
        OSError: the file could not be written; ``path`` is unchanged.
    """
    with AtomicFile(path, prefix=prefix) as target:
        with target.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        target.commit()


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8", prefix: str = ".tmp-") -> None:
    """Replace ``path`` with ``text`` atomically (see :func:`atomic_write_bytes`); for small JSON or text files.

    Example::

        >>> import json
        >>> path = os.path.join(tempfile.mkdtemp(), "quarantine.json")
        >>> atomic_write_text(path, json.dumps({"indices": [3, 7]}, indent=1))
        >>> json.loads(open(path).read())["indices"]
        [3, 7]
    """
    atomic_write_bytes(path, text.encode(encoding), prefix=prefix)


def atomic_save(path: PathLike, write: Callable[[str], None]) -> None:
    """Replace ``path`` atomically with what ``write(name)`` writes to the file ``name``, for a
    library that opens its file by name (``safetensors.torch.save_file``).

    ``name`` is in a ``0700`` temporary directory beside ``path`` (same filesystem: the rename
    is atomic), so no one else can plant a link there; the file is fsynced, renamed over
    ``path`` and the temporary directory removed.

    Raises:
        OSError: the file could not be written; ``path`` is unchanged.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    private = tempfile.mkdtemp(prefix=".tmp-", dir=directory)
    try:
        tmp = os.path.join(private, os.path.basename(path))
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o002)  # the umask's mode, never world-writable
            os.fsync(fd)
        finally:
            os.close(fd)
        AtomicFile(path, tmp=tmp).commit()
    finally:
        shutil.rmtree(private, ignore_errors=True)
