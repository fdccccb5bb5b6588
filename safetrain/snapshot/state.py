"""``TrainState``: what a snapshot captures and puts back, as named tensors plus JSON.

Cost: a capture copies nothing (a flat table of *live* tensors: the stores decide where the bytes
go) and a restore writes in place. Part of ``snapshot``, beneath every store; the tensor names and
the JSON part are listed in :meth:`TrainState.capture`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import torch
from torch.nn.parameter import is_lazy

from ..adapters.compiled import plain_namer
from ..errors import SafetrainError, SnapshotError
from .accepted import Pattern, check_patterns, patterns_of
from .codec import decode, encode, tensor_refs
from .optim import capture_optimizer, check_optimizer, restore_optimizer, state_tensor_names
from .rng import capture_rng, restore_rng
from .store import CorruptSnapshotError
from .tensors import copy_all_, put_buffer_

__all__ = ["TrainState", "Captured", "FORMAT", "VERSION", "validate_meta"]

FORMAT = "safetrain.snapshot"
VERSION = 1

Spec = Tuple[Tuple[int, ...], torch.dtype]


@dataclass
class Captured:
    """One capture: live tensors by name, the JSON part, the names whose finiteness gates it, and
    among those the buffers non-finite by design, gated by their pattern instead (:mod:`.accepted`)."""

    tensors: Dict[str, torch.Tensor]
    meta: Dict[str, Any]
    checked: List[str]
    accepted: Dict[str, Pattern] = field(default_factory=dict)


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class TrainState:
    """The whole training state a snapshot holds: model, optimizer, scheduler, scaler and RNGs.

    Holds references only; :meth:`capture` reads the live objects and :meth:`apply` writes them
    back in place, so a restore leaves every outside reference (the optimizer's parameters, a
    DDP wrapper, hooks) valid.

    Args:
        model: the module whose ``state_dict()`` (parameters and persistent buffers) is saved.
        optimizer: any ``torch.optim.Optimizer``; its full state and every param-group value.
        scheduler: an ``LRScheduler`` or ``ReduceLROnPlateau``, or ``None``.
        scaler: a ``torch.amp.GradScaler`` (enabled or not), or ``None``.
        rng: also capture and restore the global torch, CUDA, numpy and Python generators.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> sorted(state.capture({"step": 0}).tensors)[:2]
        ['model/bias', 'model/weight']
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Optional[torch.amp.GradScaler] = None,
        *,
        rng: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.rng = rng
        #: Buffers non-finite by design (``model/{name}`` -> pattern), see :meth:`accept_nonfinite_buffers`.
        self.accepted: Dict[str, Pattern] = {}
        #: What the last :meth:`apply` found changed since its snapshot was taken and how it was
        #: handled (a buffer put back with another shape, a buffer or param group that appeared
        #: since): sentences for the journal; empty when the live state had the snapshot's layout.
        self.changed: List[str] = []

    def accept_nonfinite_buffers(self) -> Dict[str, Pattern]:
        """Accept the model's buffers that hold NaN/Inf now (at the start of a run) as part of it.

        A float causal mask holds ``-inf`` by design; from now on a snapshot takes it as long as
        its non-finite pattern is unchanged (:mod:`.accepted`). Parameters are never accepted.
        Slow path: one host read (and one per non-finite buffer).

        Returns:
            The accepted buffers, ``model/{name}`` -> ``(nan, posinf, neginf, position hash)``.
        """
        plain = plain_namer(self.model)
        params = {plain(n) for n, _ in self.model.named_parameters(remove_duplicate=False)}
        state = self._model_state().items()  # (extra state that is not a tensor is refused by capture)
        buffers = [(f"model/{n}", t) for n, t in state if n not in params and isinstance(t, torch.Tensor)]
        self.accepted = patterns_of(buffers)
        return dict(self.accepted)

    # -- capture ---------------------------------------------------------------------------

    def capture(
        self,
        counters: Mapping[str, int],
        extra: Optional[Mapping[str, Any]] = None,
        extra_tensors: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Captured:
        """Read the live state into named tensors (not copied) and a JSON-ready dict.

        A capture is a flat table of *live* tensors (no copies: the stores decide where the bytes go)
        and a JSON-ready dict of everything else. Tensor names:

        * ``model/{name}``: every entry of ``model.state_dict()`` (parameters and persistent buffers;
          names without the ``_orig_mod.`` of ``torch.compile`` wrappers);
          a tensor shared under two names (tied weights) is stored once, the other name is an alias;
        * ``optim/state/{i}/{key}``: per-parameter optimizer state (``exp_avg``, ``step``...), ``i`` being
          the parameter's index in ``optimizer.state_dict()``; ``optim/groups/{g}/{key}`` for tensor
          hyperparameters (several optimizers: ``optim/{name}/state/...`` and ``optim/{name}/groups/...``,
          one set per optimizer; see :mod:`.optim`);
        * ``sched/...``, ``scaler/...``: tensors found in the scheduler's or scaler's state (rare);
        * ``rng/torch``, ``rng/cuda/{i}``, ``rng/numpy``: generator states;
        * ``extra/{name}``: the caller's own tensors (an epoch's shuffling seed, say).

        The JSON part holds the counters, the caller's ``extra`` state, param-group hyperparameters,
        the scheduler and scaler state and the non-tensor RNG state, encoded by :mod:`.codec`.

        Args:
            counters: integer counters, ``step`` required (``epoch`` and ``batch`` by convention).
            extra: the caller's JSON-able state (the engine's LR scale, policy counters).
            extra_tensors: the caller's own tensors, returned as they were on restore.

        Raises:
            SnapshotError: a counter is not an int, or some state cannot be stored without pickle.
        """
        tensors: Dict[str, torch.Tensor] = {}

        def sink(name: str, t: torch.Tensor) -> None:
            if name in tensors:
                raise SnapshotError(f"{name}: two tensors would be stored under this name")
            tensors[name] = t.detach()

        counters = _check_counters(counters)
        aliases = self._capture_model(sink)
        checked = list(tensors)
        accepted = {n: p for n, p in self.accepted.items() if n in tensors}
        optim = capture_optimizer(self.optimizer, sink)
        checked += state_tensor_names(tensors)
        meta: Dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.time(),
            "counters": counters,
            "model": {"aliases": aliases, "accepted": {n: list(p) for n, p in accepted.items()}},
            "optimizer": optim,
            "scheduler": None,
            "scaler": None,
            "rng": capture_rng(sink) if self.rng else None,
        }
        if self.scheduler is not None:
            meta["scheduler"] = {
                "type": _type_name(self.scheduler),
                "state": encode(self.scheduler.state_dict(), "sched", sink),
            }
        if self.scaler is not None:
            # host sync: GradScaler.state_dict() reads the scale with .item() (once per snapshot).
            meta["scaler"] = {
                "enabled": self.scaler.is_enabled(),
                "state": encode(self.scaler.state_dict(), "scaler", sink),
            }
        meta["extra"] = encode(dict(extra or {}), "extra_json", sink)
        meta["extra_tensors"] = []
        for name, t in (extra_tensors or {}).items():
            if not isinstance(t, torch.Tensor):
                raise SnapshotError(f"extra_tensors[{name!r}]: got {type(t).__name__}; expected a tensor")
            sink(f"extra/{name}", t)
            meta["extra_tensors"].append(name)
        return Captured(tensors, meta, checked, accepted)

    def _model_state(self) -> Dict[str, torch.Tensor]:
        """``model.state_dict()`` keyed without compile wrappers' ``_orig_mod.`` segments, so a
        snapshot of a compiled model loads into the same model compiled or not."""
        plain = plain_namer(self.model)
        state = self.model.state_dict()
        named = {plain(k): v for k, v in state.items()}
        if len(named) < len(state):  # two names the same once the wrappers' segments are gone
            clash = {plain(k) for k in state if sum(plain(j) == plain(k) for j in state) > 1}
            raise SnapshotError(
                f"model.state_dict(): names clash once torch.compile's '_orig_mod' segments are "
                f"dropped: {_few(sorted(k for k in state if plain(k) in clash))}"
            )
        return named

    def _capture_model(self, sink: Any) -> Dict[str, str]:
        aliases: Dict[str, str] = {}
        seen: Dict[tuple, str] = {}
        for name, t in self._model_state().items():
            if type(t) is not torch.Tensor and not isinstance(t, torch.Tensor):  # (exact type first: no call)
                raise SnapshotError(
                    f"model.state_dict()[{name!r}]: is a {type(t).__name__}, not a tensor; "
                    "snapshots hold tensors only (extra module state cannot be stored without pickle)"
                )
            key = (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in seen and t.numel():  # tied weights: store once
                aliases[name] = seen[key]
                continue
            seen[key] = name
            sink(f"model/{name}", t)
        return aliases

    # -- compatibility -------------------------------------------------------------------------

    def check_compatible(self, specs: Mapping[str, Spec], meta: Mapping[str, Any], where: str) -> None:
        """Refuse a snapshot that does not fit this state, before anything is written.

        Args:
            specs: the snapshot's tensors as ``name -> (shape, dtype)``.
            meta: the snapshot's JSON part.
            where: the file (or store slot) named in errors.

        Raises:
            SafetrainError: the model has lazy parameters not made yet (a dry run first).
            SnapshotError: naming the first mismatch: a model on the meta device, format, a missing
                or extra model tensor, a shape or dtype, the optimizer's type or parameter layout, the scheduler's type,
                the scaler's enabled state. ``CorruptSnapshotError`` when the metadata is malformed.
        """
        lazy = [n for n, t in self._model_state().items() if is_lazy(t)]
        if lazy:  # (not a SnapshotError: resume="auto" would start fresh over a run that has snapshots)
            raise SafetrainError(
                f"{where}: the model's lazy modules have not made their parameters yet ({_few(lazy)}), so their "
                "shapes are unknown: run one forward of a batch (a dry run) before loading or resuming"
            )
        meta_device = [n for n, t in self._model_state().items() if t.is_meta]
        if meta_device:
            raise SnapshotError(
                f"{where}: the model is on the meta device ({_few(meta_device)}): it has no storage and "
                "loading would do nothing; materialize it first with model.to_empty(device=...), then load"
            )
        try:
            self._check_compatible(specs, meta, where)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CorruptSnapshotError(f"{where}: malformed snapshot metadata ({type(exc).__name__}: {exc})") from None

    def _check_compatible(self, specs: Mapping[str, Spec], meta: Mapping[str, Any], where: str) -> None:
        validate_meta(meta, where)
        for name in _referenced(meta):
            if name not in specs:
                raise SnapshotError(f"{where}: metadata refers to tensor {name!r}, which the file lacks (corrupted?)")
        live = self._model_state()
        aliases = meta["model"]["aliases"]
        check_patterns(meta["model"].get("accepted", {}), where)
        saved = {n[len("model/") :] for n in specs if n.startswith("model/")} | set(aliases)
        params = self._param_names()
        # A buffer that appeared since the snapshot is left as it is (a module that registers one
        # at its first forward); a parameter missing is another model.
        missing, unexpected = sorted(n for n in set(live) - saved if n in params), sorted(saved - set(live))
        if missing or unexpected:
            raise SnapshotError(
                f"{where}: snapshot does not match the model (from another model?): "
                f"missing {_few(missing)}, unexpected {_few(unexpected)}"
            )
        for name, t in live.items():
            if name not in saved:
                continue
            shape, dtype = specs[f"model/{aliases.get(name, name)}"]
            if (tuple(shape) != tuple(t.shape) or dtype != t.dtype) and name in params:  # (buffers go back as saved)
                raise SnapshotError(
                    f"{where}: model tensor {name!r} is {list(shape)} {dtype} in the snapshot, "
                    f"{list(t.shape)} {t.dtype} in the live model"
                )
        check_optimizer(self.optimizer, specs, meta["optimizer"], where)
        _check_same_kind(where, "scheduler", meta.get("scheduler"), self.scheduler)
        _check_same_kind(where, "scaler", meta.get("scaler"), self.scaler)
        if self.scaler is not None and meta["scaler"]["enabled"] != self.scaler.is_enabled():
            raise SnapshotError(
                f"{where}: GradScaler enabled={meta['scaler']['enabled']} in the snapshot, "
                f"enabled={self.scaler.is_enabled()} in the live state"
            )
        if self.rng and meta.get("rng") is None:
            raise SnapshotError(f"{where}: snapshot has no RNG state; build TrainState(..., rng=False) to load it")

    # -- restore -------------------------------------------------------------------------------

    def _param_names(self) -> Set[str]:
        plain = plain_namer(self.model)
        return {plain(n) for n, _ in self.model.named_parameters(remove_duplicate=False)}

    def _put_back_changed(self, pairs: List[Tuple[str, torch.Tensor, Optional[torch.Tensor]]]) -> None:
        """Buffers whose shape or dtype changed since the snapshot go back as they were in it (in
        place: the module keeps its tensor); buffers the snapshot lacks are left as they are."""
        reshaped = [n for n, t, src in pairs if src is not None and (src.shape != t.shape or src.dtype != t.dtype)]
        if reshaped:  # the buffers themselves (state_dict() holds detached aliases: their shape is their own)
            plain = plain_namer(self.model)
            buffers = {plain(n): b for n, b in self.model.named_buffers(remove_duplicate=False)}
            for name, _, src in pairs:
                if name in reshaped:
                    put_buffer_(buffers[name], src)
        if reshaped:
            self.changed.append(f"buffers put back with the shape or dtype of the snapshot: {_few(reshaped)}")
        new = [n for n, _, src in pairs if src is None]
        if new:
            self.changed.append(f"buffers that appeared since the snapshot, left as they are: {_few(new)}")

    def apply(
        self,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        *,
        owned: bool,
        where: str,
        homes: Optional[Mapping[str, torch.device]] = None,
    ) -> None:
        """Put a snapshot back into the live objects; call :meth:`check_compatible` first.

        Model tensors are copied in place (``non_blocking``: asynchronous from pinned memory), so
        every reference to a parameter stays valid; see :func:`.optim.restore_optimizer` for the
        optimizer. Then the scheduler, the scaler and the generators are loaded.

        Args:
            tensors: the snapshot's tensors by name.
            meta: the snapshot's JSON part.
            owned: the tensors are fresh (read from a file) and may be adopted by the optimizer
                instead of copied; ``False`` for a store's reusable buffers.
            where: named in errors.
            homes: the device each tensor was captured on, for copies the optimizer must own.
        """
        self.changed = []
        try:
            aliases = meta["model"]["aliases"]
            live = self._model_state()
            pairs = [(n, t, tensors.get(f"model/{aliases.get(n, n)}")) for n, t in live.items()]
            same = [(t, s) for _, t, s in pairs if s is not None and s.shape == t.shape and s.dtype == t.dtype]
            copy_all_([t for t, _ in same], [s for _, s in same])
            self._put_back_changed(pairs)
            if "accepted" in meta["model"]:  # a snapshot of this safetrain: its acceptance goes on (resume)
                self.accepted = check_patterns(meta["model"]["accepted"], where)
            self.changed += restore_optimizer(
                self.optimizer, tensors, meta["optimizer"], owned=owned, where=where, homes=homes
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CorruptSnapshotError(f"{where}: malformed snapshot metadata ({type(exc).__name__}: {exc})") from None
        try:
            if self.scheduler is not None:
                self.scheduler.load_state_dict(decode(meta["scheduler"]["state"], tensors, where))
            if self.scaler is not None:
                self.scaler.load_state_dict(decode(meta["scaler"]["state"], tensors, where))
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise SnapshotError(f"{where}: cannot restore the scheduler or scaler state: {exc}") from None
        if self.rng:
            restore_rng(meta["rng"], tensors, where)


_SECTIONS = {
    "counters": dict,
    "model": dict,
    "optimizer": dict,
    "scheduler": (dict, type(None)),
    "scaler": (dict, type(None)),
    "rng": (dict, type(None)),
    "extra_tensors": list,
}


def validate_meta(meta: Any, where: str) -> None:
    """Check the JSON part's format, version and sections (types only; contents are checked on use).

    Raises:
        CorruptSnapshotError: naming ``where`` and the first problem.
    """
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CorruptSnapshotError(f"{where}: not a safetrain snapshot (format {got!r})")
    if meta.get("version") != VERSION:
        raise CorruptSnapshotError(
            f"{where}: snapshot format version {meta.get('version')!r}; this safetrain reads version {VERSION}"
        )
    for key, kind in _SECTIONS.items():
        if not isinstance(meta.get(key), kind):
            raise CorruptSnapshotError(
                f"{where}: malformed snapshot metadata: {key!r} is {type(meta.get(key)).__name__}"
            )
    created = meta.get("created", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise CorruptSnapshotError(f"{where}: malformed snapshot metadata: created {created!r:.80}")
    run_id = meta.get("run_id")
    if run_id is not None and not isinstance(run_id, str):
        raise CorruptSnapshotError(f"{where}: malformed snapshot metadata: run_id {run_id!r:.80}")
    counters = meta["counters"]
    if "step" not in counters or not all(isinstance(v, int) and not isinstance(v, bool) for v in counters.values()):
        raise CorruptSnapshotError(f"{where}: malformed snapshot metadata: counters {counters!r}")


def _check_counters(counters: Mapping[str, int]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for key, value in counters.items():
        if type(value) is not int:  # (an exact int, the usual counter, is taken without a call)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SnapshotError(f"counters[{key!r}]: got {value!r}; expected an int")
            value = int(value)
        out[str(key)] = value
    if "step" not in out:
        raise SnapshotError(f"counters: 'step' is required (got keys {sorted(out)})")
    return out


def _check_same_kind(where: str, what: str, saved: Optional[Mapping[str, Any]], live: Any) -> None:
    if saved is None and live is None:
        return
    if saved is None:
        raise SnapshotError(f"{where}: snapshot has no {what} state but the live state has a {type(live).__name__}")
    if live is None:
        raise SnapshotError(
            f"{where}: snapshot has {what} state ({saved.get('type', what)}) but the live state has none"
        )
    if "type" in saved and saved["type"] != _type_name(live):
        raise SnapshotError(f"{where}: {what} is {saved['type']} in the snapshot, {_type_name(live)} in the live state")


def _referenced(meta: Mapping[str, Any]) -> List[str]:
    names = list(tensor_refs([meta.get(k) for k in ("optimizer", "scheduler", "scaler", "extra")]))
    names += [f"extra/{n}" for n in meta.get("extra_tensors", [])]
    rng = meta.get("rng")
    if rng is not None:
        names += ["rng/torch", "rng/numpy"] + [f"rng/cuda/{i}" for i in range(int(rng.get("cuda", 0)))]
    return names


def _few(names: List[str], n: int = 4) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more
