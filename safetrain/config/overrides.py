"""Dotted ``KEY=VALUE`` overrides: checked one by one, parsed into one layer, repeats noted.

Each override is checked on its own so that an error names the one that is wrong (not the whole
list). A key set twice keeps the last value, as on most command lines; :func:`override_notes`
says so, and :func:`~safetrain.config.load_config` logs it. No torch.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from .validate import show

__all__ = ["parse_overrides", "override_notes", "check_overrides"]

_EXAMPLE = "e.g. recovery.max_retries=5"
#: Every key of the schema is a Python identifier (and so is each anomaly kind in ``recovery.actions``).
_DOTTED = re.compile(r"^[^\W\d]\w*(\.\w+)*$")


def check_overrides(overrides: Any) -> List[str]:
    """The overrides as a list of strings, or a :class:`ConfigError` naming the first that is not one.

    A single string is refused rather than read letter by letter.
    """
    if isinstance(overrides, (str, bytes)):
        raise ConfigError(f"overrides: got the string {show(overrides)}; expected a list of KEY=VALUE strings")
    try:
        items = list(overrides)
    except TypeError:
        raise ConfigError(
            f"overrides: got {type(overrides).__name__}; expected a list of KEY=VALUE strings, {_EXAMPLE}"
        ) from None
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"override {show(item)}: got {type(item).__name__}; expected a KEY=VALUE string")
        key = item.split("=", 1)[0]
        if "=" not in item or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, {_EXAMPLE}")
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(
                f"override {item!r}: the key {key!r} has an empty part; expected a dotted key, {_EXAMPLE}"
            )
        if not _DOTTED.match(key.strip()):
            raise ConfigError(
                f"override {show(item)}: the key {show(key)} is not a dotted name; expected one, {_EXAMPLE}"
            )
    return items


def parse_overrides(overrides: List[str]) -> Dict[str, Any]:
    """Parse checked overrides into one nested dict (interpolations kept as strings).

    Raises:
        ConfigError: naming the override whose value cannot be parsed, and why.
    """
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except Exception as exc:  # noqa: BLE001 - a parser of user text: any failure means a bad value
            raise ConfigError(f"override {show(item)}: cannot parse the value: {problem_of(exc)}") from None
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"overrides {show(overrides)}: {problem_of(exc)}; expected each key set once") from None


def override_notes(overrides: Iterable[str]) -> List[str]:
    """One note for each key that the overrides set again: the last value wins.

    Example::

        >>> override_notes(["recovery.max_retries=3", "recovery.max_retries=4"])
        ["recovery.max_retries is set twice by the overrides ('3', then '4'); the last, '4', wins"]
    """
    last: Dict[str, str] = {}
    notes = []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            continue
        key, value = item.split("=", 1)
        key = key.strip()
        if key in last:
            notes.append(
                f"{key} is set twice by the overrides ({show(last[key], 40)}, then {show(value, 40)}); "
                f"the last, {show(value, 40)}, wins"
            )
        last[key] = value
    return notes


def problem_of(exc: BaseException) -> str:
    """The first line of an OmegaConf or YAML error, without its wrapping, as one short phrase."""
    text = " ".join((str(exc).splitlines() or [""])[0].split())
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        text = f"{exc.context + ', ' if exc.context else ''}{exc.problem}"
    for prefix in ("raised while resolving interpolation: ",):
        if prefix in text:
            text = text.split(prefix, 1)[1]
    return text.strip().strip('"')[:200] or type(exc).__name__
