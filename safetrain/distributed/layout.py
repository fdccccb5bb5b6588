"""A sharded snapshot's tensors as its shard files describe them, read without trust.

DCP's ``HuggingFaceStorageReader`` takes each tensor's full size from the shards' sharding
metadata (``DCP_SHARDING_INFO``: each shard's ``saved_offsets``) without checking it against
anything: one shard of one element saved "at offset 10**9" makes a reader allocate a tensor of
10**9 elements (a 301-byte snapshot had ``safetrain export`` write a 1 GB file). Every reader that
allocates from the layout (:mod:`.inspection`, :mod:`.export`, the own tensors of :mod:`.loading`)
takes it from :func:`shard_layout` instead, which checks, before anything is allocated:

* every ``*.safetensors`` entry of the directory (the files DCP's reader opens) is a regular file
  in it, not a link, FIFO or device, and its header is sound and bounded (:func:`safetrain.
  snapshot.header.read_layout`: every tensor's bytes present);
* every tensor's ``saved_offsets`` are as many integers >= 0 as it has dimensions;
* every key's chunks agree on dtype and number of dimensions, and the full tensor they describe
  holds no more elements than its chunks do (so what is allocated is bounded by the bytes present;
  a gap the chunks leave reads as zeros, not as memory left over).
"""

from __future__ import annotations

import os
import stat
from typing import Any, Dict, List, Tuple

import torch

from ..snapshot.header import MAX_DIMS, numel_within, parse_json, read_layout
from ..snapshot.store import CorruptSnapshotError

__all__ = ["Layout", "shard_layout", "shard_files"]

#: ``key -> (full size, dtype)`` of every tensor of a sharded snapshot.
Layout = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]

_SUFFIX = ".safetensors"  # the files DCP's HuggingFaceStorageReader reads: every name ending so
_SHARDING = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY
_OFFSETS = "saved_offsets"  # ... SAVED_OFFSETS_KEY
_MAX_INDEX = 2**63 - 1


def shard_files(snap: str) -> List[str]:
    """The paths of ``snap``'s shard files (every entry named ``*.safetensors``), each a regular file.

    Raises:
        CorruptSnapshotError: one is a link, a directory, a FIFO or a device.
    """
    try:
        names = sorted(n for n in os.listdir(snap) if n.endswith(_SUFFIX))
    except OSError as exc:
        raise CorruptSnapshotError(f"{snap}: cannot list the snapshot: {exc.strerror or exc}") from None
    paths = [os.path.join(snap, n) for n in names]
    for path in paths:
        try:
            mode = os.lstat(path).st_mode
        except OSError as exc:
            raise CorruptSnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
        if not stat.S_ISREG(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise CorruptSnapshotError(
                f"{path}: {what}; a sharded snapshot's shard files are regular files in its directory"
            )
    return paths


def shard_layout(snap: str) -> Layout:
    """Every tensor of the sharded snapshot ``snap``: its full size and dtype, checked against the
    bytes its shard files hold (see the module docstring).

    Raises:
        CorruptSnapshotError: a shard file is not a regular file or not sound safetensors, or its
            sharding metadata does not fit the tensors and bytes present; the message names the
            file or the tensor.
    """
    sizes: Dict[str, List[int]] = {}
    dtypes: Dict[str, torch.dtype] = {}
    held: Dict[str, int] = {}
    for path in shard_files(snap):
        header = read_layout(path)
        offsets = _offsets(path, header.metadata)
        for e in header.entries:
            if offsets is not None and e.name not in offsets:
                raise CorruptSnapshotError(f"{path}: tensor {e.name!r} is missing from the {_SHARDING} metadata")
            at = offsets[e.name] if offsets is not None else [0] * len(e.shape)
            if not _ints(at, len(e.shape)):
                raise CorruptSnapshotError(
                    f"{path}: tensor {e.name!r}: {_OFFSETS} {at!r:.80} is not {len(e.shape)} integer(s) >= 0 "
                    "(one per dimension): corrupted"
                )
            ends = [o + n for o, n in zip(at, e.shape)]
            if e.name not in sizes:
                sizes[e.name], dtypes[e.name], held[e.name] = ends, e.dtype, 0
            elif dtypes[e.name] != e.dtype or len(sizes[e.name]) != len(ends):
                raise CorruptSnapshotError(
                    f"{path}: tensor {e.name!r}: a {e.dtype} shard of {len(ends)} dimension(s), where another "
                    f"shard is {dtypes[e.name]} of {len(sizes[e.name])}: corrupted"
                )
            else:
                sizes[e.name] = [max(a, b) for a, b in zip(sizes[e.name], ends)]
            held[e.name] += (e.end - e.begin) // e.dtype.itemsize
    layout: Layout = {}
    for name, size in sizes.items():
        full = tuple(size)
        if numel_within(full, held[name]) is None:
            raise CorruptSnapshotError(
                f"{snap}: tensor {name!r}: its shards' offsets describe a tensor of size {list(full)!r:.120}, "
                f"more than the {held[name]} element(s) its shards hold: corrupted"
            )
        layout[name] = (full, dtypes[name])
    return layout


def _offsets(path: str, metadata: Dict[str, str]) -> Any:
    """The shard's ``saved_offsets`` by tensor name, or ``None`` without sharding metadata."""
    if _SHARDING not in metadata:
        return None
    info = parse_json(metadata[_SHARDING], path, f"the {_SHARDING} metadata")
    if not isinstance(info, dict) or not all(isinstance(v, dict) and _OFFSETS in v for v in info.values()):
        raise CorruptSnapshotError(f"{path}: the {_SHARDING} metadata is not a map of {{{_OFFSETS}: [...]}}: corrupted")
    return {name: v[_OFFSETS] for name, v in info.items()}


def _ints(values: Any, n: int) -> bool:
    return (
        isinstance(values, list)
        and len(values) == n <= MAX_DIMS
        and all(not isinstance(v, bool) and isinstance(v, int) and 0 <= v <= _MAX_INDEX for v in values)
    )
