"""A planted sharded snapshot and the edits a planter makes to one (its mark, its sharding offsets,
the checksums recorded after an edit): shared by the tests of untrusted snapshots and their fuzz."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch


def sharded_snapshot(root: Path, step: int = 3, **mark: Any) -> Path:
    """A complete one-rank sharded snapshot: model/w, model/b, an optimizer tensor; checksums recorded."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    from safetrain.distributed.mark import write_mark
    from safetrain.distributed.snapdir import rank_path, step_dir, write_json

    snap = Path(step_dir(str(root), step))
    snap.mkdir(parents=True)
    meta = {"counters": {"step": step}, "created": 1.7e9, "run_id": "r1", "world": 1, "optim": {}, "own": {}}
    write_json(rank_path(str(snap), 0), {**meta, "optimizer_type": "torch.optim.sgd.SGD"})
    tensors = {"model/w": torch.randn(4, 3), "model/b": torch.zeros(4), "optim/w/momentum_buffer": torch.ones(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save(tensors, storage_writer=HuggingFaceStorageWriter(str(snap), save_distributed=True), no_dist=True)
    write_mark(str(snap), meta, None, "r1")
    if mark:
        edit_mark(snap, **mark)
    return snap


def edit_mark(snap: Path, **changes: Any) -> None:
    """Set ``changes`` in the snapshot's mark (safetrain.json), its checksums left as they were."""
    path = snap / "safetrain.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def rechecksum(snap: Path) -> None:
    """What a planter does after editing a file: record its new checksum in the mark."""
    from safetrain.distributed.verify import checksum_files

    edit_mark(snap, files=checksum_files(str(snap), None))


def set_offsets(snap: Path, name: str, offsets: list) -> None:
    """Rewrite tensor ``name``'s saved offsets in the shard's sharding metadata; checksums recorded again."""
    shard = next(snap.glob("*.safetensors"))
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    info[name]["saved_offsets"] = offsets
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    rechecksum(snap)
