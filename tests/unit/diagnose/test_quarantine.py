"""QuarantineSampler and quarantine.json: skipping, index bookkeeping, atomic file, under DDP."""

from __future__ import annotations

import json
from typing import Any, List

import pytest
import torch
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


def _diagnosed(index: int) -> Any:
    from safetrain.events import AnomalyFound

    detail = {"diagnosis": {"dataset_indices": [index]}}
    return AnomalyFound(step=2, epoch=0, batch=1, kind="loss", action="skip_batch", message="", detail=detail)


def _process_group_of_two(monkeypatch: Any, calls: List[Any]) -> None:
    """The process's default group: 2 ranks, this one rank 1; ``all_gather_object`` records its calls
    and adds index 9 from the other rank."""

    def gather(out: List[Any], mine: Any, group: Any = None) -> None:
        calls.append(mine)
        out[:] = [mine, [9]]

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather_object", gather)


@pytest.mark.parametrize("given", ["guard's DistributedSync", "none: the process's group"])
def test_when_ranks_step_together_the_keeper_unites_them_only_on_diagnosed_steps(monkeypatch, given):
    from safetrain.distributed import DistributedSync
    from safetrain.events import SnapshotTaken

    calls: List[Any] = []
    _process_group_of_two(monkeypatch, calls)
    sync = DistributedSync(torch.device("cpu")) if given.startswith("guard") else None
    sampler = QuarantineSampler(SequentialSampler(range(12)))
    emitted = []
    keeper = QuarantineKeeper(sampler, None, lambda *a, **k: emitted.append(a), sync=sync)
    keeper.after_step([SnapshotTaken(step=1, epoch=0, batch=0, kind="snapshot", action="saved", message="")])
    assert calls == [], "a step without a diagnosis makes no collective"
    keeper.after_step([_diagnosed(3)])
    assert calls == [[3]] and sorted(sampler.quarantined) == [3, 9], "another rank's sample is quarantined here too"
    assert list(sampler) == [0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 0, 1], "under DDP the shard keeps its length"
    assert emitted[0][0] == "add" and emitted[0][2]["indices"] == [3, 9]


def test_a_plain_model_in_a_process_group_quarantines_alone(monkeypatch, tmp_path):
    """Issue 25: a plain (not DDP) model in a process whose default group was made for another
    reason has a LocalSync; its keeper must not enter ``all_gather_object`` alone (rank 0 died
    there, or waited for a peer still training until the collective's timeout). Fails before:
    the keeper asked ``distributed.active()`` and gathered."""
    from safetrain.distributed import LocalSync

    calls: List[Any] = []
    _process_group_of_two(monkeypatch, calls)
    sampler = QuarantineSampler(SequentialSampler(range(6)))
    emitted = []
    keeper = QuarantineKeeper(sampler, tmp_path, lambda *a, **k: emitted.append(a), sync=LocalSync(0))
    keeper.after_step([_diagnosed(3)])
    assert calls == [], "no collective: this rank's decisions are its own"
    assert sorted(sampler.quarantined) == [3] and read_quarantine(tmp_path / "quarantine.json") == [3]
    assert list(sampler) == [0, 1, 2, 4, 5], "skipped, not replaced: no other rank to keep in step with"
    assert "keep the ranks in step" not in emitted[0][1]


def test_the_keeper_maps_by_the_loaders_batch_size_and_refuses_a_batch_that_lost_a_sample():
    """Issue 16: a collate_fn that drops a sample shifted every later batch's mapping by one.
    Fails before: there was no batch_size; batch 2 was mapped to [3, 4, 5, 6] (row count taking)."""
    import torch

    sampler = QuarantineSampler(SequentialSampler(range(10)))
    emitted = []
    keeper = QuarantineKeeper(sampler, None, lambda *a, **k: emitted.append(a), batch_size=4)
    list(sampler)  # the loader's workers may run ahead: every index handed out already
    assert keeper.indices_for((torch.zeros(3, 2), torch.zeros(3))) is None, "3 rows from 4 indices: ambiguous"
    assert keeper.indices_for((torch.zeros(4, 2), torch.zeros(4))) == [4, 5, 6, 7], "the next batch is not shifted"
    assert keeper.indices_for({"x": torch.zeros(2, 2)}) == [8, 9], "the epoch's last, shorter batch"
    assert keeper.unmapped == 1 and [a[0] for a in emitted] == ["unmapped"]
    assert emitted[0][2] == {"rows": 3, "indices": 4}


def test_a_replay_in_an_unmapped_batch_quarantines_nothing_and_says_why():
    import torch

    from safetrain.events import AnomalyFound

    def anomaly(detail):
        return AnomalyFound(step=1, epoch=0, batch=0, kind="loss", action="skip_batch", message="", detail=detail)

    sampler = QuarantineSampler(SequentialSampler(range(8)))
    emitted = []
    keeper = QuarantineKeeper(sampler, None, lambda *a, **k: emitted.append(a), batch_size=4)
    list(sampler)
    assert keeper.indices_for(torch.zeros(5, 2)) is None, "a collate_fn that adds a row is ambiguous too"
    keeper.after_step([anomaly({"diagnosis": {"bad_rows": [1], "dataset_indices": []}})])
    assert sampler.quarantined == set()
    assert [a[0] for a in emitted] == ["unmapped", "refused"]
    assert "bad rows [1] not quarantined" in emitted[1][1] and emitted[1][2] == {
        "bad_rows": [1],
        "rows": 5,
        "indices": 4,
    }
    assert keeper.indices_for(torch.zeros(4, 2)) == [4, 5, 6, 7]
    keeper.after_step([anomaly({"diagnosis": {"bad_rows": [2], "dataset_indices": [6]}})])
    assert sorted(sampler.quarantined) == [6] and [a[0] for a in emitted] == ["unmapped", "refused", "add"]


def test_for_loader_reads_the_sampler_and_batch_size_of_a_dataloader():
    """Fails before (the unbatched loader): a batch of 3 rows took indices [0, 1, 2], naming two
    samples that were not in it."""
    import torch
    from torch.utils.data import DataLoader

    sampler = QuarantineSampler(SequentialSampler(range(10)))
    keeper = QuarantineKeeper.for_loader(DataLoader(range(10), batch_size=3, sampler=sampler), None, print)
    assert keeper.sampler is sampler and keeper.batch_size == 3
    assert QuarantineKeeper.for_loader([[1, 2]], None, print).sampler is None
    plain = QuarantineKeeper.for_loader(DataLoader(range(10), batch_size=None, sampler=sampler), None, print)
    list(sampler)
    assert plain.indices_for(torch.zeros(3, 2)) == [0, 0, 0], "no batching: a batch is one sample, all its rows"
    assert plain.indices_for(torch.zeros(2, 2)) == [1, 1]
