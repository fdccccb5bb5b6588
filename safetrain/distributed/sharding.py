"""How a model is spread over processes, as the guard sees it: one process, DDP, or FSDP2
(``torch.distributed.fsdp.fully_shard``); anything else is refused at construction.

Under FSDP2 parameters, gradients and optimizer state are sharded ``DTensor``s: the detectors
work on each rank's local shard (:func:`local`), the step's read sums the squared gradient
norms over ranks, and a memory snapshot keeps each rank's local shards
(:class:`ShardedState`). Replays are off (FSDP's forward all-gathers parameters, so ranks
cannot re-run forwards on their own).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping

import torch

from ..config import without_replays
from ..errors import SafetrainError
from ..optimizers import Optimizers
from ..snapshot import TrainState

__all__ = ["DDP", "FSDP2", "LOCAL", "layout_of", "local", "ShardedState", "LocalOptimizer", "for_layout", "train_state"]

LOCAL, DDP, FSDP2 = "local", "ddp", "fsdp2"
_SUPPORTED = (
    "supported: one process, DistributedDataParallel, or FSDP2 (torch.distributed.fsdp.fully_shard "
    "on the root module, 1-D device mesh)"
)

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - older torch: no DTensor, no FSDP2
    DTensor, Shard = (), None  # type: ignore[assignment,misc]
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover
    FSDPModule = ()  # type: ignore[assignment,misc]


def local(t: Any) -> Any:
    """A ``DTensor``'s local shard (a view of the live storage), any other value as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def layout_of(model: torch.nn.Module) -> str:
    """:data:`LOCAL`, :data:`DDP` or :data:`FSDP2` for ``model`` (the module inside a compile wrapper).

    Raises:
        SafetrainError: the model is spread in a way safetrain does not handle (FSDP1, a
            pipeline, tensor parallel or a ``distribute_module`` model, HSDP, a model whose root
            was not ``fully_shard``-ed), naming what was found and what is supported.
    """
    name = type(model).__qualname__
    fsdp1 = getattr(torch.distributed, "fsdp", None)
    if fsdp1 is not None and isinstance(model, getattr(fsdp1, "FullyShardedDataParallel", ())):
        raise SafetrainError(
            f"the model is FullyShardedDataParallel (FSDP1), which safetrain cannot protect; {_SUPPORTED}"
        )
    if any(type(m).__module__.startswith("torch.distributed.pipelining") for m in model.modules()):
        raise SafetrainError(f"the model is a pipeline ({name}): pipeline stages are not supported; {_SUPPORTED}")
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    dtensors = [(n, p) for n, p in inner.named_parameters() if isinstance(p, DTensor)]
    if not dtensors:
        return DDP if inner is not model else LOCAL
    if inner is not model:
        raise SafetrainError(
            f"the DistributedDataParallel model holds DTensor parameters ({dtensors[0][0]}): "
            f"DDP over tensor parallel is not supported; {_SUPPORTED}"
        )
    if not isinstance(model, FSDPModule):
        where = next((n for n, m in model.named_modules() if isinstance(m, FSDPModule)), None)
        found = (
            f"fully_shard was applied to {where!r} but not to the root module (call fully_shard(model) last)"
            if where is not None
            else "DTensor parameters without fully_shard (tensor parallel, distribute_module)"
        )
        raise SafetrainError(f"the model has {found}, e.g. {dtensors[0][0]!r}; {_SUPPORTED}")
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise SafetrainError(f"the FSDP2 model has parameters that are not sharded ({plain[:3]}); {_SUPPORTED}")
    for n, p in dtensors:
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            raise SafetrainError(
                f"parameter {n!r} is placed {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh: "
                f"HSDP, tensor parallel and other placements are not supported; {_SUPPORTED}"
            )
    return FSDP2


def for_layout(layout: str, cfg: Any) -> Any:
    """The config the guard runs with under ``layout``: under FSDP2 replays are turned off (logged
    once); a ``safetensors`` store writes sharded snapshots (:mod:`.checkpoint`)."""
    if layout != FSDP2:
        return cfg
    return without_replays(
        cfg,
        "FSDP2: replays are off (detect.replay.enabled=false): FSDP's forward all-gathers parameters, "
        "so a rank cannot re-run forwards on its own; anomalies are judged from the step's read",
    )


def _to_local(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


class _LocalState(dict):
    """One parameter's optimizer state with local shards; writes go through to the live state."""

    def __init__(self, live: Dict[str, Any]) -> None:
        super().__init__(_to_local(live))
        self._live = live

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._live[key] = value


class _LocalStates(Mapping):
    def __init__(self, state: Mapping[Any, Any]) -> None:
        self._state = state

    def __getitem__(self, p: Any) -> _LocalState:
        return _LocalState(self._state[p])

    def __contains__(self, p: object) -> bool:
        return p in self._state

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class LocalOptimizer:
    """An optimizer seen through its local shards: what :class:`ShardedState` captures and writes
    back in place (``state_dict()``, ``state``, ``load_state_dict`` with local tensors). The
    parameter layout (``param_groups``) is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The optimizer's own groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Mapping[Any, Any]:
        """Per-parameter state, each tensor its local shard (a view of the live one)."""
        return _LocalStates(self.optimizer.state)

    def state_dict(self) -> Dict[str, Any]:
        """``optimizer.state_dict()`` with every ``DTensor`` its local shard."""
        return _to_local(self.optimizer.state_dict())

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Load local shards: each tensor shaped like its parameter's shard becomes a ``DTensor``."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for i, s in sd["state"].items():
            p = params[int(i)]
            state[i] = {k: _like(v, p) for k, v in s.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _like(t: Any, p: Any) -> Any:
    if isinstance(p, DTensor) and isinstance(t, torch.Tensor) and t.shape == p.to_local().shape and t.dim():
        return DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)
    return t


class ShardedState(TrainState):
    """:class:`~safetrain.snapshot.TrainState` of an FSDP2 model: model and optimizer state as
    each rank's local shards, captured without a copy and written back in place (memory store)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        super().__init__(model, LocalOptimizer(optimizer), **kwargs)  # type: ignore[arg-type]

    def _model_state(self) -> Dict[str, torch.Tensor]:
        return {k: local(v) for k, v in super()._model_state().items()}


def train_state(layout: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any) -> TrainState:
    """The guard's :class:`~safetrain.snapshot.TrainState`: a :class:`ShardedState` under FSDP2.

    Raises:
        ValueError: several optimizers under FSDP2 (its sharded snapshots hold one).
    """
    if layout == FSDP2 and isinstance(optimizer, Optimizers):
        raise ValueError(
            f"{optimizer!r} under FSDP2: sharded snapshots hold one optimizer; pass one optimizer over every "
            "parameter group (or train with DDP or in one process, where several are snapshotted together)"
        )
    return (ShardedState if layout == FSDP2 else TrainState)(model, optimizer, **kwargs)
