"""The README is the front page, short, and still carries the two set-up commands CI runs; the
site's pages are where the manual lives (``mkdocs build --strict`` in CI checks the links)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def command_after(marker: str, text: str) -> str:
    """The first line of the ```bash block after ``<!-- marker -->``, as .ci/run extracts it."""
    lines = text.splitlines()
    at = lines.index(f"<!-- {marker} -->")
    fence = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("```"))
    assert lines[fence] == "```bash", f"the block after <!-- {marker} --> is not a bash block: {lines[fence]!r}"
    return lines[fence + 1]


def test_the_readme_is_a_front_page_of_at_most_200_lines_with_both_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines; the manual is docs/"
    tests, main_job = command_after("tests", text), command_after("main-job", text)
    assert 'pip install -e ".[dev]" -c constraints.txt' in tests and "python -m pytest" in tests, tests
    assert "safetrain demo" in main_job, main_job


def test_every_readme_link_points_at_a_file_of_the_checkout():
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(t.startswith("docs/") for t in targets), "the README links to no page of the site"
    for target in targets:
        if target.startswith(("http://", "https://", "#")):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README links to {target}, which does not exist"


def test_the_sites_front_page_is_the_readme_with_its_links_on_the_site():
    spec = importlib.util.spec_from_file_location("readme_hook", ROOT / "docs" / "hooks" / "readme.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.front_page()
    assert page.startswith("# safetrain") and "<!-- tests -->" in page
    assert "](docs/" not in page and "](quickstart.md)" in page and "](benchmarks.md)" in page
