"""Every relative link in README.md and docs/*.md points at a file that exists, and its #anchor at a heading of that
file, slugged as the code host slugs them (lower case, punctuation dropped, spaces to hyphens)."""

import re

import pytest
from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading):
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())  # a '#' line in a code block is no heading
    return {slug(m[1]) for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)}


def links(path):
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def broken_links(page):
    """Each relative link of `page` whose file or heading is not there, said as the failure says it."""
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            broken.append(f"{target}: no heading #{anchor} in {where}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, broken


def test_the_checker_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` title\n\n[ok](#a-code-title) [bad](#nope) [gone](missing.md)\n")
    assert anchors(page) == {"a-code-title"}
    assert links(page) == ["#a-code-title", "#nope", "missing.md"]
    assert broken_links(page) == ["#nope: no heading #nope in page.md",
                                  f"missing.md: no file {tmp_path / 'missing.md'}"]
