"""``safetrain export``: one consolidated model file from a sharded (FSDP2) snapshot.

The model's shards of every rank (DCP keys ``model/{fqn}``) are read into full tensors in one
process, no process group needed, and written as one safetensors file keyed by the user's
parameter names: ``model.load_state_dict(safetensors.torch.load_file(OUT))`` on the unsharded
model. Optimizer state, RNG and the guard's state are left out (a model file, for inference or
Hugging Face).
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Union

import torch

from ..errors import SnapshotError
from ..rundir.atomicfile import atomic_save
from .layout import shard_layout
from .snapdir import MARK, sharded_snapshots

__all__ = ["export_model"]


def export_model(snapshot: Union[str, os.PathLike], out: Union[str, os.PathLike]) -> Dict[str, torch.Tensor]:
    """Write the full model of a sharded snapshot to ``out`` (safetensors); returns its tensors.

    Args:
        snapshot: a ``step-*`` snapshot directory, or a snapshot directory (its newest complete one).
        out: the safetensors file to write (replaced atomically; a link there is replaced, not followed).

    Raises:
        SnapshotError: no complete sharded snapshot there, or it cannot be read.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    snap = os.fspath(snapshot)
    if not os.path.isfile(os.path.join(snap, MARK)):
        found = sharded_snapshots(snap)
        if not found:
            raise SnapshotError(f"{snap}: no complete sharded snapshot (step-*/ with {MARK}) here")
        snap = found[-1]
    try:
        layout = shard_layout(snap)  # sizes checked against the bytes held: a few bytes cannot ask for gigabytes
        full = {k: torch.zeros(size, dtype=dtype) for k, (size, dtype) in layout.items() if k.startswith("model/")}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(full, storage_reader=HuggingFaceStorageReader(snap), no_dist=True)
    except Exception as exc:  # DCP and safetensors raise their own types
        raise SnapshotError(f"{snap}: cannot read the model's shards: {exc}") from None
    if not full:
        raise SnapshotError(f"{snap}: the snapshot holds no model tensor")
    tensors = {k[len("model/") :]: t.contiguous() for k, t in full.items()}
    try:
        metadata = {"format": "pt", "safetrain.snapshot": os.path.basename(snap)}
        # written in a private temporary directory beside OUT, then renamed: a link at OUT is replaced
        atomic_save(out, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    except OSError as exc:
        raise SnapshotError(f"{os.fspath(out)}: cannot write the model file: {exc.strerror or exc}") from None
    return tensors
