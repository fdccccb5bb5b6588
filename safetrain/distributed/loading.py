"""Loading a sharded snapshot directory (:mod:`.snapdir`) into the live FSDP2 state:
verified first (:mod:`.verify`), then read by DCP's ``HuggingFaceStorageReader`` (resharded to
this job's ranks) and put in place with ``set_state_dict``."""

from __future__ import annotations

import logging
from typing import Any, Dict

import torch

from ..errors import SnapshotError
from ..snapshot.accepted import check_patterns
from ..snapshot.codec import decode
from ..snapshot.rng import restore_rng
from ..snapshot.store import CorruptSnapshotError, SnapshotInfo, make_info
from .mark import read_mark
from .snapdir import dcp_modules, flat_state, rank_path, read_json
from .verify import verify_files

__all__ = ["load_sharded"]

logger = logging.getLogger(__name__)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptSnapshotError(f"unknown dtype {name!r}")
    return dtype


def load_sharded(snap: str, state: Any, sync: Any = None) -> SnapshotInfo:
    """Every rank (a collective): verify the complete snapshot directory ``snap`` (its files'
    checksums, :mod:`.verify`), then load it into ``state`` (resharded to this job's ranks); this
    rank's RNG and extra tensors come from its own part, or rank 0's when the snapshot had fewer ranks.

    Raises:
        CorruptSnapshotError: incomplete, or a file fails its checksum (on every rank; the live
            state is untouched).
        SnapshotError: it does not fit the live model and optimizer.
    """
    rank = getattr(sync, "rank", 0)
    dcp, sd = dcp_modules()
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    mark = read_mark(snap)
    if not verify_files(snap, mark, sync):
        logger.info("%s: written without checksums (an older safetrain): sizes and offsets checked only", snap)
    src = rank if rank < int(mark["world"]) else 0
    meta = read_json(rank_path(snap, src))
    tensors, _ = flat_state(state)
    own = {n: torch.empty(shape, dtype=_dtype(dt)) for n, (shape, dt) in meta["own"].items()}
    want = {**tensors, **{f"rank{src}/{n}": t for n, t in own.items()}}
    try:
        dcp.load(want, storage_reader=HuggingFaceStorageReader(snap))
    except Exception as exc:  # DCP raises a CheckpointException carrying every rank's failure
        raise SnapshotError(f"{snap}: cannot load the sharded snapshot into the live state: {exc}") from None
    optim = decode(meta["optim"], own, snap)
    states: Dict[str, Dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("optim/"):
            fqn, key = name[len("optim/") :].rsplit("/", 1)
            states.setdefault(fqn, {})[key] = t
    for fqn, extra in optim["plain"].items():
        states.setdefault(fqn, {}).update(extra)
    model_sd = {n[len("model/") :]: t for n, t in tensors.items() if n.startswith("model/")}
    sd.set_state_dict(
        state.model,
        state.optimizer.optimizer,
        model_state_dict=model_sd,
        optim_state_dict={"state": states, "param_groups": optim["groups"]},
    )
    try:
        if state.scheduler is not None and meta.get("scheduler") is not None:
            state.scheduler.load_state_dict(decode(meta["scheduler"]["state"], own, snap))
        if state.scaler is not None and meta.get("scaler") is not None:
            state.scaler.load_state_dict(decode(meta["scaler"]["state"], own, snap))
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise SnapshotError(f"{snap}: cannot restore the scheduler or scaler state: {exc}") from None
    if state.rng and meta.get("rng") is not None:
        restore_rng(meta["rng"], own, snap)
    if "accepted" in meta:  # buffers non-finite by design: the acceptance goes on
        try:
            state.accepted = check_patterns(meta["accepted"], snap)
        except ValueError as exc:
            raise CorruptSnapshotError(str(exc)) from None
    extra = {f"extra/{n}": own[f"extra/{n}"] for n in meta.get("extra_tensors", [])}
    return make_info(meta, extra, snap, snap)
