"""Validation of a :class:`~safetrain.config.TrainConfig`: types, ranges and cross-field rules.

Each field is checked against its type hint and the range in its metadata; ``recovery.actions``
and ``recovery.escalate`` against the tables in :mod:`safetrain.kinds`. Errors name the dotted
key, the value and what is allowed; the loader adds the file and line. No torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Callable, Dict, List, Literal, Mapping, Union

from ..errors import ConfigError
from ..kinds import ALLOWED_FIRST, ANOMALY_KINDS, ESCALATION
from .schema import TrainConfig, iter_fields

__all__ = ["validate", "check_layer", "check_size", "KeyedError", "describe", "show", "MAX_NODES", "fix_leaves"]

#: At most this many values (mappings, lists and scalars, aliases counted as often as they are used)
#: in one config layer: a real config has about a hundred; a YAML alias bomb has billions.
MAX_NODES = 10_000


class KeyedError(ConfigError):
    """A validation error that knows its dotted key, so the loader can say where it was set."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so that an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_size(data: Any, where: str, limit: int = MAX_NODES) -> None:
    """Refuse a config layer that expands to more than ``limit`` values, or that contains itself.

    YAML aliases share one object between many places, so a 400-byte file can stand for billions
    of values; this counts each value as often as it is used, without expanding anything (each
    shared object is counted once and its count reused), so it costs only the distinct objects.

    Raises:
        ConfigError: naming ``where`` (file or override), the dotted key and the limit.
    """
    sizes: Dict[int, int] = {}
    active: set = set()

    def count(node: Any, key: str) -> int:
        if not isinstance(node, (Mapping, list, tuple)):
            return 1
        ident = id(node)
        if ident in sizes:
            return sizes[ident]
        if ident in active:
            raise ConfigError(f"{where}{key or 'config'}: a YAML alias refers to itself; expected plain values")
        active.add(ident)
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        total = 1
        for k, v in items:
            total += count(v, f"{key}.{k}" if key and isinstance(node, Mapping) else (key or str(k)))
            if total > limit:
                raise ConfigError(
                    f"{where}{key or 'config'}: expands to more than {limit} values (YAML aliases?); "
                    f"expected a config of at most {limit} values"
                )
        active.discard(ident)
        sizes[ident] = total
        return total

    count(data, "")


def check_layer(data: Any, cls: type = TrainConfig, prefix: str = "") -> None:
    """Check the types of one raw config layer (a YAML file, overrides, a dict) before any merge.

    OmegaConf converts what it is given (``2`` to ``True`` for a bool, ``1`` to ``'1'`` in a list of
    strings) and fails with a traceback where it cannot (a mapping given for a list); here every
    bool key takes only booleans, a list key only a list of strings, a mapping key only a mapping
    of strings, and a number or string key no list or mapping. Ranges and choices are left to
    :func:`validate`. Unknown keys must have been refused already.

    Raises:
        KeyedError: naming the dotted key, the value (cut short) and what is allowed.
    """
    if not isinstance(data, Mapping):
        return
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        tp = hints.get(key)
        if tp is None:
            continue
        if dataclasses.is_dataclass(tp):
            check_layer(value, tp, dotted + ".")
            continue
        if not _raw_ok(tp, value):
            if isinstance(value, (list, tuple)) and _raw_ok(tp, []):
                i, item = next((i, v) for i, v in enumerate(value) if not isinstance(v, str))
                raise KeyedError(dotted, f"item {i}: got {show(item)}; expected a string ({describe(tp)})")
            raise KeyedError(dotted, f"got {show(value)}; expected {describe(tp)}")


def _raw_ok(tp: Any, value: Any) -> bool:
    if isinstance(value, str) and "${" in value:
        return True  # an interpolation: its resolved value is checked after the merge
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return True
        rest = tuple(a for a in args if a is not type(None))
        tp = rest[0] if len(rest) == 1 else Union[rest]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):  # a number or a named choice (guard.grad_norm_threshold)
        return any(_raw_ok(a, value) for a in args)
    if origin is Literal:
        return isinstance(value, str)
    if origin in (list, List, tuple):
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if origin in (dict, Dict):
        return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    if isinstance(value, (Mapping, list, tuple)):
        return False
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float, str):
        return not isinstance(value, bool)
    return True


def describe(tp: Any) -> str:
    """Say in words what a field accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return " or ".join([describe(a) for a in rest] + (["null"] if type(None) in args else []))
    if origin in (list, List):
        return "a list of strings" if args == (str,) else f"a list of {describe(args[0]) if args else 'values'}"
    if origin in (dict, Dict):
        return "a mapping of strings" if args[1:] == (str,) else "a mapping"
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
        if kind not in ALLOWED_FIRST:
            valid = [k.value for k in ANOMALY_KINDS if k in ALLOWED_FIRST]
            extra = " (input and target are set by sanitize.inputs / sanitize.targets)" if kind in ANOMALY_KINDS else ""
            close = difflib.get_close_matches(str(kind), valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise KeyedError(
                f"recovery.actions.{kind}",
                f"unknown anomaly kind{extra}{hint}; valid kinds: {', '.join(valid)}",
            )
        allowed = [a.value for a in ALLOWED_FIRST[kind]]
        if action not in allowed:
            raise KeyedError(f"recovery.actions.{kind}", f"got {show(action)}; expected one of {' | '.join(allowed)}")
    ladder = [a.value for a in ESCALATION]
    for i, action in enumerate(rec.escalate):
        if action not in ladder:
            raise KeyedError("recovery.escalate", f"item {i}: got {show(action)}; expected one of {' | '.join(ladder)}")
    snap = cfg.snapshot
    if snap.min_every > snap.max_every:
        raise KeyedError(
            "snapshot.min_every", f"got {snap.min_every}; expected at most snapshot.max_every ({snap.max_every})"
        )
    if cfg.guard.spike.min_history > cfg.guard.spike.window:
        raise KeyedError(
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
    described = describe(tp)

    def fail() -> None:
        raise KeyedError(dotted, f"got {show(value)}; expected {described}{_range_text(rules)}")

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        if value is None:
            return
        rest = tuple(a for a in args if a is not type(None))
        tp = rest[0] if len(rest) == 1 else Union[rest]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):  # a number or a named choice: the choice, else the number's rules
        choice = next((a for a in args if typing.get_origin(a) is Literal), None)
        if isinstance(value, str) and choice is not None:
            tp, origin, args = choice, Literal, typing.get_args(choice)
        else:
            tp = next((a for a in args if a in (int, float)), tp)
            origin = None
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


def fix_leaves(data: Any, cls: type, fix: Callable[[Dict[str, Any], str, Any, Any], None]) -> None:
    """Walk plain config ``data`` (nested dicts) along the schema dataclass ``cls`` and call
    ``fix(section, key, value, field_type)`` for every key that is not a section, so it can put a
    corrected value in place (a string YAML or an interpolation gave where the schema wants another
    type). Keys the schema does not know are passed with the field type ``None``."""
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for key, value in list(data.items()):
        tp = hints.get(key)
        if dataclasses.is_dataclass(tp):
            fix_leaves(value, tp, fix)
        else:
            fix(data, key, value, tp)
