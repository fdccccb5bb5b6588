"""The command line: check-config output, exit codes and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from safetrain.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_check_config_prints_resolved_config(capsys):
    assert main(["check-config", str(CONFIGS / "default.yaml"), "recovery.max_retries=8"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["recovery"]["max_retries"] == 8
    assert printed["detect"]["mode"] == "eager"


def test_check_config_bad_value_exits_2_with_one_line(capsys, tmp_path):
    assert main(["check-config", str(CONFIGS / "default.yaml"), "recovery.lr_factor=7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "recovery.lr_factor: got 7.0; expected a number (> 0, < 1)" in err


def test_check_config_missing_file_exits_2(capsys, tmp_path):
    assert main(["check-config", str(tmp_path / "x.yaml")]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_unknown_command_and_no_command_exit_2():
    for argv in (["frobnicate"], []):
        proc = subprocess.run([sys.executable, "-m", "safetrain.cli", *argv], capture_output=True, text=True)
        assert proc.returncode == 2, argv
        assert proc.stderr.strip(), argv
        if argv:  # one line naming the bad choice
            assert "invalid choice: 'frobnicate'" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
