"""safetrain as a library others depend on (issue 35): the wheel, its metadata, logging, entry points.

A library is typed (``py.typed``), carries its license, declares every package it imports, sets no
level on its loggers (the application does), and runs as ``python -m safetrain``.
"""

from __future__ import annotations

import ast
import email
import importlib.metadata
import io
import logging
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from safetrain import SafeTrainer, load_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "safetrain"

# Imported only when a program already imported it (no dependency): trainer._interactive looks for a kernel.
ALREADY_LOADED_ONLY = {"IPython"}


def _imported_top_levels() -> set:
    """Every top-level module named by an import anywhere in safetrain/ (lazy ones inside functions too)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"safetrain", "__future__"} - ALREADY_LOADED_ONLY


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of the checkout's sources (the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PACKAGE, src / "safetrain", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("safetrain-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_is_typed_licensed_and_versioned_once(wheel):
    names = wheel.namelist()
    assert "safetrain/py.typed" in names, "type checkers ignore the hints without py.typed"
    assert "safetrain/config/presets/default.yaml" in names
    assert any(re.fullmatch(r"safetrain-[^/]+\.dist-info/licenses/LICENSE", n) for n in names), names
    meta = email.message_from_bytes(wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert meta["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in meta.get_all("Classifier")
    urls = {u.split(",")[0] for u in meta.get_all("Project-URL") or []}
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= urls, urls
    assert meta["Keywords"], "keywords"
    import safetrain

    assert meta["Version"] == safetrain.__version__, "the version has one source: safetrain.__version__"


def test_the_wheel_declares_every_package_the_code_imports(wheel):
    """PyYAML was imported by the config loader but never declared (it came through omegaconf)."""
    meta = email.message_from_bytes(wheel.read(next(n for n in wheel.namelist() if n.endswith("METADATA"))))
    declared = {
        re.split(r"[\s;<>=!~\[]", req, maxsplit=1)[0].lower().replace("_", "-") for req in meta.get_all("Requires-Dist")
    }
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_imported_top_levels()):
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"imported but not declared in pyproject.toml (module: distributions): {missing}"


def test_python_m_safetrain_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "safetrain", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "check-config" in out.stdout and "inspect" in out.stdout


def test_import_where_posix_calls_are_missing_fails_with_a_sentence():
    code = "import os; del os.pwrite; import safetrain"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "safetrain needs a POSIX system" in out.stderr, out.stderr


def test_no_library_code_sets_a_logger_level():
    """A library leaves levels to the application: only the command line applies ``log.level``."""
    setters = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).as_posix() == "cli/__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "setLevel":
                setters.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not setters, f"library code sets a logger level: {setters}"


def test_fit_leaves_the_applications_logging_as_it_was():
    """Before: ``fit`` called ``logger.setLevel(cfg.log.level)``, so an application that had quieted
    safetrain (WARNING) got INFO lines again after its first ``fit``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(3)]
    package = logging.getLogger("safetrain")
    before = package.level
    package.setLevel(logging.WARNING)
    try:
        cfg = load_config(None, ["log.level=DEBUG", "log.progress=false"])
        SafeTrainer(model, opt, cfg, loss_fn=torch.nn.functional.mse_loss).fit(data, epochs=1)
        assert package.level == logging.WARNING
        children = [n for n in logging.root.manager.loggerDict if n.startswith("safetrain.")]
        assert children, "every module logs under its own name below safetrain"
        assert all(logging.getLogger(n).level == logging.NOTSET for n in children)
    finally:
        package.setLevel(before)


def test_the_progress_bar_shows_in_a_notebook_and_not_in_piped_output(monkeypatch):
    """Jupyter's stderr is no terminal, but ``tqdm.auto`` draws a widget there (issue 35, point 5)."""
    from safetrain import trainer

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert trainer._progress(True, 1, [1, 2]) is None, "piped output gets no bar"

    kernel_shell = types.SimpleNamespace(kernel=object(), config={})
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: kernel_shell
    monkeypatch.setitem(sys.modules, "IPython", fake)
    bar = trainer._progress(True, 1, [1, 2])
    assert bar is not None, "a Jupyter kernel gets the bar"
    bar.close()
    assert trainer._progress(False, 1, [1, 2]) is None, "log.progress: false still turns it off"

    fake.get_ipython = lambda: types.SimpleNamespace(config={})  # terminal IPython, output piped
    assert trainer._progress(True, 1, [1, 2]) is None
