"""``make_store``: the snapshot store a config names, in memory or on disk.

The one place that knows both concrete stores (:mod:`.memory`, :mod:`.disk`); choosing costs
nothing, and the safetensors store's directory defaults to ``<log.dir>/snapshots``.
"""

from __future__ import annotations

import os
from typing import Optional, Union

from ..config import SnapshotConfig
from ..errors import ConfigError, SnapshotError
from .disk import SafetensorsStore
from .memory import MemoryStore
from .store import SnapshotStore, new_run_id

__all__ = ["SnapshotConfigError", "make_store"]


class SnapshotConfigError(SnapshotError, ConfigError):
    """The snapshot configuration cannot be used (no directory for the safetensors store, say)."""


def make_store(cfg: SnapshotConfig, run_dir: Optional[Union[str, os.PathLike]] = None) -> SnapshotStore:
    """Build the store ``cfg`` (a :class:`safetrain.config.SnapshotConfig`) describes.

    Args:
        cfg: ``store`` (memory | safetensors), ``keep``, ``device`` (memory), ``dir`` and ``overwrite``
            (safetensors). The store belongs to a new run (a fresh ``run_id``); a resume adopts the
            run it loads (:meth:`~.store.SnapshotStore.adopt`).
        run_dir: the run directory; safetensors snapshots go to ``cfg.dir`` or ``<run_dir>/snapshots``.

    Raises:
        SnapshotConfigError: (a ``SnapshotError`` and a ``ConfigError``) the safetensors store has
            no directory, or ``cfg.store`` is unknown.
    """
    if cfg.store == "memory":
        return MemoryStore(keep=cfg.keep, device=cfg.device, run_id=new_run_id())
    if cfg.store == "safetensors":
        directory = cfg.dir or (os.path.join(os.fspath(run_dir), "snapshots") if run_dir is not None else None)
        if directory is None:
            raise SnapshotConfigError(
                "snapshot.dir: store is 'safetensors' but neither snapshot.dir nor a run directory (log.dir) "
                "is set; set snapshot.dir=PATH or log.dir=PATH"
            )
        # A new run (its own uuid): it owns no file of the directory until a resume adopts one.
        return SafetensorsStore(directory, keep=cfg.keep, run_id=new_run_id(), overwrite=cfg.overwrite)
    raise SnapshotConfigError(f"snapshot.store: got {cfg.store!r}; expected 'memory' or 'safetensors'")
