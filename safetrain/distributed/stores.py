"""The guard's snapshot store for a layout: FSDP2's :class:`.checkpoint.ShardedStore` on disk,
or the config's store made collective by the sync."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .checkpoint import ShardedStore
from .store import wrap_store

__all__ = ["make_store"]

logger = logging.getLogger(__name__)


def make_store(layout: str, cfg: Any, run_dir: Optional[str], sync: Any) -> Any:
    """The guard's snapshot store: a :class:`ShardedStore` for ``snapshot.store: safetensors``
    under FSDP2, else the config's store made collective by ``sync``."""
    from ..snapshot import make_store as plain_store
    from ..snapshot.make import SnapshotConfigError
    from ..snapshot.store import new_run_id
    from .sharding import FSDP2

    if cfg.async_save and (layout != FSDP2 or cfg.store != "safetensors"):
        logger.warning("snapshot.async_save: applies to FSDP2 sharded snapshots (store: safetensors) only; ignored")
    if layout != FSDP2 or cfg.store != "safetensors":
        return wrap_store(plain_store(cfg, run_dir=run_dir), sync)
    directory = cfg.dir or (os.path.join(os.fspath(run_dir), "snapshots") if run_dir is not None else None)
    if directory is None:
        raise SnapshotConfigError("snapshot.dir: store is 'safetensors' but neither snapshot.dir nor log.dir is set")
    run_id = _agreed_id(sync, new_run_id())
    return ShardedStore(directory, cfg.keep, sync, run_id=run_id, overwrite=cfg.overwrite, async_save=cfg.async_save)


def _agreed_id(sync: Any, run_id: str) -> str:
    """Rank 0's run id on every rank (4 x 32 bits through ``gather_int``)."""
    gather = getattr(sync, "gather_int", None)
    if gather is None:
        return run_id
    return "".join(f"{gather(int(run_id[i : i + 8], 16))[0]:08x}" for i in range(0, 32, 8))
