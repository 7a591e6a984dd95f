"""Every file path the README and ``docs/*.md`` name exists (the layout they describe is the tree's), and every
relative Markdown link points at a file that exists. Brace sets (``level{1,2,3}/``) are expanded; globs are skipped."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = "runtime|learner|agents|memory|tools|bench|experiments|tests|docs|packaging"
PATH = re.compile(rf"(?<![\w/.-])((?:{TOP})/[\w./{{}},-]*[\w/}}])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _expand(path: str) -> list[str]:
    """``a/level{1,2}/b`` -> ``a/level1/b``, ``a/level2/b``."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_paths_exist(doc: Path) -> None:
    missing = sorted(
        {p for m in PATH.finditer(doc.read_text()) if "*" not in m.group(1) for p in _expand(m.group(1).rstrip(".,")) if not (ROOT / p).exists()}
    )
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    links = [m.group(1) for m in LINK.finditer(doc.read_text()) if "://" not in m.group(1) and not m.group(1).startswith("mailto:")]
    missing = sorted({link for link in links if not (doc.parent / link).exists()})
    assert not missing, f"{doc.name} links to files that do not exist: {missing}"


def test_brace_sets_expand() -> None:
    assert _expand("agents/tasks/kernels/level{1,2}/") == ["agents/tasks/kernels/level1/", "agents/tasks/kernels/level2/"]
