"""Runs told apart in the journal (issue #25): every driver's ``run_started`` carries the run's id,
and a run resumed from a framework's checkpoint goes on under its id.

The callbacks' ``run_started`` had no ``run_id`` (``SafeTrainer.fit``'s had), so ``safetrain
report`` over a directory several callback runs appended to listed every start under every run;
and a run resumed from Lightning's checkpoint would read as a new run. The guard's state (which a
framework's checkpoint carries) holds the id now; a resume adopts it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard
from safetrain.rundir.runlog import read_run
from tests.helpers.models import loader as regression_loader
from tests.helpers.models import mlp, regression_data


def test_the_guards_state_carries_the_run_id_and_a_resume_adopts_it():
    a, b = mlp(), mlp()
    first = Guard(a, torch.optim.SGD(a.parameters(), lr=0.1), None, loss_fn=F.mse_loss)
    second = Guard(b, torch.optim.SGD(b.parameters(), lr=0.1), None, loss_fn=F.mse_loss)
    assert first.run_id and second.run_id and first.run_id != second.run_id, "each guard starts its own run"
    for batch in list(regression_loader(regression_data()))[:2]:
        first.step(batch)
    second.load_state_dict(first.state_dict())
    assert second.run_id == first.run_id


def test_lightning_runs_in_one_directory_are_told_apart_and_a_resume_is_the_same_run(tmp_path):
    pytest.importorskip("lightning")
    from safetrain.integrations.lightning import SafeTrainingCallback
    from tests.helpers.lightning import CFG, Net, loader, trainer

    cfg = {**CFG, "log": {"dir": str(tmp_path / "run"), "level": "WARNING"}}
    cb = SafeTrainingCallback(cfg)
    t = trainer(cb, tmp_path, max_steps=4)
    t.fit(Net(), loader())
    t.save_checkpoint(tmp_path / "last.ckpt")
    trainer(SafeTrainingCallback(cfg), tmp_path, max_steps=6).fit(
        Net(), loader(), ckpt_path=str(tmp_path / "last.ckpt")
    )
    trainer(SafeTrainingCallback(cfg), tmp_path, max_steps=3).fit(Net(), loader())  # a new run, same directory
    run = read_run(tmp_path / "run")
    starts = [e for e in run.events if e["event"] == "run_started"]
    assert [s["action"] for s in starts] == ["start", "resume", "start"]
    ids = [s["detail"]["run_id"] for s in starts]
    assert ids[0] == ids[1] != ids[2] and all(ids), ids
    assert run.run_ids == [ids[0], ids[2]], "two runs: the first and its resume, then the new one"
