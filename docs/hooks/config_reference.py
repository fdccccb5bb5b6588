"""MkDocs hook: the configuration reference, generated from the schema at every build.

``docs/configuration.md`` holds the line ``<!-- config-reference -->``; this hook replaces it with
one table per section of :class:`safetrain.TrainConfig` (every key, its default, what it accepts
and its documentation, all read off the dataclass fields in ``safetrain/config/schema.py``), so
the page cannot drift from the code. ``reference_markdown()`` is importable on its own (a test
checks it lists every key).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, List

import yaml

MARKER = "<!-- config-reference -->"


def _default(value: Any) -> str:
    """A default as it is written in YAML (flow style, on one line)."""
    if isinstance(value, tuple):
        value = list(value)
    elif isinstance(value, typing.Mapping):
        value = dict(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _accepts(tp: Any, rules: typing.Mapping[str, Any]) -> str:
    """What a field accepts: its type hint and its range, in the words of the YAML file."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return " \\| ".join(_accepts(arg, rules) for arg in typing.get_args(tp))
    if origin is typing.Literal:
        return " \\| ".join(str(arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple, typing.List, typing.Tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return f"list of {_accepts(item, {})}"
    if origin in (dict, typing.Dict, typing.Mapping):
        return "mapping"
    name = getattr(tp, "__name__", str(tp))
    ops = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
    bounds = [f"{op} {rules[key]}" for key, op in ops if key in rules]
    return f"{name} {', '.join(bounds)}" if bounds else name


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(cfg: Any, prefix: str) -> List[str]:
    rows = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            rows += _table(value, dotted + ".")
            continue
        accepts = _accepts(hints[f.name], f.metadata)
        rows.append(f"| `{dotted}` | `{_cell(_default(value))}` | {accepts} | {_cell(f.metadata.get('doc', ''))} |")
    return rows


def reference_markdown() -> str:
    """Every key of the configuration, one table per section, from the schema's fields."""
    from safetrain.config import TrainConfig

    cfg = TrainConfig()
    out: List[str] = []
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        out += [f"### `{section.name}`: {section.metadata.get('doc', '')}", ""]
        out += ["| key | default | accepts | what it does |", "| --- | --- | --- | --- |"]
        out += _table(value, section.name + ".")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: put the generated reference where the page has the marker."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, reference_markdown())
    return markdown
