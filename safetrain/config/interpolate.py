"""Interpolations (``${oc.env:VAR}``, ``${recovery.max_retries}``...): resolved once, before the schema.

The merged config is resolved as plain data, without the schema, so that every failure (an unset
environment variable, a key that does not exist, a cycle, an unknown resolver, a resolver that
raises) is one :class:`~safetrain.errors.ConfigError` naming where the interpolation was written,
the key and why; and so that what an interpolation gives is checked like a value written in the
file (``${oc.env:FLAG}`` set to ``2`` is not a boolean), naming the interpolation it came from.
No torch.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Set, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, OmegaConfBaseException

from ..errors import ConfigError
from .overrides import problem_of
from .validate import fix_leaves, show
from .yamlfile import MAX_FILE_BYTES

__all__ = ["has_interpolation", "resolve_interpolations", "check_growth", "MAX_RESOLVED"]

#: The most characters the config's values may resolve to, all together: as much as a config file
#: may hold. ``b: ${a}${a}`` doubles ``a``; each level of such nesting multiplies again, so a few
#: hundred kilobytes of YAML could resolve to gigabytes (it ran past 2 minutes and 1 GB).
MAX_RESOLVED = MAX_FILE_BYTES

Path = Tuple[Union[str, int], ...]
_OPEN = re.compile(r"\$\{\s*([^\s:{}$,]*)\s*([:}])?")  # "${" and what it names: a key, or a resolver and ":"
_KEY_ARG = re.compile(r"\s*([^\s,{}$]*)")  # a resolver's first argument, where it names a key or a variable

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
        check_growth(plain, source_of)
        resolved = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    except OmegaConfBaseException as exc:
        raise _unresolved(exc, source_of) from None
    except RecursionError:
        raise ConfigError("config: interpolations nested too deeply to resolve; expected plain values") from None
    fix_leaves(resolved, cls, _read_bool)
    return resolved


def check_growth(plain: Any, source_of: SourceOf, limit: int = MAX_RESOLVED) -> None:
    """Refuse a config whose interpolations would resolve to more than ``limit`` characters in all,
    before anything is resolved.

    Each string's size is measured as its own length plus the size of everything its ``${...}``
    name (another key or section, ``oc.select``/``oc.dict`` of one, an environment variable), each
    key measured once and its size reused, so the check costs the config's size, not the resolved
    one. It is an upper bound (an escaped ``\\${`` counts too); a cycle is left to OmegaConf's error.

    Raises:
        ConfigError: naming where the biggest interpolation was set, its key and the limit.
    """
    memo: Dict[Path, int] = {}
    active: Set[Path] = set()

    def size(path: Path) -> int:
        if path in memo:
            return memo[path]
        if path in active:
            return 0
        active.add(path)
        node, total = _at(plain, path), 0
        if isinstance(node, str):
            total = len(node)
            for ref in _refs(node, path):
                total += ref if isinstance(ref, int) else size(ref)
                if total > limit:
                    break
        elif isinstance(node, Mapping):
            total = sum(size((*path, k)) for k in node)
        elif isinstance(node, (list, tuple)):
            total = sum(size((*path, i)) for i in range(len(node)))
        elif node is not None:
            total = len(str(node))
        active.discard(path)
        memo[path] = min(total, limit + 1)
        return memo[path]

    if size(()) <= limit:
        return
    grown = max((size(p), p) for p in _strings(plain, ()) if "${" in _at(plain, p))[1]
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in grown).lstrip(".")
    where, raw = source_of(key)
    raw = _at(plain, grown) if raw is None else raw
    raise ConfigError(
        f"{where}{key}: cannot resolve {show(raw)}: the config's interpolations would resolve to over {limit} "
        "characters (each ${...} repeats the value it names, and nested ones multiply); expected at most "
        f"{limit} characters"
    )


def _refs(text: str, path: Path) -> Iterator[Union[int, Path]]:
    """What each ``${...}`` in ``text`` (the value at ``path``) brings in: the key it names, or a size."""
    for m in _OPEN.finditer(text):
        name, end = m.group(1), m.group(2)
        if end == "}":
            yield _target(name, path)
        elif end == ":" and name in ("oc.env", "oc.select", "oc.dict.keys", "oc.dict.values"):
            arg = _KEY_ARG.match(text, m.end()).group(1)  # type: ignore[union-attr]
            yield len(os.environ.get(arg, "")) if name == "oc.env" else _target(arg, path)


def _target(name: str, path: Path) -> Path:
    """The path a key written in the value at ``path`` names (``.x``: a sibling, ``..x``: the parent's)."""
    dots = len(name) - len(name.lstrip("."))
    base: List[Union[str, int]] = list(path[: len(path) - dots]) if dots else []
    for part in name[dots:].replace("[", ".").replace("]", "").split("."):
        if part:
            base.append(int(part) if part.isdigit() else part)
    return tuple(base)


def _at(data: Any, path: Path) -> Any:
    for part in path:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, Mapping) and str(part) in data:
            data = data[str(part)]
        elif isinstance(data, (list, tuple)) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return None
    return data


def _strings(data: Any, path: Path) -> Iterator[Path]:
    """The paths of every string in ``data``."""
    if isinstance(data, str):
        yield path
    elif isinstance(data, Mapping):
        for k, v in data.items():
            yield from _strings(v, (*path, k))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            yield from _strings(v, (*path, i))


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
    """An interpolation resolves to a string: ``"true"``/``"false"`` for a boolean field is that boolean."""
    if tp is bool and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        section[key] = value.strip().lower() == "true"
