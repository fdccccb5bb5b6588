"""FSDP2 sharded snapshots on disk (torch.distributed.checkpoint): resume, verification on load,
asynchronous saves; on gloo ranks.

Issue #17. Three launches, each a fresh set of processes (a launch, not its few steps, is what
costs; the runs of each share it, each in its own directory):

1. **train** (2 ranks): an uninterrupted run of 10 steps and a run cut after 7 steps, both with
   ``snapshot.store: safetensors`` (sharded snapshot directories); a second cut run for the
   verification; and the same 10-step run with ``snapshot.async_save`` off and on (they end
   bitwise equal, with the same snapshots), then a NaN loss on rank 1 while an async save is still
   in flight (that snapshot is awaited and restored).
2. **resume** (2 new ranks): the cut run resumed with ``fit(resume=DIR)`` to step 10; a restore from
   disk mid-run. Before it, the test flips one byte inside a shard of the second cut run's newest
   snapshot (a checksum of every file is in the completion mark): ``fit(resume="auto")`` refuses
   it, names it, resumes from the one before and ends bitwise equal to the uninterrupted run; a
   restore mid-run sets a damaged snapshot aside; ``safetrain inspect`` says which file fails; a
   snapshot whose mark records no checksums still loads, and inspect says so.
3. **one** (1 rank): the 2-rank snapshot loads on one rank (DCP reshards).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from tests.helpers.fsdp import (
    RUN_STEPS,
    adam_digest,
    batches,
    fsdp_mlp,
    launch,
    load_newest,
    restore_midrun,
    sharded_fit,
    snapshot_cfg,
    spawn_ranks,
    unsharded_mlp,
)

pytestmark = pytest.mark.slow

TIMEOUT = 150
STEPS, CUT, SNAP = RUN_STEPS, 7, 6  # the cut run's newest snapshot is of step 6 (snapshot.every=3)


# ----------------------------------------------------------------------------- the ranks' side


def _async_fit(rank: int, directory: str, async_save: bool) -> Dict[str, Any]:
    import torch.nn.functional as F

    from safetrain import SafeTrainer, load_config

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = load_config(None, [*snapshot_cfg(directory), f"snapshot.async_save={str(async_save).lower()}"])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss)
    result = trainer.fit(batches(rank, STEPS), epochs=1, max_steps=STEPS)
    shards = {
        p.name: _shard_tensors(p) for p in sorted(Path(directory).glob("step-*")) if (p / "safetrain.json").is_file()
    }
    background = trainer.guard.store.background
    return {"digest": adam_digest(model, opt), "steps": result.steps, "shards": shards, "async": background is not None}


def _shard_tensors(snap: Path) -> str:
    """A digest of every tensor (name and bytes) in a snapshot's shard files."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for file in sorted(snap.glob("*.safetensors")):
        for name, t in sorted(load_file(str(file)).items()):
            h.update(f"{file.name}/{name}".encode() + t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _restore_after_async_save(rank: int, directory: str) -> List[Any]:
    """Async snapshots every 3 steps, their completion marks held back 2 s; a NaN loss on rank 1
    at step 6 (steps 4 and 5 read clean after the snapshot of step 3: vouched for, issue 23): the
    snapshot of step 3, its mark still held back, is awaited and restored."""
    import torch.nn.functional as F

    from safetrain import load_config
    from safetrain.distributed import background
    from safetrain.guard import Guard

    write_mark = background.write_mark

    def late(*args: Any) -> None:
        time.sleep(2.0)
        write_mark(*args)

    background.write_mark = late

    model = fsdp_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    cfg = load_config(
        None,
        [*snapshot_cfg(directory), "snapshot.async_save=true", "sanitize.targets=off", "recovery.actions.loss=restore"],
    )
    restored: List[Any] = []
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.bus.subscribe(lambda e: restored.append(e.detail.get("snapshot_step")) if e.name == "restored" else None)
        guard.begin_epoch(0)
        for step, (x, y) in enumerate(batches(rank, STEPS)[:6], start=1):
            if step == 6 and rank == 1:
                y = y.clone().fill_(math.nan)
            guard.step((x, y))
    background.write_mark = write_mark
    return restored


def flip_tensor_byte(snap: Path, rank_file: int = 1) -> str:
    """Flip one bit of a float32 model tensor's bytes in one shard file of ``snap``; its name."""
    file = sorted(snap.glob("*.safetensors"))[rank_file]
    data = bytearray(file.read_bytes())
    n = int.from_bytes(data[:8], "little")
    for name, entry in json.loads(data[8 : 8 + n]).items():
        if name.startswith("model/") and entry.get("dtype") == "F32":
            begin, end = entry["data_offsets"]
            if end > begin:
                data[8 + n + begin + 1] ^= 0x01  # a low mantissa bit: still finite, so only a checksum sees it
                file.write_bytes(bytes(data))
                return file.name
    raise AssertionError(f"no float32 model tensor in {file}")


def _verify_midrun(rank: int, directory: str) -> Dict[str, Any]:
    """Snapshots of steps 0 and 3; rank 0 damages step 3's shard; a NaN loss on rank 1 at step 6:
    every rank refuses step 3 (set aside) and restores step 0."""
    import torch.distributed as dist

    def damage() -> None:
        if rank == 0:
            flip_tensor_byte(Path(directory, "step-0000000003"))
        dist.barrier()

    return {**restore_midrun(rank, directory, damage), "listing": os.listdir(directory)}


def _train(rank: int, tmp: str) -> Dict[str, Any]:
    full = sharded_fit(rank, f"{tmp}/full", STEPS)
    cut = sharded_fit(rank, f"{tmp}/cut", CUT)
    listing = sorted(os.listdir(f"{tmp}/cut"))
    if rank == 0:  # a save cut short by a SIGKILL: this run's rank-0 part, no completion mark
        os.makedirs(f"{tmp}/cut/step-0000000008")
        with open(f"{tmp}/cut/step-0000000008/rank-0.json", "w") as f:
            json.dump({"run_id": cut["run"]}, f)
    sharded_fit(rank, f"{tmp}/verify/cut", CUT)  # the test damages its newest snapshot before the resume
    async_runs = {
        "off": _async_fit(rank, f"{tmp}/async/off", False),
        "on": _async_fit(rank, f"{tmp}/async/on", True),
        "restored": _restore_after_async_save(rank, f"{tmp}/async/midrun"),
    }
    incomplete = sorted(os.listdir(f"{tmp}/cut"))
    return {"full": full, "cut": cut, "listing": listing, "incomplete": incomplete, "async": async_runs}


def _verify_resume(rank: int, tmp: str) -> Dict[str, Any]:
    import logging

    warnings: List[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("safetrain").addHandler(handler)
    return {
        "resumed": sharded_fit(rank, f"{tmp}/cut", STEPS, resume="auto"),
        "warnings": warnings,
        "old": load_newest(rank, f"{tmp}/old"),
        "midrun": _verify_midrun(rank, f"{tmp}/midrun"),
    }


def _phase(rank: int, tmp: str, phase: str) -> Dict[str, Any]:
    if phase == "train":
        return _train(rank, tmp)
    if phase == "resume":
        loaded = load_newest(rank, f"{tmp}/cut")
        resumed = sharded_fit(rank, f"{tmp}/cut", STEPS, resume=f"{tmp}/cut")
        midrun = restore_midrun(rank, f"{tmp}/midrun")
        listing = sorted(os.listdir(f"{tmp}/cut"))
        verify = _verify_resume(rank, f"{tmp}/verify")
        return {"loaded": loaded, "resumed": resumed, "listing": listing, "midrun": midrun, "verify": verify}
    loaded = load_newest(rank, f"{tmp}/cut/step-{SNAP:010d}")
    resumed = sharded_fit(rank, f"{tmp}/one", STEPS, resume=f"{tmp}/cut/step-{SNAP:010d}")  # the full fit path
    marks = [json.loads(Path(p, "safetrain.json").read_text()) for p in sorted(Path(tmp, "one").glob("step-*"))]
    return {"loaded": loaded, "resumed": resumed, "written": [(m["counters"]["step"], m["world"]) for m in marks]}


# ----------------------------------------------------------------------------- the test's side


def _damage_for_verify(tmp: Path) -> Dict[str, Any]:
    """Between the train and resume launches: a copy of a snapshot as written before checksums
    (none in its mark), one byte flipped in the newest snapshot, and ``safetrain inspect`` of each."""
    from safetrain.cli import main

    old = tmp / "old" / "step-0000000003"  # a snapshot as written before checksums: none in its mark
    shutil.copytree(tmp / "cut" / "step-0000000003", old)
    mark = json.loads((old / "safetrain.json").read_text())
    assert mark["checksum"] == "xxh3_64" and len(mark["files"]) == 4, mark  # 2 shards, 2 rank parts
    (old / "safetrain.json").write_text(json.dumps({k: v for k, v in mark.items() if k not in ("files", "checksum")}))
    damaged = flip_tensor_byte(tmp / "cut" / "step-0000000006")
    inspected = {}  # before the resume: it rotates step 3 out
    for key, path in (("dir", tmp / "cut"), ("one", tmp / "cut" / "step-0000000003"), ("old", old)):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            inspected[key] = (main(["inspect", str(path)]), out.getvalue())
    return {"damaged": damaged, "inspected": inspected}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fsdp_snapshots")
    out: Dict[str, Any] = {}
    for phase, world in (("train", 2), ("resume", 2), ("one", 1)):
        if phase == "resume":
            out.update(_damage_for_verify(tmp / "verify"))
        out[phase] = launch(__file__, tmp, phase, TIMEOUT, f"the FSDP2 {phase} launch", world)
    out["dir"] = [{"path": str(tmp / "cut")}]
    return out


@pytest.fixture
def async_ranks(runs: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [r["async"] for r in runs["train"]]


# resume


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


# verified on load


def test_resume_auto_refuses_the_damaged_newest_snapshot_and_resumes_the_one_before(runs):
    """Fails before: the flipped bit loads silently (step 6 resumed, 4 steps, a different digest)."""
    for r in range(2):
        resumed, full = runs["resume"][r]["verify"]["resumed"], runs["train"][r]["full"]
        assert resumed["steps"] == STEPS and resumed["events"] == STEPS - 3, resumed  # from step 3, not 6
        assert resumed["digest"] == full["digest"], "bitwise equal to the uninterrupted run"
        warned = [w for w in runs["resume"][r]["verify"]["warnings"] if "step-0000000006" in w and "checksum" in w]
        assert warned and runs["damaged"] in warned[0], runs["resume"][r]["verify"]["warnings"]  # named, on every rank


def test_a_restore_from_disk_sets_the_damaged_snapshot_aside_and_restores_the_one_before(runs):
    r0, r1 = runs["resume"][0]["verify"]["midrun"], runs["resume"][1]["verify"]["midrun"]
    assert r0["actions"] == r1["actions"] and r0["actions"][5] == "restore", r0["actions"]
    assert r0["restored"] == r1["restored"] == [0], (r0["restored"], r1["restored"])
    assert r0["digest"] == r1["digest"]
    assert "step-0000000003.corrupt" in r0["listing"], r0["listing"]


def test_inspect_names_the_file_that_fails_its_checksum(runs):
    """Fails before: no checksums, the directory verifies (exit 0) with a flipped bit in it."""
    code, out = runs["inspected"]["one"]
    assert code == 0 and "checksum   ok" in out, out
    code, out = runs["inspected"]["dir"]
    assert code == 1, out  # step 6 does not verify
    row = next(line for line in out.splitlines() if "step-0000000006" in line)
    assert "FAILED" in row and "fails its checksum" in row and runs["damaged"] in row, out


def test_a_snapshot_written_without_checksums_still_loads_and_inspect_says_so(runs):
    code, out = runs["inspected"]["old"]
    assert code == 0 and "written without checksums" in out, out
    for r in range(2):
        assert runs["resume"][r]["verify"]["old"]["step"] == 3, runs["resume"][r]["verify"]["old"]


# async_save


def test_a_run_with_async_save_ends_bitwise_equal_with_the_same_snapshots(async_ranks):
    """Fails before: snapshot.async_save is not a config key."""
    for run in async_ranks:
        off, on = run["off"], run["on"]
        assert on["async"] and not off["async"]
        assert on["steps"] == off["steps"] == STEPS and on["digest"] == off["digest"], (on, off)
        assert sorted(on["shards"]) == ["step-0000000006", "step-0000000009"], on["shards"]  # keep-2, all complete
        assert on["shards"] == off["shards"], "the same tensors on disk"


def test_a_restore_right_after_an_async_save_loads_that_snapshot(async_ranks):
    """The save of step 3 is awaited before the restore at step 6 (without the wait: step 0's snapshot)."""
    assert async_ranks[0]["restored"] == async_ranks[1]["restored"] == [3], [r["restored"] for r in async_ranks]


if __name__ == "__main__":
    spawn_ranks(_phase, "train")
