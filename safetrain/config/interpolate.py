"""Interpolations (``${oc.env:VAR}``, ``${recovery.max_retries}``...): resolved once, before the schema.

The merged config is resolved as plain data, without the schema, so that every failure (an unset
environment variable, a key that does not exist, a cycle, an unknown resolver, a resolver that
raises) is one :class:`~safetrain.errors.ConfigError` naming where the interpolation was written,
the key and why; and so that what an interpolation gives is checked like a value written in the
file (``${oc.env:FLAG}`` set to ``2`` is not a boolean), naming the interpolation it came from.
No torch.
"""

from __future__ import annotations

import typing
from typing import Any, Callable, Dict, Mapping, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from ..errors import ConfigError
from .overrides import problem_of
from .validate import fix_leaves, show

__all__ = ["has_interpolation", "resolve_interpolations"]

#: ``key -> (where, raw value)``: the file and line (or override) that set a key, and what it wrote.
SourceOf = Callable[[str], Tuple[str, Any]]


def has_interpolation(data: Any) -> bool:
    """Whether a raw config layer holds a ``${...}`` string anywhere (values of lists and mappings too)."""
    if isinstance(data, str):
        return "${" in data
    if isinstance(data, Mapping):
        return any(has_interpolation(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(has_interpolation(v) for v in data)
    return False


def resolve_interpolations(merged: DictConfig, cls: type, source_of: SourceOf) -> Dict[str, Any]:
    """The merged config as a plain dict with every interpolation replaced by what it gives.

    Strings ``true`` and ``false`` (any case) given to a boolean key become booleans, as an
    environment variable can only give a string; any other conversion is left to the schema.

    Raises:
        ConfigError: naming where the interpolation was set, the key, the interpolation and why it
            cannot be resolved.
    """
    plain = OmegaConf.to_container(merged, resolve=False)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    except OmegaConfBaseException as exc:
        raise _unresolved(exc, source_of) from None
    except RecursionError:
        raise ConfigError("config: interpolations nested too deeply to resolve; expected plain values") from None
    fix_leaves(resolved, cls, _read_bool)
    return resolved


def _unresolved(exc: OmegaConfBaseException, source_of: SourceOf) -> ConfigError:
    key = str(getattr(exc, "full_key", None) or "")
    where, raw = source_of(key)
    if isinstance(exc, InterpolationKeyError):
        problem = f"{problem_of(exc).replace('Interpolation key', 'the key')} in the config"
    elif "Recursive interpolation" in str(exc):
        problem = "it refers back to itself (an interpolation cycle); expected a value or another key"
    else:
        problem = problem_of(exc)
        if "Environment variable" in problem:
            problem += "; set it, or give a default: ${oc.env:NAME,default}"
    return ConfigError(f"{where}{key or 'config'}: cannot resolve {show(raw)}: {problem}")


def _read_bool(section: Dict[str, Any], key: str, value: Any, tp: Any) -> None:
    """An interpolation resolves to a string: ``"true"``/``"false"`` for a boolean field is that
    boolean; a whole number for a field that takes an integer or a named choice (``snapshot.every``)
    is that integer (OmegaConf converts it for a plain integer field, not for a union)."""
    if tp is bool and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        section[key] = value.strip().lower() == "true"
    elif isinstance(value, str) and typing.get_origin(tp) is Union and int in typing.get_args(tp):
        if value.strip().lstrip("+-").isdigit():
            section[key] = int(value)
