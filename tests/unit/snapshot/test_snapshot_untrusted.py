"""Reading a snapshot someone else made (issue 36, "untrusted files are bounded and honest").

A shared snapshot directory, a file sent by a colleague, a planted file: each reproduction is a
small crafted file. Every size, count, dimension and offset is checked against limits and the
bytes present before anything is multiplied, allocated or written; the names in a completion
mark are plain file names of the snapshot; a FIFO where a file is expected is refused without
blocking; everything ``safetrain inspect`` prints from a file is escaped.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from safetrain.cli import main
from safetrain.errors import SnapshotError
from safetrain.snapshot import SafetensorsStore, TrainState, inspect_snapshot
from safetrain.snapshot.header import MAX_DIMS, read_header, read_layout
from tests.helpers.snapshots import edit_mark, rechecksum, set_offsets, sharded_snapshot


def _cli(*argv: str) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _within(seconds: float, fn: Callable[[], Any], fifo: Any = None) -> Any:
    """``fn()`` in a thread; fails the test if it takes longer (a reader blocked on ``fifo`` is released)."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:  # a writer end lets a blocked open() return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"took over {seconds} s (blocked?)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def _safetensors(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


# --- a safetensors header of many huge dimensions --------------------------------------------------


def test_a_header_of_many_huge_dimensions_is_refused_at_once(tmp_path):
    """Issue 36: a tensor of tens of thousands of huge dimensions and a final 0 had its element count
    multiplied out in full before any check: `safetrain inspect` took 11 s on a 1.7 MB file (cost
    quadratic in the header), and the store reads every `snapshot-*` header at start-up.

    Fails before: 5 to 13 s (by machine load) for this 840 KB file, as long again for the store;
    after: 0.04 s.
    """
    path = tmp_path / "snapshot-0000000001.safetensors"
    _safetensors(path, {"t": {"dtype": "F32", "shape": [2**62] * 40000 + [0], "data_offsets": [0, 0]}})
    start = time.perf_counter()
    code, _, err = _cli("inspect", str(path))
    assert code == 2 and "malformed header entry" in err and f"at most {MAX_DIMS}" in err, err
    assert len(err) < 600, "the error is cut short"
    with SafetensorsStore(tmp_path, keep=1) as store:
        assert store.foreign() == []  # unreadable: not another run's
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "shape,why",
    [
        ([1] * (MAX_DIMS + 1), "malformed header entry"),  # too many dimensions
        ([2**40, 2**40], "holds more than the 16 bytes"),  # an element count past the data
        ([2**62, 2**62, 2**62, 0], "holds more than"),  # no element, but strides past int64
        ([2**63], "holds more than"),  # a dimension past int64
    ],
)
def test_shapes_that_do_not_fit_the_file_or_torch_are_refused(tmp_path, shape, why):
    """Fails before: ([2**62]*3 + [0]) passed the header and made torch raise RuntimeError
    (stride overflow) when the tensor was allocated."""
    path = tmp_path / "x.safetensors"
    _safetensors(path, {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(SnapshotError, match=why):
        read_layout(str(path))


def test_empty_tensors_and_large_dimensions_beside_a_zero_still_read(tmp_path):
    path = tmp_path / "x.safetensors"
    _safetensors(
        path,
        {
            "a": {"dtype": "F32", "shape": [0, 4096], "data_offsets": [0, 0]},
            "b": {"dtype": "F32", "shape": [2**40, 0], "data_offsets": [0, 0]},
            "c": {"dtype": "I64", "shape": [2, 1], "data_offsets": [0, 16]},
        },
        bytes(16),
    )
    layout = read_layout(str(path))
    assert [(e.name, e.shape) for e in layout.entries] == [("a", (0, 4096)), ("b", (2**40, 0)), ("c", (2, 1))]
    assert all(torch.empty(e.shape, dtype=e.dtype).numel() == (2 if e.name == "c" else 0) for e in layout.entries)
    with pytest.raises(SnapshotError, match="not a safetrain snapshot"):
        read_header(str(path))


# --- what inspect prints is escaped ----------------------------------------------------------------


def test_inspect_escapes_every_string_it_prints_from_a_file(tmp_path):
    """Issue 36: strings from the file (optimizer type, extra keys, counters) were printed raw:
    escape sequences in a snapshot cleared the screen and printed a fake "snapshot OK".

    Fails before: the output held ESC characters.
    """
    evil = "\x1b[2J\x1b[H\u202e"
    model = nn.Linear(2, 1)
    opt_type = type(f"SGD{evil}", (torch.optim.SGD,), {})
    state = TrainState(model, opt_type(model.parameters(), lr=0.1))
    with SafetensorsStore(tmp_path, keep=1) as store:
        path = store.save(state, {"step": 3, f"seen{evil}": 1}, extra={f"key{evil}": 1}).path
    code, out, _ = _cli("inspect", path)
    assert code == 0, out
    assert "\x1b" not in out and "\u202e" not in out, repr(out)
    assert "SGD\\x1b[2J\\x1b[H\\u202e" in out and "key\\x1b[2J" in out and "seen\\x1b" in out, out
    assert inspect_snapshot(path)["optimizer"].endswith(f"SGD{evil}")  # the data itself is left as it is


def test_a_cli_error_quoting_a_file_is_escaped(monkeypatch):
    """An error message may quote what a file holds (a library's message, a name): the one line the
    CLI prints is escaped by the same function. Fails before: the ESC went to the terminal."""
    import safetrain.snapshot

    def damaged(path: str) -> None:
        raise SnapshotError(f"{path}: tensor name\x1b[2J\x1b[32m snapshot OK\n")

    monkeypatch.setattr(safetrain.snapshot, "inspect_snapshot", damaged)
    code, _, err = _cli("inspect", "x.safetensors")
    assert code == 2 and "\x1b" not in err and "name\\x1b[2J" in err and err.count("\n") == 1, repr(err)


# --- sharded snapshots: made in one process (DCP without a process group) ---------------------------


def test_a_sound_sharded_snapshot_inspects_and_exports(tmp_path):
    snap = sharded_snapshot(tmp_path)
    code, out, err = _cli("inspect", str(snap))
    assert code == 0 and "checksum   ok" in out and "finite     ok" in out, out + err
    assert _cli("export", str(snap), str(tmp_path / "m.safetensors"))[0] == 0


def test_sharding_offsets_past_the_bytes_present_are_refused_before_anything_is_allocated(tmp_path):
    """Issue 36: `saved_offsets` were never checked against the bytes present: a 301-byte snapshot
    made `safetrain export` write a 1 GB file and `inspect` allocate and scan 4 GB.

    Fails before: export wrote a 300 MB file and exited 0; inspect allocated 300 MB and said ok.
    """
    snap = sharded_snapshot(tmp_path)
    set_offsets(snap, "model/w", [25_000_000, 0])  # 25,000,004 x 3 float32: 300 MB, from 48 bytes
    out = tmp_path / "model.safetensors"
    start = time.perf_counter()
    code, _, err = _cli("export", str(snap), str(out))
    assert code == 2 and "model/w" in err and "more than the 12 element(s) its shards hold" in err, err
    assert not out.exists()
    code, _, err = _cli("inspect", str(snap))
    assert code == 2 and "more than the 12 element(s)" in err, err
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "offsets,why",
    [([0], r"saved_offsets \[0\] is not 2 integer"), ([0, -1], "is not 2 integer"), (None, "is not 2 integer")],
)
def test_malformed_sharding_offsets_are_refused_by_name(tmp_path, offsets, why):
    snap = sharded_snapshot(tmp_path)
    set_offsets(snap, "model/w", offsets)
    with pytest.raises(SnapshotError, match=why):
        from safetrain.distributed.inspection import inspect_sharded

        inspect_sharded(str(snap))


def test_mark_names_outside_the_snapshot_are_refused_never_read(tmp_path):
    """Issue 36: a mark's file names were joined onto the snapshot path unchecked: `../../file` and
    absolute paths were read and checksummed, and the verdict told whether they matched a guess.

    Fails before: inspect read both files and said "checksum ok" (the guess was right).
    """
    from safetrain.distributed.inspection import inspect_sharded
    from safetrain.distributed.verify import file_checksum

    secret = tmp_path / "secret.json"
    secret.write_text('{"token": "guess"}')
    snap = sharded_snapshot(tmp_path / "snaps")
    files = json.loads((snap / "safetrain.json").read_text())["files"]
    for name in ("../../secret.json", str(secret), "sub/../../../secret.json"):
        edit_mark(snap, files={**files, name: file_checksum(str(secret))})
        with pytest.raises(SnapshotError, match="the completion mark lists .*not the name of a file in the snapshot"):
            inspect_sharded(str(snap))


def test_a_link_in_the_snapshot_is_not_followed(tmp_path):
    """A file of the snapshot that is a link to a file elsewhere fails, its target unread.

    Fails before: the link was followed, checksummed and passed.
    """
    from safetrain.distributed.inspection import inspect_sharded
    from safetrain.distributed.verify import file_checksum

    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    snap = sharded_snapshot(tmp_path / "snaps")
    (snap / "rank-1.json").symlink_to(secret)
    edit_mark(
        snap,
        files={**json.loads((snap / "safetrain.json").read_text())["files"], "rank-1.json": file_checksum(str(secret))},
    )
    assert inspect_sharded(str(snap))["bad_checksums"] == ["rank-1.json"]
    (snap / "rank-1.json").unlink()
    shard = next(snap.glob("*.safetensors"))
    shard.rename(tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    edit_mark(
        snap,
        files={
            n: c for n, c in json.loads((snap / "safetrain.json").read_text())["files"].items() if n != "rank-1.json"
        },
    )
    with pytest.raises(SnapshotError, match="a symbolic link"):
        inspect_sharded(str(snap))


def test_a_fifo_in_place_of_a_snapshot_json_is_refused_without_blocking(tmp_path):
    """Issue 36: a FIFO in place of a sharded snapshot's JSON hung `inspect` (a plain open()).

    Fails before: inspect blocked (released by this test after 5 s).
    """
    snap = sharded_snapshot(tmp_path)
    fifo = snap / "rank-0.json"
    fifo.unlink()
    os.mkfifo(fifo)
    code, _, err = _within(5, lambda: _cli("inspect", str(snap)), fifo)
    assert code == 2 and "not a regular file (a FIFO)" in err, err


def test_a_huge_created_time_is_a_clear_error(tmp_path):
    """Issue 36: a huge `created` time in a sharded snapshot's mark was a traceback (OverflowError).

    Fails before: OverflowError escaped from `safetrain inspect`.
    """
    snap = sharded_snapshot(tmp_path, created=1e300)
    code, _, err = _cli("inspect", str(snap))
    assert code == 2 and "created 1e+300 is not a date" in err, err


def test_a_sharded_snapshot_prints_its_run_id_escaped(tmp_path):
    snap = sharded_snapshot(tmp_path, run_id="r1\x1b[2J\x1b[32msnapshot OK")
    code, out, _ = _cli("inspect", str(snap))
    assert code == 0 and "\x1b" not in out and "run r1\\x1b[2J" in out, repr(out)


@pytest.mark.parametrize("mark", [{"world": "x"}, {"world": 0}, {"files": {"../../rank-0.json": "0"}}])
def test_a_resume_from_a_planted_sharded_snapshot_is_a_clear_error(tmp_path, mark):
    """The loader reads the same mark: a malformed world (a ValueError before) or a name outside the
    snapshot is a CorruptSnapshotError, before anything is allocated or read."""
    from safetrain.distributed.loading import load_sharded

    snap = sharded_snapshot(tmp_path, **mark)
    with pytest.raises(SnapshotError, match="world|not the name of a file"):
        load_sharded(str(snap), object())


def test_a_rank_part_asking_for_a_tensor_its_shards_do_not_hold_is_refused_before_allocating(tmp_path):
    """A rank's JSON part names its own tensors' shapes; a load allocated them as written (here
    100 MB for a tensor no shard holds). Fails before: no check; the load went on (to the state)."""
    from safetrain.distributed.loading import load_sharded

    snap = sharded_snapshot(tmp_path)
    part = snap / "rank-0.json"
    part.write_text(json.dumps({**json.loads(part.read_text()), "own": {"rng": [[25_000_000], "torch.float32"]}}))
    rechecksum(snap)
    with pytest.raises(SnapshotError, match=r"own tensor 'rng' .* does not match the shards \(None\)"):
        load_sharded(str(snap), object())
