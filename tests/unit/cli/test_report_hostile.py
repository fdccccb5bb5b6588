"""Journals and metrics files that safetrain did not write itself (issue 26, points 1 and 5): each
record is checked once where it is read, what cannot be used is skipped and named, and the
report, its cross-check and the plot work from the rest. A journal cut by a kill or a full disk
says so, and the next run mends it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from safetrain.cli import main
from safetrain.cli.report import format_report, reconcile
from safetrain.events import AnomalyFound, RunEnded, RunStarted
from safetrain.rundir import Journal, ReportError, Skipped, read_run
from safetrain.rundir.records import Unsound, sound_event, sound_metrics_row, sound_summary

ROOT = Path(__file__).resolve().parents[3]
HEADER = "step,epoch,batch,loss,grad_norm,lr_scale,trained,action"
CUT = "the last line was cut; the run ended on a full disk or a kill"


def make_run(root: Path, summary: bool = True) -> Path:
    """A closed run of 4 steps: a start, a dropped row at step 2, the end; and its metrics."""
    journal = Journal(root / "events.jsonl")
    for event in (
        RunStarted(step=0, epoch=0, batch=-1, kind="run", action="start", message="m", detail={"run_id": "r1"}),
        AnomalyFound(step=2, epoch=0, batch=1, kind="input", action="drop_rows", message="m", detail={"count": 1}),
        RunEnded(step=4, epoch=0, batch=3, kind="run", action="done", message="m"),
    ):
        journal.write(event.to_dict())
    journal.close({"steps": 4, "dropped_rows": 1, "restores": 0, "events": 3} if summary else None)
    rows = [f"{s},0,{s - 1},{1 / s:.3f},0.5,1,1,{'drop_rows' if s == 2 else ''}" for s in range(1, 5)]
    (root / "metrics.csv").write_text("\n".join([HEADER, *rows]) + "\n")
    return root


def insert_lines(path: Path, at: int, *lines: bytes) -> None:
    """Put ``lines`` before the 1-based line ``at`` of ``path``."""
    old = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(old[: at - 1] + list(lines) + old[at - 1 :]))


@pytest.mark.parametrize(
    "line,reason",
    [
        ('{"event": "anomaly", "step": "41", "kind": "loss"}', "step is not an integer >= 0 (got '41')"),
        ('{"event": "anomaly", "step": null, "kind": "loss"}', "step is not an integer >= 0 (got None)"),
        ('{"event": "anomaly", "step": 2.5}', "step is not an integer >= 0 (got 2.5)"),
        ('{"event": "anomaly", "step": -3}', "step is not an integer >= 0 (got -3)"),
        ('{"event": "anomaly", "step": 1e999}', "step is not an integer >= 0 (got inf)"),
        ('{"event": "anomaly", "step": NaN}', "step is not an integer >= 0 (got nan)"),
        ('{"event": "anomaly", "step": 3, "detail": [1, 2]}', "detail is not an object (got [1, 2])"),
        ('{"event": "run_started", "step": 0, "detail": {"run_id": 7}}', "detail.run_id is not a short printable"),
        ('{"event": "anomaly", "step": 3, "kind": "input", "detail": {"count": "2"}}', "detail.count is not an"),
        ('{"event": "anomaly", "step": 3, "kind": ["loss"]}', "kind is not a short printable string"),
        ('{"event": "anomaly", "step": 3, "action": "a\\u0000b"}', "action is not a short printable string"),
        ('{"event": "anomaly", "step": 3, "epoch": true}', "epoch is not an integer >= -1 (got True)"),
        ('{"event": "anomaly", "step": 3, "time": "noon"}', "time is not a finite number (got 'noon')"),
        ('{"step": 3}', "event is missing"),
        ('[{"event": "anomaly", "step": 3}]', "not a JSON object (got [{"),
        ('{"event": "anomaly", "step": 3', "not JSON (Expecting ',' delimiter at column 31)"),
        ("[" * 100_000, "not JSON this reader can hold (nested too deeply)"),
        ('{"event": "summary", "steps": "many"}', "summary steps is not an integer >= 0 (got 'many')"),
        ('{"event": "summary", "aborted": "no"}', "summary aborted is not true or false (got 'no')"),
    ],
)
def test_an_unsound_journal_line_is_skipped_and_named(tmp_path, line, reason):
    """The issue's examples (a string or null step, a list detail) and their kin, in the middle of a journal."""
    insert_lines(make_run(tmp_path) / "events.jsonl", 2, line.encode())
    run = read_run(tmp_path)
    assert [s.line for s in run.skipped] == [2] and reason in run.skipped[0].reason, run.skipped
    assert [e["event"] for e in run.events] == ["run_started", "anomaly", "run_ended"], "the sound records are kept"
    assert run.summary is not None and run.summary["steps"] == 4 and run.cut_at is None
    assert reconcile(run)["dropped_rows"] == (1, 1), "the cross-check works from the sound records"
    text = format_report(run)
    assert f"1 journal line skipped: line 2: {run.skipped[0].reason}" in text
    assert "drop_rows" in text


def test_a_line_that_is_not_utf8_is_skipped(tmp_path):
    insert_lines(make_run(tmp_path) / "events.jsonl", 3, b'{"event": "anomaly", "step": 3, "message": "\xff\xfe"}')
    assert read_run(tmp_path).skipped == [Skipped(3, "not UTF-8 (byte 45)")]


def test_a_line_holding_a_unicode_line_separator_is_one_line(tmp_path):
    """JSON may hold U+2028 unescaped (another tool's ``ensure_ascii=False``); str.splitlines splits there."""
    record = {"event": "anomaly", "step": 3, "kind": "loss", "message": "a\u2028b\x85c"}
    insert_lines(make_run(tmp_path) / "events.jsonl", 3, json.dumps(record, ensure_ascii=False).encode())
    run = read_run(tmp_path)
    assert run.skipped == [] and run.events[2]["message"] == "a\u2028b\x85c"


def test_skipped_lines_show_the_first_three_and_count_the_rest(tmp_path):
    bad = [json.dumps({"event": "anomaly", "step": f"s{i}"}).encode() for i in range(5)]
    insert_lines(make_run(tmp_path) / "events.jsonl", 2, *bad)
    text = format_report(read_run(tmp_path))
    assert (
        "5 journal lines skipped: line 2: step is not an integer >= 0 (got 's0'); "
        "line 3: step is not an integer >= 0 (got 's1'); line 4: step is not an integer >= 0 (got 's2'); and 2 more"
    ) in text


def test_unknown_events_and_fields_are_kept(tmp_path):
    """A newer version's event and an extra field are sound: shown, not skipped."""
    record = {"event": "upload", "step": 3, "kind": "checkpoint", "action": "sent", "bucket": "s3://x"}
    insert_lines(make_run(tmp_path) / "events.jsonl", 3, json.dumps(record).encode())
    run = read_run(tmp_path)
    assert run.skipped == [] and run.events[2]["bucket"] == "s3://x" and run.events[2]["epoch"] == -1
    assert "upload" in format_report(run)


def test_a_metrics_field_over_the_csv_limit_costs_one_row(tmp_path):
    """csv refuses a field over 131072 characters; read_run raised _csv.Error for the whole file."""
    make_run(tmp_path)
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("5,0,4,0.2,0.5,1,1," + "x" * 200_000 + "\n6,0,5,0.1,0.5,1,1,\n")
    run = read_run(tmp_path)
    assert run.metrics is not None and run.metrics["step"] == [1.0, 2.0, 3.0, 4.0, 6.0]
    assert run.metrics_skipped == [Skipped(6, "not a CSV row (field larger than field limit (131072))")]
    assert "1 metrics.csv line skipped: line 6: not a CSV row" in format_report(run)


@pytest.mark.parametrize(
    "row,reason",
    [
        ("5,0,4,0.2,0.5", "5 cells, expected 8"),
        ("5,0,4,0.2,0.5,1,1,,extra", "9 cells, expected 8"),
        ("five,0,4,0.2,0.5,1,1,", "step is not a number (got 'five')"),
        ("5.5,0,4,0.2,0.5,1,1,", "step is not an integer >= 0 (got '5.5')"),
        ("1e999,0,4,0.2,0.5,1,1,", "step is not an integer >= 0 (got '1e999')"),
        ("5,0,4,low,0.5,1,1,", "loss is not a number (got 'low')"),
        ("5,0,4,0.2,0.5,1,2,", "trained is not 0 or 1 (got '2')"),
        ("5,0,4,0.2,0.5,1,1,a\x01b", "action is not a short printable string"),
    ],
)
def test_a_metrics_row_of_the_wrong_shape_is_skipped_and_named(tmp_path, row, reason):
    make_run(tmp_path)
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write(row + "\n")
    run = read_run(tmp_path)
    assert run.metrics is not None and len(run.metrics["step"]) == 4
    assert [s.line for s in run.metrics_skipped] == [6] and reason in run.metrics_skipped[0].reason


def test_a_metrics_header_without_the_columns_is_not_used(tmp_path):
    make_run(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,epoch,batch,grad_norm\n1,0,0,0.5\n")
    run = read_run(tmp_path)
    assert run.metrics is None and run.metrics_note.startswith("its header lacks loss, lr_scale, trained, action")
    assert "metrics.csv not used: its header lacks loss" in format_report(run)
    assert "steps" not in reconcile(run), "no rows, no cross-check of the step count"


def test_a_metrics_header_in_another_order_is_read_by_name(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"event": "run_started", "step": 0}\n')
    (tmp_path / "metrics.csv").write_text(
        "loss,step,epoch,batch,grad_norm,lr_scale,trained,action,extra\n0.5,1,0,0,1,1,1,,z\n"
    )
    assert read_run(tmp_path).metrics["loss"] == [0.5]


def test_the_summary_is_read_into_its_types():
    s = sound_summary({"event": "summary", "steps": 3.0, "final_loss": "nan", "error": "E:\n  a\tb", "x": [1]})
    assert s["steps"] == 3 and type(s["steps"]) is int and math.isnan(s["final_loss"])
    assert s["error"] == "E: a b" and s["x"] == [1] and "event" not in s
    with pytest.raises(Unsound, match="summary restores is not an integer >= 0"):
        sound_summary({"restores": -1})


def test_a_sound_event_has_every_known_field():
    e = sound_event({"event": "anomaly", "step": 4, "detail": None})
    known = {"event": "anomaly", "step": 4, "epoch": -1, "batch": -1, "rank": 0, "kind": "", "action": ""}
    assert e == {**known, "message": "", "detail": {}, "time": None}
    row = sound_metrics_row(HEADER.split(","), "3,0,2,nan,-inf,1,0,skip_batch".split(","))
    assert row[:3] == [3.0, 0.0, 2.0] and math.isnan(row[3]) and row[4:] == [-math.inf, 1.0, 0.0, "skip_batch"]


# -- point 5: a journal cut by a full disk or a kill -----------------------------------------------


def test_a_cut_journal_says_so_and_the_next_run_mends_it(tmp_path):
    """A kill or a full disk leaves the last line without its end; the report says how the run ended,
    and the next run's Journal ends that line first, so that its own records are whole lines."""
    make_run(tmp_path, summary=False)
    path = tmp_path / "events.jsonl"
    whole = len(path.read_bytes().split(b"\n"))
    with open(path, "ab") as f:  # what a write cut by ENOSPC or SIGKILL leaves: part of a line
        f.write(json.dumps({"event": "anomaly", "step": 5, "kind": "loss"}).encode()[:23])
    run = read_run(tmp_path)
    assert run.cut_at == whole and run.skipped == [] and len(run.events) == 3
    assert f"{CUT} (line {whole};" in format_report(run)
    assert main(["report", "--no-plot", str(tmp_path)]) == 0

    journal = Journal(path)  # the next run (a resume) appends
    journal.write(RunStarted(step=4, epoch=0, batch=3, kind="run", action="resume", message="m").to_dict())
    journal.close({"steps": 6})
    run = read_run(tmp_path)
    assert run.cut_at is None and [s.line for s in run.skipped] == [whole], "the cut line is now a line of its own"
    assert run.skipped[0].reason.startswith("not JSON") and run.runs == 2 and run.summary == {"steps": 6}
    assert CUT not in format_report(run) and f"1 journal line skipped: line {whole}: not JSON" in format_report(run)


def test_a_cut_multibyte_character_is_a_cut_line(tmp_path):
    make_run(tmp_path, summary=False)
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write('{"event": "anomaly", "message": "\u00e9'.encode()[:-1])
    run = read_run(tmp_path)
    assert run.cut_at is not None and run.skipped == []


def test_a_whole_last_line_without_its_newline_is_read(tmp_path):
    """A hand-written file may lack the final newline; a whole JSON record there is sound, not cut."""
    (tmp_path / "events.jsonl").write_text('{"event": "run_started", "step": 0}\n{"event": "anomaly", "step": 1}')
    run = read_run(tmp_path)
    assert run.cut_at is None and len(run.events) == 2


def test_a_plot_that_cannot_be_written_is_a_report_error(tmp_path):
    """A run directory read-only to the reader: the table is printed, the plot is a one-line note."""
    pytest.importorskip("matplotlib")
    from safetrain.cli.plot import plot_run

    with pytest.raises(ReportError, match="cannot write the plot"):
        plot_run(read_run(make_run(tmp_path)), tmp_path / "gone" / "report.png")


# -- the command, in a real process ---------------------------------------------------------------


def test_report_in_a_real_process_prints_no_traceback(tmp_path):
    """Every kind of damage at once, through `python -m safetrain.cli report`: exit 0, the report, what
    was skipped and the cut line named; a missing directory is one line and exit 2."""
    make_run(tmp_path, summary=False)
    insert_lines(
        tmp_path / "events.jsonl",
        2,
        b'{"event": "anomaly", "step": "41"}',
        b'{"event": "anomaly", "step": null}',
        b'{"event": "run_started", "step": 0, "detail": [1]}',
        b"\xff\xfe not utf-8",
        b"",
        b'{"event": "anomaly", "step": 7, "kind": "loss", "action": "skip_batch", "loss": NaN, "x": {"y": [[]]}}',
    )
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"event": "anomaly", "st')
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("5,0,4,0.2,0.5,1,1," + "x" * 140_000 + "\n6,0\nsix,0,5,0.1,0.5,1,1,\n")
    proc = subprocess.run(
        [sys.executable, "-m", "safetrain.cli", "report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "4 journal lines skipped: line 2: step is not an integer >= 0 (got '41'); line 3:" in proc.stdout
    assert "3 metrics.csv lines skipped: line 6: not a CSV row" in proc.stdout
    assert CUT in proc.stdout and "skip_batch" in proc.stdout, "the sound anomaly at step 7 is in the table"
    assert proc.stderr == "" or proc.stderr.startswith("safetrain report: note:"), proc.stderr

    proc = subprocess.run(
        [sys.executable, "-m", "safetrain.cli", "report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no such run directory" in proc.stderr
