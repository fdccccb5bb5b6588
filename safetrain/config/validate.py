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
from typing import Any, Dict, List, Literal, Mapping, Union

from ..errors import ConfigError
from ..kinds import ALLOWED_FIRST, ANOMALY_KINDS, ESCALATION
from .schema import TrainConfig, iter_fields

__all__ = ["validate", "KeyedError", "describe"]


class KeyedError(ConfigError):
    """A validation error that knows its dotted key, so the loader can say where it was set."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key


def describe(tp: Any) -> str:
    """Say in words what a field accepts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join([describe(rest[0]) if len(rest) == 1 else str(rest), "null"])
    if origin in (list, List):
        return f"a list of {describe(args[0]) if args else 'values'}"
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
            raise KeyedError(f"recovery.actions.{kind}", f"got {action!r}; expected one of {' | '.join(allowed)}")
    ladder = [a.value for a in ESCALATION]
    for i, action in enumerate(rec.escalate):
        if action not in ladder:
            raise KeyedError("recovery.escalate", f"item {i}: got {action!r}; expected one of {' | '.join(ladder)}")
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
        raise KeyedError(dotted, f"got {value!r}; expected {described}{_range_text(rules)}")

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
