"""The house rules of the package layout, checked on the source.

* No private name crosses a module. A private name (one leading underscore) is imported only from
  inside the package that owns it: a private module ``a/b/_c.py`` only by modules under
  ``a/b/``, and a private function, class or constant never from another module (shared helpers
  live, public, in a module that owns them).
* Every public module declares ``__all__``, and every name in it exists.
* No module imports a compatibility shim (a module that only re-exports other modules' names):
  the package's own code imports from the module that owns a name.
* Every ``mhanum.x.y`` that a docstring or a comment names exists, and not only through a shim.
* No import cycle between modules, lazy imports (inside functions) included: data flows one way.
  An edge is an import of a module (``from a.b import c`` reaches ``a.b.c`` where that is a
  module, else ``a.b``); a package's ``__init__`` importing its own submodules is not a cycle
  with them unless one of them imports the package's ``__init__`` back.
* The bound engine (``mhanum/bounds/``) stays in small pieces: no module over 800 lines, no
  function body over 120 lines (its docstring not counted), and no signature over 8 parameters
  except the public API's.
* The rest of the package stays readable: no module over 1,000 lines, no function body over 150.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import io
import pathlib
import re
import tokenize
import types

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
    source = "from mhanum.bounds.forward.head import _logits\nfrom mhanum.reference import _dd\n"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: source)
    assert len(_violations(bad)) == 2
    ok = ROOT / "reference" / "_fastref.py"
    monkeypatch.setattr(
        pathlib.Path, "read_text", lambda self: "from mhanum.reference import _dd\n"
    )
    assert _violations(ok) == []


# --------------------------------------------------------------------------------------------
# Every public module declares its public names.

PUBLIC_MODULES = [
    path
    for path in MODULES
    if path.name != "__main__.py"
    and not any(_is_private(part) for part in path.relative_to(ROOT.parent).with_suffix("").parts)
]


def _declared_all(tree: ast.Module) -> list[str] | None:
    """The names of a literal ``__all__`` at the top of a module, or None without one."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node.value, (ast.List, ast.Tuple)), "__all__ is not a literal"
            return [ast.literal_eval(element) for element in node.value.elts]
    return None


def _bound_names(path: pathlib.Path, tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (in ``if``, ``try`` and ``with`` blocks too,
    ``if TYPE_CHECKING:`` imports included), and for a package the names of its submodules."""
    names: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo.extend(ast.iter_child_nodes(node))
    if path.name == "__init__.py":
        names.update(p.stem for p in path.parent.glob("*.py"))
        names.update(p.parent.name for p in path.parent.glob("*/__init__.py"))
    return names


@pytest.mark.parametrize("path", PUBLIC_MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_public_module_declares_all_and_each_name_exists(path):
    tree = ast.parse(path.read_text())
    declared = _declared_all(tree)
    assert declared is not None, f"{_module_name(path)} has no __all__"
    assert [name for name in declared if name not in _bound_names(path, tree)] == []


def test_the_all_rule_reads_what_a_module_binds():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from mhanum.formats import Format\n"
        "X: int = 1\ndef f(): pass\n__all__ = ['Format', 'X', 'f', 'g']\n"
    )
    tree = ast.parse(source)
    declared = _declared_all(tree)
    assert declared == ["Format", "X", "f", "g"]
    assert [n for n in declared if n not in _bound_names(ROOT / "formats.py", tree)] == ["g"]
    assert _declared_all(ast.parse("x = 1\n")) is None
    assert "reference" in _bound_names(ROOT / "__init__.py", ast.parse(""))  # a subpackage


# --------------------------------------------------------------------------------------------
# No module imports a compatibility shim: a module that only re-exports names of other modules.


def _is_shim(path: pathlib.Path) -> bool:
    if path.name == "__init__.py":
        return False  # a package that re-exports its submodules' names is their facade
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    imports = [node for node in body if isinstance(node, ast.ImportFrom)]
    rest = [
        node
        for node in body
        if not isinstance(node, ast.ImportFrom | ast.Import) and not _is_warning(node)
    ]
    return bool(imports) and len(rest) == 1 and _declared_all(ast.Module(rest, [])) is not None


def _is_warning(node: ast.stmt) -> bool:
    """``warnings.warn(...)``: a deprecated alias warns on import and is a shim all the same."""
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "warnings.warn"
    )


SHIMS = {_module_name(path) for path in MODULES if _is_shim(path)}


def _origin(package: str, name: str) -> str:
    """What ``from package import name`` imports: the origin of the package's own binding of
    ``name`` (its ``__init__`` may bind a function of the same name as a submodule), else the
    submodule ``package.name``."""
    init = ROOT.parent / package.replace(".", "/") / "__init__.py"
    if init.exists():
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return f"{node.module}.{alias.name}"
    return f"{package}.{name}"


def _shim_imports(path: pathlib.Path) -> list[str]:
    """The imports of a shim (and uses of one as ``mhanum.<shim>``) anywhere in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [node.module] + [_origin(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            targets = [_origin(node.value.id, node.attr)] if node.value.id == "mhanum" else []
        else:
            continue
        found += [f"line {node.lineno}: {t}" for t in targets if t in SHIMS]
    return found


def test_the_shims_are_found():
    assert {"mhanum.attention", "mhanum.summation", "mhanum.tensorcore", "mhanum.measure"} <= SHIMS


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_imports_a_shim(path):
    name = _module_name(path)
    if name in SHIMS:
        return
    found = _shim_imports(path)
    if name == "mhanum":  # the package exposes its shims as attributes, lazily
        found = [f for f in found if f.partition(": ")[2].rpartition(".")[0] != name]
    assert found == []


def test_the_shim_rule_catches_what_it_forbids(monkeypatch):
    source = (
        "import mhanum\nfrom mhanum import attention, summation\n"
        "def f():\n    from mhanum.tensorcore import matmul\n    return mhanum.summation.sum\n"
    )
    read = pathlib.Path.read_text
    monkeypatch.setattr(
        pathlib.Path, "read_text", lambda self: source if self.name == "demo.py" else read(self)
    )
    assert _shim_imports(ROOT / "demo.py") == [
        "line 2: mhanum.summation",
        "line 4: mhanum.tensorcore",
        "line 5: mhanum.summation",
    ]


# --------------------------------------------------------------------------------------------
# Every ``mhanum.x.y`` that a docstring or a comment names exists, at its owner's path.

_DOTTED = re.compile(r"(?::(\w+):`~?)?(?<![\w.])(mhanum(?:\.\w+)+)")
# The optional frameworks: a module that imports one is read, not imported, so that this test
# neither needs them installed nor pays for loading them.
_FRAMEWORKS = ("torch", "tensorflow", "keras", "flax", "transformers")


def _references(path: pathlib.Path) -> set[tuple[str, str]]:
    """``(role, name)`` for each dotted ``mhanum...`` name in a module's docstrings (attribute
    docstrings included) and comments; the role is ``mod`` in ``:mod:`mhanum.x```, else ``""``
    or another role."""
    source = path.read_text()
    texts = [
        node.value.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    lines = io.StringIO(source).readline
    texts += [t.string for t in tokenize.generate_tokens(lines) if t.type == tokenize.COMMENT]
    return {match for text in texts for match in _DOTTED.findall(text)}


def _module_path(name: str) -> pathlib.Path | None:
    base = ROOT.parent / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _imports_a_framework(path: pathlib.Path) -> bool:
    return any(
        (alias.name if isinstance(node, ast.Import) else node.module or "").partition(".")[0]
        in _FRAMEWORKS
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    )


class _Source:
    """A module known from its source: the names it binds, and anything below them."""

    def __init__(self, path: pathlib.Path) -> None:
        self.names = _bound_names(path, ast.parse(path.read_text()))


_BELOW_SOURCE = object()  # an attribute of a module known from its source, or below one


def _attribute(parent: object, name: str) -> object:
    if parent is _BELOW_SOURCE or (isinstance(parent, _Source) and name in parent.names):
        return _BELOW_SOURCE
    fields = (
        dataclasses.fields(parent)
        if isinstance(parent, type) and dataclasses.is_dataclass(parent)
        else ()
    )
    if name in {field.name for field in fields}:
        return _BELOW_SOURCE  # a field without a default is no class attribute
    return getattr(parent, name)


def _is_module(obj: object) -> bool:
    return isinstance(obj, (types.ModuleType, _Source))


def _is_shim_module(obj: object) -> bool:
    return isinstance(obj, types.ModuleType) and obj.__name__ in SHIMS


@functools.cache
def _lookup(dotted: str) -> tuple[tuple[object, bool], ...]:
    """What ``dotted`` can name, each with whether the way to it goes through a shim: a package
    attribute and a submodule may share a name (``mhanum.attention``)."""
    parent, _, name = dotted.rpartition(".")
    found = []
    for obj, via_shim in _lookup(parent) if parent else ():
        with contextlib.suppress(AttributeError):
            value = _attribute(obj, name)
            found.append((value, via_shim or _is_shim_module(obj) or _is_shim_module(value)))
    path = _module_path(dotted)
    if path is not None:
        module = _Source(path) if _imports_a_framework(path) else importlib.import_module(dotted)
        found.append((module, dotted in SHIMS))
    return tuple(found)


def _unresolved(dotted: str, role: str = "") -> str | None:
    """Why ``dotted`` names nothing (no module, with the role ``mod``), or names it only through
    a compatibility shim; None if it resolves."""
    found = [(obj, via) for obj, via in _lookup(dotted) if role != "mod" or _is_module(obj)]
    if not found:
        return f"{dotted}: no such {'module' if role == 'mod' else 'module or attribute'}"
    if all(via_shim for _, via_shim in found):
        return f"{dotted}: named through a compatibility shim"
    return None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_dotted_names_in_docstrings_and_comments_resolve(path):
    problems = [why for role, name in sorted(_references(path)) if (why := _unresolved(name, role))]
    assert problems == []


def test_the_dotted_name_rule_catches_what_it_forbids():
    through_shim = "named through a compatibility shim"
    assert _unresolved("mhanum.attention") is None  # the function
    assert _unresolved("mhanum.attention", "mod") == f"mhanum.attention: {through_shim}"
    assert _unresolved("mhanum.emulate.summation.sum") is None
    assert _unresolved("mhanum.summation.sum") == f"mhanum.summation.sum: {through_shim}"
    assert _unresolved("mhanum.summation", "mod") == f"mhanum.summation: {through_shim}"
    assert _unresolved("mhanum.Numerics.summation") is None  # a dataclass field
    assert _unresolved("mhanum.adapters.torch.load") is None  # read from the source
    assert _unresolved("mhanum.adapters.torch.nothing") is not None
    assert _unresolved("mhanum._dd.matmul") == "mhanum._dd.matmul: no such module or attribute"
    assert _unresolved("mhanum.formats.round_to", "mod") is not None
    source = ":mod:`~mhanum.summation` and :func:`mhanum.reference._dd.add`.\n"
    assert set(_DOTTED.findall(source)) == {
        ("mod", "mhanum.summation"),
        ("func", "mhanum.reference._dd.add"),
    }


# --------------------------------------------------------------------------------------------
# No import cycle, lazy imports included.

NAMES = {_module_name(path): path for path in MODULES}


def _owner(name: str, names: set[str]) -> str | None:
    """The module ``name`` is, or the innermost module that holds it as an attribute."""
    while name and name not in names:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """Every mhanum module ``path`` imports, at its top or inside a function."""
    here = _package_of(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in (_owner(x, names) for x in targets if x.startswith("mhanum")) if t}
    return found - {_module_name(path)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle_lazy_imports_included():
    names = set(NAMES)
    graph = {name: _imports(path, names) for name, path in NAMES.items()}
    assert import_cycles(graph) == []


def test_the_cycle_rule_catches_what_it_forbids():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    # an import inside a function counts: the audit runs the Hugging Face adapter lazily
    audit = _imports(ROOT / "models" / "_audit.py", set(NAMES))
    assert "mhanum.adapters.transformers" in audit


ANY_BUDGET = 408


def _bare_any_annotations(tree: ast.Module) -> int:
    """The parameters (``*args`` and ``**kwargs`` included) and returns annotated with the bare
    name ``Any``; ``list[Any]`` and the like are not counted."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            for annotation in [*(p.annotation for p in params), node.returns]:
                count += isinstance(annotation, ast.Name) and annotation.id == "Any"
    return count


def test_signatures_annotate_few_parameters_as_bare_any():
    """At most ``ANY_BUDGET`` parameters and returns in the package are annotated with the bare
    ``Any``: the others name their types (the array aliases of ``mhanum/_types.py``, the
    package's classes, ``object`` for a value that is only inspected). Counted on the source
    with :mod:`ast`: every ``def`` under ``mhanum/``, each parameter whose annotation is exactly
    the name ``Any``, and each return annotated so. ``Any`` stays where a value is arbitrary
    (``**kwargs`` forwarded as they are, JSON values)."""
    per_module = {
        _module_name(path): n
        for path in MODULES
        if (n := _bare_any_annotations(ast.parse(path.read_text())))
    }
    total = sum(per_module.values())
    worst = sorted(per_module.items(), key=lambda item: -item[1])[:5]
    assert total <= ANY_BUDGET, f"{total} bare Any annotations (most in {worst})"


def test_the_any_count_reads_parameters_and_returns():
    source = (
        "def f(a: Any, *b: Any, c: list[Any], d: int, **e: Any) -> Any:\n"
        "    def g(x: Any) -> None: ...\n"
        "async def h(y: object, /, z: Any) -> tuple[Any, int]: ...\n"
    )
    assert _bare_any_annotations(ast.parse(source)) == 6


# --------------------------------------------------------------------------------------------
# The bound engine in small pieces: one module per theorem, one function per proof step.

MAX_MODULE_LINES = 800
MAX_BODY_LINES = 120
MAX_PARAMETERS = 8
# The public API keeps its keyword signatures: the names exported by the package.
PUBLIC_API = frozenset(mhanum.__all__) | frozenset(importlib.import_module("mhanum.bounds").__all__)


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function from its first statement after the docstring to its end."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    end = node.end_lineno or node.lineno
    return end - body[0].lineno + 1 if body else 0


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters of a signature, ``*args`` and ``**kwargs`` included, ``self`` and ``cls``
    not."""
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    return sum(p.arg not in ("self", "cls") for p in params)


@dataclasses.dataclass(frozen=True)
class SizeLimits:
    """The most lines a module, a function body and (with ``parameters``) a signature may hold."""

    module: int
    body: int
    parameters: int | None = None


BOUND_ENGINE = SizeLimits(MAX_MODULE_LINES, MAX_BODY_LINES, MAX_PARAMETERS)
PACKAGE = SizeLimits(1_000, 150)


def size_offenders(
    name: str,
    source: str,
    public: frozenset[str] = PUBLIC_API,
    limits: SizeLimits = BOUND_ENGINE,
) -> list[str]:
    """What breaks ``limits`` in the module ``name`` of the source ``source``: the module's
    length, each function's body and each signature but a public function's (a module-level
    ``def`` whose name ``public`` holds)."""
    found = []
    lines = len(source.splitlines())
    if lines > limits.module:
        found.append(f"{name}: {lines} lines (at most {limits.module})")
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        where = f"{name}:{node.lineno} {node.name}"
        if (body := _body_lines(node)) > limits.body:
            found.append(f"{where}: body of {body} lines (at most {limits.body})")
        if limits.parameters is None or (id(node) in top and node.name in public):
            continue
        if (n := _parameters(node)) > limits.parameters:
            found.append(f"{where}: {n} parameters (at most {limits.parameters})")
    return found


def test_bound_engine_size_limits():
    """Every module of ``mhanum/bounds/`` holds at most 800 lines, every function body at most 120
    (from its first statement after the docstring to its end), and every signature at most 8
    parameters (``self`` and ``cls`` not counted) except the public API's (the names of
    ``mhanum.__all__`` and ``mhanum.bounds.__all__``, which keep their keyword arguments): a
    longer step is split into the steps of its proof, and arguments that travel together are
    one value."""
    offenders = [
        found
        for path in MODULES
        if path.is_relative_to(ROOT / "bounds")
        for found in size_offenders(_module_name(path), path.read_text())
    ]
    assert offenders == [], "over the bound engine's size limits:\n" + "\n".join(offenders)


def test_the_size_rule_catches_what_it_forbids():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_BODY_LINES))
    docstring = '    """What it computes.\n\n    Over\n    several\n    lines.\n    """\n'
    source = (
        f"def short(a, b, c, d, e, f, g, h):\n{docstring}{body}"  # 120 lines after the docstring
        f"def long(self, a):\n{body}    return a\n"
        "def wide(a, b, c, d, e, f, g, h, *, i):\n    pass\n"
        "def public(a, b, c, d, e, f, g, h, i):\n    pass\n"
        "class C:\n    def public(self, a, b, c, d, e, f, g, h, i):\n        pass\n"
    )
    found = size_offenders("demo", source, frozenset({"public"}))
    assert found == [
        "demo:128 long: body of 121 lines (at most 120)",
        "demo:250 wide: 9 parameters (at most 8)",
        "demo:255 public: 9 parameters (at most 8)",  # a method: not the public function
    ]
    assert size_offenders("demo", "x = 1\n" * 801) == ["demo: 801 lines (at most 800)"]


def test_package_size_limits():
    """Every module of ``mhanum/`` holds at most 1,000 lines and every function body at most
    150 (from its first statement after the docstring to its end); the bound engine's tighter
    limits are :func:`test_bound_engine_size_limits`'."""
    offenders = [
        found
        for path in MODULES
        for found in size_offenders(_module_name(path), path.read_text(), limits=PACKAGE)
    ]
    assert offenders == [], "over the package's size limits:\n" + "\n".join(offenders)


def test_the_package_size_rule_reads_its_own_limits():
    body = "".join(f"    x{i} = {i}\n" for i in range(PACKAGE.body))
    source = f"def short(a, b, c, d, e, f, g, h, i, j):\n{body}def long():\n{body}    pass\n"
    assert size_offenders("demo", source, limits=PACKAGE) == [
        f"demo:{PACKAGE.body + 2} long: body of {PACKAGE.body + 1} lines (at most {PACKAGE.body})"
    ]
    assert size_offenders("demo", "x = 1\n" * 1_001, limits=PACKAGE) == [
        "demo: 1001 lines (at most 1000)"
    ]
