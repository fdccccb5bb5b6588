"""A sharded snapshot's completion mark (:data:`.snapdir.MARK`): written last, by rank 0, once
every rank's files are on disk, with their checksums (:mod:`.verify`); read first, before any load.

Both writers (:mod:`.checkpoint` in the step, :mod:`.background` for ``snapshot.async_save``)
call :func:`write_mark`; the loader (:mod:`.loading`) calls :func:`read_mark`. Cost: each rank
reads back its share of the snapshot's files once per save (the checksums).
"""

from __future__ import annotations

import os
from typing import Any, Dict

from ..rundir import fsync_dir
from ..snapshot.store import CorruptSnapshotError
from .snapdir import FORMAT, MARK, read_json, write_json
from .verify import ALGORITHM, checksum_files

__all__ = ["write_mark", "read_mark"]


def write_mark(snap: str, meta: Any, sync: Any, run_id: str) -> None:
    """Every rank, once every rank's files of ``snap`` are on disk: checksum them (a share each,
    gathered), then rank 0 writes the completion mark (``meta`` holds ``counters`` and ``created``).

    Args:
        snap: the snapshot directory.
        meta: the snapshot's metadata: ``counters`` and ``created`` go into the mark.
        sync: ``rank``, ``world`` and ``gather_int`` of the ranks that wrote it (``None``: one process).
        run_id: the run the snapshot belongs to.
    """
    files = checksum_files(snap, sync)
    if getattr(sync, "rank", 0) != 0:
        return
    mark = {
        "format": FORMAT,
        "version": 2,
        "run_id": run_id,
        "world": getattr(sync, "world", 1),
        "counters": meta["counters"],
        "created": meta["created"],
        "checksum": ALGORITHM,
        "files": files,
    }
    write_json(os.path.join(snap, MARK), mark)
    fsync_dir(os.path.dirname(snap))


def read_mark(snap: str) -> Dict[str, Any]:
    """The completion mark of ``snap``.

    Raises:
        CorruptSnapshotError: there is none (an incomplete snapshot), or it is not a sharded snapshot's.
    """
    path = os.path.join(snap, MARK)
    mark = read_json(path) if os.path.isfile(path) else None
    if not isinstance(mark, dict) or mark.get("format") != FORMAT:
        raise CorruptSnapshotError(f"{snap}: not a complete sharded snapshot (no {MARK})")
    return mark
