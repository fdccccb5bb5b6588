"""Loading a configuration: OmegaConf structured schema <- YAML file <- dotted overrides.

The chain is ``OmegaConf.structured(TrainConfig)`` <- YAML file (:mod:`.yamlfile`) <- dotlist
(:mod:`.overrides`) -> interpolations resolved (:mod:`.interpolate`) -> ``to_object`` ->
:func:`~safetrain.config.validate` -> a read-only :class:`TrainConfig`. Unknown keys are refused
with the closest valid one; every error is one :class:`ConfigError` line naming the file and line
(or the override) that set the value, never a traceback. No torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Literal, Mapping, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ..errors import ConfigError
from .interpolate import check_growth, has_interpolation, resolve_interpolations
from .overrides import check_overrides, override_notes, parse_overrides, problem_of
from .presets import preset_path
from .schema import REPLACED_KEYS, TrainConfig, to_dict
from .validate import KeyedError, check_layer, check_size, describe, fix_leaves, show, validate
from .yamlfile import Located, read_yaml

__all__ = ["ConfigLike", "load_config", "as_config"]

_log = logging.getLogger(__name__)

ConfigLike = Union[None, str, os.PathLike, Mapping[str, Any], DictConfig, TrainConfig]


def load_config(path: Optional[Union[str, os.PathLike]] = None, overrides: Iterable[str] = ()) -> TrainConfig:
    """Load, merge and validate a configuration: defaults <- YAML file <- dotted overrides.

    Args:
        path: a YAML file, a preset's name (``"default"``, ``"lenient"``, ``"strict"``, ``"fp16"``,
            ``"bf16"``: shipped in the package), or ``None`` for the defaults alone.
        overrides: dotted ``KEY=VALUE`` strings such as ``"recovery.max_retries=5"``.

    Returns:
        A validated, read-only :class:`TrainConfig` (lists become tuples, dicts read-only mappings).

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8 or unparsable, or gives a key twice
            (file and line named); a key is unknown (closest valid key suggested); an interpolation
            cannot be resolved; or a value has the wrong type or range. A key set twice by the
            overrides is no error: the last wins, with a note logged at INFO.

    Example::

        >>> cfg = load_config(None, ["recovery.max_retries=5"])
        >>> cfg.recovery.max_retries
        5
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"config path: got {type(path).__name__}; expected a path to a YAML file, or None")
    overrides = check_overrides(overrides)
    base = OmegaConf.structured(TrainConfig)
    layers: List[tuple] = []
    if path is not None:
        file = preset_path(path) or Path(path)
        layers.append((read_yaml(file), f"{os.fspath(path) if file == Path(path) else file}"))
    if overrides:
        layers.append((parse_overrides(overrides), "override"))
    for note in override_notes(overrides):
        _log.info("config: %s", note)
    return _build(base, layers, path)


def as_config(cfg: ConfigLike) -> TrainConfig:
    """Turn whatever a user passes as a config into a validated :class:`TrainConfig`.

    Accepts ``None`` (defaults), a path to YAML or a preset's name, a plain (nested) dict, an OmegaConf ``DictConfig``
    or a ``TrainConfig``; everything goes through the same merge and validation as :func:`load_config`.

    Raises:
        ConfigError: as :func:`load_config`, or when ``cfg`` is none of the accepted types.
    """
    if cfg is None or isinstance(cfg, (str, os.PathLike)):
        return load_config(cfg)
    if isinstance(cfg, TrainConfig):
        return _build(OmegaConf.structured(TrainConfig), [(to_dict(cfg), "TrainConfig")], None)
    if isinstance(cfg, DictConfig):
        try:
            check_growth(OmegaConf.to_container(cfg, resolve=False), lambda key: ("DictConfig: ", None))
            data = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"DictConfig: {_key_of(exc) or 'config'}: cannot resolve: {problem_of(exc)}") from None
        return _build(OmegaConf.structured(TrainConfig), [(data, "DictConfig")], None)
    if isinstance(cfg, Mapping):
        return _build(OmegaConf.structured(TrainConfig), [(dict(cfg), "dict")], None)
    raise ConfigError(f"config: got {type(cfg).__name__}; expected a YAML path, a dict, a DictConfig or a TrainConfig")


def _build(base: DictConfig, layers: List[tuple], path: Any) -> TrainConfig:
    merged = base
    for data, source in layers:
        check_size(data, _where(data, source, ""))
        _check_keys(data, TrainConfig, "", source)
        fix_leaves(data, TrainConfig, _yaml_off)
        _refuse_missing(data, source)
        merged = _merge(merged, data, lambda key, d=data, s=source: (_where(d, s, key), ""), source)
    if any(has_interpolation(data) for data, _ in layers):
        resolved = resolve_interpolations(merged, TrainConfig, lambda key: _source_of(key, layers))
        merged = _merge(OmegaConf.structured(TrainConfig), resolved, lambda key: _resolved_where(key, layers), "config")
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # not expected once interpolations are resolved
        raise ConfigError(f"config: {_key_of(exc) or 'config'}: {problem_of(exc)}") from None
    try:
        validate(obj)
    except KeyedError as exc:
        # Name the layer (file and line, or override) that set the bad value.
        if not any(_lookup(data, exc.key) is not None for data, _ in layers):
            raise
        where, note = _resolved_where(exc.key, layers)
        raise ConfigError(f"{where}{exc}{note}") from None
    return _freeze(obj)


def _merge(merged: DictConfig, data: Any, locate: Callable[[str], Tuple[str, str]], source: str) -> DictConfig:
    """Check the types of one layer, then merge it; an error about ``key`` is framed by ``locate(key)``."""
    try:
        check_layer(data)
    except KeyedError as exc:
        where, note = locate(exc.key)
        raise ConfigError(f"{where}{exc}{note}") from None
    try:
        return OmegaConf.merge(merged, OmegaConf.create(dict(data)))
    except ValidationError as exc:
        key = exc.full_key
        (where, note), value = locate(key), _lookup(data, key)
        raise ConfigError(f"{where}{key}: got {show(value)}; expected {describe(_field_type(key))}{note}") from None
    except (OmegaConfBaseException, TypeError, ValueError) as exc:
        key = _key_of(exc)
        where, note = locate(key) if key else ("", "")
        raise ConfigError(f"{where or source + ': '}{key + ': ' if key else ''}{problem_of(exc)}{note}") from None


def _resolved_where(key: str, layers: List[tuple]) -> Tuple[str, str]:
    """Where the last layer set ``key``, and a note naming the interpolation it wrote there, if any."""
    where, raw = _source_of(key, layers)
    return where, (f" (the value of {show(raw)})" if isinstance(raw, str) and "${" in raw else "")


def _refuse_missing(data: Any, source: str, root: Any = None, prefix: str = "") -> None:
    """OmegaConf's ``???`` (a value to be given later) silently keeps the default when merged: refuse it."""
    root = data if root is None else root
    if not isinstance(data, Mapping):
        return
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, str) and value.strip() == "???":
            raise ConfigError(
                f"{_where(root, source, dotted)}{dotted}: got '???' (OmegaConf's mark for a value still to be "
                f"given); expected {describe(_field_type(dotted))}, or no {dotted} at all for the default"
            )
        _refuse_missing(value, source, root, dotted + ".")


def _key_of(exc: BaseException) -> str:
    return str(getattr(exc, "full_key", None) or "")


def _source_of(key: str, layers: List[tuple]) -> tuple:
    """(where, raw value) of the last layer that set ``key`` (``a.b[2]`` is item 2 of ``a.b``)."""
    dotted, _, index = key.partition("[")
    for data, source in reversed(layers):
        raw = _lookup(data, dotted)
        if raw is None:
            continue
        if index and isinstance(raw, (list, tuple)) and index[:-1].isdigit() and int(index[:-1]) < len(raw):
            raw = raw[int(index[:-1])]
        return _where(data, source, dotted), raw
    return "", None


def _where(data: Any, source: str, key: str) -> str:
    if isinstance(data, Located):
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


def _yaml_off(section: Dict[str, Any], key: str, value: Any, tp: Any) -> None:
    """YAML 1.1 reads a bare ``off`` as ``false``: give choice fields that allow 'off' their string back.
    A whole number given to a field that takes a number or a named choice becomes a float (OmegaConf
    converts it for a plain float field, not for a union)."""
    if value is False and typing.get_origin(tp) is Literal and "off" in typing.get_args(tp):
        section[key] = "off"
    elif type(value) is int and typing.get_origin(tp) is Union and float in typing.get_args(tp):
        section[key] = float(value)


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return None
        data = data[part]
    return data


def _field_type(dotted: str) -> Any:
    cls: Any = TrainConfig
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
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
