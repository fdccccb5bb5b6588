"""Sharded (FSDP2) snapshots are verified on load: a checksum of every file in the completion mark.

Issue #17 ("verified on load"). One byte flipped inside a shard's tensor data of the newest
snapshot: ``fit(resume="auto")`` refuses it, names it, resumes from the one before and ends
bitwise equal to the uninterrupted run; a restore from disk in the middle of a run sets it aside
and restores the one before; ``safetrain inspect`` says which file fails. A snapshot whose mark
records no checksums (written before they were) still loads, and inspect says so. Two launches of
2 gloo ranks; the helpers are :mod:`tests.helpers.fsdp`'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest

from tests.helpers.fsdp import (
    RUN_STEPS,
    launch,
    load_newest,
    restore_midrun,
    sharded_fit,
    spawn_ranks,
)

pytestmark = pytest.mark.slow

TIMEOUT = 150
STEPS, CUT = RUN_STEPS, 7  # the cut run's snapshots: steps 3 and 6


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


def _midrun(rank: int, directory: str) -> Dict[str, Any]:
    """Snapshots of steps 0 and 3; rank 0 damages step 3's shard; a NaN loss on rank 1 at step 6:
    every rank refuses step 3 (set aside) and restores step 0."""
    import torch.distributed as dist

    def damage() -> None:
        if rank == 0:
            flip_tensor_byte(Path(directory, "step-0000000003"))
        dist.barrier()

    return {**restore_midrun(rank, directory, damage), "listing": os.listdir(directory)}


def _phase(rank: int, tmp: str, phase: str) -> Dict[str, Any]:
    if phase == "train":
        return {"full": sharded_fit(rank, f"{tmp}/full", STEPS), "cut": sharded_fit(rank, f"{tmp}/cut", CUT)}
    import logging

    warnings: List[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("safetrain").addHandler(handler)
    return {
        "resumed": sharded_fit(rank, f"{tmp}/cut", STEPS, resume="auto"),
        "warnings": warnings,
        "old": load_newest(rank, f"{tmp}/old"),
        "midrun": _midrun(rank, f"{tmp}/midrun"),
    }


def _launch(tmp: Path, phase: str) -> List[Dict[str, Any]]:
    return launch(__file__, tmp, phase, TIMEOUT, f"the {phase} launch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Dict[str, Any]:
    from safetrain.cli import main

    tmp = tmp_path_factory.mktemp("fsdp_verify")
    train = _launch(tmp, "train")
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
    return {"train": train, "resume": _launch(tmp, "resume"), "damaged": damaged, "inspected": inspected, "tmp": tmp}


def test_resume_auto_refuses_the_damaged_newest_snapshot_and_resumes_the_one_before(runs):
    """Fails before: the flipped bit loads silently (step 6 resumed, 4 steps, a different digest)."""
    for r in range(2):
        resumed, full = runs["resume"][r]["resumed"], runs["train"][r]["full"]
        assert resumed["steps"] == STEPS and resumed["events"] == STEPS - 3, resumed  # from step 3, not 6
        assert resumed["digest"] == full["digest"], "bitwise equal to the uninterrupted run"
        warned = [w for w in runs["resume"][r]["warnings"] if "step-0000000006" in w and "checksum" in w]
        assert warned and runs["damaged"] in warned[0], runs["resume"][r]["warnings"]  # named, on every rank


def test_a_restore_from_disk_sets_the_damaged_snapshot_aside_and_restores_the_one_before(runs):
    r0, r1 = runs["resume"][0]["midrun"], runs["resume"][1]["midrun"]
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
        assert runs["resume"][r]["old"]["step"] == 3, runs["resume"][r]["old"]


if __name__ == "__main__":
    spawn_ranks(_phase, "train")
