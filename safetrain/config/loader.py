"""Loading a configuration: OmegaConf structured schema <- YAML file <- dotted overrides.

The chain is ``OmegaConf.structured(TrainConfig)`` <- YAML file <- dotlist -> ``to_object`` ->
:func:`~safetrain.config.validate` -> a read-only :class:`TrainConfig`. Unknown keys are refused
with the closest valid one; every error names the file and line (or the override) that set the
value. No torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterable, List, Literal, Mapping, Optional, Union

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ..errors import ConfigError
from .schema import REPLACED_KEYS, TrainConfig, to_dict
from .validate import KeyedError, check_layer, check_size, describe, show, validate

__all__ = ["ConfigLike", "load_config", "as_config"]

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
        data = OmegaConf.to_container(cfg, resolve=True)
        return _build(OmegaConf.structured(TrainConfig), [(data, "DictConfig")], None)
    if isinstance(cfg, Mapping):
        return _build(OmegaConf.structured(TrainConfig), [(dict(cfg), "dict")], None)
    raise ConfigError(f"config: got {type(cfg).__name__}; expected a YAML path, a dict, a DictConfig or a TrainConfig")


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
        check_size(data, _where(data, source, ""))
        _check_keys(data, TrainConfig, "", source)
        _yaml_off(data, TrainConfig)
        try:
            check_layer(data)
        except KeyedError as exc:
            raise ConfigError(f"{_where(data, source, exc.key)}{exc}") from None
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(dict(data)))
        except ValidationError as exc:
            key = exc.full_key
            value = _lookup(data, key)
            raise ConfigError(
                f"{_where(data, source, key)}{key}: got {show(value)}; expected {describe(_field_type(key))}"
            ) from None
        except (OmegaConfBaseException, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {' '.join(str(exc).split())[:200]}") from None
    obj = OmegaConf.to_object(merged)
    try:
        validate(obj)
    except KeyedError as exc:
        # Name the layer (file and line, or override) that set the bad value.
        for data, source in reversed(layers):
            if _lookup(data, exc.key) is not None:
                raise ConfigError(f"{_where(data, source, exc.key)}{exc}") from None
        raise
    return _freeze(obj)


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
                f"{_where(root, source, prefix[:-1])}{prefix[:-1]}: got {show(data)}; expected a section with keys "
                f"{', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names and dotted in REPLACED_KEYS:
            raise ConfigError(f"{_where(root, source, dotted)}'{dotted}' was {REPLACED_KEYS[dotted]}")
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
