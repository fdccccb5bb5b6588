"""Checksums of a sharded snapshot's files: recorded in its completion mark, checked before a load.

When a sharded snapshot is saved, its files (the ``shard-*.safetensors`` tensors and the
``rank-*.json`` parts) are checksummed once every rank's are on disk: the files are shared out
among the ranks (file ``i`` of the sorted list to rank ``i % world``), each rank reads its share
back and checksums it with the single-file store's ``xxh3_64`` (:mod:`safetrain.snapshot.checksums`,
at memory speed, the whole file in one digest), and rank 0 gathers the ``{file: checksum}`` tables
(one small all-gather of their JSON bytes) into the mark (``"files"``, ``"checksum": "xxh3_64"``).
A mark of 0.1.0 says ``"checksum": "blocksum64"`` (of each 64 MiB piece, joined by ``:``) and is
checked with that; a mark naming an algorithm this version does not know is refused.

Before a load, the files are shared out again among the loading ranks (any number) and checked;
the verdict is agreed (one ``gather_int``), so every rank refuses a damaged snapshot together, and
every rank's message names the first file that fails. A file listed but missing, a shard file not
listed, or a different checksum is damage (:class:`CorruptSnapshotError`). A mark without
``"files"`` (a snapshot written before checksums were recorded) is not checked: it still loads.
Cost: each rank reads back ``1/world`` of the snapshot's bytes once per save and once per load.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional

import torch
import xxhash

from ..errors import SnapshotError
from ..snapshot.checksums import ALGORITHM, ALGORITHMS, blocksum64
from ..snapshot.header import open_regular
from ..snapshot.store import CorruptSnapshotError
from .snapdir import is_snapshot_file, snapshot_files

__all__ = [
    "ALGORITHM",
    "file_checksum",
    "checksum_files",
    "check_recorded",
    "mark_algorithm",
    "verify_files",
    "bad_files",
]

_CHUNK = 64 * 2**20  # bytes read and checksummed at a time


def file_checksum(path: str, algorithm: str = ALGORITHM) -> str:
    """A file's checksum: ``xxh3_64`` of its bytes (16 hex digits), or, for ``algorithm="blocksum64"``
    (marks of 0.1.0), ``blocksum64`` of each 64 MiB piece, joined by ``:``.

    Raises:
        SnapshotError: ``path`` is a link, a FIFO, a device or missing: a snapshot's files are
            regular files in its directory (never followed out of it, never waited on).
        ValueError: ``algorithm`` is not one of :data:`~safetrain.snapshot.checksums.ALGORITHMS`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}")
    hasher, parts = xxhash.xxh3_64(), []
    buf = bytearray(_CHUNK)
    fd, _ = open_regular(path, follow=False)
    with os.fdopen(fd, "rb", buffering=0) as f:
        while True:
            n = _read_into(f, memoryview(buf))
            if algorithm == "xxh3_64":
                hasher.update(memoryview(buf)[:n])  # (releases the GIL while it hashes)
            elif n:
                parts.append(blocksum64(torch.frombuffer(buf, dtype=torch.uint8)[:n]))
            if n < _CHUNK:
                break
    if algorithm == "xxh3_64":
        return hasher.hexdigest()
    return ":".join(parts) or blocksum64(torch.empty(0, dtype=torch.uint8))


def _read_into(f: Any, view: memoryview) -> int:
    """Fill ``view`` from ``f``: the bytes read, fewer only at the end of the file."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def mark_algorithm(snap: str, mark: Mapping[str, Any]) -> str:
    """The algorithm of the checksums a completion mark records (``"checksum"``; ``blocksum64`` when
    the mark does not say, as no mark with checksums did before 0.1.0 wrote the key).

    Raises:
        CorruptSnapshotError: the mark names an algorithm this version does not read.
    """
    algorithm = mark.get("checksum", "blocksum64")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise CorruptSnapshotError(
            f"{snap}: the completion mark's checksums are {str(algorithm)!r:.40}, which this safetrain does not read "
            f"(it reads {', '.join(sorted(ALGORITHMS))}): written by a newer safetrain, or corrupted"
        )
    return algorithm


def _share(names: List[str], rank: int, world: int) -> List[str]:
    return [n for i, n in enumerate(names) if i % world == rank]


def checksum_files(snap: str, sync: Any) -> Dict[str, str]:
    """Every rank (a collective when ``sync`` is distributed): checksum this rank's share of
    ``snap``'s files (all written) and return every rank's table merged (on every rank)."""
    rank, world = getattr(sync, "rank", 0), getattr(sync, "world", 1)
    mine = {n: file_checksum(os.path.join(snap, n)) for n in _share(snapshot_files(snap), rank, world)}
    merged: Dict[str, str] = {}
    for table in _gather_text(sync, json.dumps(mine)):
        merged.update(json.loads(table))
    return merged


def check_recorded(snap: str, recorded: Any) -> Dict[str, str]:
    """The completion mark's checksum table ``recorded``, checked: ``{name: checksum}`` where every
    name is a plain file name of a snapshot's file (``shard-*.safetensors``, ``rank-*.json``): no
    separator, no ``..``, not absolute, so that nothing outside ``snap`` is ever read for it.

    Raises:
        CorruptSnapshotError: the table is not such a map; the message names the first bad name.
    """
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        raise CorruptSnapshotError(f"{snap}: the completion mark's checksum table is malformed")
    for name in recorded:
        if not is_snapshot_file(name):
            raise CorruptSnapshotError(
                f"{snap}: the completion mark lists {name!r:.80}, not the name of a file in the snapshot "
                "(expected plain names such as rank-0.json or shard-*.safetensors): corrupted or planted"
            )
    return recorded


def bad_files(
    snap: str, recorded: Mapping[str, str], names: Optional[List[str]] = None, algorithm: str = ALGORITHM
) -> List[str]:
    """The files of ``snap`` (of ``names``, default every file listed or present) that are missing,
    not listed in ``recorded``, not regular files (a link, a FIFO), or fail their ``algorithm``
    checksum (the mark's: :func:`mark_algorithm`).

    Raises:
        CorruptSnapshotError: ``recorded`` is malformed or names a file outside ``snap`` (:func:`check_recorded`).
    """
    recorded = check_recorded(snap, recorded)
    names = sorted(set(recorded) | set(snapshot_files(snap))) if names is None else names
    bad = []
    for name in names:
        if name not in recorded or _checksum_or_none(os.path.join(snap, name), algorithm) != recorded[name]:
            bad.append(name)
    return bad


def _checksum_or_none(path: str, algorithm: str) -> Optional[str]:
    try:
        return file_checksum(path, algorithm)
    except SnapshotError:  # missing, a link, a FIFO: it fails (every rank must reach the vote)
        return None


def verify_files(snap: str, mark: Mapping[str, Any], sync: Any = None) -> bool:
    """Check ``snap``'s files against the checksums in its completion mark ``mark`` (every rank a
    share; the verdict agreed). Returns ``False`` when the mark records none (an older snapshot).

    Raises:
        CorruptSnapshotError: a file is missing, unlisted, or fails its checksum, on any rank;
            the message names the first such file; or the mark names an unknown algorithm.
    """
    recorded = mark.get("files")
    if recorded is None:
        return False
    recorded = check_recorded(snap, recorded)
    algorithm = mark_algorithm(snap, mark)
    rank, world = getattr(sync, "rank", 0), getattr(sync, "world", 1)
    names = sorted(set(recorded) | set(snapshot_files(snap)))
    bad = bad_files(snap, recorded, _share(names, rank, world), algorithm)
    gather = getattr(sync, "gather_int", None)
    firsts = gather(names.index(bad[0]) if bad else -1) if gather is not None else [names.index(bad[0]) if bad else -1]
    failed = sorted(i for i in firsts if i >= 0)
    if failed:
        raise CorruptSnapshotError(f"{snap}: {names[failed[0]]} fails its checksum (or is missing): corrupted")
    return True


def _gather_text(sync: Any, text: str) -> List[str]:
    """Every rank's ``text`` in rank order (two small collectives; ``[text]`` in one process)."""
    gather = getattr(sync, "gather_int", None)
    if gather is None or getattr(sync, "world", 1) == 1:
        return [text]
    import torch.distributed as dist

    data = text.encode("utf-8")
    lengths = gather(len(data))
    device = getattr(sync, "device", torch.device("cpu"))
    mine = torch.zeros(max(lengths), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(len(lengths) * max(lengths), dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, mine.to(device), group=getattr(sync, "group", None))
    rows = out.cpu().view(len(lengths), max(lengths))
    return [bytes(rows[r, :n].tolist()).decode("utf-8") for r, n in enumerate(lengths)]
