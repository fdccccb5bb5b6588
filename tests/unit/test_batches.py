"""``to_device``: a CPU loader's batch follows the model to its accelerator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from safetrain.batches import to_device

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
