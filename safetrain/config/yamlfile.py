"""Reading one YAML config file: a bounded, UTF-8, regular file whose keys each appear once.

Every way a file can be unusable ends in one :class:`~safetrain.errors.ConfigError` that names the
file (and the line where there is one) and what is wrong: missing, a directory, not
readable, too big, not UTF-8, not YAML, nested too deeply, not a mapping, or a key given twice in
one mapping (PyYAML would keep the last silently). The result remembers its file and text so
that later errors can name the line of a key. No torch.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, List, Optional, Tuple

import yaml

from ..errors import ConfigError
from .presets import PRESETS

__all__ = ["Located", "read_yaml", "MAX_FILE_BYTES"]

#: A config file larger than this is refused before it is parsed: ``configs/default.yaml``, which
#: lists every key with a comment, is about 5 kB.
MAX_FILE_BYTES = 1 << 20

_MERGE_TAG = "tag:yaml.org,2002:merge"


class Located(dict):
    """A dict read from a file that remembers where it came from, for error messages."""

    def __init__(self, data: dict, path: Path, text: str) -> None:
        super().__init__(data)
        self.path = path
        self.text = text

    def line_of(self, dotted: str) -> Optional[int]:
        """The 1-based line of a dotted key in the file, or ``None`` when it is not there."""
        node = yaml.compose(self.text, Loader=yaml.SafeLoader)
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


def read_yaml(path: Path) -> Any:
    """Read and parse one config file: a :class:`Located` mapping, or ``{}`` for an empty file.

    Raises:
        ConfigError: naming the file (and line) and what is wrong with it.
    """
    text = _read_text(path)
    try:
        loader = yaml.SafeLoader(text)  # refuses control characters here, before parsing
        try:
            node = loader.get_single_node()
            if node is not None:
                _refuse_duplicates(node, path)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(
            f"{path}:{line}: cannot parse YAML: character #x{char:04x} is not allowed ({exc.reason})"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: cannot parse YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; expected sections of plain values") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of sections (detect:, guard:, ...), got {type(data).__name__}")
    return Located(data, path, text)


def _read_text(path: Path) -> str:
    """The file's text, after checking that it is a regular, readable, small, UTF-8 file."""
    try:
        info = path.stat()
    except FileNotFoundError:
        presets = ", ".join(PRESETS)
        raise ConfigError(f"{path}: no such config file; expected a YAML file or a preset's name ({presets})") from None
    except (OSError, ValueError) as exc:  # permission on a parent, a name too long, a NUL in the name
        raise ConfigError(f"{path}: cannot read the config file: {_reason(exc)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path}: is a directory; expected a YAML config file")
    too_big = f"{path}: is over {MAX_FILE_BYTES} bytes; expected a YAML config file (a full one is about 5 kB)"
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_FILE_BYTES:
        raise ConfigError(too_big)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {_reason(exc)}") from None
    if len(raw) > MAX_FILE_BYTES:  # it grew between stat and read, or is a device or pipe
        raise ConfigError(too_big)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "expected a YAML file saved as UTF-8"
        ) from None


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _refuse_duplicates(root: yaml.Node, path: Path) -> None:
    """Refuse a key that appears twice in one mapping (block or flow style), naming both lines.

    Keys brought in by a merge key (``<<: *base``) may be overridden: that is what merge keys are
    for. Each node is visited once, so aliases cost nothing and a recursive alias ends the walk.
    """
    seen_nodes: set = set()
    todo: List[Tuple[yaml.Node, str]] = [(root, "")]
    loader = yaml.SafeLoader("")
    while todo:
        node, prefix = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{prefix}[{i}]") for i, item in enumerate(node.value))
        if not isinstance(node, yaml.MappingNode):
            continue
        lines: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = _scalar_key(loader, key_node)
            dotted = f"{prefix}.{key}" if prefix else str(key)
            todo.append((value_node, dotted))
            if key is None:
                continue
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(
                    f"{path}:{line}: duplicate key '{dotted}' (first on line {lines[key]}, again on line {line}); "
                    "expected each key once per section: delete one"
                )
            lines[key] = line


def _scalar_key(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """The value of a scalar key as the loader will read it (``1`` and ``0x1`` are one key), else ``None``."""
    if not isinstance(node, yaml.ScalarNode):
        return None  # an unhashable key: the loader refuses it with its own error
    try:
        value = loader.construct_object(node)
        hash(value)
    except (yaml.YAMLError, TypeError, ValueError):
        return None
    return value
