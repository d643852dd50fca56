"""The house rules of the package layout, checked on the source: no private name crosses a module.

A private name (one leading underscore) is imported only from inside the package that owns it: a
private module ``a/b/_c.py`` only by modules under ``a/b/``, and a private function, class or
constant never from another module (shared helpers live, public, in a module that owns them).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import mhanum

ROOT = pathlib.Path(mhanum.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: pathlib.Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to itself)."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _violations(path: pathlib.Path) -> list[str]:
    here = _package_of(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("mhanum"):
                continue
            parts = target.split(".")
            for i, part in enumerate(parts):
                if not _is_private(part):
                    continue
                owner = ".".join(parts[:i])
                module = ".".join(parts[: i + 1])
                is_module = (ROOT.parent / (module.replace(".", "/") + ".py")).exists() or (
                    ROOT.parent / module.replace(".", "/") / "__init__.py"
                ).exists()
                inside = here == owner or here.startswith(owner + ".")
                if not (is_module and inside):
                    found.append(f"line {node.lineno}: {target}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_private_name_is_imported_across_modules(path):
    assert _violations(path) == []


def test_the_rule_catches_what_it_forbids(tmp_path, monkeypatch):
    bad = ROOT / "bounds" / "heads.py"
    source = "from mhanum.bounds.attention import _head\nfrom mhanum.reference import _dd\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source)
    assert len(_violations(bad)) == 2
    ok = ROOT / "reference" / "_fastref.py"
    monkeypatch.setattr(
        pathlib.Path, "read_text", lambda self: "from mhanum.reference import _dd\n"
    )
    assert _violations(ok) == []
