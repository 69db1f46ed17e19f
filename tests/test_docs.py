"""The project's texts speak to its users: the README stays short, every relative link in the README
and docs/ leads to a file, no text cites a work item, review or round, and the package metadata
points nowhere a wheel does not go."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "docs").is_dir():  # pragma: no cover - the tests ship with the clone
    pytest.skip("no docs/ next to the tests", allow_module_level=True)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Citations of our own history (built from pieces so that this file does not match itself).
HISTORY = re.compile("|".join([
    r"\bissues? #?\d", r"#\d+ F\d", r"\breview ?\d", r"\breview\d", r"\breview finding", r"\bsecond review",
    r"\bthird review", r"\bround \d", r"\bround 2\b", r"\bsessions? of round", r"\bprevious session",
    r"\bthis session", r"\bfinding F\d", r"\bfindings F\d", r"\bthis change\b", r"\bthis tree\b",
    r"\bthese changes\b", r"\bthe tree before\b",
]), re.IGNORECASE)
TEXT_FILES = [p for pattern in ("README.md", "docs/*.md", "kvdd/**/*.py", "kvdd/**/*.pyx", "kvdd/**/*.pxi",
                                "tests/**/*.py", "examples/**/*", "benchmarks/**/*.py", "stubs/**/*.pyi",
                                ".ci/*", "pyproject.toml")
              for p in ROOT.glob(pattern) if p.is_file() and p != Path(__file__).resolve()]


def test_readme_is_read_in_one_sitting() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 16 * 1024


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page: Path) -> None:
    missing = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_no_text_cites_our_history() -> None:
    assert len(TEXT_FILES) > 100
    hits = []
    for path in TEXT_FILES:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_history_pattern_catches_citations() -> None:
    for text in ("Targets of issue 15", "issue #11 F1", "review4 F2", "Review 3 of", "round 2 session 4",
                 "the previous session", "(review finding F3)", "commit 1f (before) and this change (after)",
                 "this tree against the tree before these changes"):
        assert HISTORY.search(text), text
    for text in ("per-session key", "a round trip", "issue a FUTEX_WAKE", "reviewed", "a changed tree"):
        assert not HISTORY.search(text), text


def test_package_metadata() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    assert '"Programming Language :: Python :: 3.13",' in text
    found = re.search(r'^readme = "([^"]+)"', text, re.M)
    assert found
    readme = ROOT / found.group(1)
    links = [t for t in LINK.findall(readme.read_text()) if not t.startswith(("http://", "https://"))]
    assert links == [], f"the wheel's long description has relative links: {links}"
