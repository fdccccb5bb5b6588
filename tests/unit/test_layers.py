"""The package's shape: no import circle between safetrain's modules, no module over ~400 lines.

The import graph is read from the source, in two readings. The load-time graph
(:func:`import_graph`) counts module-level imports only: an import inside a function, or under
``if TYPE_CHECKING:``, runs late or never and makes no circle at load time
(:func:`test_no_import_circle`). The design graph (``import_graph(inside_functions=True)``)
counts imports inside functions too (not those under ``if TYPE_CHECKING:``, which are for
annotations): a late import that closes a circle still makes two modules each the other's
bottom, so that graph has no circle either (:func:`test_no_import_circle_counting_imports_inside_functions`).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parents[2] / "safetrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (ROOT.parent / Path(*name.split(".")) / "__init__.py").exists()


def _exists(name: str) -> bool:
    return _is_package(name) or (ROOT.parent / Path(*name.split("."))).with_suffix(".py").exists()


def _top_level_imports(tree: ast.Module) -> List[ast.stmt]:
    out: List[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            out += [n for n in node.body + node.orelse if isinstance(n, (ast.Import, ast.ImportFrom))]
        elif isinstance(node, ast.Try):
            out += [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def _all_imports(tree: ast.Module) -> List[ast.stmt]:
    """Every import in the module, inside functions and classes too, but not under ``if TYPE_CHECKING:``."""
    out: List[ast.stmt] = []
    todo: List[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return out


def import_graph(inside_functions: bool = False) -> Dict[str, Set[str]]:
    """Each safetrain module -> the safetrain modules it imports when it is loaded (``inside_functions``:
    or later, from inside a function)."""
    graph: Dict[str, Set[str]] = {}
    imports = _all_imports if inside_functions else _top_level_imports
    for path in ROOT.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: Set[str] = set()
        for node in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name.startswith("safetrain")}
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("safetrain"):
                continue
            for alias in node.names:  # `from .pkg import module` imports the module itself
                sub = f"{target}.{alias.name}"
                edges.add(sub if _exists(sub) else target)
        graph[name] = {e for e in edges if e != name and _exists(e)}
    return graph


def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_import_graph_is_read():
    graph = import_graph()
    assert "safetrain.guard.judge" in graph["safetrain.guard.decisions"], "a relative module import is an edge"
    assert "safetrain.policy" in graph["safetrain.guard.decisions"]
    assert "safetrain.kinds" in graph["safetrain.policy"]
    assert "safetrain.config" not in graph["safetrain.policy"], "an import under TYPE_CHECKING is no edge"


def test_the_import_graph_counts_imports_inside_functions_when_asked():
    late, load = import_graph(inside_functions=True), import_graph()  # each reading parses the package once
    assert "safetrain.detect" in late["safetrain.diagnose.quarantine"], "an import inside a method is an edge"
    assert "safetrain.detect" not in load["safetrain.diagnose.quarantine"]
    assert "safetrain.config" not in late["safetrain.policy"], "an import under TYPE_CHECKING is still no edge"
    assert load.keys() == late.keys()
    assert all(load[m] <= late[m] for m in late)


def test_no_import_circle():
    assert _cycle(import_graph()) == []


def test_no_import_circle_counting_imports_inside_functions():
    """A circle closed by an import inside a function has no bottom: put what both sides need below both."""
    assert _cycle(import_graph(inside_functions=True)) == []


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


# The layers of the README's table "Where each part lives", from the drivers at the top to the
# vocabulary at the bottom: a module imports from its own row or a row below, never from above.
LAYERS = [
    ["cli"],
    ["integrations"],
    ["trainer", "run", "ending", "hooks", "metrics"],
    ["testing"],
    ["guard"],
    ["diagnose"],
    ["distributed"],
    ["snapshot"],
    ["detect"],
    ["adapters"],
    ["numerics"],
    ["steps", "optimizers"],
    ["stats"],
    ["policy"],
    ["rundir"],
    ["config"],
    ["kinds", "events", "errors", "deprecation"],
]

#: What lies at the top of safetrain/: the public entry points and the shared vocabulary.
ROOT_MODULES = {"__init__", "__main__"} | {name for row in LAYERS for name in row if not (ROOT / name).is_dir()}


def _row(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, row in enumerate(LAYERS) if top in row)


def test_the_root_holds_the_entry_points_and_the_vocabulary_only():
    """A module that serves one client lives in that client's package, not beside the entry points."""
    assert {p.stem for p in ROOT.glob("*.py")} == ROOT_MODULES
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} | ROOT_MODULES == {
        name for row in LAYERS for name in row
    } | {"__init__", "__main__"}


def test_imports_point_down_the_layers():
    """Each import, inside functions too, goes to the importer's row or one below (the README's table)."""
    up = [
        f"{m} -> {e}"
        for m, edges in sorted(import_graph(inside_functions=True).items())
        if m != "safetrain" and m.split(".")[1] != "__main__"
        for e in sorted(edges)
        if e != "safetrain" and _row(e) < _row(m)
    ]
    assert up == []


def test_the_layer_check_finds_an_import_that_points_up():
    assert _row("safetrain.policy.history") > _row("safetrain.guard.lr") > _row("safetrain.cli.demo")


@pytest.mark.parametrize("package", ["kinds", "errors", "events", "policy", "stats", "rundir", "config", "cli.report"])
def test_the_pure_packages_import_no_torch_module(package):
    """Every module of the packages that promise no torch reaches only modules that promise the same."""
    graph = import_graph()
    pure = {"safetrain.kinds", "safetrain.errors", "safetrain.events", "safetrain.cli.report", "safetrain.cli.plot"}
    pure |= {m for m in graph if m.split(".")[1:2] in (["policy"], ["stats"], ["rundir"], ["config"])}
    for start in [m for m in graph if m == f"safetrain.{package}" or m.startswith(f"safetrain.{package}.")]:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        assert seen <= pure, f"{start} reaches {sorted(seen - pure)}"


def test_torch_compiles_private_orig_mod_is_read_in_adapters_only():
    """``_orig_mod`` is private to torch.compile's wrapper: one adapter reads it (issue #34)."""
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if any(isinstance(n, ast.Attribute) and n.attr == "_orig_mod" for n in ast.walk(ast.parse(p.read_text())))
    )
    assert readers == ["adapters/compiled.py"]
