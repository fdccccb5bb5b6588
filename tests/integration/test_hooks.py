"""``fit(hooks=...)`` and ``log.tensorboard`` (issue 35): what ``fit`` tells the code around it.

Before, a ``SafeTrainer.fit`` user could not see safetrain's metrics anywhere but ``metrics.csv``:
the guard is made inside ``fit`` and its event bus was out of reach.
"""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from safetrain import ConfigError, RunHook, SafeTrainer, load_config
from safetrain.testing import GradFault
from tests.helpers.models import loader, mlp, regression_data

# A finite gradient outlier at the 6th backward is restored (no replay), and the two batches after
# the restore are skipped: a run with a restore and skips, 32 decided steps.
FAULTY = [
    "log.progress=false",
    "snapshot.every=4",
    "guard.spike.min_history=8",
    "guard.grad_norm_threshold=50",
    "recovery.actions.grad_norm=restore",
    "recovery.skip_batches_after_restore=2",
]


class Recorder(RunHook):
    def __init__(self) -> None:
        self.events, self.steps, self.ends = [], [], []

    def on_event(self, event):
        self.events.append(event)

    def on_step(self, record):
        self.steps.append(record)

    def on_end(self, result):
        self.ends.append(result)


def _fit(tmp_path, overrides=(), hooks=()):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    GradFault(model[0].weight, calls=[6], value=1e4)
    cfg = load_config(None, [*FAULTY, f"log.dir={tmp_path / 'run'}", *overrides])
    return SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), epochs=2, hooks=hooks)


def test_a_hook_receives_every_journaled_event_every_step_and_the_end(tmp_path):
    hook = Recorder()
    result = _fit(tmp_path, hooks=[hook])
    assert result.restores == 1 and result.skipped_batches == 3
    journal = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    journaled = [(r["event"], r["step"], r["action"]) for r in journal if "step" in r]  # not the summary line
    assert [(e.name, e.step, e.action) for e in hook.events] == journaled, "every journaled event, in order"
    assert {"run_started", "anomaly", "restored", "run_ended"} <= {e.name for e in hook.events}

    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r.step for r in hook.steps] == [int(r["step"]) for r in rows], "one record per metrics row"
    assert [r.action for r in hook.steps] == [r["action"] for r in rows]
    assert all(r.lrs == (0.02,) for r in hook.steps)
    assert hook.steps[-1].counts["restores"] == 1 and hook.steps[-1].counts["skipped_batches"] == 3
    assert hook.ends == [result] and result.ended == "done"


def test_a_hook_that_raises_is_logged_and_dropped_and_the_run_goes_on(tmp_path, caplog):
    class Broken(RunHook):
        calls = 0

        def on_step(self, record):
            Broken.calls += 1
            raise ConnectionError("tracker unreachable")

    after = Recorder()
    with caplog.at_level(logging.ERROR, logger="safetrain"):
        result = _fit(tmp_path, hooks=[Broken(), after])
    assert result.ended == "done" and Broken.calls == 1
    assert len(after.steps) == result.steps, "the hooks after it still get every step"
    assert any(
        "tracker unreachable" in (r.exc_text or "") or "called no more" in r.getMessage() for r in caplog.records
    )


def test_hooks_must_be_run_hooks(tmp_path):
    with pytest.raises(ConfigError, match="expected a safetrain.hooks.RunHook"):
        _fit(tmp_path, hooks=[print])


def test_tensorboard_needs_a_run_dir():
    model = mlp()
    cfg = load_config(None, ["log.progress=false", "log.tensorboard=true"])
    with pytest.raises(ConfigError, match="needs log.dir"):
        SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, loss_fn=F.mse_loss).fit(
            loader(regression_data())
        )


def test_tensorboard_event_files_hold_the_scalars_and_the_events(tmp_path):
    """Read back with TensorBoard's own reader: the loss of every trained step, the LR in force,
    the counters when they changed, and the journal's events as text."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hook = Recorder()
    result = _fit(tmp_path, ["log.tensorboard=true"], hooks=[hook])
    reader = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    reader.Reload()
    tags = reader.Tags()
    loss = reader.Scalars("safetrain/loss")
    finite = [r for r in hook.steps if r.loss == r.loss]
    assert [s.step for s in loss] == [r.step for r in finite]
    assert [s.value for s in loss] == pytest.approx([r.loss for r in finite], rel=1e-6)
    lrs = reader.Scalars("safetrain/lr")
    assert len(lrs) == len(hook.steps) and all(s.value == pytest.approx(0.02) for s in lrs)
    restores = reader.Scalars("safetrain/restores")
    assert [s.value for s in restores] == [0, 1], "written when it changes"
    texts = [t.tensor_proto.string_val[0].decode() for t in reader.Tensors("safetrain/events/text_summary")]
    assert len(texts) == len(result.events) and any(t.startswith("restored") for t in texts), tags


def test_a_step_record_holds_the_lr_in_force_of_every_optimizers_groups(tmp_path):
    """Several optimizers (issue 33): the record has each group's LR, the backoff's scale included."""
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.02)
    second = torch.optim.AdamW(model[2].parameters(), lr=0.001)
    hook = Recorder()
    cfg = load_config(None, ["log.progress=false"])
    SafeTrainer(model, [first, second], cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), hooks=[hook])
    assert hook.steps and all(r.lrs == pytest.approx((0.02, 0.001)) for r in hook.steps)
