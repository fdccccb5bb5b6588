"""How a run ends (issue #16): the journal says done only when the run finished; cut lines,
a log.dir that cannot be written, a full disk, and the misuse items of ``fit``."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from safetrain import SafeTrainer, SafetrainError, load_config
from safetrain.cli.report import format_report
from safetrain.errors import TrainingAborted
from safetrain.rundir import RunDirError, read_run
from tests.helpers.models import mlp, regression_data


def _fit(tmp_path, loader=None, *overrides, epochs=1, **kw):
    model = mlp()
    cfg = load_config(None, ["log.progress=false", f"log.dir={tmp_path}", *overrides])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = SafeTrainer(model, opt, cfg, loss_fn=kw.pop("loss_fn", F.mse_loss), scheduler=kw.pop("scheduler", None))
    if kw.pop("forward_fault", False):
        model[0].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("forward broke")))
    loader = loader if loader is not None else DataLoader(regression_data(64), batch_size=8)
    return model, trainer, lambda **more: trainer.fit(loader, epochs=epochs, **{**kw, **more})


class Failing:
    def __init__(self, loader, at, exc):
        self.loader, self.at, self.exc = loader, at, exc

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == self.at:
                raise self.exc
            yield batch


class BadScheduler:
    def __init__(self, opt):
        self.optimizer, self.n = opt, 0

    def step(self):
        self.n += 1
        if self.n == 3:
            raise ValueError("scheduler broke")

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


@pytest.mark.parametrize("where", ["loader", "loss_fn", "forward", "scheduler", "ctrl-c"])
def test_an_exception_or_ctrl_c_does_not_end_the_run_done(tmp_path, where):
    """Fails before: every one of these closed the journal with run_ended 'done' / 'finished'."""
    base = DataLoader(regression_data(64), batch_size=8)
    kw = {}
    if where == "loader":
        kw["loader"] = Failing(base, 3, OSError("disk read failed"))
    if where == "ctrl-c":
        kw["loader"] = Failing(base, 3, KeyboardInterrupt())
    if where == "loss_fn":
        calls = []

        def loss_fn(out, y):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("loss broke")
            return F.mse_loss(out, y)

        kw["loss_fn"] = loss_fn
    model, trainer, fit = _fit(tmp_path, kw.pop("loader", None), forward_fault=where == "forward", **kw)
    if where == "scheduler":
        trainer.scheduler = BadScheduler(trainer.optimizer)
    with pytest.raises((Exception, KeyboardInterrupt)):
        fit()
    run = read_run(tmp_path)
    end = run.events[-1]
    assert end["event"] == "run_ended"
    expected = "interrupted" if where == "ctrl-c" else "failed"
    assert end["action"] == expected and run.summary["ended"] == expected
    if expected == "failed":
        assert end["detail"]["error"] and "broke" in end["detail"]["error_message"] or where == "loader"
    assert f"summary: {expected}" in format_report(run)
    assert "finished" not in end["message"]
    assert not model[0]._forward_hooks and not model[2]._forward_hooks, "guard hooks left on the model"


def test_a_full_disk_mid_run_fails_clearly_and_removes_the_hooks(tmp_path, monkeypatch):
    """metrics.csv on a full disk (/dev/full): fails before with a raw OSError and 'done' in the journal.
    (A link to /dev/full planted at metrics.csv is refused since issue 36, so the writer's file is /dev/full.)"""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    from safetrain import rundir

    real = rundir.open_append

    def full_disk(path, **kwargs):
        if os.path.basename(path) != "metrics.csv":
            return real(path)
        return os.fdopen(os.open("/dev/full", os.O_RDWR | os.O_APPEND), "a", encoding="utf-8")

    monkeypatch.setattr(rundir, "open_append", full_disk)
    model, trainer, fit = _fit(tmp_path, None, "snapshot.every=2")
    with pytest.raises(RunDirError, match="metrics.csv"):
        fit()
    run = read_run(tmp_path)
    assert run.events[-1]["action"] == "failed"
    assert not model[0]._forward_hooks


def test_a_log_dir_that_is_a_file_or_under_one_is_a_clear_error(tmp_path):
    """Fails before: FileExistsError / NotADirectoryError from deep inside."""
    f = tmp_path / "afile"
    f.write_text("x")
    for bad in (f, f / "sub"):
        _, _, fit = _fit(bad)
        with pytest.raises(SafetrainError, match=str(bad)):
            fit()


def test_a_cut_last_line_does_not_swallow_the_next_runs_first(tmp_path):
    """Fails before: the resumed run's run_started was glued to the cut line and lost."""
    _, _, fit = _fit(tmp_path)
    fit()
    for name in ("events.jsonl", "metrics.csv"):
        p = tmp_path / name
        p.write_bytes(p.read_bytes()[:-7])  # a kill mid-write
    cut_at = len((tmp_path / "events.jsonl").read_text().splitlines())
    _, _, fit = _fit(tmp_path)
    fit()
    run = read_run(tmp_path)
    assert run.runs == 2 and run.bad_lines == [cut_at] and run.cut_at is None
    assert run.events[-1]["action"] == "done"
    # a second fresh run is another run (issue 16): its 8 rows are all there, beside run 1's
    assert run.metrics["run"].count(run.run_ids[-1]) == 8 and len(run.run_ids) == 2


def test_max_steps_zero_trains_nothing(tmp_path):
    model, _, fit = _fit(tmp_path)
    before = [p.clone() for p in model.parameters()]
    assert fit(max_steps=0).steps == 0  # fails before: 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_one_shot_generator_for_several_epochs_is_an_error(tmp_path):
    gen = (b for b in DataLoader(regression_data(64), batch_size=8))
    _, _, fit = _fit(tmp_path, gen, epochs=3)
    with pytest.raises(SafetrainError, match="one-shot iterator"):
        fit()


def test_resuming_with_nothing_left_says_so(tmp_path, caplog):
    _, _, fit = _fit(tmp_path, None, "snapshot.store=safetensors", "snapshot.every=8", epochs=2)
    fit()
    _, _, fit = _fit(tmp_path, None, "snapshot.store=safetensors", epochs=2)
    with caplog.at_level(logging.WARNING, logger="safetrain"):
        result = fit(resume=tmp_path / "snapshots")
    assert result.steps == 16
    assert "nothing left to train" in caplog.text


def test_final_loss_is_the_last_steps_even_when_not_finite(tmp_path):
    """With every action warn, the last steps' NaN losses are the final loss, not a stale finite one."""
    n = [0]

    def loss_fn(out, y):
        n[0] += 1
        loss = F.mse_loss(out, y)
        return loss * math.nan if n[0] > 6 else loss

    warn = [f"recovery.actions.{k}=warn" for k in ("loss", "forward", "gradient", "weights")]
    _, _, fit = _fit(tmp_path, None, *warn, loss_fn=loss_fn)
    with pytest.raises(TrainingAborted, match="the run ended with non-finite parameters") as info:  # issue 18
        fit()
    result = info.value.result  # never "done" with NaN weights: aborted, the result still says how it ended
    assert result.steps == 8 and math.isnan(result.final_loss)
