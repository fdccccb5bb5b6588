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


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


#: Calls that start ranks or signal another process: what puts a test under tests/multiprocess.
LAUNCHERS = (
    "multiprocessing.spawn",
    "mp.spawn",
    "run_session",
    "run_two_ranks",
    "run_torchrun",
    "spawn_ranks",
    "send_signal",
)


def _launches(path: Path) -> List[str]:
    """What in ``path`` starts ranks or signals a process other than its own, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value == "torch.distributed.run":
            found.append(f"{node.lineno}: torch.distributed.run")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        own_pid = bool(node.args) and _dotted(getattr(node.args[0], "func", node.args[0])) == "os.getpid"
        if name.endswith(LAUNCHERS) or (name in ("os.kill", "os.killpg") and not own_pid):
            found.append(f"{node.lineno}: {name}")
    return found


def test_tests_that_start_ranks_or_signal_processes_are_under_multiprocess_and_marked_slow():
    outside = [
        f"{p.relative_to(TESTS.parent)}:{hit}"
        for p in _modules()
        if p.name.startswith("test_") and p.parent.name != "multiprocess" and p != Path(__file__).resolve()
        for hit in _launches(p)
    ]
    assert outside == [], "move these files to tests/multiprocess/:\n" + "\n".join(outside)
    unmarked = []
    for p in sorted((TESTS / "multiprocess").glob("test_*.py")):
        marks = [
            ast.unparse(n.value)
            for n in ast.parse(p.read_text()).body
            if isinstance(n, ast.Assign) and any(_dotted(t) == "pytestmark" for t in n.targets)
        ]
        if not any("pytest.mark.slow" in m for m in marks):
            unmarked.append(p.name)
    assert unmarked == [], f"pytestmark = pytest.mark.slow missing in {unmarked}"
