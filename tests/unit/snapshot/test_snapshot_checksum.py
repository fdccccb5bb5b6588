"""The snapshot checksum (issue 35, point 7): ``xxh3_64`` catches what ``blocksum64`` missed, and files
written with ``blocksum64`` by 0.1.0 still open.

``blocksum64`` sums 64-bit words per 32 KiB block: two words swapped inside one block, or a +1/-1
pair inside one block, leave every sum as it was. Each damage below is caught by ``xxh3_64``; the
two marked ``missed_before`` pass unnoticed under ``blocksum64`` (shown too, so the docstrings stay
true). Fails before: the swapped-word and +1/-1 cases (the store wrote ``blocksum64``).

The fixtures in ``tests/data`` were written by safetrain 0.1.0 (commit e6174df) with its own store:
``blocksum64.safetensors`` (``SafetensorsStore.save`` of ``nn.Linear(64, 130)`` after
``torch.manual_seed(0)``, ``SGD(lr=0.1)``, counters ``{"step": 5}``) and ``blocksum64-sharded``
(a one-rank sharded snapshot: ``model/weight`` = ``torch.randn(130, 64)`` after ``torch.manual_seed(1)``,
``model/bias`` zeros, its mark by ``write_mark``). Both tensors of 130x64 float32 hold one full
32 KiB block and a tail, so both halves of ``blocksum64`` are exercised.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from safetrain.cli import main
from safetrain.errors import SnapshotError
from safetrain.snapshot import SafetensorsStore, TrainState, inspect_snapshot, load_snapshot
from safetrain.snapshot.checksums import ALGORITHM, WIDTH, blocksum64, checksum, xxh3_64
from safetrain.snapshot.store import CorruptSnapshotError

DATA = Path(__file__).resolve().parents[2] / "data"
WORDS_PER_BLOCK = 4096  # 32 KiB of 8-byte words


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


def _flip_bit(t: torch.Tensor) -> None:
    t.view(torch.int32)[1000] ^= 1 << 7


def _swap_words_in_block(t: torch.Tensor) -> None:
    """Two 8-byte words exchanged inside the second 32 KiB block (a sum of the block cannot see it)."""
    w = _words(t)
    i, j = WORDS_PER_BLOCK + 10, WORDS_PER_BLOCK + 2000
    assert w[i] != w[j]
    w[[i, j]] = w[[j, i]].clone()


def _plus_minus_pair(t: torch.Tensor) -> None:
    """+1 on one 8-byte word, -1 on another of the same block: the block's sum is unchanged."""
    w = _words(t)
    w[5] += 1
    w[3000] -= 1


def _swap_blocks(t: torch.Tensor) -> None:
    b = t[: 8192 * 4].view(-1, 8192)  # 32 KiB blocks of float32
    b[[0, 1]] = b[[1, 0]].clone()


def _zero_page(t: torch.Tensor) -> None:
    t.view(torch.uint8)[8192:12288] = 0


def _flip_tail(t: torch.Tensor) -> None:
    t.view(torch.uint8)[-1] ^= 1


DAMAGE = [_flip_bit, _swap_words_in_block, _plus_minus_pair, _swap_blocks, _zero_page, _flip_tail]
MISSED_BEFORE = {_swap_words_in_block, _plus_minus_pair}


def _tensor() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(8192 * 5 + 2)  # five 32 KiB blocks and a tail of 8 bytes


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_xxh3_catches(damage: Callable[[torch.Tensor], None]) -> None:
    t = _tensor()
    damaged = t.clone()
    damage(damaged)
    assert not torch.equal(t, damaged)
    assert checksum(damaged) != checksum(t), damage.__name__


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_blocksum64_catches_all_but_changes_that_keep_every_block_sum(damage: Callable[[torch.Tensor], None]) -> None:
    """What the old docstring left out, kept true for the reader of older files."""
    t = _tensor()
    damaged = t.clone()
    damage(damaged)
    assert (blocksum64(damaged) == blocksum64(t)) == (damage in MISSED_BEFORE), damage.__name__


@settings(max_examples=60, deadline=None)
@given(
    n_words=st.integers(2, 3 * WORDS_PER_BLOCK),
    picks=st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
    kind=st.sampled_from(["swap", "plus_minus", "bit"]),
    seed=st.integers(0, 2**16),
)
def test_any_swap_pair_or_bit_anywhere_is_caught(n_words: int, picks: tuple, kind: str, seed: int) -> None:
    """The three classes at any positions and lengths (a swap of two equal words changes nothing: skipped)."""
    t = torch.from_numpy(np.random.default_rng(seed).integers(-(2**62), 2**62, n_words))
    i, j = (int(p * n_words) for p in picks)
    damaged = t.clone()
    if kind == "swap":
        damaged[[i, j]] = damaged[[j, i]].clone()
    elif kind == "plus_minus":
        damaged[i] += 1
        damaged[j if j != i else (i + 1) % n_words] -= 1
    else:
        damaged.view(torch.uint8)[8 * i + j % 8] ^= 1 << (j % 8)
    if torch.equal(damaged, t):
        return
    assert xxh3_64(damaged) != xxh3_64(t)


def test_xxh3_is_xxhash_of_the_bytes_whatever_the_layout() -> None:
    """The documented definition: XXH3-64 (seed 0) of the bytes; alignment and dtype do not matter."""
    torch.manual_seed(0)
    flat = torch.randn(70001)
    misaligned = flat[1:]  # a parameter inside a flat buffer: not 8-byte aligned
    expected = xxhash.xxh3_64_hexdigest(misaligned.numpy().tobytes())
    assert xxh3_64(misaligned) == xxh3_64(misaligned.clone()) == expected
    assert xxh3_64(misaligned.view(torch.uint8)) == expected
    assert xxh3_64(torch.empty(0)) == "2d06800538d394c2" and ALGORITHM == "xxh3_64"
    assert all(len(checksum(flat, a)) == WIDTH[a] for a in WIDTH)
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        checksum(flat, "md4")


def test_blocksum64_is_still_its_documented_definition() -> None:
    """Recomputed independently with numpy, so files of 0.1.0 keep reading."""
    torch.manual_seed(0)
    for t in (torch.randn(8192 * 5 + 3), torch.randn(70000)[1:], torch.empty(0)):
        a = t.numpy().tobytes()
        n_blocks = len(a) // (8 * 4096)
        head = n_blocks * 8 * 4096
        c = np.frombuffer(a[:head], dtype=np.uint64).reshape(n_blocks, 4096).sum(1, dtype=np.uint64)
        s1 = int(c.sum(dtype=np.uint64))
        s2 = int((c * np.arange(1, n_blocks + 1, dtype=np.uint64)).sum(dtype=np.uint64))
        crc = zlib.crc32(a[head:]) if head < len(a) else 0
        assert blocksum64(t) == f"{s1:016x}{s2:016x}{crc:08x}"


# -- files written by 0.1.0 (blocksum64) --------------------------------------------------------------


def _old_state() -> TrainState:
    model = nn.Linear(64, 130)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_file_written_by_0_1_0_still_loads_and_is_still_checked(tmp_path: Path) -> None:
    path = DATA / "blocksum64.safetensors"
    assert json.loads(_metadata(path)["safetrain.checksum"])["algorithm"] == "blocksum64"
    state = _old_state()
    info = load_snapshot(path, state)
    torch.manual_seed(0)
    expected = nn.Linear(64, 130)
    assert info.step == 5
    assert torch.equal(state.model.weight, expected.weight) and torch.equal(state.model.bias, expected.bias)
    assert inspect_snapshot(str(path))["checksum_ok"]

    damaged = tmp_path / "snapshot-0000000005.safetensors"
    shutil.copy(path, damaged)
    _flip_in(damaged, "model/weight")
    with pytest.raises(CorruptSnapshotError, match="fails its checksum"):
        load_snapshot(damaged, _old_state())


def test_new_files_name_xxh3_in_a_table_older_versions_refuse_by_its_version(tmp_path: Path) -> None:
    """A 0.1.0 reader meets table version 3 and says "written by a newer safetrain", not "corrupted";
    a table that names the other version's algorithm is refused (no file is read under the wrong one)."""
    with SafetensorsStore(tmp_path) as store:
        path = Path(store.save(_old_state(), {"step": 1}).path)
    table = json.loads(_metadata(path)["safetrain.checksum"])
    assert (table["version"], table["algorithm"]) == (3, "xxh3_64")
    assert all(len(v) == 16 for v in table["tensors"].values())
    _replace(path, b'\\"version\\": 3, \\"algorithm\\": \\"xxh3_64', b'\\"version\\": 2, \\"algorithm\\": \\"xxh3_64')
    with pytest.raises(SnapshotError, match="checksum metadata is malformed"):
        load_snapshot(path, _old_state())


def _metadata(path: Path) -> dict:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])["__metadata__"]


def _flip_in(path: Path, name: str) -> None:
    """Flip a low mantissa bit in the middle of tensor ``name``'s bytes (still finite: only a checksum sees it)."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    data[8 + n + (begin + end) // 2 // 4 * 4] ^= 0x01
    path.write_bytes(bytes(data))


def _replace(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new), (old, new)
    path.write_bytes(data.replace(old, new))


def _cli(*argv: str) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_sharded_snapshot_written_by_0_1_0_still_verifies(tmp_path: Path) -> None:
    from safetrain.distributed.verify import verify_files

    snap = tmp_path / "step-0000000003"
    shutil.copytree(DATA / "blocksum64-sharded" / "step-0000000003", snap)
    mark = json.loads((snap / "safetrain.json").read_text())
    assert mark["checksum"] == "blocksum64"
    assert verify_files(str(snap), mark)
    code, out, err = _cli("inspect", str(snap))
    assert code == 0 and "checksum   ok" in out, out + err

    shard = next(snap.glob("shard-*.safetensors"))
    _flip_in(shard, "model/weight")
    with pytest.raises(CorruptSnapshotError, match=f"{shard.name} fails its checksum"):
        verify_files(str(snap), mark)
    with pytest.raises(CorruptSnapshotError, match="'sha3'.*newer safetrain"):
        verify_files(str(snap), {**mark, "checksum": "sha3"})


def test_a_new_sharded_mark_records_xxh3_of_each_whole_file(tmp_path: Path) -> None:
    from safetrain.distributed.verify import checksum_files, file_checksum, verify_files

    snap = tmp_path / "step-0000000003"
    shutil.copytree(DATA / "blocksum64-sharded" / "step-0000000003", snap)
    files = checksum_files(str(snap), None)
    for name, value in files.items():
        assert value == xxhash.xxh3_64_hexdigest((snap / name).read_bytes()) == file_checksum(str(snap / name))
    assert verify_files(str(snap), {"checksum": "xxh3_64", "files": files})
