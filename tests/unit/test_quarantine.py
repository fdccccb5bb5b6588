"""QuarantineSampler and quarantine.json: skipping, index bookkeeping, atomic file, under DDP."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from torch.utils.data import SequentialSampler

from safetrain import SafetrainError
from safetrain.diagnose.quarantine import QuarantineKeeper, QuarantineSampler, read_quarantine, write_quarantine


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


def test_keep_length_replaces_quarantined_indices_with_repeats_of_healthy_ones():
    sampler = QuarantineSampler(SequentialSampler(range(6)), quarantined=[1, 4], keep_length=True)
    assert list(sampler) == [0, 2, 3, 5, 0, 2], "same length as the shard: every rank runs as many batches"
    assert sampler.take(6) == [0, 2, 3, 5, 0, 2] and (sampler.skipped, sampler.repeated) == (2, 2)
    everything = QuarantineSampler(SequentialSampler(range(2)), quarantined=[0, 1], keep_length=True)
    with pytest.raises(SafetrainError, match="every one of this rank's 2 samples is quarantined"):
        list(everything)


def test_under_distributed_the_keeper_unites_ranks_only_on_diagnosed_steps(monkeypatch):
    from safetrain.diagnose import quarantine
    from safetrain.events import AnomalyFound, SnapshotTaken

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    calls = []
    monkeypatch.setattr(quarantine, "_union_across_ranks", lambda mine: calls.append(mine) or sorted({*mine, 9}))
    sampler = QuarantineSampler(SequentialSampler(range(12)))
    emitted = []
    keeper = QuarantineKeeper(sampler, None, lambda *a: emitted.append(a))
    keeper.after_step([SnapshotTaken(step=1, epoch=0, batch=0, kind="snapshot", action="saved", message="")])
    assert calls == [], "a step without a diagnosis makes no collective"
    diagnosed = AnomalyFound(
        step=2,
        epoch=0,
        batch=1,
        kind="loss",
        action="skip_batch",
        message="",
        detail={"diagnosis": {"dataset_indices": [3]}},
    )
    keeper.after_step([diagnosed])
    assert calls == [[3]] and sorted(sampler.quarantined) == [3, 9], "another rank's sample is quarantined here too"
    assert list(sampler) == [0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 0, 1], "under DDP the shard keeps its length"
    assert emitted[0][0] == "add" and emitted[0][2]["indices"] == [3, 9]
