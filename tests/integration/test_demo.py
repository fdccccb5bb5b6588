"""The demo end to end, in-process and small: faults caught, accuracy kept, journal and summary agree."""

from __future__ import annotations

import json
import re

import pytest

from safetrain.cli import main
from safetrain.cli.demo import DemoSize, demo_config, format_summary, run_demo
from safetrain.cli.report import reconcile
from safetrain.rundir import read_run

SIZE = DemoSize(n_train=3072, n_test=4096, epochs=4)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    return run_demo(demo_config(None, ["log.progress=false"], out), SIZE)


def anomalies(demo):
    return [e for e in demo.result.events if e.name in ("anomaly", "restored", "lr_changed")]


def test_accuracy_within_two_points_of_the_clean_run(demo):
    assert demo.clean_accuracy > 0.8, f"the task should be learnable: {demo.clean_accuracy:.3f}"
    assert abs(demo.accuracy - demo.clean_accuracy) <= 0.02, (demo.accuracy, demo.clean_accuracy)
    assert not demo.result.aborted


def test_clean_run_has_no_fault_to_catch(demo):
    found = [(e.step, e.kind) for e in demo.clean.events if e.name == "anomaly"]
    assert not [f for f in found if f[1] != "spike"] and len(found) <= 1, found  # at most a rare spike false alarm


def test_every_injected_fault_is_caught_near_its_step(demo):
    events = anomalies(demo)
    kinds = {e.kind for e in events if e.name == "anomaly"}
    assert "input" in kinds, kinds
    assert demo.result.dropped_rows >= 3 * SIZE.epochs - 3  # three poisoned rows a pass (two may share a batch)
    steps = [s for s, _ in demo.faults if s > 0]
    assert len(steps) == 4 or len(steps) == 3, demo.faults  # zero row, labels, LR x1000 (twice if retrained)
    for step in steps[:2]:
        near = [(e.step, e.kind, e.action) for e in events if step <= e.step <= step + 1 and e.kind != "input"]
        assert near, f"no detection at step {step}: {[(e.step, e.kind, e.action) for e in events]}"
    lr_step = steps[2]
    after = [e for e in events if lr_step < e.step <= lr_step + 5 and e.kind != "input"]
    assert any(e.name == "restored" for e in after), [(e.step, e.name, e.kind, e.action) for e in after]


def test_summary_counts_match_the_journal(demo):
    run = read_run(demo.run_dir)
    assert run.cut_at is None and run.bad_lines == [] and run.runs == 1
    checks = reconcile(run)
    assert {"events", "restores", "dropped_rows", "steps", "skipped_batches"} <= set(checks)
    for name, (summary, journal) in checks.items():
        assert summary == journal, f"{name}: {summary} in the summary, {journal} in the journal"
    summary = demo.result.summary()
    for key in ("steps", "healthy_steps", "skipped_batches", "dropped_rows", "restores", "zeroed_grads"):
        assert run.summary[key] == summary[key], key
    lines = (demo.run_dir / "events.jsonl").read_text().splitlines()
    assert len(lines) == len(demo.result.events) + 1 and json.loads(lines[-1])["event"] == "summary"


def test_run_directory_and_summary_text(demo):
    for name in ("events.jsonl", "metrics.csv", "report.txt"):
        assert (demo.run_dir / name).is_file(), name
    if demo.png is not None:
        assert demo.png.read_bytes()[:4] == b"\x89PNG"
    text = format_summary(demo)
    assert "faults injected -> what safetrain did:" in text and "with faults under safetrain" in text
    assert "not seen" not in text, text
    assert f"safetrain report {demo.run_dir}" in text
    assert "journal and summary agree" in (demo.run_dir / "report.txt").read_text()


def test_cli_demo_prints_detections_summary_and_run_dir(tmp_path, capsys):
    out = tmp_path / "cli-run"
    code = main(["demo", "--out", str(out), "--epochs", "1", "--no-clean", "log.progress=false"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"run directory {out}" in captured.err and "WARNING" in captured.err and "anomaly" in captured.err
    assert not re.search(r"step \d+: snapshot of step", captured.err), "routine snapshots are hidden without -v"
    assert f"run directory: {out}" in captured.out and "accuracy:" in captured.out
    assert (out / "events.jsonl").is_file()
