"""``mhanum.report`` and ``mhanum report``: content, soundness, reproducibility, refusals, rendering."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import mhanum.report
from mhanum import InvalidArgument, bounds, cli
from mhanum.report import _compute, _document

TINY = {
    "samples": 2,
    "presets": ["fp32", "bf16"],
    "lengths": [8, 16],
    "d_k": 8,
    "masks": ["none", "causal"],
    "heads": {"d_model": 16, "num_heads": [1, 4], "length": 8},
    "mask_constants": {"formats": ["float32", "float16"], "n_keys": 16},
    "variants": {"length": 8, "heads": 4, "kv_heads": 2, "window": 3, "sink": 2.0},
    "backward": {"length": 8, "block": 4},
}
SMALLEST = TINY | {"presets": ["fp32"], "lengths": [8], "masks": ["causal"]}
RECORDS = Path(__file__).parents[1] / "papers" / "measurements" / "h100-records.jsonl"
CASE = {
    "mhanum_version": "0.1.0",
    "numerics": {"input": "bfloat16", "accum": "float32"},
    "preset": "bf16-fp32acc",
    "shape": [1, 1, 16, 8],
    "seed": 7,
    "objective": "ratio",
    "error": 0.01,
    "bound": 0.5,
    "ratio": 0.02,
    "dominant_term": "logits",
    "created": "2026-01-01T00:00:00+00:00",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    cases = root / "cases"
    cases.mkdir()
    (cases / "a.json").write_text(json.dumps(CASE))
    (cases / "b.json").write_text(json.dumps([CASE | {"ratio": 0.3, "seed": 8}]))
    records = root / "records.jsonl"
    with RECORDS.open() as f:
        records.write_text("".join(next(f) for _ in range(4)))
    return mhanum.report.build(TINY, root / "out", cases=[cases], records=[records])


def test_writes_html_markdown_json_and_figures(report):
    assert {p.name for p in report.out.iterdir()} == {*mhanum.report.FILES, "figures"}
    assert set(report.figures) == {"error_vs_length", "term_breakdown", "heads", "device_records"}
    for name, png in report.figures.items():
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert (report.out / "figures" / f"{name}.png").read_bytes() == png
    page = report.html.read_text()
    # Self-contained: every image is a data: URI, nothing is fetched.
    assert page.count('src="data:image/png;base64,') == len(report.figures)
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)
    md = report.markdown.read_text()
    for name in report.figures:
        assert f"(figures/{name}.png)" in md
    assert json.dumps(json.loads(report.json.read_text())) == json.dumps(report.data)  # NaN


def test_every_measured_error_is_within_its_bounds(report):
    points = report.data["attention"]["points"]
    assert len(points) == 2 * 2 * 2  # presets × lengths × masks
    for p in points:
        assert len(p["error_max_abs"]) == TINY["samples"]
        assert all(0 <= r <= 1 for r in p["ratio"]), p
        assert p["error_worst"] <= max(p["bound_a_posteriori"])
        assert p["error_worst"] <= max(p["bound_probabilistic"])
        assert p["probabilistic_probability"] >= report.data["config"]["probability"]
        assert math.isclose(sum(p["terms_at_max"].values()), max(p["bound_a_posteriori"]))
        assert p["dominant_term"] in p["terms_at_max"]
    for row in report.data["heads"]["rows"]:
        for entry in row["presets"].values():
            assert 0 < entry["error_max_abs"] <= entry["bound_max"]


def test_heads_and_mask_sections_match_the_bounds_modules(report):
    rows = report.data["heads"]["rows"]
    assert [r["num_heads"] for r in rows] == [1, 4]
    assert "difference_to_one_head" not in rows[0]
    assert rows[1]["difference_to_one_head"]["normwise_max"] > 0.01  # a different function
    assert rows[1]["scale_exactness"]["bfloat16/scores"]["exact"]  # d_k = 4: 1/2
    assert not rows[1]["scale_exactness"]["bfloat16/qk"]["exact"]  # 4^(-1/4) is irrational
    f16 = next(f for f in report.data["mask_constants"]["formats"] if f["format"] == "float16")
    by = {c["constant"]: c for c in f16["constants"]}
    assert by["-1e+09"]["stored"] == -math.inf  # M.1
    assert by["-1e+09"]["overflows"]
    assert by["-inf"]["fully_masked_row"] == "nan"
    assert by["finfo.min"]["fully_masked_row"] == "uniform"
    expected = bounds.safe_mask_range("float16", 30.0, 1e-6, n_keys=16)
    assert f16["safe_range"]["low"] == expected.low
    assert f16["safe_range"]["high"] == expected.high


def test_cases_and_records_sections(report):
    cases = report.data["cases"]
    assert [c["seed"] for c in cases] == [8, 7]  # worst ratio first
    assert set(_compute.CASE_FIELDS) <= set(cases[0])
    (records,) = report.data["records"]["files"]
    assert sum(records["counts"].values()) == 4
    assert records["ok"] == (records["counts"]["VIOLATED"] + records["counts"]["inconsistent"] == 0)
    md = report.markdown.read_text()
    assert "## Worst cases found by search" in md
    assert "bf16-fp32acc" in md


def test_the_a_priori_bound_holds_too(report):
    assert report.data["attention"]["a_priori"] == "attention_bound_a_priori"
    for p in report.data["attention"]["points"]:
        for error, prior in zip(p["error_max_abs"], p["bound_a_priori"], strict=True):
            assert error <= prior  # Theorem A.4 from each input's sizes and norms
    assert "Theorem A.4" in report.markdown.read_text()


def test_without_an_a_priori_bound_the_report_says_so(monkeypatch):
    monkeypatch.delattr(bounds, "attention_bound_a_priori", raising=False)
    config = mhanum.report.load_config(SMALLEST)
    data = _compute.attention_grid(config, lambda what: None)
    assert data["a_priori"] is None
    assert data["points"][0]["bound_a_priori"] is None
    text = _document._a_priori_text(data)
    assert "absent" in text


def test_same_seed_same_numbers(tmp_path):
    a = mhanum.report.build(SMALLEST, tmp_path / "a")
    b = mhanum.report.build(SMALLEST, tmp_path / "b")
    volatile = {"created", "seconds", "versions"}
    assert {k: v for k, v in a.data.items() if k not in volatile} == {
        k: v for k, v in b.data.items() if k not in volatile
    }
    assert a.figures == b.figures
    other = _compute.attention_grid(mhanum.report.load_config(SMALLEST | {"seed": 1}), print)
    assert other["points"] != a.data["attention"]["points"]


def test_an_existing_report_is_never_overwritten_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="pass --force"):
        mhanum.report.build(SMALLEST, out)
    assert not (out / "report.html").exists()
    mhanum.report.build(SMALLEST, out, force=True)
    assert (out / "report.html").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only the report's files are replaced
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match="expected a directory"):
        mhanum.report.build(SMALLEST, tmp_path / "file", force=True)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"lenghts": [8]}, "lenghts"),
        ({"lengths": []}, "lengths"),
        ({"lengths": [8, 8]}, "lengths"),
        ({"lengths": [1]}, "lengths"),
        ({"lengths": ["8"]}, "lengths"),
        ({"presets": ["fp31"]}, "presets"),
        ({"masks": ["diagonal"]}, "masks"),
        ({"samples": 0}, "samples"),
        ({"seed": True}, "seed"),
        ({"structure": "uniform"}, "structure"),
        ({"probability": 1.0}, "probability"),
        ({"heads": 4}, "heads"),
        ({"heads": {"num_heads": [3]}}, "heads.num_heads"),
        ({"heads": {"d_modl": 8}}, "heads.d_modl"),
        ({"mask_constants": {"values": [1e4]}}, "mask_constants.values"),
        ({"mask_constants": {"formats": ["float13"]}}, "mask_constants.formats"),
        ({"mask_constants": {"mode": "replace"}}, "mask_constants.mode"),
        ({"mask_constants": {"leak_tol": 1.5}}, "mask_constants.leak_tol"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(config, key):
    with pytest.raises(InvalidArgument, match=rf"^{re.escape(key)}: expected"):
        mhanum.report.load_config(config)


def test_config_files_are_toml_and_default_to_the_embedded_grid(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text(
        'lengths = [8]\n[heads]\nnum_heads = [2]\n[mask_constants]\nvalues = ["-inf"]\n'
    )
    config = mhanum.report.load_config(path)
    default = mhanum.report.load_config(None)
    assert config.lengths == (8,)
    assert config.heads.num_heads == (2,)
    assert config.heads.d_model == default.heads.d_model
    assert config.mask_constants.values == (-math.inf,)
    assert config.presets == default.presets
    assert tomllib.loads(mhanum.report.default_toml())["presets"] == list(default.presets)
    path.write_text("lengths = [8")
    with pytest.raises(InvalidArgument, match="config: expected TOML"):
        mhanum.report.load_config(path)
    with pytest.raises(InvalidArgument, match="config: expected a readable TOML file"):
        mhanum.report.load_config(tmp_path / "missing.toml")


def test_bad_cases_are_refused_before_any_work(tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(InvalidArgument, match="cases: expected JSON objects"):
        mhanum.report.build(SMALLEST, tmp_path / "out", cases=[tmp_path / "bad.json"])
    with pytest.raises(InvalidArgument, match="cases: expected JSON files"):
        mhanum.report.build(SMALLEST, tmp_path / "out", cases=[tmp_path / "missing"])
    with pytest.raises(InvalidArgument, match="records: expected a records file"):
        mhanum.report.build(SMALLEST, tmp_path / "out", records=[tmp_path / "missing.jsonl"])
    assert not (tmp_path / "out").exists()


def test_command_writes_the_report_with_a_progress_bar(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'samples = 1\npresets = ["fp32"]\nlengths = [8]\nd_k = 8\nmasks = ["none"]\n'
        "[heads]\nd_model = 8\nnum_heads = [1, 2]\nlength = 8\n"
    )
    out = tmp_path / "out"
    assert cli.main(["report", str(grid), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "report in" in captured.out
    assert re.search(r"\[#+\] (\d+)/\1 ", captured.err)
    assert (out / "report.html").exists()
    assert cli.main(["report", str(grid), "-o", str(out)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path / "nope.toml"), "-o", str(tmp_path / "x")]) == 2
    assert cli.main(["report", "--print-default-config"]) == 0
    assert tomllib.loads(capsys.readouterr().out) == tomllib.loads(mhanum.report.default_toml())


def test_import_mhanum_does_not_import_matplotlib():
    code = "import sys, mhanum, mhanum.cli; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# Rendering in a real browser -----------------------------------------------------------------

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# After load, record every <img>'s decoded size on <body>, where --dump-dom shows it.
_PROBE = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
    "JSON.stringify([...document.images].map(i => [i.naturalWidth, i.naturalHeight, "
    "i.complete]))));</script>"
)


def _chromium(tmp_path: Path, *args: str) -> str:
    assert _CHROMIUM is not None
    command = [
        _CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(
    _CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)
def test_report_html_renders_its_figures_in_headless_chromium(report, tmp_path):
    page = tmp_path / "probe.html"
    page.write_text(report.html.read_text().replace("</body>", _PROBE + "</body>"))
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    found = re.search(r'data-images="([^"]*)"', dom)
    assert found, dom[:500]
    images = json.loads(html.unescape(found.group(1)))
    # PNG sizes from the IHDR chunk: every figure decoded at its own size.
    expected = [
        (int.from_bytes(p[16:20]), int.from_bytes(p[20:24])) for p in report.figures.values()
    ]
    assert [(w, h) for w, h, _ in images] == expected
    assert all(complete and w > 100 and h > 100 for w, h, complete in images)

    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", report.html.as_uri())
    from matplotlib.image import imread

    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    not_white = (pixels < 0.95).any(axis=-1).mean()
    colourful = (pixels.max(axis=-1) - pixels.min(axis=-1) > 0.3).sum()
    assert not_white > 0.02  # text, tables and figures were painted
    assert colourful > 2000  # the figures' coloured lines and bars (the text is black and grey)


def test_bfloat16_accumulation_over_256_terms_is_bounded_not_refused(tmp_path):
    # n·u = 1: γ_n is infinite, and A.1, A.2 and H.1 take (1 + u)^h - 1 (Corollary R.1')
    config = {
        "samples": 1,
        "presets": ["bf16"],
        "lengths": [8],
        "d_k": 256,
        "masks": ["none"],
        "heads": {"d_model": 256, "num_heads": [8], "length": 8},
    }
    report = mhanum.report.build(config, tmp_path / "out")
    (point,) = report.data["attention"]["points"]
    assert point["error_worst"] > 0
    (bound,) = point["bound_a_posteriori"]
    assert point["error_worst"] <= bound < math.inf
    assert not report.data["attention"]["refusals"]
    assert report.data["heads"]["rows"][0]["presets"]["bf16"]["bound_max"] is not None
    assert "Bounds refused" not in report.markdown.read_text()


def test_every_variant_is_within_its_bound(report):
    section = report.data["variants"]
    labels = {r["variant"] for r in section["rows"]}
    assert labels == {
        "causal", "sliding window of 3", "ALiBi, causal", "sinks (σ = 2), causal",
        "GQA 4/2 heads, causal", "soft-capped (c = 50), causal", "split-KV (4 splits), causal",
    }  # fmt: skip
    assert len(section["rows"]) == len(labels) * len(TINY["presets"])
    for r in section["rows"]:
        assert r["error_max"] <= r["bound_max"]
        assert 0 <= r["ratio_max"] <= 1, r
        assert r["theorem"] == ("A.6" if r["variant"].startswith("split-KV") else "A.1")
    assert "Today's attention variants" in (report.out / "report.md").read_text()


def test_every_gradient_is_within_its_bound(report):
    section = report.data["backward"]
    assert not section["refusals"]
    seen = {(r["preset"], r["algorithm"], r["gradient"]) for r in section["rows"]}
    assert len(seen) == len(section["rows"]) == len(TINY["presets"]) * 2 * 3
    for r in section["rows"]:
        assert 0 < r["error_max"] <= r["bound_max"], r
        assert 0 < r["ratio_max"] <= 1, r
        assert r["theorem"] == ("B.2" if r["algorithm"] == "flash2" else "B.1")
    assert "The backward pass" in (report.out / "report.md").read_text()


@pytest.mark.parametrize(
    ("backward", "key"),
    [({"length": 0}, "backward.length"), ({"algorithms": ["reverse"]}, "backward.algorithms"),
     ({"block": 0}, "backward.block")],
)  # fmt: skip
def test_bad_backward_settings_are_refused_by_name(backward, key, tmp_path):
    with pytest.raises(InvalidArgument, match=key):
        mhanum.report.build(SMALLEST | {"backward": backward}, tmp_path / "out")


@pytest.mark.parametrize(
    ("variants", "names"),
    [
        ({"heads": 4, "kv_heads": 3}, "variants.kv_heads"),
        ({"window": 0}, "variants.window"),
        ({"softcap": 0.0}, "variants.softcap"),
        ({"kv_splits": 0}, "variants.kv_splits"),
    ],
)
def test_bad_variant_settings_are_refused_by_name(variants, names, tmp_path):
    with pytest.raises(mhanum.InvalidArgument, match=names):
        mhanum.report.build(SMALLEST | {"variants": variants}, tmp_path / "out")


def test_command_on_two_workers_with_a_journal_writes_the_same_numbers(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'samples = 1\npresets = ["fp32"]\nlengths = [8]\nd_k = 8\nmasks = ["causal"]\n'
        "[heads]\nd_model = 8\nnum_heads = [1, 2]\nlength = 8\n"
        "[variants]\nlength = 8\nheads = 2\nkv_heads = 1\nwindow = 3\n"
        "[backward]\nlength = 8\nblock = 4\n"
    )
    volatile = {"created", "seconds", "versions"}

    def numbers(out):
        data = json.loads((out / "report.json").read_text())
        return json.dumps({k: v for k, v in data.items() if k not in volatile})

    assert cli.main(["report", str(grid), "-o", str(tmp_path / "here")]) == 0
    journal = tmp_path / "cells.jsonl"
    argv = ["report", str(grid), "-o", str(tmp_path / "pool"), "--journal", str(journal)]
    assert cli.main([*argv, "--workers", "2"]) == 0
    assert numbers(tmp_path / "pool") == numbers(tmp_path / "here")
    before = journal.read_bytes()
    assert cli.main([*argv, "--force"]) == 0  # every cell read back from the journal
    assert journal.read_bytes() == before
    assert numbers(tmp_path / "pool") == numbers(tmp_path / "here")
    other = ["report", str(grid), "-o", str(tmp_path / "x"), "--journal", str(journal)]
    grid.write_text("seed = 3\n" + grid.read_text())
    assert cli.main(other) == 2
    assert "another campaign" in capsys.readouterr().err
