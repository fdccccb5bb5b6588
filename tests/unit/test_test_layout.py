"""The tests' own layout (issue 34): what they share lives in tests/helpers, never in another test.

Read from the source with ``ast``, without importing anything: a test module that imports another
(or conftest) runs that module's top level and hides a helper where no one looks for it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, List, Tuple

TESTS = Path(__file__).resolve().parents[1]


def _modules() -> List[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, dotted name) of every module ``path`` imports, relative imports resolved, and for
    ``from package import name`` the name too (it may be a module)."""
    package = path.relative_to(TESTS.parent).with_suffix("").parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _is_test_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def test_no_test_module_imports_another_or_conftest():
    found = [
        f"{p.relative_to(TESTS.parent)}:{line}: {name}"
        for p in _modules()
        if p.name.startswith("test_") or p.parent.name == "helpers"
        for line, name in _imported(p)
        if _is_test_module(name)
    ]
    assert found == [], "move what is shared into tests/helpers:\n" + "\n".join(found)


def test_test_file_names_are_unique_and_say_what_they_test():
    """Two ``test_invariance.py`` (unit and integration) read as one file in a report, a traceback
    or ``-k``; each name says what its file tests instead."""
    seen: dict = {}
    for p in _modules():
        if p.name.startswith("test_"):
            seen.setdefault(p.name, []).append(str(p.relative_to(TESTS.parent)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert twice == {}, twice
