"""The root conftest's table of modules that need an optional dependency: complete (every module
of ``mhanum/`` whose import needs a package beyond mhanum's dependencies and the ``test`` extra
is in it, and nothing else), and obeyed (such a module is collected as a skip that names the
missing package, where the doctest plugin would fail to import it)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

import conftest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mhanum"


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _present_wherever_tests_run() -> set[str]:
    """Top-level import names of mhanum's dependencies and of its ``test`` extra (installed)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    required = {_normalized(Requirement(r).name) for r in requirements}
    return {
        name
        for name, distributions in importlib.metadata.packages_distributions().items()
        if required & {_normalized(d) for d in distributions}
    }


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(
        isinstance(n, ast.Name) and n.id in {"ImportError", "ModuleNotFoundError"} for n in names
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(nodes: Iterable[ast.AST]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: not those in function bodies,
    under ``if TYPE_CHECKING:``, or guarded by an ``except ImportError``."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found += _import_time_imports(node.orelse)
        elif isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers)):
            found += _import_time_imports([*node.handlers, *node.orelse, *node.finalbody])
        else:
            found += _import_time_imports(ast.iter_child_nodes(node))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(statement: ast.Import | ast.ImportFrom, module: str, path: Path) -> list[str]:
    """Absolute dotted names of what the statement imports (``from a import b``: ``a`` and, when
    ``b`` is a submodule, ``a.b``)."""
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = statement.module or ""
    if statement.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(statement.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".rstrip(".")
    return [base, *(f"{base}.{alias.name}" for alias in statement.names)]


def _needs() -> dict[str, set[str]]:
    """Module path (relative to the root) -> the packages outside mhanum's dependencies that its
    import needs, directly or through the mhanum modules it imports."""
    present = _present_wherever_tests_run() | set(sys.stdlib_module_names) | {"mhanum"}
    paths = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    direct: dict[str, set[str]] = {}
    internal: dict[str, set[str]] = {}
    for module, path in paths.items():
        names = [
            name
            for statement in _import_time_imports(ast.parse(path.read_text(), str(path)).body)
            for name in _imported_names(statement, module, path)
        ]
        direct[module] = {n.partition(".")[0] for n in names} - present
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first
        internal[module] = {
            ".".join(n.split(".")[:i])
            for n in names
            for i in range(1, n.count(".") + 2)
            if ".".join(n.split(".")[:i]) in paths
        } - {module}

    def closure(module: str, seen: set[str]) -> set[str]:
        seen.add(module)
        needs = set(direct[module])
        for other in internal[module] - seen:
            needs |= closure(other, seen)
        return needs

    return {
        path.relative_to(ROOT).as_posix(): needs
        for module, path in paths.items()
        if (needs := closure(module, set()))
    }


def test_the_table_lists_every_module_that_needs_an_optional_package() -> None:
    needs = _needs()
    table = conftest.OPTIONAL_DEPENDENCIES
    assert sorted(needs) == sorted(table), (
        "conftest.OPTIONAL_DEPENDENCIES: expected the modules whose import needs a package "
        f"outside mhanum's dependencies, {needs}, got {sorted(table)}"
    )
    for module, packages in needs.items():
        assert packages <= set(table[module]), (
            f"conftest.OPTIONAL_DEPENDENCIES[{module!r}]: expected at least {sorted(packages)}, "
            f"got {table[module]}"
        )


def test_a_module_whose_package_is_missing_is_skipped_with_the_reason() -> None:
    """Collected in a process where every optional package fails to import (``sys.modules[name]
    = None``: ``find_spec`` returns None and ``import`` raises), installed or not."""
    blocked = sorted({p for packages in conftest.OPTIONAL_DEPENDENCIES.values() for p in packages})
    modules = sorted(conftest.OPTIONAL_DEPENDENCIES)
    run = (
        "import sys, pytest\n"
        f"sys.modules.update(dict.fromkeys({blocked!r}))\n"
        f"sys.exit(pytest.main(['--collect-only', '-q', '-rs', '-p', 'no:cacheprovider', "
        f"'-p', 'no:xdist', *{modules!r}]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", run],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 5, result.stdout + result.stderr  # 5: no tests collected
    for module, packages in conftest.OPTIONAL_DEPENDENCIES.items():
        assert f"{module} needs {', '.join(packages)} (not installed)" in result.stdout, (
            result.stdout
        )
