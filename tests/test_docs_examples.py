"""Every ```python block of every docs page runs, in order, one namespace per page.

A page that begins with ``<!-- requires: mod1 mod2 -->`` is skipped when one of those modules
is not importable (framework tutorials); a page holding ``<!-- slow -->`` is marked slow (as are
the pages in ``SLOW``, which build reports or measure). Pages run with the working directory set to a fresh
temporary directory holding a link to ``papers/``, so examples may read the committed
measurements and write files without touching the repository.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"\A<!--\s*requires:\s*([\w.\s]+?)\s*-->")
SLOW = {"getting-started.md", "report.md", "tutorials/devices.md"}  # build reports / measure


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def _param(page: Path) -> object:
    name = page.relative_to(DOCS).as_posix()
    marks = [pytest.mark.slow] if name in SLOW or "<!-- slow -->" in page.read_text() else []
    return pytest.param(page, id=name, marks=marks)


@pytest.mark.parametrize("page", [_param(p) for p in PAGES if _blocks(p)])
def test_python_blocks_run(page, tmp_path, monkeypatch):
    found = REQUIRES.match(page.read_text())
    if found:
        missing = [m for m in found.group(1).split() if importlib.util.find_spec(m) is None]
        if missing:
            pytest.skip(f"{page.name} requires {', '.join(missing)}")
    (tmp_path / "papers").symlink_to(ROOT / "papers")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, source in _blocks(page):
        # Blank lines keep tracebacks pointing at the page's own line numbers.
        code = compile("\n" * (line - 1) + source, str(page), "exec")
        exec(code, namespace)  # noqa: S102


def test_the_pages_with_examples_are_found():
    names = {p.relative_to(DOCS).as_posix() for p in PAGES if _blocks(p)}
    assert {"tutorials/heads.md", "tutorials/mask-constants.md", "getting-started.md"} <= names
