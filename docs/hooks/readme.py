"""MkDocs hook: the site's front page is the README, so the two cannot drift apart.

``docs/index.md`` is a stub; at build time its text becomes README.md's, with the README's links
to ``docs/*.md`` (and to the benchmarks, the changelog and the license) pointed at the site's
pages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: README link target -> site page (links into docs/ lose the prefix).
LINKS = {
    "benchmarks/README.md": "benchmarks.md",
    "CHANGELOG.md": "changelog.md",
    "docs/": "index.md",
}


def front_page() -> str:
    """README.md with its links made relative to docs/; a link to a file outside docs/ that has
    no page (LICENSE) is left as text."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")

    def link(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if target.startswith(("http://", "https://", "#")):
            return m.group(0)
        if target in LINKS:
            return f"[{label}]({LINKS[target]})"
        if target.startswith("docs/"):
            return f"[{label}]({target[len('docs/') :]})"
        return label

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, text)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: the index page's text is the README's."""
    if page.file.src_uri == "index.md":
        return front_page()
    return markdown
