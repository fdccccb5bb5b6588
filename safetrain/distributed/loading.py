"""Loading a sharded snapshot directory (:mod:`.snapdir`) into the live FSDP2 state:
verified first (:mod:`.verify`), then read by DCP's ``HuggingFaceStorageReader`` (resharded to
this job's ranks) and put in place with ``set_state_dict``."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import SnapshotError
from ..snapshot.accepted import check_patterns
from ..snapshot.codec import decode
from ..snapshot.rng import restore_rng
from ..snapshot.store import CorruptSnapshotError, SnapshotInfo, make_info
from .layout import shard_layout
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


def _own_part(snap: str, src: int, sync: Any) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """Rank ``src``'s JSON part and its own tensors, allocated as the shard files hold them (the
    part's shapes must agree with :func:`.layout.shard_layout`, so a few bytes of JSON cannot ask
    for gigabytes). Every rank a part, the verdict agreed (one ``gather_int``): a rank that cannot
    read its part never leaves the others waiting in DCP's collective load.

    Raises:
        CorruptSnapshotError: on every rank, when any rank's part is unreadable or does not match the shards.
    """
    error: Optional[SnapshotError] = None
    meta: Dict[str, Any] = {}
    own: Dict[str, torch.Tensor] = {}
    try:
        meta = read_json(rank_path(snap, src))
        specs = meta.get("own") if isinstance(meta, dict) else None
        if not isinstance(specs, dict):
            raise CorruptSnapshotError(f"{rank_path(snap, src)}: no table of the rank's own tensors: corrupted")
        layout = shard_layout(snap)
        for name, spec in specs.items():
            held = layout.get(f"rank{src}/{name}")
            ok = isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], str) and held is not None
            if not ok or list(held[0]) != spec[0] or held[1] != _dtype(spec[1]):  # type: ignore[index]
                raise CorruptSnapshotError(
                    f"{rank_path(snap, src)}: own tensor {name!r} ({spec!r:.80}) does not match the shards "
                    f"({held!r:.80}): corrupted"
                )
            own[name] = torch.empty(held[0], dtype=held[1])  # type: ignore[index]
    except SnapshotError as exc:
        error = exc
    gather = getattr(sync, "gather_int", None)
    votes = gather(int(error is not None)) if gather is not None else [int(error is not None)]
    if error is not None:
        raise error
    if any(votes):
        raise CorruptSnapshotError(f"{snap}: another rank's part of the snapshot is damaged (see that rank's log)")
    return meta, own


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
    world = mark.get("world")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CorruptSnapshotError(f"{snap}: the completion mark's world {world!r:.40} is not a number of ranks")
    src = rank if rank < world else 0
    meta, own = _own_part(snap, src, sync)
    tensors, _ = flat_state(state)
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
