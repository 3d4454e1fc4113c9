"""The documentation site: the API reference names every public name, and every page is in
the navigation (``mkdocs build --strict`` in the test command builds it)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import fsdp_builder

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
DIRECTIVE = re.compile(r"^:::\s+fsdp_builder\.(?P<name>\w+)\s*$", re.M)
NAV_PAGE = re.compile(r"^\s*-\s+(?:[^:\n]+:\s+)?(?P<page>[\w/]+\.md)\s*$", re.M)


def api_names() -> list[str]:
    """Names documented with ``::: fsdp_builder.Name`` in docs/api/*.md."""
    return [
        m["name"]
        for page in sorted(DOCS.glob("api/*.md"))
        for m in DIRECTIVE.finditer(page.read_text())
    ]


def test_api_reference_lists_every_public_name_once() -> None:
    names = api_names()
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    assert not duplicates, f"documented twice: {duplicates}"
    public = set(fsdp_builder.__all__)
    assert public - set(names) == set(), "public names missing from docs/api/*.md"
    assert set(names) - public == set(), "docs/api/*.md documents names that are not public"


def test_every_page_is_in_the_navigation() -> None:
    nav = set(NAV_PAGE.findall((REPO / "mkdocs.yml").read_text()))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == nav


def test_the_docs_site_is_built_by_the_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "pytest -q" in line)
    assert "mkdocs build --strict -q && pytest -q" in command
    assert command in (REPO / ".ci" / "run").read_text()
