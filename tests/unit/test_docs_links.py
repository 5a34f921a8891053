"""Every relative link in README.md and docs/**/*.md resolves: the file (or folder) exists and, for
a ``#anchor`` into a markdown file, a heading of that file has that anchor as GitHub renders it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`\n]*`")
#: [text](target) and ![alt](target); the text may hold one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", flags=re.MULTILINE)


def prose(markdown: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    return CODE.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (letters, digits,
    ``_`` and ``-`` kept), each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    return "".join(c for c in text if c.isalnum() or c in "_- ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's ``-1``, ``-2`` for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_slug_follows_github():
    assert slug("The knobs (`recipe/sorl/config/sorl_trainer.yaml`, section `sorl.guard`)") == (
        "the-knobs-recipesorlconfigsorl_traineryaml-section-sorlguard"
    )
    assert slug("CPU kinds: why the demo's numbers differ") == "cpu-kinds-why-the-demos-numbers-differ"
    assert slug("verl's vLLM rollout on CPU (`rollout.name=vllm`)") == "verls-vllm-rollout-on-cpu-rolloutnamevllm"


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## A section\n\n[ok](#a-section) [bad](#nowhere) [gone](missing.md) `[code](x.md)`\n")
    assert relative_links(page) == ["#a-section", "#nowhere", "missing.md"]
    assert broken(page) == ["#nowhere (no such heading)", "missing.md (no such file)"]


def broken(page: Path) -> list[str]:
    found = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            found.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(f"{target} (no such heading)")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken(page) == []
