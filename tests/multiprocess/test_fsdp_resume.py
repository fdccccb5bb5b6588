"""FSDP2 sharded snapshots on disk (torch.distributed.checkpoint) and resume, on gloo ranks.

Issue #17 (second slice). Three launches, each a fresh set of processes: (1) 2 ranks train an
uninterrupted run of 10 steps and a run cut after 7 steps, both with ``snapshot.store:
safetensors`` (sharded snapshot directories); (2) 2 new ranks resume the cut run with
``fit(resume=DIR)`` and train to step 10; (3) 1 rank loads the same snapshot (DCP reshards).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests.helpers.fsdp import (
    RUN_STEPS,
    launch,
    load_newest,
    restore_midrun,
    sharded_fit,
    spawn_ranks,
    unsharded_mlp,
)

pytestmark = pytest.mark.slow

TIMEOUT = 150
STEPS, CUT, SNAP = RUN_STEPS, 7, 6  # the cut run's newest snapshot is of step 6 (snapshot.every=3)


def _phase(rank: int, tmp: str, phase: str) -> Dict[str, Any]:
    if phase == "train":
        full = sharded_fit(rank, f"{tmp}/full", STEPS)
        cut = sharded_fit(rank, f"{tmp}/cut", CUT)
        listing = sorted(os.listdir(f"{tmp}/cut"))
        if rank == 0:  # a save cut short by a SIGKILL: this run's rank-0 part, no completion mark
            os.makedirs(f"{tmp}/cut/step-0000000008")
            with open(f"{tmp}/cut/step-0000000008/rank-0.json", "w") as f:
                json.dump({"run_id": cut["run"]}, f)
        return {"full": full, "cut": cut, "listing": listing, "incomplete": sorted(os.listdir(f"{tmp}/cut"))}
    if phase == "resume":
        loaded = load_newest(rank, f"{tmp}/cut")
        resumed = sharded_fit(rank, f"{tmp}/cut", STEPS, resume=f"{tmp}/cut")
        midrun = restore_midrun(rank, f"{tmp}/midrun")
        return {"loaded": loaded, "resumed": resumed, "listing": sorted(os.listdir(f"{tmp}/cut")), "midrun": midrun}
    loaded = load_newest(rank, f"{tmp}/cut/step-{SNAP:010d}")
    resumed = sharded_fit(rank, f"{tmp}/one", STEPS, resume=f"{tmp}/cut/step-{SNAP:010d}")  # the full fit path
    marks = [json.loads(Path(p, "safetrain.json").read_text()) for p in sorted(Path(tmp, "one").glob("step-*"))]
    return {"loaded": loaded, "resumed": resumed, "written": [(m["counters"]["step"], m["world"]) for m in marks]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Dict[str, List[Dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("fsdp_resume")
    out: Dict[str, List[Dict[str, Any]]] = {}
    for phase, world in (("train", 2), ("resume", 2), ("one", 1)):
        out[phase] = launch(__file__, tmp, phase, TIMEOUT, f"the FSDP2 {phase} launch", world)
    out["dir"] = [{"path": str(tmp / "cut")}]
    return out


def test_sharded_snapshots_are_directories_kept_k_with_a_completion_mark(runs):
    train = runs["train"][0]
    assert train["listing"] == ["step-0000000003", "step-0000000006"], train["listing"]
    assert "step-0000000008" in train["incomplete"]
    assert runs["resume"][0]["resumed"]["run"] == train["cut"]["run"], "resume continues the cut run"


def test_resume_of_a_sharded_run_on_the_same_ranks_ends_bitwise_equal_to_the_uninterrupted_run(runs):
    train, resume = runs["train"], runs["resume"]
    for r in range(2):
        assert resume[r]["loaded"]["step"] == SNAP, resume[r]["loaded"]
        assert resume[r]["resumed"]["steps"] == STEPS and resume[r]["resumed"]["events"] == STEPS - SNAP
        assert resume[r]["resumed"]["digest"] == train[r]["full"]["digest"], "bitwise equal to the uninterrupted run"
    assert train[0]["full"]["digest"] == train[1]["full"]["digest"]
    # the incomplete directory of the same run is ignored on load and removed by its next save
    assert "step-0000000008" not in resume[0]["listing"], resume[0]["listing"]
    assert resume[0]["listing"] == ["step-0000000006", "step-0000000009"], resume[0]["listing"]


def test_an_anomaly_on_one_rank_restores_the_sharded_snapshot_from_disk_on_every_rank(runs):
    r0, r1 = runs["resume"][0]["midrun"], runs["resume"][1]["midrun"]
    assert r0["actions"] == r1["actions"] and r0["actions"][5] == "restore", r0["actions"]
    assert r0["restored"] == r1["restored"] == [3], (r0["restored"], r1["restored"])
    assert r0["digest"] == r1["digest"] and r0["finite"] and r1["finite"]


def test_a_sharded_snapshot_of_two_ranks_loads_on_one_rank(runs):
    """DCP reshards: the 2-rank snapshot's full model and optimizer state on 1 rank."""
    one, resume = runs["one"][0]["loaded"], runs["resume"][0]["loaded"]
    assert one["step"] == SNAP and one["digest"] == resume["digest"], (one, resume)

    # fit(resume=...) of the 2-rank snapshot on 1 rank: 4 steps more, its own 1-rank snapshots, same run
    fit = runs["one"][0]["resumed"]
    assert fit["steps"] == STEPS and fit["events"] == STEPS - SNAP and fit["finite"], fit
    assert fit["run"] == runs["train"][0]["cut"]["run"], "the run goes on"
    assert runs["one"][0]["written"] == [[9, 1]], runs["one"][0]["written"]


def test_no_pickle_in_a_sharded_snapshot(runs):
    """Every file of a sharded snapshot is JSON or safetensors (DCP's default FileSystemWriter
    pickles its ``.metadata`` file and torch.saves the tensors; it is not used)."""
    files = [p for p in Path(runs["dir"][0]["path"]).rglob("*") if p.is_file()]
    assert {p.suffix for p in files} == {".json", ".safetensors"}, files
    assert len([p for p in files if p.parent.name == "step-0000000009" and p.suffix == ".safetensors"]) == 2
    for p in files:
        data = p.read_bytes()
        if p.suffix == ".json":
            json.loads(data)
        else:  # safetensors: an 8-byte little-endian header length, a JSON header, raw tensor bytes
            n = int.from_bytes(data[:8], "little")
            assert isinstance(json.loads(data[8 : 8 + n]), dict), p


def test_export_writes_one_model_file_that_loads_into_the_unsharded_model(runs, tmp_path, capsys):
    """`safetrain export SNAPSHOT OUT.safetensors`: the 2-rank snapshot's model as one file."""
    from safetensors.torch import load_file

    from safetrain.cli import main

    out = tmp_path / "model.safetensors"
    assert main(["export", f"{runs['dir'][0]['path']}/step-{SNAP:010d}", str(out)]) == 0
    assert "6 tensors" in capsys.readouterr().out
    net = unsharded_mlp()
    net.load_state_dict(load_file(str(out)))  # strict: every name, every shape
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    assert hashlib.sha256(flat.numpy().tobytes()).hexdigest() == runs["one"][0]["loaded"]["params"]
    assert main(["export", str(tmp_path), str(tmp_path / "x.safetensors")]) == 2  # no snapshot there


if __name__ == "__main__":
    spawn_ranks(_phase, "train")
