"""The README's and docs' relative links lead somewhere: every linked file exists, and
every #anchor names a heading (GitHub's rule: lower case, punctuation dropped, spaces
as hyphens) or an explicit ``<a id="...">`` of the page it points into."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "docs" / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    headings = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
    return headings | set(re.findall(r'<a id="([^"]+)"', text))


def _broken(page: pathlib.Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such anchor")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert _broken(page) == []


def test_the_check_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A heading\n\n[ok](#a-heading) [gone](b.md) "
                                   "[no anchor](#elsewhere)\n```\n[in code](c.md)\n```\n")
    assert _broken(tmp_path / "a.md") == ["b.md: no such file", "#elsewhere: no such anchor"]
