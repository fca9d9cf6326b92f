"""Every relative link in README.md and docs/*.md resolves to a file of this repository, so a
user's clone can follow each one; none names the development workspace's `../shared` folder,
which a clone does not have (not even as plain text: a path in backticks is followed too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def links(text: str) -> list[str]:
    """Markdown link and image targets outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", text))


def test_link_pattern_finds_links_and_skips_code():
    text = "see [a](docs/x.md#part) and ![b](img/y.png \"t\")\n```\nz = m[i](k)\n```\n"
    assert links(text) == ["docs/x.md#part", "img/y.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    text = page.read_text()
    bad = [line.strip() for line in text.splitlines() if "../shared/" in line
           or "shared/reference/" in line]
    assert not bad, f"{page.name} names the workspace's shared folder: {bad}"
    for target in links(text):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} leaves the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"
