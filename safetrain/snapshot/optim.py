"""Optimizer state as snapshot tensors and JSON, checked against and restored into a live optimizer.

``optimizer.state_dict()`` numbers parameters 0..N-1 across param groups. Per-parameter state
becomes tensors ``optim/state/{i}/{key}`` (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``,
``step`` as the optimizer keeps it: tensor or number); param-group hyperparameters (``lr``,
``betas``, ``weight_decay``...) become JSON, tuples kept as tuples, tensor-valued ones as tensors.
Several optimizers stepped as one (:class:`~safetrain.optimizers.Optimizers`) are each stored so
under ``optim/{name}/...``, their JSON under ``{"type": "safetrain.Optimizers", "optimizers":
{name: ...}}``; a single optimizer's format is unchanged.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ..errors import SnapshotError
from ..optimizers import SEVERAL, members
from .codec import decode, encode
from .tensors import copy_all_

__all__ = ["capture_optimizer", "check_optimizer", "restore_optimizer", "is_state_tensor", "state_tensor_names"]


def is_state_tensor(name: str) -> bool:
    """Whether a snapshot tensor is per-parameter optimizer state: ``optim/state/...``, or
    ``optim/{name}/state/...`` for one of several optimizers (whose finiteness gates a snapshot)."""
    if name[:12] == "optim/state/":  # (slices, not a split: every tensor of every snapshot is asked)
        return True
    if name[:6] != "optim/":
        return False
    member = name[6:].partition("/")[2]  # ("{name}/state/...": one of several optimizers)
    return member == "state" or member[:6] == "state/"


def state_tensor_names(names: Iterable[str]) -> List[str]:
    """The names among ``names`` that :func:`is_state_tensor` accepts, in order: one call for a
    whole capture, a single optimizer's ``optim/state/`` names matched without a call each."""
    return [n for n in names if n[:12] == "optim/state/" or (n[:6] == "optim/" and is_state_tensor(n))]


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _params(opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _parts(opt: Any, meta: Mapping[str, Any], where: str) -> List[Tuple[str, Any, Mapping[str, Any]]]:
    """``(prefix, member, its meta)`` for each optimizer in ``opt``, matched against the snapshot's.

    Raises:
        SnapshotError: one optimizer in the snapshot and several live, or the members' names differ.
    """
    live = members(opt)
    several = meta.get("type") == SEVERAL
    if not several and len(live) == 1 and live[0][0] == "optim":
        return [(live[0][0], live[0][1], meta)]
    names = [prefix[len("optim/") :] for prefix, _ in live] if live[0][0] != "optim" else []
    saved = list(meta["optimizers"]) if several else []
    if names != saved:
        got = f"optimizers {saved}" if several else "one optimizer"
        want = f"optimizers {names}" if names else "one optimizer"
        raise SnapshotError(f"{where}: the snapshot holds {got}, the live state {want}")
    return [(prefix, member, meta["optimizers"][name]) for (prefix, member), name in zip(live, names)]


def capture_optimizer(opt: Any, sink: Any) -> Dict[str, Any]:
    """Encode ``opt.state_dict()`` (each member's, for several): tensors go to ``sink``, the rest
    is returned as JSON."""
    parts = members(opt)
    if len(parts) == 1 and parts[0][0] == "optim":
        return _capture(opt, sink, "optim")
    optimizers = {prefix[len("optim/") :]: _capture(member, sink, prefix) for prefix, member in parts}
    return {"type": SEVERAL, "optimizers": optimizers}


def _capture(opt: torch.optim.Optimizer, sink: Any, prefix: str) -> Dict[str, Any]:
    sd = opt.state_dict()
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {"params": [int(i) for i in group["params"]], "hyper": encode(hyper, f"{prefix}/groups/{g}", sink)}
        )
    state = {str(int(i)): encode(s, f"{prefix}/state/{int(i)}", sink) for i, s in sd["state"].items()}
    params = [[list(p.shape), str(p.dtype).replace("torch.", "")] for p in _params(opt)]
    return {"type": _type_name(opt), "param_groups": groups, "state": state, "params": params}


def check_optimizer(
    opt: Any,
    specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
    meta: Mapping[str, Any],
    where: str,
) -> None:
    """Refuse optimizer state that does not fit ``opt``: how many optimizers, type, groups,
    parameter shapes, state tensors.

    Raises:
        SnapshotError: naming the first mismatch.
    """
    for prefix, member, part in _parts(opt, meta, where):
        _check(member, specs, part, f"{where}" if prefix == "optim" else f"{where} ({prefix})", prefix)


def _check(
    opt: torch.optim.Optimizer,
    specs: Mapping[str, Tuple[Tuple[int, ...], torch.dtype]],
    meta: Mapping[str, Any],
    where: str,
    prefix: str,
) -> None:
    if meta["type"] != _type_name(opt):
        raise SnapshotError(
            f"{where}: optimizer is {meta['type']} in the snapshot, {_type_name(opt)} in the live state"
        )
    live_groups = opt.state_dict()["param_groups"]
    saved_sizes = [len(g["params"]) for g in meta["param_groups"]]
    live_sizes = [len(g["params"]) for g in live_groups]
    if saved_sizes != live_sizes[: len(saved_sizes)]:  # (groups added since, after the snapshot's: kept)
        raise SnapshotError(
            f"{where}: optimizer has param groups of sizes {saved_sizes} in the snapshot, "
            f"{live_sizes} in the live state"
        )
    params = _params(opt)
    for i, (p, (shape, dtype)) in enumerate(zip(params, meta["params"])):
        if list(p.shape) != list(shape) or str(p.dtype).replace("torch.", "") != dtype:
            raise SnapshotError(
                f"{where}: optimizer parameter {i} is {shape} {dtype} in the snapshot, "
                f"{list(p.shape)} {str(p.dtype).replace('torch.', '')} in the live optimizer"
            )
    for key in meta["state"]:
        i = int(key)
        if not 0 <= i < len(params):
            raise SnapshotError(f"{where}: optimizer state for parameter {i}, but the optimizer has {len(params)}")
        for k, t in opt.state.get(params[i], {}).items():
            name = f"{prefix}/state/{i}/{k}"
            if isinstance(t, torch.Tensor) and name in specs:
                shape, dtype = specs[name]
                if tuple(shape) != tuple(t.shape) or dtype != t.dtype:
                    raise SnapshotError(
                        f"{where}: optimizer state {name!r} is {list(shape)} {dtype} in the snapshot, "
                        f"{list(t.shape)} {t.dtype} in the live optimizer"
                    )


def restore_optimizer(
    opt: Any,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    owned: bool,
    where: str,
    homes: Optional[Mapping[str, torch.device]] = None,
) -> List[str]:
    """Put the snapshot's optimizer state back (every member's, for several).

    With ``owned`` tensors (fresh from a file) this is ``opt.load_state_dict``, which adopts them
    where device and dtype already fit. With a store's reusable buffers, state of the same layout
    is copied in place (no allocation, asynchronous from pinned memory); a different layout (Adam
    state that did not exist yet, or no longer does) falls back to ``load_state_dict`` on copies
    made on each tensor's ``homes`` device.

    Param groups added since the snapshot (``optimizer.add_param_group``: progressive unfreezing)
    are kept, with their hyperparameters as they are now and their optimizer state reset (the
    snapshot has none for them; their parameters are the model's, which the snapshot restores).

    Returns:
        Sentences for the journal on what changed since the snapshot (empty: the same groups).
    """
    parts = list(_parts(opt, meta, where))
    changed = []
    for prefix, member, part in parts:
        said = _restore(member, tensors, part, owned, where, homes, prefix)
        changed += [f"{prefix}: {text}" if len(parts) > 1 else text for text in said]
    return changed


def _restore(
    opt: torch.optim.Optimizer,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    owned: bool,
    where: str,
    homes: Optional[Mapping[str, torch.device]],
    prefix: str,
) -> List[str]:
    saved_state = {int(i): decode(s, tensors, where) for i, s in meta["state"].items()}
    saved_groups = [dict(decode(g["hyper"], tensors, where), params=list(g["params"])) for g in meta["param_groups"]]
    added = _added_groups(opt, saved_groups)
    if not owned and not added and _same_layout(opt, saved_state, saved_groups):
        _copy_in_place(opt, saved_state, saved_groups)
        return []
    if not owned:
        homes = homes or {}

        def fresh(name: str, t: torch.Tensor) -> torch.Tensor:
            return t.to(device=homes.get(name, t.device), copy=True, non_blocking=True)

        saved_state = {i: _map_tensors(s, f"{prefix}/state/{i}", fresh) for i, s in saved_state.items()}
        saved_groups = [_map_tensors(g, f"{prefix}/groups/{n}", fresh) for n, g in enumerate(saved_groups)]
    try:
        opt.load_state_dict({"state": saved_state, "param_groups": saved_groups + added})
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SnapshotError(f"{where}: optimizer.load_state_dict refused the snapshot's state: {exc}") from None
    if not added:
        return []
    n = len(saved_groups)
    return [
        f"optimizer param groups {n}..{n + len(added) - 1} added since the snapshot "
        f"({sum(len(g['params']) for g in added)} parameters): kept, their optimizer state reset"
    ]


def _added_groups(opt: torch.optim.Optimizer, saved_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The live param groups after the snapshot's (added since), as ``load_state_dict`` takes
    them: hyperparameters as they are now, parameters numbered on from the snapshot's."""
    first = sum(len(g["params"]) for g in saved_groups)
    out = []
    for group in opt.param_groups[len(saved_groups) :]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.append(dict(hyper, params=list(range(first, first + len(group["params"])))))
        first += len(group["params"])
    return out


def _map_tensors(obj: Any, path: str, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, f"{path}/{k}", fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, f"{path}/{i}", fn) for i, v in enumerate(obj))
    return obj


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _same_kind(live: Any, saved: Any) -> bool:
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return live.shape == saved.shape and live.dtype == saved.dtype
    return not _has_tensor(live) and not _has_tensor(saved)


def _same_layout(opt: torch.optim.Optimizer, saved_state: Dict[int, Any], saved_groups: List[Dict[str, Any]]) -> bool:
    params = _params(opt)
    live_state = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state and opt.state[p]}
    if set(live_state) != set(saved_state):
        return False
    for i, saved in saved_state.items():
        live = live_state[i]
        if set(live) != set(saved) or not all(_same_kind(live[k], saved[k]) for k in saved):
            return False
    for group, saved in zip(opt.param_groups, saved_groups):
        if set(group) != set(saved) or not all(_same_kind(group[k], saved[k]) for k in saved if k != "params"):
            return False
    return len(opt.param_groups) == len(saved_groups)


def _copy_in_place(opt: torch.optim.Optimizer, saved_state: Dict[int, Any], saved_groups: List[Dict[str, Any]]) -> None:
    params = _params(opt)
    dst: List[torch.Tensor] = []
    src: List[torch.Tensor] = []
    for i, saved in saved_state.items():
        live = opt.state[params[i]]
        for k, v in saved.items():
            if isinstance(v, torch.Tensor):
                dst.append(live[k])
                src.append(v)
            else:
                live[k] = v
    for group, saved in zip(opt.param_groups, saved_groups):
        for k, v in saved.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):
                dst.append(group[k])
                src.append(v)
            else:
                group[k] = v
    copy_all_(dst, src)
