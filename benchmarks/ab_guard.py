"""The guarded step of several commits side by side, in one process, interleaved step by step.

A change to the guard's per-step path moves the tiny model's ratio by 0.01-0.03, while this
shared machine's speed moves ratios from one run to the next by as much. Comparing two runs of
``fit_overhead.py`` therefore says little; this script loads the ``safetrain`` package of each
commit under its own name (``git archive`` into a temporary folder; the package's imports are
all relative) and registers ``g_<name>`` (default config, eager) and ``gl_<name>`` (lazy) for
each, so every version runs in the same rounds as the plain loop and the detectors.

Run::

    .venv/bin/python benchmarks/ab_guard.py --refs before=HEAD~3,now=WORKTREE \\
        --models tiny --variants lazy,gl_before,gl_now,g_before,g_now --seconds 40

``WORKTREE`` is the working tree's ``safetrain/`` as it is (uncommitted changes included); other
refs are anything ``git archive`` takes. The remaining options are ``overhead.py``'s.
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

import argparse  # noqa: E402
import importlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

import overhead  # noqa: E402
from fit_overhead import guard_variant  # noqa: E402
from overhead import register_variant  # noqa: E402


def load_version(name: str, ref: str, into: Path) -> ModuleType:
    """Import ``safetrain`` as of ``ref`` under the name ``st_<name>``."""
    dst = into / f"st_{name}"
    if ref == "WORKTREE":
        shutil.copytree(REPO / "safetrain", dst, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        dst.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ref, "safetrain"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dst), "--strip-components=1"], input=archive, check=True)
    return importlib.import_module(f"st_{name}")


def register(name: str, package: ModuleType) -> None:
    """Register ``g_<name>`` and ``gl_<name>``: that version's ``Guard.step`` in eager and lazy mode."""
    for mode, variant in (("eager", f"g_{name}"), ("lazy", f"gl_{name}")):
        register_variant(variant)(lambda s, mode=mode: guard_variant(s, mode, package))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument(
        "--refs", required=True, help="name=ref pairs, comma-separated (ref WORKTREE: the working tree)"
    )
    args, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="safetrain-ab-") as tmp:
        sys.path.insert(0, tmp)
        for pair in args.refs.split(","):
            name, _, ref = pair.partition("=")
            if not name.isidentifier() or not ref:
                parser.error(f"--refs: got {pair!r}; expected name=ref with a Python identifier as the name")
            register(name, load_version(name, ref, Path(tmp)))
        return overhead.main(rest)


if __name__ == "__main__":
    sys.exit(main())
