"""examples/lightning_callback.py runs offline as a user would run it and shows the recovery."""

from __future__ import annotations

import re

import pytest

from tests.helpers.processes import run_example

pytest.importorskip("lightning")


def test_the_lightning_example_recovers_from_each_fault(tmp_path):
    out = run_example("lightning_callback.py", str(tmp_path))
    assert re.search(r"anomaly\s+input\s+drop_rows", out), out
    assert re.search(r"anomaly\s+forward\s+retry\s+forward anomaly: non-finite output in module 'features.0'", out), out
    assert re.search(r"anomaly\s+gradient", out), out
    assert re.search(r"run_ended run\s+done", out) and "parameters finite: True" in out, out
    assert (tmp_path / "events.jsonl").exists()
