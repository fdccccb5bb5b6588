"""The one lock of the run and snapshot directories (issue 26, point 4): who holds it, roles that
share it in one process, a stale holder taken over with a warning."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys

import pytest

from safetrain.rundir import RunDirBusy, lock_run_dir
from safetrain.rundir.dirlock import DirLock, describe_holder


def _busy(directory, holder):
    return RuntimeError(f"{directory}: held by {holder}")


def _record(lock: DirLock) -> str:
    return open(lock._path(), encoding="utf-8").read().strip()


def test_the_holder_is_named_and_a_second_run_of_this_process_refused(tmp_path):
    first = lock_run_dir(tmp_path)
    try:
        rec = json.loads(_record(first))
        assert rec["pid"] == os.getpid() and rec["host"] and rec["started"] > 0
        with pytest.raises(RunDirBusy) as info:
            lock_run_dir(tmp_path)
        text = str(info.value)
        assert f"log.dir={tmp_path}" in text and f"pid {os.getpid()} on host " in text and "started 20" in text
        assert "own log.dir" in text and "this very process" in text, "the holder may be a run not closed yet"
    finally:
        first.release()
    assert _record(first) == "", "let go: the lock file is emptied, no next taker reads it as stale"
    lock_run_dir(tmp_path).release()


def test_roles_share_the_lock_in_one_process_and_the_last_one_lets_it_go(tmp_path):
    """A run whose snapshot.dir is its log.dir: the run's lock and its store's are one."""
    run, snaps = DirLock(str(tmp_path), "run", _busy), DirLock(str(tmp_path), "snapshots", _busy)
    assert run.take() and snaps.take()
    run.release()
    assert _record(snaps), "still held by the store"
    with pytest.raises(RuntimeError, match="held by pid"):
        DirLock(str(tmp_path), "snapshots", _busy).take()
    snaps.release()
    assert _record(snaps) == ""
    assert DirLock(str(tmp_path), "snapshots", _busy).take(wait_error=False)


def test_a_lock_dropped_without_release_is_freed(tmp_path, caplog):
    """As a store garbage-collected unclosed freed its flock before the shared lock existed."""
    lock = DirLock(str(tmp_path), "run", _busy)
    lock.take()
    del lock
    gc.collect()
    again = DirLock(str(tmp_path), "run", _busy)
    with caplog.at_level(logging.WARNING, logger="safetrain"):
        assert again.take()
    assert "stale" not in caplog.text, "this process's own dropped lock is no stranger's"
    again.release()


def test_a_stale_holder_is_taken_over_with_a_warning_naming_it(tmp_path, caplog):
    """A killed run leaves its record (the kernel frees the flock of a dead process)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    lock = DirLock(str(tmp_path), "run", _busy)
    with open(lock._path(), "w", encoding="utf-8") as f:
        f.write(json.dumps({"host": "gpu7", "pid": pid, "started": 1.7e9, "dir": os.path.realpath(tmp_path)}) + "\n")
    with caplog.at_level(logging.WARNING, logger="safetrain"):
        assert lock.take()
    assert (
        f"stale lock: its holder (pid {pid} on host gpu7, started 2023-11-14" in caplog.text
        and str(tmp_path) in caplog.text
    )
    assert json.loads(_record(lock))["pid"] == os.getpid()
    lock.release()
    with caplog.at_level(logging.WARNING, logger="safetrain"):
        caplog.clear()
        lock.take()
        lock.release()
    assert "stale" not in caplog.text, "a lock let go cleanly is not stale"


def test_a_record_of_another_directory_or_an_older_safetrain_is_taken_over_silently(tmp_path, caplog):
    """A crashed run's directory removed, a new one reusing its inode; an old version never emptied the file."""
    lock = DirLock(str(tmp_path), "run", _busy)
    for old in ['{"host": "gpu7", "pid": 1, "started": 1.7e9, "dir": "/gone"}', "host gpu7 pid 1"]:
        with open(lock._path(), "w", encoding="utf-8") as f:
            f.write(old + "\n")
        with caplog.at_level(logging.WARNING, logger="safetrain"):
            assert lock.take()
        lock.release()
    assert "stale" not in caplog.text


def test_describe_holder_reads_old_and_damaged_records():
    assert describe_holder("host a pid 12\n") == "host a pid 12"
    assert describe_holder("") == "a process"
    assert describe_holder('{"pid": "x"}') == '{"pid": "x"}'
