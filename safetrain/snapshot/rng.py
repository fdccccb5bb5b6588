"""Capture and restore of the global random number generators: torch CPU, CUDA, numpy, Python.

The generators' states become tensors (torch's byte states, numpy's Mersenne Twister key viewed
as int32) and JSON (numpy's position and cached Gaussian, Python's ``random`` state tuple), so a
snapshot restores the exact random streams: dropout masks, shuffling and augmentation continue
as if training had never stopped.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Callable, Dict, Mapping

import numpy as np
import torch

from ..errors import SnapshotError
from .codec import decode

__all__ = ["capture_rng", "restore_rng"]

log = logging.getLogger(__name__)


def _cuda_in_use() -> bool:
    # Reading CUDA generators would initialize CUDA; a process that never did has default states.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_rng(sink: Callable[[str, torch.Tensor], None]) -> Dict[str, Any]:
    """Put every global generator's state into ``sink`` (tensors) and return the JSON part.

    Tensor names: ``rng/torch``, ``rng/cuda/{i}`` (one per visible device, when CUDA is in use)
    and ``rng/numpy``. Reading the states is host-side: no device synchronization.
    """
    sink("rng/torch", torch.get_rng_state())
    n_cuda = 0
    if _cuda_in_use():
        states = torch.cuda.get_rng_state_all()
        for i, s in enumerate(states):
            sink(f"rng/cuda/{i}", s)
        n_cuda = len(states)
    kind, key, pos, has_gauss, cached = np.random.get_state()
    sink("rng/numpy", torch.from_numpy(np.ascontiguousarray(key).view(np.int32).copy()))
    return {
        "cuda": n_cuda,
        "numpy": {"kind": str(kind), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": _python_state(sink),
    }


def _python_state(sink: Callable[[str, torch.Tensor], None]) -> Dict[str, Any]:
    """Python's Mersenne Twister: its 625 words as a tensor (encoding them as JSON, word by word,
    made every snapshot of a small model several ms slower), the rest as JSON."""
    version, internal, gauss = random.getstate()
    sink("rng/python", torch.tensor(internal, dtype=torch.int64))
    return {"version": version, "gauss_next": gauss}


def _no_tensors(name: str, t: torch.Tensor) -> None:
    raise SnapshotError(f"{name}: unexpected tensor in the Python random state")


def restore_rng(meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Set every global generator back to the state :func:`capture_rng` recorded.

    CUDA states are restored for the devices both the snapshot and this process have; a
    different device count is logged, not fatal (resuming on another machine).

    Raises:
        SnapshotError: a state is malformed (the message names ``where``).
    """
    try:
        torch.set_rng_state(tensors["rng/torch"].cpu())
        n_saved = int(meta.get("cuda", 0))
        if n_saved:
            if torch.cuda.is_available():
                n_here = torch.cuda.device_count()
                if n_here != n_saved:
                    log.warning(
                        "%s: snapshot has %d CUDA generator states, this process sees %d devices; "
                        "restoring the first %d",
                        where,
                        n_saved,
                        n_here,
                        min(n_saved, n_here),
                    )
                for i in range(min(n_saved, n_here)):
                    torch.cuda.set_rng_state(tensors[f"rng/cuda/{i}"].cpu(), i)
            else:
                log.warning("%s: snapshot has CUDA generator states but CUDA is not available; skipped", where)
        npm = meta["numpy"]
        key = tensors["rng/numpy"].numpy().view(np.uint32)
        np.random.set_state((npm["kind"], key, npm["pos"], npm["has_gauss"], npm["cached_gaussian"]))
        py = meta["python"]
        if "version" in py:
            internal = tuple(int(x) for x in tensors["rng/python"].tolist())
            random.setstate((py["version"], internal, py["gauss_next"]))
        else:  # snapshots written before the state became a tensor
            random.setstate(decode(py, {}, where))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SnapshotError(f"{where}: cannot restore the random generators: {exc}") from None
