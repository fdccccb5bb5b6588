"""Quarantine never names a healthy sample when a ``collate_fn`` drops samples (issue 16, bad batches).

A ``collate_fn`` that drops a sample (a corrupt image, a too-long sequence) makes a batch shorter
than the indices the sampler gave for it; mapping rows to indices by row count then shifts every
later batch by one, and a replay blamed a healthy neighbour of the bad sample.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset
from torch.utils.data.dataloader import default_collate

from safetrain import SafeTrainer, load_config
from safetrain.diagnose.quarantine import QuarantineSampler, read_quarantine
from tests.helpers.models import finite_params, mlp, regression_data

LAZY = ["log.progress=false", "detect.mode=lazy", "snapshot.every=1000", "recovery.max_retries=9"]
CORRUPT = 5  # the sample the collate_fn drops (its first feature is a marker)


def dropping_collate(samples):
    """Leave out corrupt samples, as many real pipelines do."""
    return default_collate([s for s in samples if float(s[0][0]) != 999.0])


def run(tmp_path, bad: int, epochs: int = 1):
    x, y = regression_data(n=64).tensors
    x, y = x.clone(), y.clone()
    x[CORRUPT, 0] = 999.0
    y[bad] = 3e38  # finite, but its squared error overflows: only a replay can find it
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    sampler = QuarantineSampler(SequentialSampler(range(64)))
    data = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler, collate_fn=dropping_collate)
    cfg = load_config(None, [*LAZY, f"log.dir={tmp_path}"])
    result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(data, epochs=epochs)
    return result, model


def test_a_dropped_sample_does_not_shift_the_blame_onto_a_healthy_neighbour(tmp_path):
    """Fails before: batch 0 lost sample 5, so batch 1's rows were mapped to indices 15..30 and the
    replay quarantined sample 19, a healthy neighbour of the bad sample 20."""
    result, model = run(tmp_path, bad=20, epochs=2)
    anomaly = next(e for e in result.events if e.name == "anomaly")
    assert anomaly.detail["diagnosis"]["dataset_indices"] == [20]
    assert read_quarantine(tmp_path / "quarantine.json") == [20]
    actions = [e.action for e in result.events if e.name == "quarantine"]
    assert actions == ["unmapped", "add", "skip"], actions
    unmapped = next(e for e in result.events if e.name == "quarantine")
    assert unmapped.detail == {"rows": 15, "indices": 16}
    assert sum(1 for e in result.events if e.name == "anomaly") == 1, "no trip after the quarantine"
    assert finite_params(model)


def test_a_bad_sample_in_a_batch_that_lost_a_sample_is_not_quarantined_and_the_journal_says_why(tmp_path):
    """Fails before: rows 0..14 of batch 0 were mapped to indices 0..14, so the bad sample 13
    (row 12, after sample 5 was dropped) was quarantined as sample 12, a healthy one."""
    result, _ = run(tmp_path, bad=13)
    anomaly = next(e for e in result.events if e.name == "anomaly")
    assert anomaly.detail["diagnosis"]["bad_rows"] == [12] and anomaly.detail["diagnosis"]["dataset_indices"] == []
    assert read_quarantine(tmp_path / "quarantine.json") == [], "no healthy sample named"
    refused = [e for e in result.events if e.name == "quarantine" and e.action == "refused"]
    assert len(refused) == 1 and "15 rows" in refused[0].message and "16 dataset indices" in refused[0].message
    assert refused[0].detail == {"bad_rows": [12], "rows": 15, "indices": 16}
    journal = (tmp_path / "events.jsonl").read_text()
    assert '"refused"' in journal and "not quarantined" in journal
