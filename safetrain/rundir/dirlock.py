"""One writer per directory: an ``fcntl.flock`` that says which process holds it, for the run
directory (``log.dir``) and the snapshot directory alike.

The lock file is ``<tmp>/safetrain-locks-<uid>/<device>-<inode>.lock``, named after the directory's
device and inode: the directory gets no extra file (a snapshot directory's listing stays its
snapshots, a read-only directory can be locked), and a directory reached by two paths is one lock.
The temporary directory is shared, so the folder is the user's own or nothing (:func:`lock_folder`):
created ``0700`` and checked at every use (a real directory, not a link; owned by this user; not
writable by group or others), as ssh checks ``~/.ssh``; the lock file is opened without following a
link (:func:`safetrain.rundir.safefile.open_private`), so a link planted there is refused, never truncated through.

It holds its holder (host, pid, start time and the directory, as one JSON line) for the error a
second writer gets, and is emptied when the lock is let go: a holder of the same directory found
there by the next taker was killed or crashed (the kernel frees a dead process's ``flock``), and
the lock is taken over with a warning naming it (silently when the record names another directory,
a gone one whose inode this one reuses, or is an older safetrain's). The lock is advisory and
per host (``flock`` may not reach across the hosts of a network filesystem).

Each lock has a role (``"run"``, ``"snapshots"``). In one process, two locks of one role on one
directory are two writers (the second is refused, as another process would be); locks of
different roles share it (a run whose ``snapshot.dir`` is its ``log.dir``). Nothing here imports torch.

Example::

    >>> import tempfile
    >>> lock = DirLock(tempfile.mkdtemp(), "run", busy=lambda d, who: RuntimeError(f"{d}: held by {who}"))
    >>> lock.take(), lock.held
    (True, True)
    >>> lock.release(); lock.held
    False
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import stat
import tempfile
import threading
import time
import weakref
from typing import IO, Callable, Optional

from .safefile import UnsafeFileError, file_kind, open_private

__all__ = ["DirLock", "HOST", "alive", "tmp_tag", "describe_holder", "lock_folder"]

logger = logging.getLogger(__name__)

#: This host's name as temporary file names carry it (letters, digits, ``_`` and ``-``).
HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def tmp_tag() -> str:
    """The writer's part of a temporary name: ``{host}.{pid}``."""
    return f"{HOST}.{os.getpid()}"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def describe_holder(text: str) -> str:
    """A lock file's holder record as words: ``pid 4242 on host gpu7, started 2026-01-02 03:04:05 UTC``.

    An older safetrain's plain line (``host H pid P``) is given as it is; nothing: ``a process``.
    """
    try:
        rec = json.loads(text)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(rec["started"])))
        return f"pid {int(rec['pid'])} on host {rec['host']}, started {when}"
    except (ValueError, TypeError, KeyError, OverflowError):
        return " ".join(text.split())[:200] or "a process"


def lock_folder() -> str:
    """This user's folder of lock files, ``<tmp>/safetrain-locks-<uid>``: created ``0700`` if
    missing, and checked at every call, since anyone can create a name in the temporary directory.

    Raises:
        UnsafeFileError: (an ``OSError``) the folder is a link or not a directory, is another
            user's, or group or others can write in it; the sentence names it, its owner and mode,
            and what to do.
    """
    folder = os.path.join(tempfile.gettempdir(), f"safetrain-locks-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = f"is {file_kind(st.st_mode)}, not a directory"
    elif st.st_uid != me:
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {me})"
    elif st.st_mode & 0o022:
        problem = "is writable by " + (
            "group and others" if st.st_mode & 0o022 == 0o022 else "its group" if st.st_mode & 0o020 else "others"
        )
    else:
        return folder
    raise UnsafeFileError(
        folder,
        f"the folder of safetrain's directory locks {problem} (owner uid {st.st_uid}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}): someone else could plant links in it",
        f"if it is yours, run chmod 700 {folder}; if not, remove it (or ask an administrator to), "
        "or set TMPDIR to a directory of your own",
        does="keep its locks there",
    )


class _Held:
    """One taken ``flock`` of this process: its open file, its record and the locks sharing it."""

    def __init__(self, file: IO[str], record: str) -> None:
        self.file, self.record = file, record
        self.locks: "weakref.WeakSet[DirLock]" = weakref.WeakSet()


# The flocks this process holds, by lock file; an entry goes when its last DirLock lets go (or is
# collected: the file's finalizer closes it and the kernel frees the flock).
_HELD: "weakref.WeakValueDictionary[str, _Held]" = weakref.WeakValueDictionary()
_MUTEX = threading.Lock()


class DirLock:
    """An exclusive, non-blocking ``flock`` for a directory, held from :meth:`take` to :meth:`release`.

    Args:
        directory: the directory (it must exist when the lock is taken).
        role: what the holder does there (``"run"``, ``"snapshots"``); see the module's note.
        busy: ``busy(directory, holder)`` makes the exception for a directory another writer
            holds, ``holder`` in words (``pid 4242 on host gpu7, started ...``).
    """

    def __init__(self, directory: str, role: str, busy: Callable[[str, str], Exception]) -> None:
        self.directory, self.role, self._busy = os.fspath(directory), role, busy
        self._held: Optional[_Held] = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._held is not None

    def _path(self) -> str:
        st = os.stat(self.directory)
        return os.path.join(lock_folder(), f"{st.st_dev}-{st.st_ino}.lock")

    def take(self, wait_error: bool = True) -> bool:
        """Take the lock; ``True`` when newly taken, ``False`` when already held here (or, with
        ``wait_error=False``, when another writer holds it). A holder left in the lock file by a
        process that is gone is taken over, with a warning naming it.

        Raises:
            Exception: ``busy(directory, holder)``: another writer holds it (``wait_error``); or
                ``OSError`` when the lock file cannot be made (an :class:`UnsafeFileError` when
                its folder or the file is not the user's own: :func:`lock_folder`).
        """
        if self._held is not None:
            return False
        path = self._path()
        with _MUTEX:
            held = _HELD.get(path)
            if held is not None:  # this process holds it already: another role shares it
                if any(lock.role == self.role for lock in held.locks):
                    if not wait_error:
                        return False
                    who = describe_holder(held.record) + "; this very process: a run or store of it not closed yet"
                    raise self._busy(self.directory, who)
                held.locks.add(self)
                self._held = held
                return True
            f = open_private(path)  # never through a link planted there
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_holder(f)
                f.close()
                if not wait_error:
                    return False
                raise self._busy(self.directory, describe_holder(holder)) from None
            f.seek(0)
            self._take_over(f.read(1000).strip())
            record = json.dumps(
                {
                    "host": HOST,
                    "pid": os.getpid(),
                    "started": round(time.time(), 3),
                    "dir": os.path.realpath(self.directory),
                }
            )
            f.seek(0)
            f.truncate()
            f.write(record + "\n")
            f.flush()
            held = _Held(f, record)
            held.locks.add(self)
            _HELD[path] = self._held = held
        return True

    def _take_over(self, previous: str) -> None:
        """Warn about the holder a killed or crashed process left in the lock file (the kernel
        freed its ``flock`` when it died, so it holds nothing now); one of this process's own
        locks, dropped without :meth:`release`, needs no warning."""
        try:
            rec = json.loads(previous)
            ours = rec["host"] == HOST and int(rec["pid"]) == os.getpid()
            here = rec.get("dir") == os.path.realpath(self.directory)
        except (ValueError, TypeError, KeyError, AttributeError):  # an older safetrain's: it never emptied it
            ours, here = False, False
        if previous and here and not ours:  # (not here: a gone directory's, whose inode this one reuses)
            logger.warning(
                "%s: taking over a stale lock: its holder (%s) ended without letting it go (killed or crashed)",
                self.directory,
                describe_holder(previous),
            )

    def release(self) -> None:
        """Let the lock go (idempotent); the last of this process's locks on it empties the lock file."""
        held, self._held = self._held, None
        if held is None:
            return
        with _MUTEX:
            held.locks.discard(self)
            if len(held.locks) > 0:
                return
            for key, value in list(_HELD.items()):
                if value is held:
                    del _HELD[key]
            try:
                held.file.seek(0)
                held.file.truncate()  # before the unlock: no next taker reads this holder as stale
                held.file.flush()
            except OSError:
                pass
            try:
                fcntl.flock(held.file.fileno(), fcntl.LOCK_UN)
            finally:
                held.file.close()


def _read_holder(f: IO[str]) -> str:
    """The holder record of a lock another process holds; a holder that took it this instant may
    not have written it yet, so an empty file is read again for up to 0.2 s."""
    for _ in range(20):
        f.seek(0)
        text = f.read(1000).strip()
        if text:
            return text
        time.sleep(0.01)
    return ""
