"""Under gradient accumulation every event about one micro-batch names that micro-batch's own
epoch and batch index, not the step's last batch; events about the whole step keep the step's.

With ``guard.accumulate_steps=4`` a step is decided at its 4th micro-batch; before, an Inf row in
the 2nd was journaled at the 4th's batch index, a batch a user looking it up finds nothing wrong
with. The public pattern: a NaN under accumulation shows only at the optimizer step, and the
micro-batch that caused it is lost (espnet/espnet#3283: "skip the specific batch or the whole set of
batches in this round of accum_grad?"; facebookresearch/mmf#893: a malformed sample under
gradient accumulation, found by hand).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, SequentialSampler

from safetrain import SafeTrainer, load_config
from safetrain.diagnose.quarantine import QuarantineSampler
from safetrain.guard import Guard
from safetrain.testing import OutputFault, PoisonRows
from tests.helpers.loops import caller_loop, make
from tests.helpers.models import loader, mlp, regression_data

BASE = ["log.progress=false", "snapshot.every=4", "guard.spike.min_history=8", "guard.accumulate_steps=4"]
ROWS = 16  # rows per batch: dataset index 16 * b + r is row r of batch b (a sequential loader)


def _about(events, kind):
    return [e for e in events if e.name == "anomaly" and e.kind == kind]


@pytest.mark.parametrize("where", ["inputs", "targets"])
@pytest.mark.parametrize("action", ["skip_batch", "drop_rows", "replace"])
def test_bad_rows_in_the_second_micro_batch_name_its_batch(where, action):
    """Batch 5 is micro-batch 2 of the window 4..7: its event and its rows say batch 5, not 7."""
    data = PoisonRows(regression_data(), indices=[ROWS * 5 + 3], where=where, value=math.inf)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    cfg = load_config(None, [*BASE, f"sanitize.{where}={action}"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(data, shuffle=False), epochs=1)
    kind = where[:-1]
    (event,) = _about(result.events, kind)
    assert (event.action, event.epoch, event.batch) == (action, 0, 5), event
    assert "micro[1]" in event.message and event.step == 2, event.message
    assert [(r["epoch"], r["batch_index"]) for r in event.detail["rows"]] == [(0, 5)], event.detail["rows"]


def test_rows_in_two_micro_batches_each_name_their_own():
    """Bad rows in batches 5 and 7 of one window: the event names the first; each row its own batch."""
    data = PoisonRows(regression_data(), indices=[ROWS * 5 + 3, ROWS * 7], value=math.nan)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    result = SafeTrainer(model, opt, load_config(None, BASE), loss_fn=F.mse_loss).fit(
        loader(data, shuffle=False), epochs=1
    )
    (event,) = _about(result.events, "input")
    assert (event.epoch, event.batch) == (0, 5), event
    assert [r["batch_index"] for r in event.detail["rows"]] == [5, 7], event.detail["rows"]


def test_a_short_window_at_the_end_of_an_epoch_names_the_second_epochs_batch():
    """6 batches an epoch: the window 4, 5 is flushed short; a bad row in batch 4, each epoch."""
    data = PoisonRows(regression_data(n=ROWS * 6), indices=[ROWS * 4 + 1], value=math.inf)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(None, [*BASE, "sanitize.inputs=skip_batch"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(data, shuffle=False), epochs=2)
    events = _about(result.events, "input")
    assert [(e.epoch, e.batch) for e in events] == [(0, 4), (1, 4)], [(e.epoch, e.batch, e.step) for e in events]


@pytest.mark.parametrize("bad", [(0, 5), (1, 0)])
def test_a_window_across_an_epoch_boundary_in_a_users_loop(bad):
    """Guard.step in a user's loop that does not flush: a window holds batches 4, 5 of epoch 0
    and 0, 1 of epoch 1; a bad row in either names its own epoch and batch."""
    batches = list(loader(regression_data(n=ROWS * 6), shuffle=False))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    events = []
    with Guard(model, opt, load_config(None, [*BASE, "sanitize.inputs=skip_batch"]), loss_fn=F.mse_loss) as guard:
        for epoch in range(2):
            guard.begin_epoch(epoch)
            for b, (x, y) in enumerate(batches):
                if (epoch, b) == bad:
                    x = x.clone()
                    x[2, 0] = math.nan
                result = guard.step((x, y))
                events += result.events if result is not None else ()
    (event,) = _about(events, "input")
    assert (event.epoch, event.batch) == bad and event.step == 2, event


def test_a_forward_finding_names_its_micro_batch():
    """A module's output goes NaN in the forward of batch 6 (micro-batch 3 of the window 4..7)."""
    model = mlp()
    OutputFault(model[0], calls=[7])  # the 7th forward: batch 6
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    overrides = ["detect.mode=eager", "recovery.actions.forward=skip_batch", "detect.replay.enabled=false"]
    cfg = load_config(None, [*BASE, *overrides])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data(), shuffle=False), epochs=1)
    (event,) = _about(result.events, "forward")
    assert (event.epoch, event.batch) == (0, 6), event
    assert (event.detail["finding"]["epoch"], event.detail["finding"]["batch_index"]) == (0, 6), event.detail


def test_a_replay_and_the_quarantine_name_the_micro_batch_with_the_bad_row():
    """A finite outlier (1e30) overflows the loss, not the input scan: the replay pins it on micro-batch
    2 (batch 5), bisects the row, and the quarantine names dataset sample 83 at batch 5."""
    data = PoisonRows(regression_data(), indices=[ROWS * 5 + 3], value=1e30)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))  # no saturation
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    sampler = QuarantineSampler(SequentialSampler(data))
    cfg = load_config(None, [*BASE, "detect.mode=lazy"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(DataLoader(data, batch_size=ROWS, sampler=sampler))
    (event,) = _about(result.events, "loss")
    diagnosis = event.detail["diagnosis"]
    assert (diagnosis["micro"], diagnosis["epoch"], diagnosis["batch_index"]) == (1, 0, 5), diagnosis
    assert diagnosis["dataset_indices"] == [ROWS * 5 + 3], diagnosis
    assert (event.epoch, event.batch) == (0, 5), event
    (added,) = [e for e in result.events if e.name == "quarantine" and e.action == "add"]
    assert (added.epoch, added.batch, added.detail["indices"]) == (0, 5, [ROWS * 5 + 3]), added


def test_whole_step_events_keep_the_steps_batch():
    """A gradient finding is about the step: its event names the window's last batch (7)."""
    from safetrain.testing import GradFault

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    GradFault(model[2].weight, calls=[5])  # the backward of batch 4: step 2
    cfg = load_config(None, [*BASE, "detect.replay.enabled=false"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data(), shuffle=False), epochs=1)
    (event,) = _about(result.events, "gradient")
    assert (event.epoch, event.batch, event.step) == (0, 7, 2), event


def test_the_caller_owned_verbs_name_the_micro_batch():
    """The caller's verbs, as the Lightning and Hugging Face callbacks drive them."""
    data = PoisonRows(regression_data(), indices=[ROWS * 5 + 3], value=math.nan)
    model, opt, _, guard = make({"guard": {"accumulate_steps": 4}, "sanitize": {"inputs": "skip_batch"}})
    with guard:
        guard.begin_epoch(0)
        results = caller_loop(guard, model, opt, list(loader(data, shuffle=False))[:8], accumulate=4)
    events = [e for decided, _ in results for e in decided.events]
    (event,) = _about(events, "input")
    assert (event.epoch, event.batch) == (0, 5), event


def test_an_empty_micro_batch_names_its_own_batch():
    """An empty batch (0 rows) at batch 5 is left out of the window 4..7; its event says batch 5."""
    batches = list(loader(regression_data(), shuffle=False))[:8]
    x, y = batches[5]
    batches[5] = (x[:0], y[:0])
    model = mlp()
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.02), load_config(None, BASE), loss_fn=F.mse_loss) as g:
        g.begin_epoch(0)
        for batch in batches:
            g.step(batch)
    (event,) = _about(g.bus.events, "input")
    assert (event.epoch, event.batch, event.detail["rows"]) == (0, 5, 0), event
