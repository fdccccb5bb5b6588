"""The layout of a sharded (FSDP2) snapshot on disk: what the writer (:mod:`.checkpoint`,
:mod:`.background`), the completion mark (:mod:`.mark`), the checksums (:mod:`.verify`) and
the readers (:mod:`.loading`, :mod:`.inspection`, :mod:`.export`, :mod:`.resume`) all agree on.
It imports no other module of :mod:`safetrain.distributed`: every one of them builds on it.

A snapshot of step ``s`` is the directory ``step-{s:010d}/`` (:func:`step_dir`):

* ``shard-*.safetensors``: the tensors, written by DCP's ``HuggingFaceStorageWriter`` with
  ``save_distributed=True`` (each rank its own file, its local shards with their offsets in the
  safetensors header). Keys: ``model/{fqn}`` and ``optim/{fqn}/{key}`` from
  ``get_state_dict(model, optimizer)`` (the user's parameter names; :func:`flat_state`), and
  ``rank{r}/{name}`` for each rank's own small tensors (RNG states, the caller's extra tensors).
* ``rank-{r}.json``: rank r's JSON part (:func:`rank_path`; counters, the guard's state, RNG,
  scheduler, scaler, the optimizer's param groups), written before the tensors.
* ``safetrain.json`` (:data:`MARK`): the completion mark, written last by rank 0 once every
  rank's files are on disk, with their checksums (:mod:`.mark`, :mod:`.verify`). A directory
  without it is never loaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import SnapshotError
from ..rundir.atomicfile import atomic_write_bytes
from ..rundir.safefile import skip_links
from ..snapshot.header import parse_json, read_regular
from ..snapshot.store import CorruptSnapshotError

__all__ = [
    "MARK",
    "FORMAT",
    "step_dir",
    "step_of",
    "sharded_snapshots",
    "rank_path",
    "snapshot_files",
    "is_snapshot_file",
    "read_json",
    "MAX_JSON_BYTES",
    "write_json",
    "dcp_modules",
    "flat_state",
]

#: The completion mark's file name: a snapshot directory without it is incomplete.
MARK = "safetrain.json"
#: The completion mark's ``format``.
FORMAT = "safetrain.sharded"
#: The most bytes a snapshot's JSON file (the mark, a rank's part) may hold: the safetensors header limit.
MAX_JSON_BYTES = 100 * 2**20
_NAME = re.compile(r"^step-(\d{10,})$")


def step_dir(directory: str, step: int) -> str:
    """The snapshot directory of ``step`` in ``directory``."""
    return os.path.join(directory, f"step-{step:010d}")


def step_of(path: str) -> Optional[int]:
    """The step of a snapshot directory named as :func:`step_dir` names it, else ``None``."""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def sharded_snapshots(directory: str, complete: bool = True) -> List[str]:
    """Snapshot directories in ``directory``, oldest step first (only complete ones by default);
    symbolic links are left out (named once in a warning)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = skip_links(directory, [n for n in names if _NAME.match(n)], "a sharded snapshot")
    found = sorted((int(m.group(1)), n) for n in names if (m := _NAME.match(n)))
    paths = [os.path.join(directory, n) for _, n in found]
    return [p for p in paths if os.path.isfile(os.path.join(p, MARK))] if complete else paths


def rank_path(snap: str, rank: int) -> str:
    """Rank ``rank``'s JSON part of the snapshot directory ``snap``."""
    return os.path.join(snap, f"rank-{rank}.json")


def is_snapshot_file(name: Any) -> bool:
    """Whether ``name`` is one the completion mark covers: a plain file name (no separator, not
    hidden, so never ``..`` or absolute) ending ``.safetensors`` or ``.json``, not the mark itself."""
    return (
        isinstance(name, str)
        and name != MARK
        and not name.startswith(".")
        and name.endswith((".safetensors", ".json"))
        and "/" not in name
        and os.sep not in name
        and (os.altsep is None or os.altsep not in name)
        and "\0" not in name
    )


def snapshot_files(snap: str) -> List[str]:
    """The file names in ``snap`` that the completion mark covers (every file but the mark), sorted."""
    return sorted(n for n in os.listdir(snap) if is_snapshot_file(n))


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file, fsync, rename; a link there
    is replaced, never written through)."""
    atomic_write_bytes(path, json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8"))


def read_json(path: str) -> Any:
    """The JSON in ``path``: a regular file of the snapshot (a FIFO or device is refused, not
    waited on; a link is not followed out of it) of at most :data:`MAX_JSON_BYTES`.

    Raises:
        CorruptSnapshotError: it cannot be read, is not a regular file, is too big, or is not JSON
            (nested too deeply included).
    """
    try:
        return parse_json(read_regular(path, MAX_JSON_BYTES, follow=False), path, "the file")
    except CorruptSnapshotError:
        raise
    except SnapshotError as exc:  # missing or unreadable
        raise CorruptSnapshotError(str(exc)) from None


def dcp_modules() -> Tuple[Any, Any]:
    """``torch.distributed.checkpoint`` and its ``state_dict`` module (imported when first needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


def flat_state(state: Any) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """``get_state_dict`` of the live model and optimizer under the snapshot's keys: DCP's
    tensors (``model/{fqn}``, ``optim/{fqn}/{key}``), and the JSON rest (``groups``, ``plain``).

    Raises:
        SnapshotError: the model's state dict holds something other than tensors.
    """
    _, sd = dcp_modules()
    model_sd, optim_sd = sd.get_state_dict(state.model, state.optimizer.optimizer)
    tensors: Dict[str, torch.Tensor] = {}
    for fqn, t in model_sd.items():
        if not isinstance(t, torch.Tensor):
            raise SnapshotError(f"model.state_dict()[{fqn!r}]: a {type(t).__name__}; sharded snapshots hold tensors")
        tensors[f"model/{fqn}"] = t
    plain: Dict[str, Dict[str, Any]] = {}
    for fqn, s in optim_sd.get("state", {}).items():
        for key, v in s.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{fqn}/{key}"] = v
            else:
                plain.setdefault(fqn, {})[key] = v
    return tensors, {"groups": optim_sd.get("param_groups", []), "plain": plain}
