"""Every script in examples/ runs offline, as a user would run it, and says what it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.processes import run_example

ROOT = Path(__file__).resolve().parents[2]


def test_every_example_is_tested():
    tested = {
        "quickstart.py",
        "custom_loop.py",
        "mixed_precision.py",
        "resume.py",
        "huggingface_style.py",
        "ddp.py",
        "fsdp.py",
        "requeue.py",  # tests/multiprocess/test_preempt.py runs it under a real SIGTERM
        "hf_trainer_callback.py",  # tests/integration/test_huggingface.py runs it
        "lightning_callback.py",  # tests/integration/test_lightning_example.py
        "gan.py",
        "lbfgs.py",
    }  # under torchrun: ddp.py in tests/multiprocess/test_ddp.py, fsdp.py in tests/multiprocess/test_fsdp_example.py
    assert {p.name for p in (ROOT / "examples").glob("*.py")} <= tested


def test_quickstart():
    out = run_example("quickstart.py")
    assert re.search(r"rows dropped [1-9]", out), out
    assert "input" in out


def test_gan():
    out = run_example("gan.py")
    assert "batch 25 d step: restore" in out and "1 restores" in out, out


def test_lbfgs():
    out = run_example("lbfgs.py")
    assert out.count("inside LBFGS.step(closure)") == 2 and "2 restores" in out, out
    assert re.search(r"final loss 0\.0[0-9]", out), out


def test_custom_loop():
    out = run_example("custom_loop.py")
    assert "epoch 2: loss" in out and "drop_rows" in out, out


def test_mixed_precision_runs_fp32_bf16_fp16():
    out = run_example("mixed_precision.py")
    lines = {line.split(":")[0].strip() for line in out.splitlines() if "steps" in line}
    assert {"float32", "bfloat16", "float16", "float16 (own GradScaler)"} <= lines, out
    for line in out.splitlines():
        if "accuracy" in line:
            assert float(line.rsplit("accuracy ", 1)[1].rstrip("%")) > 70, line


def test_resume_after_kill_matches_the_uninterrupted_run(tmp_path):
    out = run_example("resume.py", str(tmp_path / "run"))
    assert "child process ended with" in out and "ended with 0 " not in out, out
    assert "finite: True" in out, out
    resumed = re.search(r"resumed: finished at step (\d+)", out)
    reference = re.search(r"uninterrupted run: (\d+) steps", out)
    assert resumed and reference and resumed.group(1) == reference.group(1), out
    gap = float(re.search(r"largest weight difference after resume: (\S+)", out).group(1))
    assert gap < 1e-5, out
    assert (tmp_path / "run" / "events.jsonl").exists()


def test_huggingface_style_catches_the_fully_masked_row_and_the_fix_removes_it():
    out = run_example("huggingface_style.py")
    naive, safe = [line for line in out.splitlines() if "steps" in line and "skipped" in line]
    assert re.search(r"[1-9]\d* skipped", naive), out
    assert " 0 skipped" in safe, out
    assert "anomaly" in out or "forward" in out, out


@pytest.mark.parametrize("name", ["mixed_precision.py", "resume.py", "huggingface_style.py"])
def test_examples_have_a_run_line_and_main_guard(name):
    text = (ROOT / "examples" / name).read_text()
    assert f"Run: python examples/{name}" in text and 'if __name__ == "__main__":' in text
