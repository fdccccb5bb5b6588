"""Temporary snapshot file names that say which process wrote them, so that only a gone writer's
leftovers are removed.

A temporary file is ``.tmp-snapshot-{host}.{pid}-...`` (:func:`~safetrain.rundir.dirlock.tmp_tag`); the
directory's one writer (:class:`~safetrain.rundir.dirlock.DirLock`) removes those :func:`stale` says are
left by this process or by a process of this host that is gone. Used by :mod:`.disk`.
"""

from __future__ import annotations

import os
import re

from ..rundir.dirlock import HOST, alive

__all__ = ["TMP_PREFIX", "stale"]

TMP_PREFIX = ".tmp-snapshot-"
# A temporary file's writer: ".tmp-snapshot-[removed-]{host}.{pid}-..."
_TMP_OWNER = re.compile(r"^\.tmp-snapshot-(?:removed-)?(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)-")
# An older safetrain's names, without the host: ".tmp-snapshot-{step}-{pid}-..." and "...removed-...snapshot-..."
_LEGACY = re.compile(r"^\.tmp-snapshot-(?:\d{10,}-\d+-|removed-snapshot-|removed-[0-9a-f]{8}-snapshot-)")


def stale(name: str) -> bool:
    """A temporary file left by this process or by a process of this host that is gone, or one
    named by an older safetrain (call it holding the directory's lock); another host's is not
    ours to judge."""
    if _LEGACY.match(name):
        return True
    m = _TMP_OWNER.match(name)
    if m is None or m.group("host") != HOST:
        return False
    pid = int(m.group("pid"))
    return pid == os.getpid() or not alive(pid)
