"""The configuration schema, YAML loading with OmegaConf, dotted overrides and validation.

The loading chain is ``OmegaConf.structured(TrainConfig)`` <- YAML file <- dotted overrides
-> ``to_object`` -> :func:`validate` -> read-only :class:`TrainConfig`. Every field carries its
documentation in ``metadata["doc"]`` and, where it has one, its allowed range; the validator,
``safetrain check-config`` and the README's reference are all read off the same fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from .errors import ConfigError

__all__ = [
    "ANOMALY_KINDS",
    "ACTIONS",
    "TrainConfig",
    "DetectConfig",
    "ReplayConfig",
    "SanitizeConfig",
    "SpikeConfig",
    "GuardConfig",
    "AmpConfig",
    "RecoveryConfig",
    "SnapshotConfig",
    "LogConfig",
    "load_config",
    "as_config",
    "validate",
    "to_dict",
    "to_yaml",
    "iter_fields",
]

#: Every kind of anomaly the engine can find, in the order a step meets them.
ANOMALY_KINDS = ("input", "target", "forward", "loss", "gradient", "grad_norm", "spike", "weights", "scaler")
#: Every action the recovery policy can take.
ACTIONS = ("warn", "skip_batch", "drop_rows", "replace", "zero_grads", "restore", "scale_lr", "abort")

SanitizeAction = Literal["skip_batch", "drop_rows", "replace", "raise", "off"]
#: Actions that make sense for each kind as its first action (``recovery.actions``).
_ALLOWED_FIRST: Dict[str, tuple] = {
    "forward": ("warn", "skip_batch", "restore", "scale_lr", "abort"),
    "loss": ("warn", "skip_batch", "restore", "scale_lr", "abort"),
    "gradient": ("warn", "skip_batch", "zero_grads", "restore", "scale_lr", "abort"),
    "grad_norm": ("warn", "skip_batch", "zero_grads", "restore", "scale_lr", "abort"),
    "spike": ("warn", "skip_batch", "restore", "scale_lr", "abort"),
    "weights": ("warn", "restore", "scale_lr", "abort"),
    "scaler": ("warn", "skip_batch", "restore", "scale_lr", "abort"),
}
_ESCALATION = ("skip_batch", "zero_grads", "restore", "scale_lr", "abort")


def _f(default: Any = dataclasses.MISSING, doc: str = "", factory: Any = None, **rules: Any) -> Any:
    """A dataclass field with its documentation and validation rules in metadata."""
    meta = {"doc": doc, **rules}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ReplayConfig:
    """Diagnosis by replay of a step that tripped: budget and limits."""

    enabled: bool = _f(True, "replay a tripped step with full hooks and anomaly mode to name the layer, op and bad rows")
    max_per_run: int = _f(20, "at most this many replays in one run; later trips are journaled without a replay", ge=0)
    time_limit_s: float = _f(60.0, "give up a replay (and its bisection) after this many seconds", gt=0)
    keep_steps: int = _f(
        16, "keep the batches and LRs of up to this many updates after a snapshot, to replay a weights fault "
        "to the update that broke it (0: off; those batches stay in memory)", ge=0,
    )
    keep_mb: float = _f(
        256.0, "...and stop keeping them (no weight replay until the next snapshot) once their batches "
        "hold more than this many MiB, wherever they live (host or device memory)", ge=0,
    )


@dataclass(frozen=True)
class DetectConfig:
    """What the detectors watch and how much they cost on a healthy step."""

    mode: Literal["eager", "lazy", "off"] = _f(
        "eager", "eager: activation hooks on every module (but see skip_passthrough); lazy: loss, gradient and weight checks only; off: no checks"
    )
    include: List[str] = _f(doc="module-name globs to monitor in eager mode ('' is the root model)", factory=lambda: ["*"])
    exclude: List[str] = _f(doc="module-name globs never monitored (wins over include)", factory=list)
    nan_only: List[str] = _f(
        doc="module-name globs whose outputs may hold +-inf legitimately (attention masks): only NaN trips there",
        factory=list,
    )
    skip_passthrough: bool = _f(
        True, "leave ReLU-like activations, dropout, pooling and reshapes unhooked (finite in, finite out: "
        "never where a NaN starts); about halves the eager hook cost of MLPs and CNNs"
    )
    check_weights_every: int = _f(100, "check every parameter for NaN/Inf every N optimizer steps (0: never; a "
                                       "forward, loss or gradient trip checks them anyway)", ge=0)
    replay: ReplayConfig = _f(doc="diagnosis by replay of a tripped step", factory=ReplayConfig)


@dataclass(frozen=True)
class SanitizeConfig:
    """What to do with non-finite values in the batch before the forward pass."""

    inputs: SanitizeAction = _f(
        "drop_rows", "non-finite input rows: skip_batch | drop_rows (with their targets) | replace | raise | off"
    )
    targets: SanitizeAction = _f("skip_batch", "non-finite target rows: skip_batch | drop_rows | replace | raise | off")
    nan: float = _f(0.0, "value that replaces NaN under 'replace'", finite=True)
    posinf: float = _f(0.0, "value that replaces +inf under 'replace' (not the dtype's max, which overflows again)", finite=True)
    neginf: float = _f(0.0, "value that replaces -inf under 'replace'", finite=True)


@dataclass(frozen=True)
class SpikeConfig:
    """Loss-spike detection on robust statistics of recent healthy losses."""

    enabled: bool = _f(True, "catch loss blow-ups that are still finite")
    window: int = _f(128, "number of recent healthy losses the median and MAD are taken over", ge=2)
    min_history: int = _f(20, "no spike is called before this many healthy losses are in the window", ge=2)
    zscore: float = _f(6.0, "a loss more than this many robust standard deviations above the median is a spike", gt=0)
    min_ratio: float = _f(2.0, "...and at least this many times the largest recent healthy loss (keeps converged runs quiet)", ge=1)


@dataclass(frozen=True)
class GuardConfig:
    """The per-step guard: clipping, gradient-norm threshold, spikes, accumulation, schedulers."""

    clip_grad_norm: Optional[float] = _f(None, "clip the total gradient norm to this value (null: no clipping)", gt=0)
    grad_norm_threshold: Optional[float] = _f(
        None, "a total gradient norm above this is a grad_norm anomaly; parameters above it are named (null: off)", gt=0
    )
    spike: SpikeConfig = _f(doc="loss-spike detection", factory=SpikeConfig)
    accumulate_steps: int = _f(1, "micro-batches whose gradients are summed before one optimizer step", ge=1)
    to_device: bool = _f(
        True,
        "copy each batch's CPU tensors to the model's accelerator before the forward, non_blocking on CUDA "
        "(pin the loader's memory); false: the model or step_fn places them",
    )
    scheduler_follows: Literal["optimizer", "batch"] = _f(
        "optimizer", "optimizer: the LR scheduler steps only when the optimizer did; batch: on every batch seen"
    )
    scheduler_interval: Literal["step", "epoch"] = _f(
        "step", "step the LR scheduler after every optimizer step, or once per epoch (ReduceLROnPlateau gets the mean loss)"
    )


@dataclass(frozen=True)
class AmpConfig:
    """Mixed precision: autocast dtype and the fp16 GradScaler's limits."""

    dtype: Optional[Literal["float16", "bfloat16"]] = _f(
        None, "autocast dtype: null (full precision) | float16 (with GradScaler) | bfloat16 (no scaler)"
    )
    init_scale: float = _f(2.0**16, "GradScaler's initial loss scale (float16 only)", gt=0, finite=True)
    min_scale: float = _f(1.0, "a loss scale below this is a scaler anomaly, not a normal overflow", gt=0, finite=True)
    max_overflows: int = _f(10, "this many scaler overflows in a row are a scaler anomaly", ge=1)


@dataclass(frozen=True)
class RecoveryConfig:
    """The recovery policy: first action per anomaly kind, the escalation ladder and its limits."""

    actions: Dict[str, str] = _f(
        doc="anomaly kind -> first action (input and target take theirs from sanitize.*)",
        factory=lambda: {
            "forward": "skip_batch",
            "loss": "skip_batch",
            "gradient": "zero_grads",
            "grad_norm": "skip_batch",
            "spike": "skip_batch",
            "weights": "restore",
            "scaler": "restore",
        },
    )
    escalate: List[str] = _f(
        doc="actions taken by the 2nd, 3rd... consecutive anomalous step (the last repeats until max_retries)",
        factory=lambda: ["restore", "scale_lr"],
    )
    max_retries: int = _f(5, "abort after this many consecutive anomalous steps", ge=0)
    reset_after: int = _f(20, "this many healthy steps in a row put the ladder back at its first rung", ge=1)
    lr_factor: float = _f(0.5, "scale_lr multiplies the learning rate by this", gt=0, lt=1)
    min_lr: float = _f(0.0, "scale_lr never takes a learning rate below this", ge=0, finite=True)
    lr_restore_after: Optional[int] = _f(
        None, "after this many healthy steps the LR scale climbs back one notch (null: never)", ge=1
    )
    max_skip_fraction: float = _f(
        0.5, "abort if more than this fraction of the last skip_window steps were not trained", gt=0, le=1
    )
    skip_window: int = _f(100, "number of recent steps max_skip_fraction is measured over", ge=1)
    skip_batches_after_restore: int = _f(
        0, "after a restore, skip this many batches (PaLM: roll back and skip the data that led in)", ge=0
    )


@dataclass(frozen=True)
class SnapshotConfig:
    """Snapshots of the whole training state for restore and resume."""

    store: Literal["memory", "safetensors"] = _f("memory", "memory (fast, lost with the process) | safetensors (on disk)")
    every: int = _f(100, "take a snapshot after this many healthy optimizer steps", ge=1)
    dir: Optional[str] = _f(None, "directory of safetensors snapshots (null: <log.dir>/snapshots)")
    keep: int = _f(2, "number of snapshots kept; older ones are deleted", ge=1)
    device: Literal["cpu", "model"] = _f("cpu", "where the memory store keeps its copy: cpu (pinned on CUDA) | model")


@dataclass(frozen=True)
class LogConfig:
    """Journal, logging and progress bar."""

    dir: Optional[str] = _f(None, "run directory for events.jsonl and reports (null: journal in memory only)")
    progress: bool = _f(True, "show a tqdm progress bar when stderr is a terminal")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _f("INFO", "level of the 'safetrain' logger")


@dataclass(frozen=True)
class TrainConfig:
    """The whole safetrain configuration; load it with :func:`load_config`."""

    detect: DetectConfig = _f(doc="detectors", factory=DetectConfig)
    sanitize: SanitizeConfig = _f(doc="batch sanitizer", factory=SanitizeConfig)
    guard: GuardConfig = _f(doc="per-step guard", factory=GuardConfig)
    amp: AmpConfig = _f(doc="mixed precision", factory=AmpConfig)
    recovery: RecoveryConfig = _f(doc="recovery policy", factory=RecoveryConfig)
    snapshot: SnapshotConfig = _f(doc="snapshots", factory=SnapshotConfig)
    log: LogConfig = _f(doc="journal and progress", factory=LogConfig)


ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], DictConfig, TrainConfig]


def load_config(path: Optional[Union[str, os.PathLike]] = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Load, merge and validate a configuration: defaults <- YAML file <- dotted overrides.

    Args:
        path: a YAML file, or ``None`` for the defaults alone.
        overrides: dotted ``KEY=VALUE`` strings such as ``"recovery.max_retries=5"``.

    Returns:
        A validated, read-only :class:`TrainConfig` (lists become tuples, dicts read-only mappings).

    Raises:
        ConfigError: the file is missing or unparsable (file and line named), a key is unknown
            (closest valid key suggested), or a value has the wrong type or range.

    Example::

        >>> cfg = load_config(None, ["recovery.max_retries=5"])
        >>> cfg.recovery.max_retries
        5
    """
    base = OmegaConf.structured(TrainConfig)
    layers: List[tuple] = []
    if path is not None:
        layers.append((_read_yaml(Path(path)), f"{os.fspath(path)}"))
    overrides = list(overrides)
    if overrides:
        layers.append((_parse_dotlist(overrides), "override"))
    return _build(base, layers, path)


def as_config(cfg: ConfigLike) -> TrainConfig:
    """Turn whatever a user passes as a config into a validated :class:`TrainConfig`.

    Accepts ``None`` (defaults), a path to YAML, a plain (nested) dict, an OmegaConf ``DictConfig``
    or a ``TrainConfig``; everything goes through the same merge and validation as :func:`load_config`.

    Raises:
        ConfigError: as :func:`load_config`, or when ``cfg`` is none of the accepted types.
    """
    if cfg is None or isinstance(cfg, (str, os.PathLike)):
        return load_config(cfg)
    if isinstance(cfg, TrainConfig):
        return _build(OmegaConf.structured(TrainConfig), [(to_dict(cfg), "TrainConfig")], None)
    if isinstance(cfg, DictConfig):
        return _build(OmegaConf.structured(TrainConfig), [(OmegaConf.to_container(cfg, resolve=True), "DictConfig")], None)
    if isinstance(cfg, Mapping):
        return _build(OmegaConf.structured(TrainConfig), [(dict(cfg), "dict")], None)
    raise ConfigError(
        f"config: got {type(cfg).__name__}; expected a YAML path, a dict, a DictConfig or a TrainConfig"
    )


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: cannot parse YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of sections (detect:, guard:, ...), got {type(data).__name__}")
    return _Located(data, path, text)


class _Located(dict):
    """A dict read from a file that remembers where it came from, for error messages."""

    def __init__(self, data: dict, path: Path, text: str) -> None:
        super().__init__(data)
        self.path = path
        self.text = text

    def line_of(self, dotted: str) -> Optional[int]:
        """The 1-based line of a dotted key in the file, or ``None`` when it is not there."""
        node = yaml.compose(self.text)
        line = None
        for part in dotted.split("."):
            if not isinstance(node, yaml.MappingNode):
                return line
            for key, value in node.value:
                if key.value == part:
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                return line
        return line


def _parse_dotlist(overrides: List[str]) -> dict:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. recovery.max_retries=5")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides {overrides}: {str(exc).splitlines()[0]}") from None


def _build(base: DictConfig, layers: List[tuple], path: Any) -> TrainConfig:
    merged = base
    for data, source in layers:
        _check_keys(data, TrainConfig, "", source)
        _yaml_off(data, TrainConfig)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(dict(data)))
        except ValidationError as exc:
            key = exc.full_key
            value = _lookup(data, key)
            raise ConfigError(
                f"{_where(data, source, key)}{key}: got {value!r}; expected {_describe(_field_type(key))}"
            ) from None
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{source}: {str(exc).splitlines()[0]}") from None
    obj = OmegaConf.to_object(merged)
    try:
        validate(obj)
    except _KeyedError as exc:
        # Name the layer (file and line, or override) that set the bad value.
        for data, source in reversed(layers):
            if _lookup(data, exc.key) is not None:
                raise ConfigError(f"{_where(data, source, exc.key)}{exc}") from None
        raise
    return _freeze(obj)


class _KeyedError(ConfigError):
    """A validation error that knows its dotted key, so the loader can say where it was set."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key


def _where(data: Any, source: str, key: str) -> str:
    if isinstance(data, _Located):
        line = data.line_of(key)
        return f"{data.path}:{line}: " if line else f"{data.path}: "
    return f"{source}: " if source == "override" else ""


def _check_keys(data: Any, cls: type, prefix: str, source: str, root: Any = None) -> None:
    """Refuse unknown keys with the closest valid one, before OmegaConf sees them."""
    root = data if root is None else root
    if not isinstance(data, Mapping):
        if prefix:
            raise ConfigError(
                f"{_where(root, source, prefix[:-1])}{prefix[:-1]}: got {data!r}; expected a section with keys "
                f"{', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(
                f"{_where(root, source, dotted)}unknown key '{dotted}'; {hint}"
                f"valid keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(names)}"
            )
        if dataclasses.is_dataclass(hints[key]):
            _check_keys(value, hints[key], dotted + ".", source, root)


def _yaml_off(data: Any, cls: type) -> None:
    """YAML 1.1 reads a bare ``off`` as ``false``: give choice fields that allow 'off' their string back."""
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        tp = hints.get(key)
        if dataclasses.is_dataclass(tp):
            _yaml_off(value, tp)
        elif value is False and typing.get_origin(tp) is Literal and "off" in typing.get_args(tp):
            data[key] = "off"


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _field_type(dotted: str) -> Any:
    cls: Any = TrainConfig
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return Any
        cls = hints[part]
    return cls


def _describe(tp: Any) -> str:
    """Say in words what a field accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join([_describe(rest[0]) if len(rest) == 1 else str(rest), "null"])
    if origin in (list, List):
        return f"a list of {_describe(args[0]) if args else 'values'}"
    if origin in (dict, Dict):
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every value of a :class:`TrainConfig` against its type, range and cross-field rules.

    Args:
        cfg: the configuration to check (a ``TrainConfig`` built by hand is checked the same way).

    Returns:
        ``cfg`` itself, unchanged, when it is valid.

    Raises:
        ConfigError: naming the dotted key, the value given and what is allowed.
    """
    for dotted, f, value in iter_fields(cfg):
        if dataclasses.is_dataclass(value):
            continue
        _check_value(dotted, typing.get_type_hints(_owner(cfg, dotted))[f.name], f.metadata, value)
    rec = cfg.recovery
    for kind, action in rec.actions.items():
        if kind not in _ALLOWED_FIRST:
            valid = [k for k in ANOMALY_KINDS if k in _ALLOWED_FIRST]
            extra = " (input and target are set by sanitize.inputs / sanitize.targets)" if kind in ANOMALY_KINDS else ""
            close = difflib.get_close_matches(str(kind), valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise _KeyedError(
                f"recovery.actions.{kind}",
                f"unknown anomaly kind{extra}{hint}; valid kinds: {', '.join(valid)}",
            )
        if action not in _ALLOWED_FIRST[kind]:
            raise _KeyedError(
                f"recovery.actions.{kind}", f"got {action!r}; expected one of {' | '.join(_ALLOWED_FIRST[kind])}"
            )
    for i, action in enumerate(rec.escalate):
        if action not in _ESCALATION:
            raise _KeyedError(
                "recovery.escalate", f"item {i}: got {action!r}; expected one of {' | '.join(_ESCALATION)}"
            )
    if cfg.guard.spike.min_history > cfg.guard.spike.window:
        raise _KeyedError(
            "guard.spike.min_history",
            f"got {cfg.guard.spike.min_history}; expected at most guard.spike.window ({cfg.guard.spike.window})",
        )
    return cfg


def _owner(cfg: Any, dotted: str) -> type:
    obj = cfg
    for part in dotted.split(".")[:-1]:
        obj = getattr(obj, part)
    return type(obj)


def _check_value(dotted: str, tp: Any, rules: Mapping[str, Any], value: Any) -> None:
    described = _describe(tp)

    def fail() -> None:
        raise _KeyedError(dotted, f"got {value!r}; expected {described}{_range_text(rules)}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            fail()
        return
    if origin in (list, List, tuple):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            fail()
        return
    if origin in (dict, Dict) or isinstance(value, Mapping):
        return
    if tp is bool and not isinstance(value, bool):
        fail()
    if tp in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        if rules.get("finite") and not math.isfinite(value):
            fail()
        if math.isnan(value):
            fail()
        for rule, ok in (
            ("ge", lambda b: value >= b),
            ("gt", lambda b: value > b),
            ("le", lambda b: value <= b),
            ("lt", lambda b: value < b),
        ):
            if rule in rules and not ok(rules[rule]):
                fail()


def _range_text(rules: Mapping[str, Any]) -> str:
    parts = [f"{sym} {rules[r]}" for r, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if r in rules]
    if rules.get("finite"):
        parts.append("finite")
    return f" ({', '.join(parts)})" if parts else ""


def iter_fields(cfg: Any, prefix: str = "") -> Iterable[tuple]:
    """Yield ``(dotted_key, dataclasses.Field, value)`` for every field of a config, depth first."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        dotted = f"{prefix}{f.name}"
        yield dotted, f, value
        if dataclasses.is_dataclass(value):
            yield from iter_fields(value, dotted + ".")


def _freeze(obj: Any) -> Any:
    """Make a validated config read-only: frozen dataclasses, tuples, read-only mappings."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = _freeze(value)
        elif isinstance(value, list):
            changes[f.name] = tuple(value)
        elif isinstance(value, dict):
            changes[f.name] = types.MappingProxyType(dict(value))
    return dataclasses.replace(obj, **changes)


def to_dict(cfg: TrainConfig) -> dict:
    """A plain, JSON-ready nested dict of a config (tuples as lists, mappings as dicts)."""
    out: dict = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved configuration as YAML, in schema order."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
