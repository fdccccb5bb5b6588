"""A run that starts broken: non-finite parameters or optimizer state before the first step.

A checkpoint converted to float16 and back (weights beyond 65504 become ``inf``, their products
NaN) or a corrupted file gives a model whose weights hold NaN before training starts; the same
pattern as https://github.com/mahmoodlab/UNI/issues/18 ("Model weights result in nan-values for
half precision"). Nothing can restore such a run (its first snapshot is refused: there is no good
state to go back to), so it stops at once with ``TrainingAborted`` naming the tensors, the first
modules whose output goes non-finite on the first batch, and the fix.

Slow path only: the run's refused first snapshot says which tensors are non-finite (its own
check, no read of its own); the guard then explains with :func:`first_nonfinite_modules` and
:func:`broken_start_reason`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..optimizers import members

__all__ = ["first_nonfinite_modules", "broken_start_reason", "state_names"]

logger = logging.getLogger(__name__)


def state_names(params: Sequence[Tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer) -> Dict[str, str]:
    """Snapshot tensor names (``model/{name}``, ``optim/state/{i}/{key}``) -> what a user calls them
    (``fc.weight``, ``fc.weight (optimizer exp_avg)``), for the model's parameters and their optimizer state."""
    by_id = {id(p): n for n, p in params}
    out = {f"model/{n}": n for n, _ in params}
    for prefix, opt in members(optimizer):  # (several optimizers: optim/{name}/state/...)
        order = [p for g in opt.param_groups for p in g["params"]]
        for i, p in enumerate(order):
            for key in opt.state.get(p, {}):
                out[f"{prefix}/state/{i}/{key}"] = f"{by_id.get(id(p), f'param {i}')} (optimizer {key})"
    return out


def first_nonfinite_modules(model: torch.nn.Module, run: Callable[[], Any], most: int = 3) -> Optional[List[str]]:
    """The modules whose output goes non-finite when ``run()`` runs ``model``, in the order they
    finished (children before parents: the first is where it starts); ``None`` when the forward
    itself failed. The model's buffers and the RNG are left as they were. Slow path: one host read per module.
    """
    found: List[str] = []
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            if len(found) < most and _any_nonfinite(output):  # host sync: slow path
                found.append(f"{name or '(the model)'} ({type(module).__name__})")

        return record

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook(name)))
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            run()
    except Exception as exc:  # noqa: BLE001 (the explanation is best effort; the abort goes on)
        logger.info("could not run the first batch to name the broken modules: %s", exc)
        return None
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for live, copy in saved:
                live.copy_(copy)
    return found


def broken_start_reason(bad: Sequence[str], names: Dict[str, str], modules: Optional[List[str]]) -> str:
    """The abort's reason: what is non-finite, where the output breaks, and the fix.

    Example::

        >>> broken_start_reason(["model/fc.weight"], {"model/fc.weight": "fc.weight"}, ["fc (Linear)"]).split(";")[0]
        'weights: non-finite before training started, in fc.weight'
    """
    what = [names.get(n, n) for n in bad]
    more = f" and {len(what) - 6} more" if len(what) > 6 else ""
    if modules:
        where = f"the first batch's output goes non-finite at {', then '.join(modules)}"
    elif modules is None:
        where = "the first batch could not be run to name the module it breaks"
    else:
        where = "the first batch's outputs stay finite, but the first update would spread them"
    return (
        f"weights: non-finite before training started, in {', '.join(what[:6])}{more}; {where}; nothing "
        "to restore (no snapshot is taken of a non-finite state); fix: reload the checkpoint (the file may be "
        "corrupted), convert it in float32 (a float16 conversion turns weights beyond 65504 into inf), or "
        "check the code that initialized or edited these tensors"
    )


def _any_nonfinite(output: Any) -> bool:
    if isinstance(output, torch.Tensor):
        return output.is_floating_point() and not bool(torch.isfinite(output).all())
    if isinstance(output, (tuple, list)):
        return any(_any_nonfinite(o) for o in output)
    if isinstance(output, dict):
        return any(_any_nonfinite(o) for o in output.values())
    return False
