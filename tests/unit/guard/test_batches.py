"""``to_device``: a CPU loader's batch follows the model to its accelerator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safetrain.guard.batches import to_device

META = torch.device("meta")  # an accelerator stand-in: tensors move there without a GPU


@dataclass
class Record:
    pixels: torch.Tensor
    name: str


def test_every_cpu_tensor_of_a_nested_batch_moves_and_the_rest_is_kept():
    batch = {"x": torch.randn(4, 3), "pair": (torch.arange(4), [Record(torch.ones(4, 2), "a")]), "n": 7}
    moved = to_device(batch, META)
    assert moved["x"].device == META and moved["x"].shape == (4, 3)
    assert moved["pair"][0].device == META and moved["pair"][0].dtype == torch.long
    record = moved["pair"][1][0]
    assert isinstance(record, Record) and record.pixels.device == META and record.name == "a"
    assert moved["n"] == 7 and isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert batch["x"].device.type == "cpu", "the user's batch is not changed in place"


def test_a_cpu_model_gets_the_batch_itself_and_device_tensors_stay_put():
    batch = (torch.randn(4, 3), torch.randn(4))
    assert to_device(batch, torch.device("cpu")) is batch
    on_device = (torch.empty(4, 3, device=META), torch.empty(4, device=META))
    assert to_device(on_device, META) is on_device  # nothing moved: not even the tuple is rebuilt


def test_pageable_tensors_names_the_cpu_tensors_a_copy_would_stage():
    from safetrain.guard.batches import pageable_tensors

    batch = {"x": torch.randn(4, 3), "on_device": torch.empty(4, device=META), "n": 1}
    assert pageable_tensors(batch) == ['batch["x"]']


def test_the_guard_trains_on_the_moved_batch_and_does_not_move_a_skipped_one(monkeypatch):
    """The wiring in ``Guard.step`` (CI has no accelerator: the move is a spy that copies)."""
    import torch.nn.functional as F

    import safetrain.guard.plumbing as guard_module
    from safetrain import load_config
    from safetrain.guard import Guard
    from tests.helpers.models import loader, mlp, regression_data

    moved = []

    def spy(batch, device):
        copy = tuple(t.clone() for t in batch)
        moved.append((batch, copy))
        return copy

    monkeypatch.setattr(guard_module, "to_device", spy)
    model = mlp()
    batches = list(loader(regression_data()))
    with Guard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        load_config(None, ["log.progress=false"]),
        loss_fn=F.mse_loss,
    ) as guard:
        guard.plumbing.moves = True  # as for a model on an accelerator
        result = guard.step(batches[0])
        assert result.action == "" and len(moved) == 1 and moved[0][0] is batches[0]
        assert guard.pending.micro == [moved[0][1]], "the moved copy is what was trained and kept for a replay"
        guard.recovery_state.skip_after_restore = 1  # as after a restore with recovery.skip_batches_after_restore
        assert guard.step(batches[1]).action == "skip_batch"
        assert len(moved) == 1, "a batch skipped unseen is not copied to the device"
