"""QuarantineSampler and quarantine.json: skipping, index bookkeeping, atomic file, DDP refusal."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from torch.utils.data import SequentialSampler

from safetrain import SafetrainError
from safetrain.quarantine import QuarantineKeeper, QuarantineSampler, read_quarantine, write_quarantine


def test_sampler_skips_quarantined_and_reports_batch_indices_in_order():
    sampler = QuarantineSampler(SequentialSampler(range(10)), quarantined=[3])
    seen = list(sampler)
    assert seen == [0, 1, 2, 4, 5, 6, 7, 8, 9] and sampler.skipped == 1
    assert sampler.take(4) == [0, 1, 2, 4] and sampler.take(2) == [5, 6]
    assert sampler.add([3, 7]) == [7] and sorted(sampler.quarantined) == [3, 7]


def test_file_round_trip_and_clear_error(tmp_path):
    path = tmp_path / "quarantine.json"
    assert read_quarantine(path) == []
    write_quarantine(path, [9, 2, 2])
    assert json.loads(path.read_text())["indices"] == [2, 9] and read_quarantine(path) == [2, 9]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")], "no temporary file left"
    path.write_text("[1, 2]")
    with pytest.raises(SafetrainError, match=r"quarantine\.json: not a quarantine file"):
        read_quarantine(path)


def test_refused_under_distributed_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(SafetrainError, match="not supported yet: ranks would run different numbers"):
        QuarantineKeeper(QuarantineSampler(SequentialSampler(range(4))), None, lambda *a: None)
