"""Several optimizers (and schedulers) stepped as one: the Muon + AdamW recipe, a GAN's two networks.

One step may move several optimizers: Muon for a transformer's 2-D hidden weights and AdamW for
its embeddings, head, norms and biases, or a generator's and a discriminator's optimizers under
one guard. :func:`as_optimizer` turns a sequence or a dict of optimizers into one
:class:`Optimizers`, which the guard, its snapshots and its LR backoff use as they use a single
optimizer: ``param_groups`` is every member's groups in order (the same dicts: an LR written there
is the member's), ``step()`` steps each member, ``zero_grad()`` clears every gradient. A single
optimizer (or a sequence of one) is returned as it is, so its path and its snapshot format are
unchanged. :func:`as_scheduler` does the same for schedulers. :func:`needs_closure` says whether an
optimizer's ``step`` must be given a closure (LBFGS).
"""

from __future__ import annotations

import collections
import inspect
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

__all__ = ["Optimizers", "Schedulers", "as_optimizer", "as_scheduler", "members", "needs_closure", "lrs_by_name"]

#: A type name for snapshots: the composite is not a torch class.
SEVERAL = "safetrain.Optimizers"


def _named(objs: Any, what: str) -> Dict[str, Any]:
    """``{name: obj}`` from a dict (its keys) or a sequence (``"0"``, ``"1"``, ...)."""
    if isinstance(objs, Mapping):
        named = dict(objs)
        for name in named:
            if not isinstance(name, str) or not name or "/" in name or name in ("state", "groups"):
                raise ValueError(
                    f"{what}: the names must be non-empty strings without '/' (and not 'state' or 'groups': "
                    f"they name snapshot tensors), got {name!r}"
                )
    else:
        named = {str(i): obj for i, obj in enumerate(objs)}
    if not named:
        raise ValueError(f"{what}: got an empty {type(objs).__name__}; expected at least one")
    return named


class Optimizers:
    """Several optimizers stepped as one (each over its own parameters), in the order given.

    Args:
        optimizers: a dict ``name -> optimizer`` or a sequence (named ``"0"``, ``"1"``, ...).

    Raises:
        TypeError: a member is not an optimizer (it has no ``param_groups``).
        ValueError: no member, a name that is not a plain string, or a parameter in two members.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> opt = Optimizers({"muon": torch.optim.Muon([model[0].weight]),
        ...                   "adamw": torch.optim.AdamW([model[0].bias, *model[1].parameters()])})
        >>> len(opt.param_groups), list(opt.members)
        (2, ['muon', 'adamw'])
    """

    def __init__(self, optimizers: Union[Mapping[str, Any], List[Any], Tuple[Any, ...]]) -> None:
        self.members: Dict[str, Any] = _named(optimizers, "optimizers")
        seen: Dict[int, str] = {}
        for name, opt in self.members.items():
            if not isinstance(getattr(opt, "param_groups", None), list):
                raise TypeError(f"optimizers[{name!r}]: expected a torch optimizer, got {type(opt).__name__}")
            if isinstance(opt, Optimizers):
                raise TypeError(f"optimizers[{name!r}]: an Optimizers inside another; pass its members")
            if needs_closure(opt):
                raise ValueError(
                    f"optimizers[{name!r}]: {type(opt).__name__}.step needs a closure (it evaluates the loss "
                    "itself); an optimizer that needs one steps alone: pass it as the only optimizer"
                )
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in seen and seen[id(p)] != name:
                        raise ValueError(
                            f"optimizers: a parameter of shape {list(p.shape)} is in both {seen[id(p)]!r} and "
                            f"{name!r}; each parameter must belong to one optimizer (it would be updated twice)"
                        )
                    seen[id(p)] = name

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """Every member's param groups, member by member (the members' own dicts)."""
        return [g for opt in self.members.values() for g in opt.param_groups]

    @property
    def state(self) -> Mapping[Any, Any]:
        """Per-parameter state of every member (read-only view)."""
        return collections.ChainMap(*(opt.state for opt in self.members.values()))

    @property
    def defaults(self) -> Dict[str, Any]:
        """The first member's defaults (what a framework reads for display)."""
        return next(iter(self.members.values())).defaults

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """Step every member, in order.

        Raises:
            ValueError: given a closure (an optimizer that needs one, LBFGS, steps alone).
        """
        if closure is not None:
            raise ValueError("Optimizers.step(closure): several optimizers take no closure; step LBFGS alone")
        for opt in self.members.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad`` on every member."""
        for opt in self.members.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """``{"optimizers": {name: member.state_dict()}}``."""
        return {"optimizers": {name: opt.state_dict() for name, opt in self.members.items()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, member by member.

        Raises:
            ValueError: the names differ from the members'.
        """
        saved = state_dict["optimizers"]
        if list(saved) != list(self.members):
            raise ValueError(f"Optimizers.load_state_dict: optimizers {list(saved)}, expected {list(self.members)}")
        for name, opt in self.members.items():
            opt.load_state_dict(saved[name])

    def __iter__(self) -> Iterator[Any]:
        return iter(self.members.values())

    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(o).__name__}" for n, o in self.members.items())
        return f"Optimizers({inner})"


class Schedulers:
    """Several LR schedulers stepped as one (each over its own optimizer), in the order given.

    Args:
        schedulers: a dict ``name -> scheduler`` or a sequence (named ``"0"``, ``"1"``, ...).
    """

    def __init__(self, schedulers: Union[Mapping[str, Any], List[Any], Tuple[Any, ...]]) -> None:
        self.members: Dict[str, Any] = _named(schedulers, "schedulers")

    def step(self, metric: Optional[float] = None) -> None:
        """Step every member; a ``ReduceLROnPlateau`` gets ``metric`` (skipped when ``None``)."""
        for sched in self.members.values():
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                if metric is not None:
                    sched.step(metric)
            else:
                sched.step()

    def get_last_lr(self) -> List[float]:
        """Every member's last LRs, in order."""
        return [lr for s in self.members.values() for lr in s.get_last_lr()]

    def state_dict(self) -> Dict[str, Any]:
        """``{name: member.state_dict()}``."""
        return {name: s.state_dict() for name, s in self.members.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, member by member.

        Raises:
            ValueError: the names differ from the members'.
        """
        if list(state_dict) != list(self.members):
            raise ValueError(
                f"Schedulers.load_state_dict: schedulers {list(state_dict)}, expected {list(self.members)}"
            )
        for name, s in self.members.items():
            s.load_state_dict(state_dict[name])

    def __repr__(self) -> str:
        return f"Schedulers({', '.join(f'{n}={type(s).__name__}' for n, s in self.members.items())})"


def as_optimizer(optimizer: Any) -> Any:
    """An optimizer, or :class:`Optimizers` for a sequence or dict of several (one: itself)."""
    if isinstance(optimizer, (list, tuple, Mapping)):
        named = _named(optimizer, "optimizers")
        return next(iter(named.values())) if len(named) == 1 else Optimizers(named)
    return optimizer


def as_scheduler(scheduler: Any) -> Any:
    """A scheduler, ``None``, or :class:`Schedulers` for a sequence or dict of several (one: itself)."""
    if isinstance(scheduler, (list, tuple, Mapping)):
        if not scheduler:
            return None
        named = _named(scheduler, "schedulers")
        return next(iter(named.values())) if len(named) == 1 else Schedulers(named)
    return scheduler


def members(optimizer: Any) -> List[Tuple[str, Any]]:
    """``(snapshot prefix, torch optimizer)`` for each optimizer inside ``optimizer``: ``("optim",
    optimizer)`` for a single one (the format every snapshot had), ``("optim/{name}", member)``
    for each member of an :class:`Optimizers`."""
    if isinstance(optimizer, Optimizers):
        return [(f"optim/{name}", opt) for name, opt in optimizer.members.items()]
    return [("optim", optimizer)]


def lrs_by_name(optimizer: Any) -> Dict[str, List[float]]:
    """Each optimizer's LRs (one per param group) by name, for several; ``{}`` for one."""
    if not isinstance(optimizer, Optimizers):
        return {}
    return {name: [float(g["lr"]) for g in opt.param_groups] for name, opt in optimizer.members.items()}


def needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` needs a closure: its ``closure`` parameter has no default
    (``torch.optim.LBFGS``: it evaluates the loss several times a step, in its line search).
    Read from the signature, so a user's closure optimizer is found too; an optimizer whose
    closure is optional (SGD, Adam, ...) is stepped without one."""
    if isinstance(optimizer, Optimizers):
        return False
    try:
        params = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError, AttributeError):
        return False
    closure = params.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
