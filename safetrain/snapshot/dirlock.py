"""One writer per snapshot directory: an ``fcntl.flock``, and temporary names that say which
process wrote them (so only a gone writer's leftovers are removed).

The lock file is ``<tmp>/safetrain-locks-<uid>/<device>-<inode>.lock``, named after the directory's
device and inode: the snapshot directory gets no extra file (its listing stays the snapshots), and
a directory reached by two paths is one lock. It holds the writer's host and pid, for the error a
second writer gets. The lock is advisory and per host (``flock`` may not reach across the hosts of a
network filesystem). Used by :mod:`.disk`.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import tempfile
from typing import IO, Optional

from ..errors import SnapshotError

__all__ = ["DirLock", "TMP_PREFIX", "tmp_tag", "stale"]

TMP_PREFIX = ".tmp-snapshot-"
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"
# A temporary file's writer: ".tmp-snapshot-[removed-]{host}.{pid}-..."
_TMP_OWNER = re.compile(r"^\.tmp-snapshot-(?:removed-)?(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)-")
# An older safetrain's names, without the host: ".tmp-snapshot-{step}-{pid}-..." and "...removed-...snapshot-..."
_LEGACY = re.compile(r"^\.tmp-snapshot-(?:\d{10,}-\d+-|removed-snapshot-|removed-[0-9a-f]{8}-snapshot-)")


def tmp_tag() -> str:
    """The writer's part of a temporary name: ``{host}.{pid}``."""
    return f"{_HOST}.{os.getpid()}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def stale(name: str) -> bool:
    """A temporary file left by this process or by a process of this host that is gone, or one
    named by an older safetrain (call it holding the directory's lock); another host's is not
    ours to judge."""
    if _LEGACY.match(name):
        return True
    m = _TMP_OWNER.match(name)
    if m is None or m.group("host") != _HOST:
        return False
    pid = int(m.group("pid"))
    return pid == os.getpid() or not _alive(pid)


class DirLock:
    """An exclusive, non-blocking ``flock`` for a directory, held from :meth:`take` to :meth:`release`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._file: Optional[IO[str]] = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._file is not None

    def _path(self) -> str:
        st = os.stat(self.directory)
        folder = os.path.join(tempfile.gettempdir(), f"safetrain-locks-{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"{st.st_dev}-{st.st_ino}.lock")

    def take(self, wait_error: bool = True) -> bool:
        """Take the lock; ``True`` when newly taken, ``False`` when already held here (or, with
        ``wait_error=False``, when another process holds it).

        Raises:
            SnapshotError: another process holds it (``wait_error``), naming the directory and the holder.
        """
        if self._file is not None:
            return False
        try:
            f = open(self._path(), "a+", encoding="utf-8")
        except OSError as exc:
            raise SnapshotError(f"{self.directory}: cannot open the snapshot lock: {exc.strerror or exc}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read(200).strip() or "a process"
            f.close()
            if not wait_error:
                return False
            raise SnapshotError(
                f"{self.directory}: another process is writing snapshots here ({holder}); two runs cannot "
                "share a snapshot directory: stop the other process or give this run its own snapshot.dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        f.flush()
        self._file = f
        return True

    def release(self) -> None:
        """Let the lock go (idempotent)."""
        if self._file is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            finally:
                self._file.close()
                self._file = None
