"""A snapshot file's header: parsed without trust, validated, and checked against its own checksum.

The header is JSON (``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}``). Its
``safetrain.checksum`` metadata entry is the checksum table (JSON):

* version 3 (written since 0.2.0): ``{"version": 3, "algorithm": "xxh3_64", "state": crc32 of the
  training-state string, "tensors": {name: xxh3_64 of its bytes}, "header": sha256}``, where
  ``header`` is the SHA-256 of :func:`header_digest`'s input: every tensor's name, dtype, shape and
  byte range, every other metadata entry, and the rest of the table. So a changed dtype (``F32``
  read as ``I32``), shape, offset or metadata value is refused, not misread.
* version 2 (written by 0.1.0): the same with ``"algorithm": "blocksum64"``; still read, and its
  tensors checked with that algorithm (:mod:`.checksums`).
* version 1 (older files: no ``version`` key, no ``header``, ``blocksum64``): only the bytes and
  the state string are covered; such files still load.

Every way a file can be malformed raises :class:`CorruptSnapshotError` naming the file: a
non-regular file (a FIFO would block ``open`` forever) is refused before it is opened for
reading, the header's length is bounded, and JSON nested too deeply is refused, not a
``RecursionError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..errors import SnapshotError
from ..rundir.safefile import file_kind
from .store import CorruptSnapshotError

__all__ = [
    "Entry",
    "Header",
    "read_header",
    "read_layout",
    "open_regular",
    "read_regular",
    "numel_within",
    "parse_json",
    "header_digest",
    "DTYPES",
    "STATE_KEY",
    "CHECKSUM_KEY",
    "TABLE_VERSION",
    "MAX_DIMS",
]

DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
_CODES = {code: dtype for dtype, code in DTYPES.items()}

STATE_KEY = "safetrain.state"
CHECKSUM_KEY = "safetrain.checksum"
TABLE_VERSION = 3  # the checksum table's version; 2: blocksum64; 1: before the header was covered
_TABLE_KEYS = {
    1: {"algorithm", "state", "tensors"},
    2: {"version", "algorithm", "state", "tensors", "header"},
    3: {"version", "algorithm", "state", "tensors", "header"},
}
_TABLE_ALGORITHM = {1: "blocksum64", 2: "blocksum64", 3: "xxh3_64"}  # each version's one algorithm
_HEADER_LIMIT = 100 * 2**20  # the safetensors library's own limit
#: The most dimensions a tensor in a file may have (NumPy's own limit; no model tensor comes close).
MAX_DIMS = 64
_MAX_INDEX = 2**63 - 1  # torch's sizes and strides are int64


@dataclass(frozen=True)
class Entry:
    """One tensor in a file: name, dtype, shape and byte range in the data section."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed, validated file header: entries in file order, metadata, where data starts."""

    path: str
    entries: Tuple[Entry, ...]
    metadata: Dict[str, str]
    data_start: int
    size: int

    def specs(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """``name -> (shape, dtype)`` for every tensor."""
        return {e.name: (e.shape, e.dtype) for e in self.entries}

    def state(self) -> Dict[str, Any]:
        """The JSON part of the training state (``safetrain.state``), parsed (checked by :func:`read_header`)."""
        return parse_json(self.metadata[STATE_KEY], self.path, STATE_KEY)

    def checksums(self) -> Dict[str, Any]:
        """The checksum table, validated: ``algorithm``, ``state``, ``tensors`` (and ``header``)."""
        return _checksums(self.path, self.metadata)


def parse_json(text: Any, path: str, what: str) -> Any:
    """``json.loads`` that raises :class:`CorruptSnapshotError` naming ``path`` and ``what`` instead of
    ``ValueError`` or ``RecursionError`` (JSON nested deeper than Python's recursion limit)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise CorruptSnapshotError(f"{path}: {what} JSON is nested too deeply: not a snapshot, or corrupted") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptSnapshotError(f"{path}: {what} is not valid JSON ({exc}): not a snapshot, or corrupted") from None


def header_digest(entries: List[Entry], metadata: Mapping[str, str], table: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of everything the header says: tensors, metadata, the checksum table but this digest."""
    text = json.dumps(
        {
            "tensors": sorted([e.name, DTYPES[e.dtype], list(e.shape), e.begin, e.end] for e in entries),
            "metadata": {k: v for k, v in metadata.items() if k != CHECKSUM_KEY},
            "table": {k: v for k, v in table.items() if k != "header"},
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def open_regular(path: str, follow: bool = True) -> Tuple[int, int]:
    """Open ``path`` for reading if it is a regular file: ``(fd, size)``; never blocks on a FIFO.

    Args:
        path: the file.
        follow: ``False``: a symbolic link at ``path`` is refused too (``O_NOFOLLOW``), for names
            that must be files of the directory they are in.

    Raises:
        SnapshotError: it is missing, unreadable, or not a regular file (FIFO, device, directory, link).
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptSnapshotError(f"{path}: not a regular file ({file_kind(mode)}); a snapshot is a regular file")
        fd = os.open(path, flags | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the stat and the open
        os.close(fd)
        kind = file_kind(st.st_mode)
        raise CorruptSnapshotError(f"{path}: not a regular file ({kind}); a snapshot is a regular file")
    return fd, st.st_size


def read_regular(path: str, limit: int, follow: bool = True) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; never blocks on a FIFO
    (``follow=False``: nor reads through a link, as :func:`open_regular`).

    Raises:
        SnapshotError: it is missing, unreadable, not a regular file, or over ``limit`` bytes.
    """
    fd, size = open_regular(path, follow)
    try:
        if size > limit:
            raise CorruptSnapshotError(f"{path}: {size} bytes, over the {limit} a snapshot's file may hold: corrupted")
        return _pread_exact(fd, size, 0, path)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _pread_exact(fd: int, n: int, pos: int, path: str) -> bytes:
    parts, done = [], 0
    while done < n:
        got = os.pread(fd, n - done, pos + done)
        if not got:
            raise CorruptSnapshotError(f"{path}: truncated while reading (file changed?)")
        parts.append(got)
        done += len(got)
    return b"".join(parts)


def read_layout(path: str) -> Header:
    """Parse a safetensors file's header without trust: every tensor's dtype, shape and byte range
    checked against the bytes present, metadata a map of strings; no safetrain key required.

    Bounded whatever the file says: the header is at most 100 MiB (the safetensors library's own
    limit), a shape has at most :data:`MAX_DIMS` dimensions, and a tensor's element count is
    multiplied out only while it still fits the file (a zero dimension makes it 0 at once), so
    the cost is linear in the header's size.

    Raises:
        SnapshotError: the file is missing, not a regular file, empty, truncated or not
            safetensors; the message names the file.
    """
    fd, size = open_regular(path)
    try:
        if size == 0:
            raise CorruptSnapshotError(f"{path}: file is empty (0 bytes); not a snapshot")
        if size < 8:
            raise CorruptSnapshotError(f"{path}: file is {size} bytes, too short for a safetensors header")
        n = int.from_bytes(_pread_exact(fd, 8, 0, path), "little")
        if n > size - 8 or n > _HEADER_LIMIT:
            raise CorruptSnapshotError(
                f"{path}: header length {n} does not fit a {size}-byte file: not a safetensors file "
                "(a pickle or torch.save file?) or truncated"
            )
        raw = _pread_exact(fd, n, 8, path)
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    header = parse_json(raw, path, "header")
    if not isinstance(header, dict):
        raise CorruptSnapshotError(
            f"{path}: header is a JSON {type(header).__name__}, not an object: not a safetensors file"
        )
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptSnapshotError(f"{path}: __metadata__ is not a map of strings: corrupted")
    data_start, data_size = 8 + n, size - 8 - n
    entries = _entries(path, header, data_size)
    end = entries[-1].end if entries else 0
    if end > data_size:
        raise CorruptSnapshotError(
            f"{path}: truncated: header describes {end} bytes of tensor data, the file holds {data_size}"
        )
    if end < data_size:
        raise CorruptSnapshotError(f"{path}: {data_size - end} unexpected bytes after the tensor data: corrupted")
    return Header(path, tuple(entries), metadata, data_start, size)


def read_header(path: str) -> Header:
    """Parse and validate a snapshot file's header without reading tensor data
    (:func:`read_layout`, then safetrain's metadata and checksums).

    Raises:
        SnapshotError: the file is missing, not a regular file, empty, truncated, not safetensors,
            not a safetrain snapshot, or its header or metadata fails its checksum; the message
            names the file.
    """
    layout = read_layout(path)
    entries, metadata = list(layout.entries), layout.metadata
    if STATE_KEY not in metadata or CHECKSUM_KEY not in metadata:
        raise CorruptSnapshotError(
            f"{path}: a safetensors file without safetrain metadata ({STATE_KEY!r}): not a safetrain snapshot"
        )
    table = _checksums(path, metadata)
    if f"{zlib.crc32(metadata[STATE_KEY].encode('utf-8')):08x}" != table["state"]:
        raise CorruptSnapshotError(f"{path}: the training-state metadata fails its checksum: corrupted")
    if set(table["tensors"]) != {e.name for e in entries}:
        raise CorruptSnapshotError(f"{path}: the checksum table does not list the file's tensors: corrupted")
    if "header" in table and header_digest(entries, metadata, table) != table["header"]:
        raise CorruptSnapshotError(
            f"{path}: header fails its checksum (a tensor's dtype, shape or offsets, or the metadata, "
            "changed): corrupted"
        )
    state = parse_json(metadata[STATE_KEY], path, f"{STATE_KEY} metadata")
    if not isinstance(state, dict):
        raise CorruptSnapshotError(f"{path}: {STATE_KEY} metadata is not a JSON object: corrupted")
    return layout


def _entries(path: str, header: Mapping[str, Any], data_size: int) -> List[Entry]:
    entries = []
    for name, spec in header.items():
        try:
            dtype = _CODES[spec["dtype"]]
            dims = spec["shape"]
            if not isinstance(dims, list) or len(dims) > MAX_DIMS:
                raise ValueError(dims)
            shape = tuple(_nonneg_int(d) for d in dims)
            begin, end = (_nonneg_int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r} has a malformed header entry {spec!r:.200} "
                f"(expected a dtype, a shape of at most {MAX_DIMS} integers >= 0 and two offsets)"
            ) from None
        numel = numel_within(shape, data_size // dtype.itemsize)
        if numel is None:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: shape {_cut(shape)} {dtype} holds more than the {data_size} bytes of "
                "tensor data in the file: corrupted or truncated"
            )
        if end - begin != numel * dtype.itemsize:
            raise CorruptSnapshotError(
                f"{path}: tensor {name!r}: shape {list(shape)} {dtype} does not match byte range {begin}..{end}"
            )
        entries.append(Entry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    for e in entries:
        if e.begin != cursor:
            raise CorruptSnapshotError(
                f"{path}: tensor {e.name!r} starts at byte {e.begin}, expected {cursor} (overlap or gap)"
            )
        cursor = e.end
    return entries


def numel_within(shape: Tuple[int, ...], limit: int) -> Optional[int]:
    """The element count of ``shape``, or ``None`` once it is over ``limit`` (the elements the data
    can hold) or a stride would not fit torch's int64 (dimensions beside a 0 still count for that).

    Multiplying stops as soon as a bound is passed, so a shape of 80,000 huge dimensions costs
    80,000 small multiplications, not a product of a million digits (quadratic in its length).
    """
    if 0 in shape:
        limit = _MAX_INDEX  # no element; torch still computes the strides of the others
    product = 1
    for d in shape:
        product *= max(d, 1)
        if product > limit:
            return None
    return 0 if 0 in shape else product


def _cut(shape: Tuple[int, ...], shown: int = 8) -> str:
    """A shape for a message: its first dimensions and how many there are."""
    if len(shape) <= shown:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:shown]))}, ...] ({len(shape)} dimensions)"


def _nonneg_int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(x)
    return x


def _checksums(path: str, metadata: Mapping[str, str]) -> Dict[str, Any]:
    """The checksum table, every key and type checked (version 1, 2 or 3, each with its algorithm)."""
    data = parse_json(metadata[CHECKSUM_KEY], path, "the checksum metadata")
    malformed = CorruptSnapshotError(f"{path}: the checksum metadata is malformed: corrupted")
    if not isinstance(data, dict):
        raise malformed
    version = data.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version not in _TABLE_KEYS:
        raise CorruptSnapshotError(
            f"{path}: checksum table version {version!r}; this safetrain reads versions "
            f"{', '.join(map(str, sorted(_TABLE_KEYS)))} (written by a newer safetrain, or corrupted)"
        )
    tensors = data.get("tensors")
    if (
        set(data) != _TABLE_KEYS[version]
        or data["algorithm"] != _TABLE_ALGORITHM[version]
        or not isinstance(data["state"], str)
        or not isinstance(data.get("header", ""), str)
        or not isinstance(tensors, dict)
        or not all(isinstance(v, str) for v in tensors.values())
    ):
        raise malformed
    return data
