"""Every ```python block of every docs page (and of ``papers/measurements/README.md``) runs, in
order, one namespace per page, and prints what the page says it prints.

A page that begins with ``<!-- requires: mod1 mod2 -->`` is skipped when one of those modules
is not importable (framework tutorials); a page holding ``<!-- slow -->`` is marked slow (as are
the pages in ``SLOW``, which build reports or measure). Pages run with the working directory set to a fresh
temporary directory holding a link to ``papers/``, so examples may read the committed
measurements and write files without touching the repository.

A ```python block that starts worker processes (``parallel.dask_executor``,
``parallel.default_executor``, Dask's ``LocalCluster``, a ``ProcessPoolExecutor``), or that holds
``if __name__ == "__main__":``, is a script: it is saved to a file and run by a fresh interpreter,
as its reader would run it: Dask and ``mhanum.parallel`` spawn their processes, and a spawned
process imports the main module, running again whatever that guard does not protect. A script
shares no names with the page's other blocks.

A page holding ``<!-- torch CPU kernels: AVX2 -->`` shows what PyTorch prints with those CPU
kernels: torch picks its vectorised kernels (softmax, ``exp``, reductions) by the instruction set
it finds, so its float32 rounding errors differ between, say, AVX2 and AVX-512 CPUs, and the page
says so beside the figures. Its examples run where torch uses those kernels: here if it does,
else in a fresh interpreter with ``ATEN_CPU_CAPABILITY`` naming them, or not at all (a skip
naming the instruction set) where the CPU has no such kernels.

Printed output is checked where a page shows it, in a ```text block that follows, with nothing
but blank lines between:

* a ```python block: the text block is what the block prints (its standard output);
* a ```bash block holding one ``mhanum ...`` command: what the command prints (run in-process,
  with ``mhanum.cli.main``);
* a line ``<!-- output of: mhanum ... -->`` right before the text block: what that command prints
  (for output shown apart from its command, as in the README's set-up).

The pages show what an AMD CPU with AVX-512 prints (:data:`SHOWN_ON`). The frameworks' float32
kernels (XLA's, oneDNN's, MKL's) sum in orders of their own per instruction set, so a measured
rounding error may print other figures on another CPU. MKL, torch's float32 matmul, picks its
kernels by the CPU's maker as well as by its instruction set (with torch's own kernels held at
AVX2, an Intel AVX-512 CPU prints other figures than the AMD one), so an Intel CPU with AVX-512
counts as an instruction set of its own (``avx512-intel``). Where a CPU prints other output, it
is recorded in ``tests/data/shown_outputs/<instruction set>.json`` beside the output the page
shows, and a run on such a CPU checks against that record (:func:`shown_here`);
``python -m tests.test_docs_examples --record PAGE...`` records what this CPU prints where it
differs. A record whose page no longer shows its output is stale, and a test says so.

The text must match line by line, with runs of spaces counted as one, except for the figures:
a figure printed with a decimal point or an exponent matches within one unit in its last printed
digit (so a figure is checked exactly as far as the page prints it, and a value on the rounding
boundary of its last digit still matches); an integer matches exactly; a figure followed by
``s`` (seconds) is a duration and matches any number. A line ``...`` matches any number of lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import io
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [
    *sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts),
    ROOT / "papers" / "measurements" / "README.md",  # the records' figures, on the site
]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
REQUIRES = re.compile(r"\A<!--\s*requires:\s*([\w.\s]+?)\s*-->")
SLOW = {"getting-started.md", "report.md", "tutorials/devices.md"}  # build reports / measure
SCRIPT = re.compile(
    r"^if __name__ == [\"']__main__[\"']:|"
    r"\b(?:dask_executor|default_executor|LocalCluster|ProcessPoolExecutor)\(",
    re.MULTILINE,
)
TORCH_KERNELS = re.compile(r"<!--\s*torch CPU kernels:\s*(\w+)\s*-->")
NO_SUCH_KERNELS = 3  # the exit status of ``python -m tests.test_docs_examples`` on such a CPU
SHOWN_ON = "avx512"  # the instruction set of the CPU whose output the pages show
VARIANTS = ROOT / "tests" / "data" / "shown_outputs"  # <instruction set>.json: what others print

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
OUTPUT_OF = re.compile(r"<!--\s*output of:\s*(mhanum\b[^\n]*?)\s*-->\s*\Z")
FIGURE = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")
DURATION = re.compile(r"\s?s\b")


@dataclasses.dataclass(frozen=True)
class Example:
    """A runnable block of a page: Python source, or a ``mhanum`` command line; and the output
    the page shows for it (None when it shows none)."""

    kind: str  # "python", "script" (a python block run as a saved file) or "command"
    source: str
    line: int  # the first line of the source in the page (1-based)
    expected: str | None


def examples(text: str) -> list[Example]:
    """The page's Python blocks and shown commands, in order, each with its shown output."""
    fences = [
        (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2, m.start(), m.end())
        for m in FENCE.finditer(text)
    ]
    found: list[Example] = []
    for i, (lang, body, line, start, _) in enumerate(fences):
        following = fences[i + 1] if i + 1 < len(fences) else None
        shown = None
        if following and following[0] == "text" and not text[fences[i][4] : following[3]].strip():
            shown = following[1]
        if lang == "python":
            found.append(Example("script" if SCRIPT.search(body) else "python", body, line, shown))
        elif lang in ("bash", "sh", "") and shown is not None:
            commands = [c for c in body.splitlines() if c.strip() and not c.startswith("#")]
            if len(commands) == 1 and commands[0].startswith("mhanum "):
                found.append(Example("command", commands[0].split("#")[0].strip(), line, shown))
        elif lang == "text":
            before = text[fences[i - 1][4] if i else 0 : start]
            comment = OUTPUT_OF.search(before)
            if comment:
                found.append(Example("command", comment.group(1), line, body))
    return found


def _figure_matches(expected: str, actual: str) -> bool:
    if expected == actual:
        return True
    mantissa = re.split(r"[eE]", expected.lstrip("+-"))[0]
    if "." not in mantissa and not re.search(r"[eE]", expected):
        return False  # an integer is exact
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exponent = int(re.split(r"[eE]", expected)[1]) if re.search(r"[eE]", expected) else 0
    unit = 10.0 ** (exponent - decimals)
    return math.isclose(float(actual), float(expected), rel_tol=0, abs_tol=unit * (1 + 1e-9))


def _line_matches(expected: str, actual: str) -> bool:
    exp_figs, act_figs = FIGURE.findall(expected), FIGURE.findall(actual)
    if len(exp_figs) != len(act_figs):
        return False
    exp_text, act_text = FIGURE.split(expected), FIGURE.split(actual)
    if [" ".join(t.split()) for t in exp_text] != [" ".join(t.split()) for t in act_text]:
        return False
    for k, (e, a) in enumerate(zip(exp_figs, act_figs, strict=True)):
        if DURATION.match(exp_text[k + 1]):
            continue  # seconds: a duration is not reproducible
        if not _figure_matches(e, a):
            return False
    return True


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def output_matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is what ``expected`` shows (module docstring)."""
    exp, act = _lines(expected), _lines(actual)

    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and _line_matches(exp[i], act[j]) and match(i + 1, j + 1)

    return match(0, 0)


def check_output(expected: str, actual: str, where: str) -> None:
    """Assert that ``actual`` is what the page shows, printing both when it is not."""
    if output_matches(expected, actual):
        return
    exp, act = _lines(expected), _lines(actual)
    first = next(
        (f"\n  shows:  {e}\n  prints: {a}" for e, a in zip(exp, act, strict=False)
         if e != "..." and not _line_matches(e, a)),
        f"\n  {len(exp)} lines shown, {len(act)} printed",
    )  # fmt: skip
    msg = f"{where}: the page shows\n{expected}\nbut the code prints\n{actual}\nfirst difference:{first}"
    raise AssertionError(msg)


PROSE_FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?%?|\d+%)(?![\w.])")


def unprinted_prose_figures(text: str) -> list[tuple[int, str]]:
    """Figures quoted in the prose right after a shown output that the output does not print.

    The prose after a shown output, up to the next code block or heading, reads that output: a
    figure there with a decimal point or a percent sign must be one it prints, unless it follows
    "about" (an order of magnitude) or is code (in backticks). Returns ``(line, figure)`` pairs.
    """
    fences = list(FENCE.finditer(text))
    shown = {e.expected for e in examples(text) if e.expected is not None}
    found: list[tuple[int, str]] = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "text" or fence.group(2) not in shown:
            continue
        end = fences[i + 1].start() if i + 1 < len(fences) else len(text)
        prose = text[fence.end() : end]
        heading = re.search(r"^#", prose, re.MULTILINE)
        prose = prose[: heading.start()] if heading else prose
        prose = re.sub(
            r"`[^`\n]*`|<!--.*?-->", lambda m: " " * len(m.group()), prose, flags=re.DOTALL
        )
        printed = set(FIGURE.findall(fence.group(2)))
        for m in PROSE_FIGURE.finditer(prose):
            figure = m.group(1)
            if prose[: m.start()].rstrip().endswith(("about", "≈", "~")):
                continue
            quoted = figure in fence.group(2) if figure.endswith("%") else figure in printed
            if quoted:
                continue
            line = text.count("\n", 0, fence.end() + m.start()) + 1
            found.append((line, figure))
    return found


def run_command(command: str) -> str:
    """What ``mhanum ...`` prints (``mhanum.cli.main`` in this process)."""
    from mhanum.cli import main

    argv = shlex.split(command)
    assert argv[0] == "mhanum", command
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv[1:])
    assert status == 0, f"{command}: exit status {status}"
    return out.getvalue()


def run_script(path: Path, example: Example) -> str:
    """What a script block prints, saved to a file and run by a fresh interpreter in the working
    directory."""
    with tempfile.TemporaryDirectory() as folder:
        # Blank lines keep tracebacks pointing at the page's own line numbers.
        script = Path(folder) / f"{path.stem}_line_{example.line}.py"
        script.write_text("\n" * (example.line - 1) + example.source)
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, check=False
        )
    if done.returncode != 0:
        msg = f"{path.name}:{example.line}: the script exits {done.returncode}:\n{done.stderr}"
        raise AssertionError(msg)
    return done.stdout


def instruction_set() -> str:
    """This CPU's vector instruction set as far as the frameworks' kernels tell them apart:
    ``"avx512"``, ``"avx512-intel"``, ``"avx2"``, or (no ``/proc/cpuinfo``, another
    architecture) the machine's name."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    flags = set(re.findall(r"\b(avx512f|avx2)\b", info))
    if "avx512f" in flags:
        # MKL picks its float32 products by the CPU's maker too (module docstring)
        return "avx512-intel" if "GenuineIntel" in info else "avx512"
    return "avx2" if "avx2" in flags else platform.machine()


def _variants(isa: str) -> list[dict[str, str]]:
    path = VARIANTS / f"{isa}.json"
    return json.loads(path.read_text()) if path.exists() else []


def shown_here(page: str, shown: str) -> str:
    """What a CPU of this instruction set prints where ``page`` shows ``shown``: the recorded
    variant (module docstring), or ``shown`` itself."""
    isa = instruction_set()
    if isa == SHOWN_ON:
        return shown
    found = [r["prints"] for r in _variants(isa) if r["page"] == page and r["shows"] == shown]
    return found[0] if found else shown


def variant_of(shown: str, printed: str) -> str:
    """The shown output as this CPU prints it: each shown line paired with a printed one of the
    same words (figures aside) takes the printed line where a figure differs; the rest, ``...``
    among them, stays as shown (so a record holds no path or other detail the page elides)."""
    exp, act = _lines(shown), _lines(printed)

    def words(line: str) -> str:
        return " ".join(FIGURE.sub("#", line).split())

    pairs = difflib.SequenceMatcher(None, [words(e) for e in exp], [words(a) for a in act], False)
    out: list[str] = []
    for tag, i1, i2, j1, j2 in pairs.get_opcodes():
        if tag != "equal":
            out += exp[i1:i2]
            continue
        out += [
            e if _line_matches(e, a) else a for e, a in zip(exp[i1:i2], act[j1:j2], strict=True)
        ]
    return "\n".join(out) + "\n"


def page_name(path: Path) -> str:
    """A page's name in the records: its path from the repository's root (else as given)."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def run_examples(
    path: Path,
    found: list[Example],
    namespace: dict[str, object],
    record: list[dict[str, str]] | None = None,
) -> None:
    """Run every example in order in one namespace, checking the output each one shows (with
    ``record``: appending ``{page, shows, prints}`` where the output differs instead)."""
    for example in found:
        where = f"{path.name}:{example.line}"
        out = io.StringIO()
        if example.kind == "python":
            # Blank lines keep tracebacks pointing at the page's own line numbers.
            code = compile("\n" * (example.line - 1) + example.source, str(path), "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)  # noqa: S102
            printed = out.getvalue()
        elif example.kind == "script":
            printed = run_script(path, example)
        else:
            printed = run_command(example.source)
        if example.expected is None:
            continue
        if record is not None:
            if not output_matches(example.expected, printed):
                here = variant_of(example.expected, printed)
                assert output_matches(here, printed), f"{where}: prints another structure"
                record.append({"page": page_name(path), "shows": example.expected, "prints": here})
            continue
        check_output(shown_here(page_name(path), example.expected), printed, where)


def torch_kernels(text: str) -> str | None:
    """The instruction set of the torch CPU kernels whose output the page shows, or None."""
    found = TORCH_KERNELS.search(text)
    return found.group(1).upper() if found else None


def _torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def run_with_kernels(kernels: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m tests.test_docs_examples ARGS...`` in a fresh interpreter whose torch uses
    these CPU kernels (``ATEN_CPU_CAPABILITY``), in this process's environment otherwise."""
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": kernels.lower(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    argv = [sys.executable, "-m", "tests.test_docs_examples", *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)


def run_page(path: Path, kinds: tuple[str, ...]) -> None:
    """Run the page's examples of these kinds (module docstring), where torch uses the CPU
    kernels the page names; a skip where it cannot."""
    text = path.read_text()
    kernels = torch_kernels(text)
    if kernels is None or _torch_capability() == kernels:
        found = [e for e in examples(text) if e.kind in kinds]
        run_examples(path, found, {"__name__": "__main__"})
        return
    done = run_with_kernels(kernels, [str(path), *kinds])
    if done.returncode == NO_SUCH_KERNELS:
        pytest.skip(f"{path.name} shows torch's {kernels} CPU kernels, which this CPU cannot run")
    if done.returncode != 0:
        msg = f"{path.name}, run with torch's {kernels} CPU kernels:\n{done.stderr[-6000:]}"
        raise AssertionError(msg)


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def _name(page: Path) -> str:
    return page.relative_to(DOCS if page.is_relative_to(DOCS) else ROOT).as_posix()


def _param(page: Path) -> object:
    name = _name(page)
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
    run_page(page, ("python", "script", "command"))


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_prose_quotes_only_figures_its_output_prints(page):
    assert unprinted_prose_figures(page.read_text()) == []


def test_the_pages_with_examples_are_found():
    names = {_name(p) for p in PAGES if _blocks(p)}
    assert {
        "tutorials/heads.md",
        "tutorials/mask-constants.md",
        "getting-started.md",
        "papers/measurements/README.md",
    } <= names


def test_the_pages_show_what_their_examples_print():
    """The pages whose prose quotes figures show the output those figures come from."""
    shown = {
        _name(p) for p in PAGES if any(e.expected is not None for e in examples(p.read_text()))
    }
    assert {
        "tutorials/heads.md",
        "tutorials/mask-constants.md",
        "tutorials/pytorch-vs-tensorflow.md",
        "tutorials/devices.md",
        "frameworks.md",
        "numerics.md",
        "search.md",
        "audit.md",
        "scaleout.md",
        "papers/measurements/README.md",
    } <= shown


def test_the_recorded_variants_belong_to_outputs_the_pages_show():
    """A variant recorded for another CPU replaces a shown output the page still shows, for a
    page that exists: a stale record fails here, on every CPU."""
    for path in sorted(VARIANTS.glob("*.json")):
        for record in json.loads(path.read_text()):
            page = ROOT / record["page"]
            assert page.is_file(), f"{path.name}: no page {record['page']}"
            shown = {e.expected for e in examples(page.read_text())}
            assert record["shows"] in shown, (
                f"{path.name}: {record['page']} no longer shows\n{record['shows']}\nrecord the"
                f" page again on such a CPU (module docstring), or delete the record"
            )
            assert not output_matches(record["shows"], record["prints"])  # else not needed


def test_a_cpu_of_another_instruction_set_is_checked_against_its_record(tmp_path, monkeypatch):
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "VARIANTS", tmp_path)
    record = [{"page": "docs/x.md", "shows": "error 9.59e-07\n", "prints": "error 1.02e-06\n"}]
    (tmp_path / "avx2.json").write_text(json.dumps(record))
    monkeypatch.setattr(module, "instruction_set", lambda: "avx2")
    assert shown_here("docs/x.md", "error 9.59e-07\n") == "error 1.02e-06\n"
    assert shown_here("docs/y.md", "error 9.59e-07\n") == "error 9.59e-07\n"  # no record
    monkeypatch.setattr(module, "instruction_set", lambda: "avx512")
    assert shown_here("docs/x.md", "error 9.59e-07\n") == "error 9.59e-07\n"  # the page's CPU
    monkeypatch.setattr(module, "instruction_set", lambda: "aarch64")
    assert shown_here("docs/x.md", "error 9.59e-07\n") == "error 9.59e-07\n"  # no file


@pytest.fixture
def page_of_an_avx2_cpu(tmp_path, monkeypatch):
    """A page ``page.md`` in a repository of its own, recorded as on a CPU with AVX2 alone."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "VARIANTS", tmp_path / "variants")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "instruction_set", lambda: "avx2")
    return tmp_path / "page.md"


def test_recording_keeps_only_the_outputs_this_cpu_prints_otherwise(
    page_of_an_avx2_cpu, monkeypatch
):
    page = page_of_an_avx2_cpu
    page.write_text(
        "```python\nprint(0.5)\n```\n\n```text\n0.5\n```\n\n"
        "```python\nprint(2.5)\n```\n\n```text\n2.7\n```\n"
    )
    path = record_variants([page])
    assert json.loads(path.read_text()) == [
        {"page": "page.md", "shows": "2.7\n", "prints": "2.5\n"}
    ]
    monkeypatch.setattr(sys.modules[__name__], "instruction_set", lambda: SHOWN_ON)
    with pytest.raises(SystemExit, match="update the pages instead"):
        record_variants([page])


def test_recording_runs_a_page_with_the_torch_kernels_it_names(page_of_an_avx2_cpu):
    """A page naming torch CPU kernels other than this interpreter's is recorded as the test
    runs it, in a fresh interpreter with those kernels (not with this interpreter's)."""
    pytest.importorskip("torch")
    page = page_of_an_avx2_cpu
    page.write_text(
        "<!-- torch CPU kernels: DEFAULT -->\n\n```python\nimport torch\n\n"
        "print(int(torch.backends.cpu.get_cpu_capability() == 'DEFAULT'))\n```\n\n"
        "```text\n0\n```\n"
    )
    assert _torch_capability() != "DEFAULT"  # the tests' torch runs AVX2 kernels (conftest)
    path = record_variants([page])
    assert json.loads(path.read_text()) == [{"page": "page.md", "shows": "0\n", "prints": "1\n"}]


# The checker itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        ("weights 1.44 0 1.44", "weights    1.44   0   1.44", True),  # spacing is free
        ("masking constant 0.745", "masking constant 0.746", True),  # one unit in the last digit
        ("masking constant 0.745", "masking constant 0.747", False),
        ("error 9.59e-07", "error 9.6e-07", True),
        ("error 9.59e-07", "error 1.02e-06", False),
        ("4096 of 4096 pairs", "4095 of 4096 pairs", False),  # integers are exact
        ("size 0", "size 3e-07", False),
        ("certified (2.4 s)", "certified (31.7 s)", True),  # durations are free
        ("a: nan, b: uniform", "a: nan, b: zero", False),
        ("-1e+09 added", "-1e+09 added", True),
        ("74%: ulp(1e9) = 64", "75%: ulp(1e9) = 64", False),
        ("float32 7.10e-04", "float32 7.11e-04", True),
        ("float32 7.10e-04", "float16 7.10e-04", False),
    ],
)
def test_output_matching(expected, actual, ok):
    assert output_matches(expected, actual) is ok


def test_output_matching_by_lines():
    assert output_matches("a 1\n...\nz 2", "a 1\nb\nc\nz 2")
    assert output_matches("a 1\n...\nz 2", "a 1\nz 2")
    assert not output_matches("a 1\nz 2", "a 1\nb\nz 2")
    assert not output_matches("a 1", "a 1\nb")
    assert output_matches("\na 1\n\n", "a 1\n")


def test_prose_figures_are_checked_against_the_output_before_them():
    text = (
        "```python\nprint(0.745)\n```\n\n```text\n0.745 74%\n```\n\n"
        "It leaves 0.745 (74%), about 1e-6 and 0.75 of `0.5` here.\n\n## Next\n\n1.5 is later.\n"
    )
    assert unprinted_prose_figures(text) == [(9, "0.75")]


def test_a_block_that_starts_processes_runs_as_a_saved_script(tmp_path, monkeypatch):
    """Run in this process, a block that spawns workers works without the main-module guard;
    saved and run as a script, as its reader runs it, it fails."""
    monkeypatch.chdir(tmp_path)
    head = "from concurrent.futures import ProcessPoolExecutor\nimport multiprocessing\n"
    body = (
        'spawn = multiprocessing.get_context("spawn")\n'
        "with ProcessPoolExecutor(1, mp_context=spawn) as pool:\n"
        "    print(pool.submit(abs, -2).result())\n"
    )
    guarded = head + 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    shown = "```text\n2\n```\n"
    page = f"```python\n{head + body}```\n{shown}\n```python\n{guarded}```\n{shown}"
    unguarded, script = examples(page)
    assert unguarded.kind == script.kind == "script"
    with pytest.raises(AssertionError, match="the script exits 1"):
        run_examples(tmp_path / "page.md", [unguarded], {})
    run_examples(tmp_path / "page.md", [script], {})


def test_examples_pair_code_with_its_output():
    text = (
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\n"
        "```bash\nmhanum demo   # the demo\n```\n```text\ndemo\n```\n\n"
        "```bash\npip install x && mhanum demo\n```\n\n```text\nnot run\n```\n\n"
        "```python\nx = 2\n```\n\nprose\n\n```text\nnot its output\n```\n\n"
        "<!-- output of: mhanum compare --seed-example -->\n```text\ntable\n```\n"
    )
    found = examples(text)
    assert [(e.kind, e.source.strip(), e.expected) for e in found] == [
        ("python", "print(1)", "1\n"),
        ("command", "mhanum demo", "demo\n"),
        ("python", "x = 2", None),
        ("command", "mhanum compare --seed-example", "table\n"),
    ]
    assert found[0].line == 2


def record_variants(pages: list[Path]) -> Path:
    """Run the pages' examples and record, for this CPU's instruction set, the outputs it prints
    where they differ from what the pages show (the records of other pages are kept)."""
    isa = instruction_set()
    if isa == SHOWN_ON:
        msg = f"this CPU ({isa}) prints what the pages show: update the pages instead"
        raise SystemExit(msg)
    names = {page_name(p) for p in pages}
    kept = [r for r in _variants(isa) if r["page"] not in names]
    found = [record for page in pages for record in page_variants(page)]
    path = VARIANTS / f"{isa}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept + found, indent=1, ensure_ascii=False) + "\n")
    return path


def page_variants(page: Path) -> list[dict[str, str]]:
    """The outputs the page's examples print otherwise than it shows, each run as
    :func:`test_python_blocks_run` runs it: here, or with the torch CPU kernels the page names
    in a fresh interpreter (:func:`run_page`)."""
    kernels = torch_kernels(page.read_text())
    if kernels is not None and _torch_capability() != kernels:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "records.json"
            done = run_with_kernels(kernels, ["--record-page", str(page), str(out)])
            if done.returncode != 0:
                msg = f"{page_name(page)}, run with torch's {kernels} CPU kernels:\n"
                raise SystemExit(msg + done.stderr[-6000:])
            return [{**r, "page": page_name(page)} for r in json.loads(out.read_text())]
    found: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        (Path(folder) / "papers").symlink_to(ROOT / "papers")
        run_examples(page, examples(page.read_text()), {"__name__": "__main__"}, found)
    return found


def _main(argv: list[str]) -> int:
    """``python -m tests.test_docs_examples PAGE KIND...``: run the page's examples of those kinds
    here, with the torch CPU kernels this interpreter was started with (:func:`run_page`);
    ``--record PAGE...``: :func:`record_variants`; ``--record-page PAGE OUT``: the page's
    :func:`page_variants`, written to OUT as JSON."""
    if argv[:1] == ["--record"]:
        import tests.conftest  # noqa: F401  (the tests' environment: threads, 64-bit JAX)

        print(record_variants([Path(a).resolve() for a in argv[1:]]))
        return 0
    if argv[:1] == ["--record-page"]:
        Path(argv[2]).write_text(json.dumps(page_variants(Path(argv[1]))))
        return 0
    page = Path(argv[0])
    kernels = torch_kernels(page.read_text())
    if kernels is not None and _torch_capability() != kernels:
        return NO_SUCH_KERNELS
    found = [e for e in examples(page.read_text()) if e.kind in argv[1:]]
    run_examples(page, found, {"__name__": "__main__"})
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
