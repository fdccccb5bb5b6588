"""Buffers non-finite by design: patterns, the snapshot check, metadata and inspection (issue 23, point 2).

The float causal mask of ``nn.Transformer.generate_square_subsequent_mask`` holds ``-inf`` above the
diagonal (https://github.com/pytorch/pytorch/issues/28272 prints it); such a buffer is accepted as
it was at the start, by its non-finite pattern.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from safetrain.snapshot import CorruptSnapshotError, MemoryStore, SafetensorsStore, TrainState, inspect_snapshot
from safetrain.snapshot.accepted import check_patterns, describe, matches, pattern, patterns_of
from safetrain.snapshot.tensors import nonfinite

N = 6


class Masked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(N, N)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x) + self.mask, dim=-1)


def state_of(model: torch.nn.Module) -> TrainState:
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_pattern_counts_each_kind_and_tells_places_apart():
    t = torch.tensor([0.0, math.nan, math.inf, -math.inf, -math.inf])
    assert pattern(t).tolist()[:3] == [1, 1, 2]
    moved = torch.tensor([math.nan, 0.0, math.inf, -math.inf, -math.inf])
    assert pattern(t).tolist()[:3] == pattern(moved).tolist()[:3]
    assert pattern(t).tolist() != pattern(moved).tolist(), "same counts, other places: another pattern"
    assert float(matches(t, pattern(t).tolist())) == 0.0
    assert math.isnan(float(matches(moved, pattern(t).tolist())))


def test_patterns_of_lists_only_nonfinite_floating_tensors_and_describe_names_them():
    mask = torch.nn.Transformer.generate_square_subsequent_mask(8)
    found = patterns_of(
        [("model/w", torch.ones(3)), ("model/mask", mask), ("model/n", torch.zeros(2, dtype=torch.long))]
    )
    assert set(found) == {"model/mask"}
    assert describe(found) == "mask (-inf x 28)"
    nan_stat = torch.tensor([1.0, math.nan])  # a corrupted BatchNorm statistic is no mask
    assert patterns_of([("model/bn.running_var", nan_stat), ("model/mask", mask)]).keys() == {"model/mask"}
    assert describe({"model/a": (2, 1, 0, 9)}) == "a (NaN x 2, +inf x 1)"


def test_parameters_are_never_accepted():
    model = Masked()
    with torch.no_grad():
        model.fc.weight[0, 0] = math.nan
    state = state_of(model)
    assert set(state.accept_nonfinite_buffers()) == {"model/mask"}
    assert state.capture({"step": 0}).checked.count("model/fc.weight") == 1


def test_nonfinite_checks_an_accepted_tensor_by_its_pattern():
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    accepted = patterns_of([("m", mask)])
    assert nonfinite([("m", mask)]) == ["m"]
    assert nonfinite([("m", mask)], accepted) == []
    changed = mask.clone()
    changed[3, 0] = -math.inf
    assert nonfinite([("m", changed), ("w", torch.ones(2))], accepted) == ["m"]


@pytest.mark.parametrize("device", ["cpu", "model"])
def test_a_memory_store_with_a_fallback_slot_takes_the_mask(device):
    """keep=2: the second save copies and checks in one pass; an accepted buffer is not streamed."""
    model = Masked()
    state = state_of(model)
    state.accept_nonfinite_buffers()
    with MemoryStore(keep=2, device=device) as store:
        for step in range(4):
            assert store.save(state, {"step": step}) is not None, step
        with torch.no_grad():
            model.mask.zero_()
        store.restore(state)
    assert torch.equal(model.mask, torch.nn.Transformer.generate_square_subsequent_mask(N))


def test_a_file_holds_the_patterns_and_inspect_does_not_call_the_mask_nonfinite(tmp_path):
    state = state_of(Masked())
    state.accept_nonfinite_buffers()
    with SafetensorsStore(str(tmp_path), keep=1) as store:
        info = store.save(state, {"step": 3})
    report = inspect_snapshot(info.path)
    assert report["all_finite"] and report["accepted_nonfinite"] == "mask (-inf x 15)", report
    fresh = state_of(Masked())
    assert fresh.accepted == {}
    with SafetensorsStore(str(tmp_path), keep=1) as store:
        store.adopt(info.run_id)
        store.restore(fresh)
    assert fresh.accepted == state.accepted, "a restore (a resume) brings the patterns back"


def test_malformed_accepted_metadata_is_a_corrupt_snapshot():
    with pytest.raises(ValueError, match="expected 4 integers"):
        check_patterns({"model/mask": [1, 2]}, "f")
    state = state_of(Masked())
    state.accept_nonfinite_buffers()
    with MemoryStore(keep=1) as store:
        store.save(state, {"step": 0})
        slot = store._slots[0]
        meta = json.loads(slot.meta_json)
        meta["model"]["accepted"] = {"model/mask": "x"}
        slot.meta_json = json.dumps(meta)
        with pytest.raises(Exception) as info:
            store.restore(state)
    assert isinstance(info.value, CorruptSnapshotError) or "malformed" in str(info.value), info.value
