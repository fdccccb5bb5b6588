"""safetrain.rundir: atomic writes leave a file whole or absent; the journal and metrics writers; file names."""

from __future__ import annotations

import json
import math
import os

import pytest

from safetrain import rundir
from safetrain.rundir import (
    AtomicFile,
    Journal,
    MetricsWriter,
    atomic_write_bytes,
    atomic_write_text,
    atomicfile,
    journal_path,
)


def listing(directory):
    return sorted(os.listdir(directory))


def test_atomic_write_creates_and_replaces_whole_files(tmp_path):
    path = tmp_path / "quarantine.json"
    atomic_write_text(path, json.dumps({"indices": [3, 7]}, indent=1))
    assert json.loads(path.read_text()) == {"indices": [3, 7]}
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    atomic_write_bytes(path, b"\x00third")
    assert path.read_bytes() == b"\x00third"
    assert listing(tmp_path) == ["quarantine.json"], "no temporary file is left"


@pytest.mark.parametrize("fails", ["write", "fsync", "replace"])
def test_a_failing_write_leaves_the_old_content_and_no_temporary_file(tmp_path, monkeypatch, fails):
    path = tmp_path / "state.json"
    atomic_write_text(path, "old")

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fails == "fsync":
        monkeypatch.setattr(rundir.os, "fsync", boom)
    elif fails == "replace":
        monkeypatch.setattr(rundir.os, "replace", boom)
    with pytest.raises(TypeError if fails == "write" else OSError):
        atomic_write_bytes(path, "not bytes" if fails == "write" else b"new")  # a str fails inside the write
    monkeypatch.undo()
    assert path.read_text() == "old", f"{fails}: the old file is intact"
    assert listing(tmp_path) == ["state.json"], f"{fails}: the temporary file is removed"


def test_a_failing_first_write_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "new.json", "{}")
    assert listing(tmp_path) == []


def test_the_rename_comes_before_the_directory_fsync(tmp_path, monkeypatch):
    calls = []
    real_replace, real_fsync_dir = os.replace, atomicfile.fsync_dir
    monkeypatch.setattr(rundir.os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b)))
    monkeypatch.setattr(
        atomicfile, "fsync_dir", lambda d: (calls.append(("fsync_dir", os.fspath(d))), real_fsync_dir(d))
    )
    atomic_write_text(tmp_path / "f.txt", "x")
    assert calls == ["replace", ("fsync_dir", os.fspath(tmp_path))]


def test_atomic_file_without_commit_removes_the_temporary_file(tmp_path):
    path = tmp_path / "snapshot.bin"
    with AtomicFile(path, prefix=".tmp-snap-") as target:
        assert os.path.dirname(target.tmp) == os.fspath(tmp_path), "the temporary file is beside the target"
        assert os.path.basename(target.tmp).startswith(".tmp-snap-")
        with open(target.tmp, "wb") as f:
            f.write(b"given up")
    assert listing(tmp_path) == [] and not target.committed
    with pytest.raises(RuntimeError):
        with AtomicFile(path) as target:
            open(target.tmp, "wb").close()
            raise RuntimeError("the writer failed")
    assert listing(tmp_path) == []


def test_atomic_file_commit_with_the_callers_rename(tmp_path):
    path, renamed = tmp_path / "final.bin", []

    def replace(src, dst):
        renamed.append((os.path.basename(src), os.path.basename(dst)))
        os.replace(src, dst)

    with AtomicFile(path, tmp=tmp_path / ".tmp-chosen") as target:
        (tmp_path / ".tmp-chosen").write_bytes(b"whole")
        target.commit(replace=replace)
    assert renamed == [(".tmp-chosen", "final.bin")] and target.committed
    assert path.read_bytes() == b"whole" and listing(tmp_path) == ["final.bin"]


def test_journal_path_names_each_rank():
    assert journal_path("runs/a") == journal_path("runs/a", 0) == rundir.Path("runs/a/events.jsonl")
    assert journal_path("runs/a", 3).name == "events-rank3.jsonl"


def test_journal_writes_a_line_per_record_and_a_closing_summary(tmp_path):
    journal = Journal(tmp_path / "sub" / "events.jsonl")  # the directory is created
    journal.write({"event": "anomaly", "step": 1, "loss": math.nan, "detail": {"norm": math.inf}})
    assert (tmp_path / "sub" / "events.jsonl").read_text().count("\n") == 1, "flushed per line"
    journal.close({"steps": 2, "final_loss": -math.inf})
    journal.close({"steps": 3})  # idempotent: nothing more is written
    with pytest.raises(ValueError, match="closed"):
        journal.write({"event": "late"})
    lines = [json.loads(x) for x in (tmp_path / "sub" / "events.jsonl").read_text().splitlines()]
    assert lines == [
        {"event": "anomaly", "step": 1, "loss": "nan", "detail": {"norm": "inf"}},
        {"event": "summary", "steps": 2, "final_loss": "-inf"},
    ], "non-finite floats as strings"
    run = rundir.read_run(tmp_path / "sub")
    assert run.summary == {"steps": 2, "final_loss": -math.inf}, "the reader reads the spelling back as a float"
    assert len(run.events) == 1 and run.cut_at is None


def test_metrics_writer_rows_header_once_and_flush(tmp_path):
    path = tmp_path / "metrics.csv"
    metrics = MetricsWriter(path)
    metrics.write(0, 0, 0, 0.5, 1.25, 1.0, True, "")
    assert path.read_text() == "", "healthy rows are buffered"
    metrics.write(1, 0, 1, math.nan, math.inf, 0.5, False, "skip_batch", flush=True)
    assert path.read_text().count("\n") == 3, "an eventful row flushes every row so far"
    metrics.close()
    metrics.close()
    resumed = MetricsWriter(path)  # a resume appends, without a second header
    resumed.write(2, 1, 0, 0.25, 0.75, 1.0, True, "")
    resumed.close()
    assert path.read_text().splitlines() == [
        "step,epoch,batch,loss,grad_norm,lr_scale,trained,action,clipped_to",
        "0,0,0,0.5,1.25,1,1,,nan",
        "1,0,1,nan,inf,0.5,0,skip_batch,nan",
        "2,1,0,0.25,0.75,1,1,,nan",
    ]
    (tmp_path / "events.jsonl").write_text('{"event": "run_started"}\n')
    m = rundir.read_run(tmp_path).metrics
    assert m["step"] == [0.0, 1.0, 2.0] and m["action"] == ["", "skip_batch", ""]


def test_metrics_rows_reach_the_os_every_flush_every_rows(tmp_path):
    """Fails before: rows stayed in the buffer until an eventful step (a killed run lost them)."""
    w = MetricsWriter(tmp_path / "metrics.csv", flush_every=3)
    for i in range(3):
        w.write(i, 0, i, 1.0, 1.0, 1.0, True, "")
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 4
    w.close()
    w.close()


def test_metrics_appended_to_an_earlier_versions_file_keep_its_columns(tmp_path):
    """A resume into a run directory an earlier version began: its header has no clipped_to, and
    a row with one cell more would be skipped by the reader as unsound."""
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,batch,loss,grad_norm,lr_scale,trained,action\n0,0,0,0.5,1.25,1,1,\n")
    resumed = MetricsWriter(path)
    resumed.write(1, 0, 1, 0.25, 0.75, 1.0, True, "", clipped_to=0.5)
    resumed.close()
    assert path.read_text().splitlines()[-1] == "1,0,1,0.25,0.75,1,1,"
    (tmp_path / "events.jsonl").write_text('{"event": "run_started"}\n')
    assert rundir.read_run(tmp_path).metrics["step"] == [0.0, 1.0]
