"""Buffers non-finite by design are part of the model (issue 23, point 2).

A transformer that registers its float causal mask as a buffer
(``nn.Transformer.generate_square_subsequent_mask`` returns ``-inf`` above the diagonal:
https://github.com/pytorch/pytorch/issues/28272 prints it) had every snapshot refused as "not
finite" from step 0, and its first restore crashed ``fit`` with ``SnapshotError: MemoryStore: no
snapshot to restore``. Snapshots take such a buffer as it was at the start; a buffer that changes
its non-finite pattern is still refused.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import List

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, load_config
from safetrain.snapshot import MemoryStore, SafetensorsStore, TrainState
from safetrain.snapshot.header import read_header
from safetrain.testing import WeightFault

T, D = 8, 8  # sequence length (the mask has T * (T - 1) / 2 = 28 entries at -inf), model width
QUIET = ["log.progress=false", "snapshot.every=2", "detect.check_weights_every=1"]


class CausalEncoder(torch.nn.Module):
    """A one-layer causal transformer regressor whose mask is a registered (persistent) buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(D, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(D, 1)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x, src_mask=self.mask)).mean(dim=1)


def data(n: int = 10) -> List[tuple]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, T, D, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def config(tmp_path: Path, store: str, *more: str):
    return load_config(None, [*QUIET, f"snapshot.store={store}", f"snapshot.dir={tmp_path / 'snaps'}", *more])


@pytest.mark.parametrize("store", ["memory", "safetensors"])
def test_a_causal_mask_buffer_is_snapshotted_and_a_nan_weight_is_restored(tmp_path, store):
    """Snapshots are taken with the mask, the first one's event names it once, the weight check
    does not flag it, and a NaN weight after step 5 is restored (not a SnapshotError)."""
    model = CausalEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fault = WeightFault(opt, model.head.weight, (0, 0), steps=[5])
    result = SafeTrainer(model, opt, config(tmp_path, store), loss_fn=F.mse_loss).fit(data(), epochs=1)
    fault.remove()
    saved = [e for e in result.events if e.name == "snapshot" and e.action == "saved"]
    assert len(saved) >= 3, [(e.step, e.action) for e in result.events if e.name == "snapshot"]
    assert "accepted non-finite buffers present at the start: mask (-inf x 28)" in saved[0].message
    assert saved[0].detail["accepted_buffers"] == "mask (-inf x 28)"
    assert all("accepted" not in e.message for e in saved[1:]), "named once"
    anomalies = [(e.kind, e.action) for e in result.events if e.name == "anomaly"]
    assert anomalies == [("weights", "restore")], anomalies
    assert result.ended == "done" and result.restores == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.equal(model.mask, torch.nn.Transformer.generate_square_subsequent_mask(T)), "the mask is intact"


def test_resume_from_a_safetensors_snapshot_keeps_the_mask_and_its_acceptance(tmp_path):
    """A snapshot file holds the mask and its pattern; a resumed run restores it and goes on taking snapshots."""
    model = CausalEncoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = config(tmp_path, "safetensors")
    SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(data(), epochs=1, max_steps=6)
    files = sorted((tmp_path / "snaps").glob("snapshot-*.safetensors"))
    assert files, "snapshots were written"
    meta = read_header(str(files[-1])).state()
    assert meta["model"]["accepted"]["model/mask"][:3] == [0, 0, 28]

    fresh = CausalEncoder()
    with torch.no_grad():  # -inf elsewhere: the snapshot's mask and its pattern must replace the live ones
        fresh.mask.copy_(fresh.mask.T.contiguous())
    opt2 = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    result = SafeTrainer(fresh, opt2, cfg, loss_fn=F.mse_loss).fit(data(), epochs=1, resume=str(tmp_path / "snaps"))
    assert result.ended == "done"
    assert torch.equal(fresh.mask, torch.nn.Transformer.generate_square_subsequent_mask(T))
    later = [e.action for e in result.events if e.name == "snapshot"]
    assert later and set(later) == {"saved"}, "snapshots go on after the resume, with the file's pattern"


@pytest.mark.parametrize("store_cls", [MemoryStore, SafetensorsStore])
@pytest.mark.parametrize("change", ["new_inf", "moved", "nan"])
def test_a_mask_that_changes_its_nonfinite_pattern_is_refused(tmp_path, store_cls, change):
    """More non-finite entries, the same count elsewhere, or a NaN: the snapshot is refused."""
    model = CausalEncoder()
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert set(state.accept_nonfinite_buffers()) == {"model/mask"}
    store = store_cls(keep=2) if store_cls is MemoryStore else store_cls(str(tmp_path / "s"), keep=2)
    with store:
        assert store.save(state, {"step": 0}) is not None
        assert store.save(state, {"step": 1}) is not None
        with torch.no_grad():
            if change == "new_inf":
                model.mask[T - 1, 0] = -math.inf
            elif change == "moved":  # one -inf moves: the counts stay, the place changes
                model.mask[0, T - 1] = 0.0
                model.mask[T - 1, 0] = -math.inf
            else:
                model.mask[0, 0] = math.nan
        assert store.save(state, {"step": 2}) is None
        assert store.refused == ("model/mask",)
        with torch.no_grad():
            model.mask.copy_(torch.nn.Transformer.generate_square_subsequent_mask(T))
        assert store.save(state, {"step": 3}) is not None


def test_a_buffer_that_turns_nonfinite_during_training_is_a_weights_fault():
    """A finite buffer at the start is not accepted: turning NaN mid-run is found and restored."""
    model = CausalEncoder()
    model.register_buffer("scale", torch.ones(D))
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, QUIET), loss_fn=F.mse_loss) as g:
        batches = data(6)
        for batch in batches[:3]:
            assert g.step(batch).trained
        assert set(g.state.accepted) == {"model/mask"}
        model.scale[0] = math.nan
        result = g.step(batches[3])
        kinds = [(e.kind, e.action) for e in result.events]
        assert ("weights", "restore") in kinds, kinds
        assert torch.isfinite(model.scale).all()


@pytest.mark.parametrize("change", ["new_inf", "nan"])
def test_a_mask_that_changes_mid_run_is_a_weights_fault_and_is_put_back(change):
    """One more -inf (the outputs stay finite: only the weight check sees it) or a NaN in the mask
    between steps: the periodic weight check finds it by its pattern, names it, and the restore puts
    the mask back as it was."""
    model = CausalEncoder()
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, QUIET), loss_fn=F.mse_loss) as g:
        batches = data(6)
        for batch in batches[:3]:
            assert g.step(batch).trained
        with torch.no_grad():
            model.mask[T - 1, 0] = -math.inf if change == "new_inf" else math.nan
        result = g.step(batches[3])
        kinds = [(e.kind, e.action) for e in result.events]
        assert ("weights", "restore") in kinds, kinds
        finding = next(e for e in result.events if e.kind == "weights").detail["finding"]
        assert finding["nonfinite"] == ["mask"], finding
        assert torch.equal(model.mask, torch.nn.Transformer.generate_square_subsequent_mask(T))
        for batch in batches[4:]:
            assert g.step(batch).trained


def test_a_masked_model_reads_the_host_once_per_healthy_step_with_its_weight_check():
    """The mask's pattern probe is folded into the weight check's value: no read of its own."""
    from safetrain.testing import count_host_syncs

    model = CausalEncoder()
    cfg = load_config(None, ["log.progress=false", "snapshot.every=1000", "detect.check_weights_every=1"])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss) as g:
        batches = data(5)
        g.step(batches[0])  # the first step's snapshot reads the host too
        with count_host_syncs() as syncs:
            for batch in batches[1:]:
                assert g.step(batch).trained
        assert syncs.count == 4
