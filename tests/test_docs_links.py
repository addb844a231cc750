"""Every relative link in README.md and docs/ points at a file that exists, and every #anchor at a heading there."""

import re
from pathlib import Path

import pytest
from helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str, inline_code: bool = False) -> str:
    """The page without its fenced code blocks and (unless ``inline_code``) its inline code: code holds no links."""
    kept, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            kept.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``: lower case, punctuation dropped, spaces as dashes."""
    found, seen = set(), {}
    for line in _prose(page.read_text(), inline_code=True).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(
                f"{target}: no such file "
                f"{destination.relative_to(ROOT) if destination.is_relative_to(ROOT) else destination}"
            )
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: {destination.name} has no heading with the anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_checker_sees_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Top: A page\n\n## Install `hasten`\n\nsee [x](other.md#part) and "
        "[y](#install-hasten)\n```\n[z](nope.md)\n```\n"
    )
    assert links(page) == ["other.md#part", "#install-hasten"]
    assert anchors(page) == {"top-a-page", "install-hasten"}
