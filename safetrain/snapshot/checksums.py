"""Checksums of snapshot bytes: ``xxh3_64`` for what is written, ``blocksum64`` for older files.

A snapshot file's header and a sharded snapshot's completion mark name the algorithm of their
checksums (``"algorithm"``, ``"checksum"``), so a file keeps the one it was written with:

* ``xxh3_64`` (written since 0.2.0): xxHash's XXH3, 64 bits (the ``xxhash`` package), of every byte,
  16 hex digits. A change to the bytes goes unnoticed only if the damaged bytes hash to the same 64
  bits, about 1 chance in 2**64 for any damage not built to collide: no class of accidental damage is
  favoured (it passes the SMHasher suite), so flipped bits, words or blocks swapped or moved anywhere,
  +1/-1 pairs, zeroed or repeated pages are each caught, as the tests show for every one of them.
  It is not a cryptographic hash: it catches accidents (disks, copies, truncation), not someone who
  rewrites the data and its checksum together.
* ``blocksum64`` (files written by 0.1.0; still read, never written): modular sums of 32 KiB blocks
  (:func:`blocksum64`). It misses any change that keeps every block's sum of 64-bit words, among them
  two words swapped inside one block and a +1/-1 pair inside one block.

Cost: ``xxh3_64`` runs at memory speed on one thread and releases the GIL while it hashes, so a
snapshot's writer and reader threads keep going beside it (``benchmarks/checksum.py``: at least as
fast as ``blocksum64``, which ran on torch's reductions).
"""

from __future__ import annotations

import zlib
from typing import Callable, Dict

import torch
import xxhash

from .tensors import byte_view

__all__ = ["ALGORITHM", "ALGORITHMS", "WIDTH", "checksum", "xxh3_64", "blocksum64"]

#: The algorithm new files are written with.
ALGORITHM = "xxh3_64"
#: Hex digits in a checksum of each algorithm (a file's header has a fixed length while it is written).
WIDTH: Dict[str, int] = {"xxh3_64": 16, "blocksum64": 40}

_BLOCK_WORDS = 4096
_MASK = 2**64 - 1


def xxh3_64(t: torch.Tensor) -> str:
    """XXH3 (64 bits, seed 0) of a contiguous CPU tensor's bytes, as 16 hex digits.

    Equal to ``xxhash.xxh3_64_hexdigest(t.numpy().tobytes())``: independent of the tensor's dtype,
    shape and alignment, only its bytes count. Detects any accidental change to them (a flipped bit,
    two words swapped, a +1/-1 pair) except with probability about ``2**-64``.

    Example::

        >>> import torch
        >>> xxh3_64(torch.zeros(0))
        '2d06800538d394c2'
    """
    return xxhash.xxh3_64_hexdigest(byte_view(t))


def blocksum64(t: torch.Tensor) -> str:
    """The ``blocksum64`` checksum of a contiguous CPU tensor's bytes (files written by 0.1.0).

    Kept to read older files. Over a tensor's bytes, with blocks of 4096 little-endian 64-bit words
    (32 KiB) and all sums modulo 2**64: ``c_j`` = sum of the words of block j (full blocks only),
    ``s1`` = sum of ``c_j``, ``s2`` = sum of ``(j + 1) * c_j``, and ``crc32`` of the remaining bytes;
    written as ``f"{s1:016x}{s2:016x}{crc:08x}"``. It catches a flipped bit, a zeroed page, whole
    blocks swapped; it misses any change that keeps each block's word sum: two words swapped inside
    one block, a +1/-1 pair inside one block.
    """
    data = t.reshape(-1).view(torch.uint8)
    n_blocks = data.numel() // (8 * _BLOCK_WORDS)
    head = n_blocks * 8 * _BLOCK_WORDS
    s1 = s2 = 0
    if n_blocks:
        words = data[:head]
        if words.data_ptr() % 8:  # int64 views need 8-byte alignment; a param inside a flat buffer may lack it
            words = words.clone()
        blocks = words.view(torch.int64).view(n_blocks, _BLOCK_WORDS).sum(1)  # int64 wraps: sums mod 2**64
        s1 = int(blocks.sum()) & _MASK
        s2 = int((blocks * torch.arange(1, n_blocks + 1)).sum()) & _MASK
    crc = zlib.crc32(byte_view(data[head:])) if head < data.numel() else 0
    return f"{s1:016x}{s2:016x}{crc:08x}"


#: Every algorithm this version reads, by the name a header or mark gives it.
ALGORITHMS: Dict[str, Callable[[torch.Tensor], str]] = {"xxh3_64": xxh3_64, "blocksum64": blocksum64}


def checksum(t: torch.Tensor, algorithm: str = ALGORITHM) -> str:
    """The checksum of a contiguous CPU tensor's bytes under ``algorithm`` (default: what is written).

    Raises:
        ValueError: ``algorithm`` is not one of :data:`ALGORITHMS` (callers check a file's
            algorithm when they read its header, and raise a snapshot error naming the file).
    """
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; expected one of {sorted(ALGORITHMS)}") from None
    return fn(t)
