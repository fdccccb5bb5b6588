"""Run directories: read defensively (rundir), the event table and cross-check (report), the plot."""

from __future__ import annotations

import json
import sys

import pytest

from safetrain.cli.plot import PlotUnavailable, plot_run
from safetrain.cli.report import event_table, format_report, reconcile
from safetrain.events import AnomalyFound, Restored, RunEnded, RunStarted, SnapshotTaken
from safetrain.rundir import Journal, ReportError, read_run

HEADER = "step,epoch,batch,loss,grad_norm,lr_scale,trained,action"

# (step, event class, kind, action, detail); step 3 has NaN loss, steps 6-7 are a spike then a restore.
EVENTS = [
    (0, RunStarted, "run", "start", {}),
    (0, SnapshotTaken, "snapshot", "saved", {}),
    (2, AnomalyFound, "input", "drop_rows", {"count": 2}),
    (3, AnomalyFound, "loss", "skip_batch", {"loss": "nan"}),
    (6, AnomalyFound, "spike", "skip_batch", {}),
    (7, AnomalyFound, "spike", "restore", {}),
    (7, Restored, "spike", "restore", {"snapshot_step": 0}),
    (9, AnomalyFound, "input", "drop_rows", {"count": 1}),
    (10, RunEnded, "run", "done", {}),
]
SUMMARY = {
    "steps": 10,
    "optimizer_steps": 7,
    "healthy_steps": 6,
    "skipped_batches": 3,
    "dropped_rows": 3,
    "replaced_rows": 0,
    "zeroed_grads": 0,
    "restores": 1,
    "scaler_skips": 0,
    "lr_scale": 1.0,
    "final_loss": 0.25,
    "wall_time": 0.5,
    "aborted": False,
    "run_dir": None,
    "events": len(EVENTS),
}


def write_run(root, events=EVENTS, summary=SUMMARY, metrics=True):
    journal = Journal(root / "events.jsonl")
    for step, cls, kind, action, detail in events:
        journal.write(
            cls(step=step, epoch=0, batch=step - 1, kind=kind, action=action, message="m", detail=detail).to_dict()
        )
    journal.close(summary)
    if metrics:
        skipped = {3, 6, 7}
        rows = [HEADER]
        for s in range(1, 11):
            loss = "nan" if s == 3 else ("40" if s in (6, 7) else f"{1.0 / s:.4f}")
            action = {2: "drop_rows", 3: "skip_batch", 6: "skip_batch", 7: "restore", 9: "drop_rows"}.get(s, "")
            rows.append(f"{s},0,{s - 1},{loss},{0.5 if s != 3 else 'nan'},1,{int(s not in skipped)},{action}")
        (root / "metrics.csv").write_text("\n".join(rows) + "\n")
    return root


def test_event_table_counts_and_first_occurrence(tmp_path):
    run = read_run(write_run(tmp_path))
    table = {(r.event, r.kind, r.action): (r.count, r.first_step) for r in event_table(run)}
    expected = {
        ("run_started", "run", "start"): (1, 0),
        ("snapshot", "snapshot", "saved"): (1, 0),
        ("anomaly", "input", "drop_rows"): (2, 2),
        ("anomaly", "loss", "skip_batch"): (1, 3),
        ("anomaly", "spike", "skip_batch"): (1, 6),
        ("anomaly", "spike", "restore"): (1, 7),
        ("restored", "spike", "restore"): (1, 7),
        ("run_ended", "run", "done"): (1, 10),
    }
    for key, value in expected.items():
        assert table[key] == value, f"{key}: {table.get(key)} != {value}"
    assert run.summary["restores"] == 1 and run.cut_at is None and run.runs == 1


def test_report_text_has_table_summary_and_agreement(tmp_path):
    text = format_report(read_run(write_run(tmp_path)))
    assert "anomaly" in text and "drop_rows" in text and "first step" in text
    assert "summary: finished" in text and "restores" in text
    assert "journal and summary agree" in text, text
    assert "run_started" not in text.split("(also:")[0], "routine records belong in the footnote"


def test_reconcile_table(tmp_path):
    checks = reconcile(read_run(write_run(tmp_path)))
    for name, (summary, journal) in checks.items():
        assert summary == journal, f"{name}: summary {summary}, journal {journal}"
    assert {"events", "restores", "dropped_rows", "steps", "skipped_batches"} <= set(checks)


def test_disagreement_is_reported(tmp_path):
    text = format_report(read_run(write_run(tmp_path, summary={**SUMMARY, "restores": 4})))
    assert "journal and summary disagree: restores 4 in the summary, 1 in the journal" in text


def test_truncated_last_line_still_reports(tmp_path):
    write_run(tmp_path, summary=None)
    path = tmp_path / "events.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n" + '{"event": "anomaly", "step": 11, "ki')
    run = read_run(tmp_path)
    assert run.cut_at == len(lines) + 1
    assert len(run.events) == len(EVENTS) and run.summary is None
    text = format_report(run)
    assert f"the last line was cut; the run ended on a full disk or a kill (line {len(lines) + 1};" in text
    assert "the run did not close" in text


def test_unreadable_middle_line_is_skipped(tmp_path):
    write_run(tmp_path)
    path = tmp_path / "events.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(3, '{"event": "anomaly", "st{"event": "run_started"}')  # a crash, then a resume
    path.write_text("\n".join(lines) + "\n")
    run = read_run(tmp_path)
    assert run.bad_lines == [4] and run.cut_at is None
    assert "1 journal line skipped: line 4: not JSON (Expecting ':' delimiter at column 27)" in format_report(run)


def test_resumed_journal_counts_runs_and_skips_the_cross_check(tmp_path):
    write_run(tmp_path)
    write_run(tmp_path, metrics=False)  # a second fit() appends to the same journal
    run = read_run(tmp_path)
    assert run.runs == 2 and reconcile(run) == {}
    # two starts without resume= are two runs, not a resume (issue 16: every start counted as one)
    assert "2 runs in this journal (2 starts, 0 resumed)" in format_report(run)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda p: p / "missing", "no such run directory"),
        (lambda p: p, "no journal here"),
    ],
)
def test_missing_directory_or_journal_raises_one_clear_error(tmp_path, make, needle):
    with pytest.raises(ReportError, match=needle):
        read_run(make(tmp_path))


def test_metrics_parse_nan_and_skip_broken_rows(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write(HEADER + "\n11,0,10,0.1,0.2\n")  # a repeated header and a row cut by a crash
    m = read_run(tmp_path).metrics
    assert len(m["step"]) == 10
    assert m["loss"][2] != m["loss"][2], "nan parses as a float NaN"
    assert m["action"][1] == "drop_rows"


def test_no_events_says_every_step_was_healthy(tmp_path):
    write_run(tmp_path, events=EVENTS[:2] + EVENTS[-1:], summary={**SUMMARY, "events": 3})
    assert "every step was healthy" in format_report(read_run(tmp_path))


def test_plot_writes_png_with_nan_losses(tmp_path):
    pytest.importorskip("matplotlib")
    run = read_run(write_run(tmp_path))
    out = plot_run(run)
    assert out == tmp_path / "report.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_is_a_report_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ReportError, match="metrics.csv"):
        plot_run(read_run(write_run(tmp_path, metrics=False)))


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match=r"pip install 'safetrain\[plot\]'"):
        plot_run(read_run(write_run(tmp_path)))


def test_report_never_needs_torch_objects(tmp_path):
    # The journal is plain JSON; a record written by hand (another tool, an older version) reads too.
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"event": "anomaly", "step": 5, "kind": "loss", "action": "skip_batch"}) + "\n"
    )
    rows = event_table(read_run(tmp_path))
    assert [(r.kind, r.action, r.first_step, r.first_epoch) for r in rows] == [("loss", "skip_batch", 5, -1)]


def test_resumed_metrics_replace_the_rows_they_rerun(tmp_path):
    write_run(tmp_path)
    with open(tmp_path / "metrics.csv", "a") as f:  # resumed from a snapshot of step 8: steps 9-10 again, then 11
        f.write("9,0,8,0.11,0.5,1,1,\n10,0,9,0.10,0.5,1,1,\n11,0,10,0.09,0.5,1,1,\n")
    m = read_run(tmp_path).metrics
    assert m["step"] == [float(s) for s in range(1, 12)]
    assert m["loss"][8:] == [0.11, 0.10, 0.09] and m["action"][8] == ""
