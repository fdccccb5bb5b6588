"""The demo, report and inspect commands: help, happy paths, and one clear line per error path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from safetrain.cli import main
from safetrain.events import AnomalyFound, RunStarted
from safetrain.rundir import Journal

ROOT = Path(__file__).resolve().parents[3]


def one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("safetrain"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def make_run(root: Path) -> Path:
    journal = Journal(root / "events.jsonl")
    journal.write(RunStarted(step=0, epoch=0, batch=-1, kind="run", action="start", message="started").to_dict())
    journal.write(AnomalyFound(step=2, epoch=0, batch=1, kind="loss", action="skip_batch", message="nan").to_dict())
    journal.close({"steps": 3, "skipped_batches": 1, "restores": 0, "events": 2, "aborted": False})
    (root / "metrics.csv").write_text(
        "step,epoch,batch,loss,grad_norm,lr_scale,trained,action\n"
        "1,0,0,1.0,0.5,1,1,\n2,0,1,nan,nan,1,0,skip_batch\n3,0,2,0.8,0.4,1,1,\n"
    )
    return root


def test_help_lists_every_command_with_examples():
    proc = subprocess.run([sys.executable, "-m", "safetrain.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    for command in ("demo", "report", "inspect", "check-config"):
        assert command in proc.stdout, command
        assert f"safetrain {command} " in proc.stdout.split("examples:")[1], f"no example for {command}"


@pytest.mark.parametrize("command", ["demo", "report", "inspect", "check-config"])
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: safetrain " + command in capsys.readouterr().out


def test_unknown_command_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    one_error_line(capsys.readouterr().err, "invalid choice: 'frobnicate'")


# ------------------------------------------------------------------------------------ report
def test_report_prints_table_and_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(make_run(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and "skip_batch" in out and "summary: finished" in out
    assert (tmp_path / "report.png").exists() and f"wrote {tmp_path / 'report.png'}" in out


def test_report_missing_directory_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    one_error_line(capsys.readouterr().err, "no such run directory", str(tmp_path / "nope"))


def test_report_directory_without_journal_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "events.jsonl", "no journal here")


def test_report_truncated_journal_still_reports(tmp_path, capsys):
    make_run(tmp_path)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "anom')
    assert main(["report", "--no-plot", str(tmp_path)]) == 0
    assert "the last line was cut; the run ended on a full disk or a kill (line 4;" in capsys.readouterr().out


def test_report_without_matplotlib_prints_table_and_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["report", str(make_run(tmp_path))]) == 0
    captured = capsys.readouterr()
    assert "skip_batch" in captured.out
    one_error_line(captured.err, "pip install 'safetrain[plot]'")
    assert not (tmp_path / "report.png").exists()


# ------------------------------------------------------------------------------------ inspect
def test_inspect_a_snapshot(tmp_path, capsys):
    from safetrain.snapshot import SafetensorsStore, TrainState

    model = torch.nn.Linear(4, 2)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with SafetensorsStore(tmp_path, keep=1) as store:
        path = store.save(state, {"step": 7, "epoch": 0, "batch": 7}).path
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step       7" in out and "checksum   ok" in out and "finite     ok" in out


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "cannot read"),
        (b"", "empty"),
        (b"\x80\x04\x95 this is a pickle, not safetensors", "not a safetensors file"),
    ],
)
def test_inspect_unreadable_snapshot_exit_2(tmp_path, capsys, content, needle):
    path = tmp_path / "snapshot-0000000001.safetensors"
    if content is not None:
        path.write_bytes(content)
    assert main(["inspect", str(path)]) == 2
    one_error_line(capsys.readouterr().err, "safetrain inspect: error:", str(path))


# ------------------------------------------------------------------------------------ demo
def test_demo_bad_override_exit_2_before_training(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "run"), "recovery.lr_factr=0.3"]) == 2
    one_error_line(capsys.readouterr().err, "recovery.lr_factr", "recovery.lr_factor")
    assert not (tmp_path / "run").exists()


def test_demo_missing_config_file_exit_2(tmp_path, capsys):
    assert main(["demo", "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys.readouterr().err, "no such config file")


def test_demo_bad_yaml_value_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("recovery:\n  max_retries: lots\n")
    assert main(["demo", "--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys.readouterr().err, "recovery.max_retries")


def test_demo_bad_epochs_exit_2(tmp_path, capsys):
    assert main(["demo", "--epochs", "0", "--out", str(tmp_path / "run")]) == 2
    one_error_line(capsys.readouterr().err, "--epochs")


def test_inspect_a_damaged_snapshot_says_so_and_exits_1(tmp_path, capsys):
    from safetrain.snapshot import SafetensorsStore, TrainState

    model = torch.nn.Linear(64, 64)
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with SafetensorsStore(tmp_path, keep=1) as store:
        path = store.save(state, {"step": 7, "epoch": 0, "batch": 7}).path
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the tensor data
    Path(path).write_bytes(bytes(data))
    code = main(["inspect", str(path)])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert "checksum   FAILED" in captured.out


def test_demo_refuses_a_directory_that_holds_a_run(tmp_path, capsys):
    make_run(tmp_path)
    assert main(["demo", "--out", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "already holds a run", "--out")
