"""Reading and writing snapshot files: safetensors layout, a fast checksum per tensor, no mmap.

A snapshot file is a plain safetensors file (``safetensors.safe_open`` reads it): an 8-byte little-endian
header length, a JSON header describing each tensor, then the tensor bytes. Its ``__metadata__`` holds two
strings: ``safetrain.state`` (the JSON part of the training state) and ``safetrain.checksum`` (a checksum of
that string, of every tensor's bytes (:func:`checksum`, ``xxh3_64``; files of 0.1.0 carry ``blocksum64``,
still read: :mod:`.checksums`) and of the header itself: dtypes, shapes, offsets, metadata; :mod:`.header`
reads and validates headers). Cost: the checksum runs at memory speed, on one thread while another writes
or reads the bytes. Part of ``snapshot``, under :mod:`.disk` and :mod:`.inspection`.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import zlib
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch

from ..errors import SnapshotError
from ..rundir.safefile import create_new
from .checksums import ALGORITHM, WIDTH, checksum
from .header import (
    CHECKSUM_KEY,
    DTYPES,
    STATE_KEY,
    TABLE_VERSION,
    Entry,
    Header,
    header_digest,
    open_regular,
    read_header,
)
from .store import CorruptSnapshotError
from .tensors import byte_view

__all__ = ["Entry", "Header", "FileWriter", "read_header", "read_tensors", "checksum", "DTYPES", "ALGORITHM"]

_CHUNK = 256 * 2**20  # bytes per read or write call (Linux caps one call just under 2 GiB)


def _header_bytes(entries: List[Entry], metadata: Mapping[str, str]) -> bytes:
    header: Dict[str, Any] = {"__metadata__": dict(metadata)}
    for e in entries:
        header[e.name] = {"dtype": DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # pad so tensor data starts 8-byte aligned


class FileWriter:
    """Writes one snapshot file, tensor data on a thread while the caller checks and checksums.

    The layout (and so the header's length: checksums have a fixed width) is known up front, so
    a thread can ``pwrite`` every tensor at its final offset at once; meanwhile the caller runs
    the finiteness check and the checksums (torch and ``os.pwrite`` both release the GIL).
    :meth:`finish` then writes the header and fsyncs; :meth:`abort` stops and deletes the file.

    Args:
        path: the (temporary) file to create; nothing may be there yet (``FileExistsError``).
        tensors: contiguous CPU tensors; they must not change until ``finish`` or ``abort``.
        state_json: the JSON part of the training state.
    """

    def __init__(self, path: str, tensors: Mapping[str, torch.Tensor], state_json: str) -> None:
        for name, t in tensors.items():
            if t.dtype not in DTYPES:
                raise SnapshotError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        self.path, self.tensors, self.state_json = path, tensors, state_json
        order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))  # largest items first: aligned
        self.entries, offset = [], 0
        for name in order:
            t = tensors[name]
            nbytes = t.numel() * t.element_size()
            self.entries.append(Entry(name, t.dtype, tuple(t.shape), offset, offset + nbytes))
            offset += nbytes
        self._header_len = len(self._header({n: "0" * WIDTH[ALGORITHM] for n in tensors}))
        self._cancel = threading.Event()
        self._error: Optional[BaseException] = None
        self._fd = create_new(path)  # new (O_EXCL | O_NOFOLLOW): nothing planted there is opened; 0o664 - umask
        self._thread = threading.Thread(target=self._write_data, name="safetrain-snapshot-writer", daemon=True)
        self._thread.start()

    def _header(self, sums: Mapping[str, str]) -> bytes:
        table: Dict[str, Any] = {
            "version": TABLE_VERSION,
            "algorithm": ALGORITHM,
            "state": f"{zlib.crc32(self.state_json.encode('utf-8')):08x}",
            "tensors": {n: sums[n] for n in sorted(sums)},
        }
        metadata = {STATE_KEY: self.state_json}
        table["header"] = header_digest(self.entries, metadata, table)  # fixed width: 64 hex digits
        raw = _header_bytes(self.entries, {**metadata, CHECKSUM_KEY: json.dumps(table)})
        return len(raw).to_bytes(8, "little") + raw

    def _write_data(self) -> None:
        try:
            base = self._header_len
            for e in self.entries:
                view, done = byte_view(self.tensors[e.name]), 0
                while done < len(view) and not self._cancel.is_set():
                    done += os.pwrite(self._fd, view[done : done + _CHUNK], base + e.begin + done)
        except BaseException as exc:  # reported by finish()
            self._error = exc

    def finish(self, sums: Mapping[str, str]) -> None:
        """Wait for the data, write the header with ``sums`` (from :func:`checksum`), fsync, close."""
        try:
            self._thread.join()
            if self._error is not None:
                raise self._error
            header = self._header(sums)
            if len(header) != self._header_len:  # cannot happen: every checksum has WIDTH[ALGORITHM] hex digits
                raise SnapshotError(f"{self.path}: internal error: header changed length while writing")
            _pwrite_all(self._fd, memoryview(header), 0)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def abort(self) -> None:
        """Stop writing, close and delete the file."""
        if self._fd < 0:
            return
        self._cancel.set()
        self._thread.join()
        os.close(self._fd)
        self._fd = -1
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _CHUNK], pos + done)


def read_tensors(
    header: Header, *, verify: bool = True, only: Optional[Set[str]] = None
) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Read tensors into fresh CPU memory (``pread``, no mmap) and check their checksums.

    A thread reads tensor after tensor while the calling thread checksums the ones already in
    memory, so the check hides behind the disk (or the page-cache copy on another core). Reading
    and writing (:class:`FileWriter`) go through ``os.preadv``/``os.pwrite`` on the tensors' own
    memory: no copy through Python bytes and no memory map, so no tensor keeps an old file alive.

    Args:
        header: from :func:`read_header`.
        verify: raise if a tensor's bytes fail their checksum.
        only: read just these tensors (default: all).

    Returns:
        ``(tensors, bad)``: tensors by name, and the names failing their checksum (empty when
        ``verify`` is true, since that raises instead).

    Raises:
        SnapshotError: the file changed size, cannot be read, or (with ``verify``) a tensor's
            bytes do not match its checksum.
    """
    table = header.checksums()  # validated: the algorithm is the one its table version names
    expected, algorithm = table["tensors"], table["algorithm"]
    entries = [e for e in header.entries if only is None or e.name in only]
    fd, size = open_regular(header.path)
    if size != header.size:
        os.close(fd)
        raise CorruptSnapshotError(f"{header.path}: the file changed size ({header.size} -> {size} bytes) while read")
    done_q: "queue.Queue[Any]" = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            for e in entries:
                if stop.is_set():
                    return
                done_q.put((e.name, _pread_tensor(fd, header, e)))
        except BaseException as exc:  # handed to the caller
            done_q.put(exc)

    thread = threading.Thread(target=reader, name="safetrain-snapshot-reader", daemon=True)
    thread.start()
    tensors: Dict[str, torch.Tensor] = {}
    bad: List[str] = []
    try:
        for _ in entries:
            item = done_q.get()
            if isinstance(item, BaseException):
                raise item
            name, t = item
            tensors[name] = t
            if checksum(t, algorithm) != expected[name]:
                bad.append(name)
    except OSError as exc:
        raise SnapshotError(f"{header.path}: cannot read: {exc.strerror or exc}") from None
    finally:
        stop.set()
        thread.join()
        os.close(fd)
    if bad and verify:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CorruptSnapshotError(
            f"{header.path}: tensor data fails its checksum: {', '.join(map(repr, bad[:3]))}{more}: corrupted"
        )
    return tensors, bad


def _pread_tensor(fd: int, header: Header, e: Entry) -> torch.Tensor:
    t = torch.empty(e.shape, dtype=e.dtype)
    view, pos, done = byte_view(t, into=True), header.data_start + e.begin, 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + _CHUNK]], pos + done)
        if got == 0:
            raise CorruptSnapshotError(f"{header.path}: truncated while reading tensor {e.name!r} (file changed?)")
        done += got
    return t
