"""examples/fsdp.py under torchrun on 2 gloo ranks, as a user would run it (issue #17)."""

from __future__ import annotations

import re

import pytest

from tests.helpers.processes import run_torchrun

pytestmark = pytest.mark.slow


def test_fsdp_example_under_torchrun_and_resume_of_its_sharded_snapshots(tmp_path):
    """Issue #17: examples/fsdp.py runs under torchrun on 2 gloo ranks; cut, then resumed, it ends bitwise equal."""
    full = run_torchrun("fsdp.py", "--run-dir", str(tmp_path / "full"), "--epochs", "2")
    assert "full parameters finite: True" in full, full
    assert "tripped: {'input': [1]}" in full and "restored forward -> restore" in full, full
    assert list((tmp_path / "full" / "snapshots").glob("step-*/safetrain.json")), "sharded snapshot directories"
    part = run_torchrun("fsdp.py", "--run-dir", str(tmp_path / "cut"), "--epochs", "2", "--max-steps", "12")
    assert part.startswith("12 steps") or "\n12 steps" in part, part
    resumed = run_torchrun("fsdp.py", "--run-dir", str(tmp_path / "cut"), "--epochs", "2", "--resume")
    digest = re.compile(r"resumed: (\d+) steps.*model and optimizer state (\w+)\)", re.S)
    want = re.search(r"^(\d+) steps.*model and optimizer state (\w+)\)", full, re.S | re.M)
    assert digest.search(resumed) and want and digest.search(resumed).groups() == want.groups(), (full, resumed)
