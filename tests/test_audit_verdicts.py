"""The audit's verdicts, tolerances, heatmaps and HTML page, on constructed audits.

The verdict rules (mhanum.models.Verdict) are checked on layers whose figures are chosen, so that
every expectation is a closed form: a ratio is a figure over a tolerance, a probability is
``1 - Σ (1 - P_layer)``. No checkpoint is needed; tests/test_audit.py runs the real model.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mhanum import InvalidArgument, models

MODEL = (
    (
        "probabilistic (lam): the rounding errors of sums and dots are independent, mean-zero random "
        "variables"
    ),
)


def _heads(*pairs: tuple[float, float]) -> tuple[models.HeadError, ...]:
    return tuple(
        models.HeadError(head=h, error=e, bound=b, ratio=e / b, dominant_term="logits")
        for h, (e, b) in enumerate(pairs)
    )


def _preset(
    error: float,
    bound: float | None,
    probable: float | None,
    heads: tuple[models.HeadError, ...] = (),
    *,
    name: str = "fp32",
    probability: float | None = 0.995,
) -> models.PresetAudit:
    return models.PresetAudit(
        preset=name, error=error, normwise=error, bound=bound,
        ratio=None if bound is None else error / bound, dominant_term="attention.logits",
        a_priori=None, heads=heads, probable_bound=probable, probability=probability,
        probable_assumptions=MODEL if probable is not None else (),
    )  # fmt: skip


# Layer 0: scale 2.0, error 1e-6, bound 4e-3, P-bound 2e-3;
# layer 1: scale 0.5, error 2e-6, bound 8e-3, P-bound 3e-3; each P-bound with P = 0.995.
# Head 0 has the larger bound, head 1 the larger error.
HEADS = _heads((5e-7, 1e-5), (1e-6, 5e-6))
LAYERS = (
    models.LayerAudit(0, 10.0, (), (_preset(1e-6, 4e-3, 2e-3, HEADS),), (), output_scale=2.0),
    models.LayerAudit(1, 10.0, (), (_preset(2e-6, 8e-3, 3e-3, HEADS),), (), output_scale=0.5),
)


@pytest.mark.parametrize(
    ("tolerance", "expected", "ratio", "head"),
    [
        (1e-2, "certified", 8e-3 / 1e-2, 0),  # every bound <= tol: the worst is layer 1's
        (5e-3, "probable", 3e-3 / 5e-3, 0),  # layer 1's bound 8e-3 > tol, its P-bound is not
        (2.5e-3, "measured", 2e-6 / 2.5e-3, 1),  # layer 1's P-bound 3e-3 > tol, its error is not
        (1.5e-6, "not within", 2e-6 / 1.5e-6, 1),  # layer 1's error 2e-6 > tol
    ],
)
def test_the_verdict_is_the_strongest_that_holds(tolerance, expected, ratio, head):
    v = models.verdict("fp32", LAYERS, tolerance=tolerance)
    assert v.verdict == expected
    assert v.ratio == pytest.approx(ratio, rel=1e-12)
    assert (v.layer, v.head) == (1, head)  # the worst layer; its head with the largest figure
    assert v.bound_ratio == pytest.approx(8e-3 / tolerance)
    assert v.probable_ratio == pytest.approx(3e-3 / tolerance)
    assert v.error_ratio == pytest.approx(2e-6 / tolerance)
    assert v.probability == pytest.approx(1 - 2 * 0.005)  # the union bound over the layers
    assert v.assumptions == MODEL


def test_rtol_is_relative_to_each_layers_output_scale():
    # τ0 = 1e-2·2.0 = 2e-2, τ1 = 1e-2·0.5 = 5e-3: layer 1's bound 8e-3 is above its tolerance
    v = models.verdict("fp32", LAYERS, rtol=1e-2)
    assert (v.verdict, v.layer) == ("probable", 1)
    assert v.ratio == pytest.approx(3e-3 / 5e-3)
    assert v.bound_ratio == pytest.approx(8e-3 / 5e-3)
    # τ1 = 4e-3·0.5 = 2e-3 is below layer 1's P-bound 3e-3: measured within only
    assert models.verdict("fp32", LAYERS, rtol=4e-3).verdict == "measured"
    # with both, the smaller tolerance: τ0 = min(4e-3, 2e-2), τ1 = min(4e-3, 5e-3) = 4e-3
    both = models.verdict("fp32", LAYERS, tolerance=4e-3, rtol=1e-2)
    assert both.verdict == "probable"
    assert both.probable_ratio == pytest.approx(3e-3 / 4e-3)
    assert models.layer_tolerance(2.0, 4e-3, 1e-2) == 4e-3
    assert models.layer_tolerance(0.25, 4e-3, 1e-2) == pytest.approx(2.5e-3)
    assert models.layer_tolerance(None, 4e-3, None) == 4e-3


def test_without_a_bound_only_the_measured_verdicts_remain():
    outside = models.LayerAudit(0, 1.0, (), (_preset(1e-6, None, None, probability=None),), ())
    v = models.verdict("fp32", [outside], tolerance=1e-2)
    assert (v.verdict, v.bound_ratio, v.probable_ratio, v.probability, v.head) == (
        "measured", None, None, None, None,
    )  # fmt: skip
    vacuous = models.LayerAudit(0, 1.0, (), (_preset(1e-6, float("inf"), 1e-3),), ())
    assert models.verdict("fp32", [vacuous], tolerance=1e-2).verdict == "probable"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerance": None}, "tolerance: expected an absolute tolerance, an rtol or both"),
        ({"tolerance": 1e-2, "layers": ()}, "layers: expected at least one audited layer"),
        ({"tolerance": 1e-2, "preset": "bf16"}, "name: expected one of fp32, got 'bf16'"),
    ],
)
def test_bad_verdict_arguments_are_refused(kwargs, message):
    args = {"preset": "fp32", "layers": LAYERS, **kwargs}
    with pytest.raises(InvalidArgument, match=message):
        models.verdict(args.pop("preset"), args.pop("layers"), **args)


def test_rtol_without_an_output_scale_is_refused():
    with pytest.raises(InvalidArgument, match="scale: expected the layer's output scale"):
        models.layer_tolerance(None, None, 1e-2)


# --- a constructed audit: the text, the heatmap, the page ---------------------------------------


def _audit(tolerance: float | None = 5e-3, rtol: float | None = None) -> models.Audit:
    second = _heads((1e-3, 2e-2), (3e-3, 4e-2))
    wider = [_preset(3e-3 * (i + 1), 0.2, 0.1, second, name="bf16-fp32acc") for i in (0, 1)]
    layers = tuple(
        dataclasses.replace(layer, presets=(*layer.presets, p))
        for layer, p in zip(LAYERS, wider, strict=True)
    )
    presets = ("fp32", "bf16-fp32acc")
    judged = (
        ()
        if tolerance is None and rtol is None
        else tuple(models.verdict(p, layers, tolerance=tolerance, rtol=rtol) for p in presets)
    )
    return models.Audit(
        model="/models/constructed", sentences=("A b.",), tokens=(("[CLS]", "a", "b", "."),),
        presets=presets, tolerance=tolerance, layers=layers, cheapest_measured=None,
        cheapest_certified=None, rtol=rtol, probability=0.99, verdicts=judged,
    )  # fmt: skip


def test_the_text_puts_one_verdict_line_per_preset_first_and_explains_the_columns():
    text = _audit().render()
    lines = text.splitlines()
    start = lines.index("verdicts (tol = 0.005 absolute; the worst layer and head):")
    assert lines[start + 1].split() == [
        "fp32", "probably", "within", "(P", ">=", "0.99):", "P-bound", "0.6", "tol", "at",
        "worst", "(layer", "1,", "head", "0);", "bound", "1.6", "tol,", "error", "0.0004", "tol",
    ]  # fmt: skip
    assert lines[start + 2].startswith("  bf16-fp32acc  not within: error 1.2 tol at worst")
    assert lines.index("per layer:") > start + 2
    for column in ("scale", "tol", "error", "bound", "P-bound", "dominant"):
        assert any(line.startswith(f"  {column} ") for line in lines), column
    assert "a priori" not in text  # explained under --verbose only
    assert "  a priori Theorem A.4" in _audit().render(verbose=True)
    # the figures above a layer's tolerance are marked
    (row,) = (line for line in lines if line.startswith("  1 "))
    assert row.split()[:7] == ["1", "0.5", "0.005", "fp32", "2e-06", "0.003", "0.008*"]


def test_the_text_states_a_relative_tolerance_and_its_scale():
    text = _audit(tolerance=None, rtol=1e-2).render()
    assert "verdicts (tol = 0.01 × the layer's scale; the worst layer and head):" in text
    assert "max |exact output| of the layer over the sentences' tokens" in text
    (row,) = (line for line in text.splitlines() if line.startswith("  1 "))
    assert row.split()[:3] == ["1", "0.5", "0.005"]  # τ = rtol · scale
    assert "verdicts" not in _audit(tolerance=None).render()


def test_heatmap_data_divides_by_each_layers_tolerance():
    data = models.heatmap_data(_audit(tolerance=None, rtol=1e-2), "fp32")
    assert data.relative
    assert data.bound_columns == ("head 0", "head 1", "layer A.2", "layer A.3")
    assert data.error_columns == ("head 0", "head 1", "layer")
    # layer 1: τ = 5e-3; heads' bounds 1e-5 and 5e-6, the layer's 8e-3 and 3e-3
    assert data.bound[1].tolist() == pytest.approx([2e-3, 1e-3, 1.6, 0.6])
    assert data.error[1].tolist() == pytest.approx([1e-4, 2e-4, 4e-4])
    assert data.bound[0].tolist() == pytest.approx([5e-4, 2.5e-4, 0.2, 0.1])  # τ = 2e-2
    absolute = models.heatmap_data(_audit(tolerance=None), "fp32")
    assert not absolute.relative
    assert absolute.bound[1].tolist() == pytest.approx([1e-5, 5e-6, 8e-3, 3e-3])


def test_heatmaps_are_a_valid_png_and_svg():
    data = models.heatmap_data(_audit(), "bf16-fp32acc")
    png = models.heatmap_png(data)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20]), int.from_bytes(png[20:24])
    assert width > 400
    assert height > 200
    svg = models.heatmap_svg(data)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = "".join(root.itertext())
    assert "bf16-fp32acc" in texts
    assert "layer A.2" in texts
    assert svg == models.heatmap_svg(data)  # same data, same text


def test_html_writes_the_page_and_heatmaps_and_never_overwrites_without_force(tmp_path):
    out = tmp_path / "audit"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    whole = _audit()
    result = dataclasses.replace(whole, presets=whole.presets[:1], verdicts=whole.verdicts[:1])
    page = models.write_html(result, out)
    assert page == out / "index.html"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*models.html_files(result.presets), "notes.txt"]
    )
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InvalidArgument, match=r"html: expected a directory without index\.html"):
        models.write_html(result, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    (out / "index.html").write_text("edited")
    models.write_html(result, out, force=True)
    assert (out / "index.html").read_text() != "edited"
    assert (out / "notes.txt").read_text() == "mine"  # never a file it does not write
    with pytest.raises(InvalidArgument, match="html: expected a directory, got the file"):
        models.write_html(result, out / "notes.txt")
    fresh = tmp_path / "new" / "dir"
    assert models.check_html_directory(fresh, result.presets) == fresh  # created when written


_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_PROBE = (
    "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
    "JSON.stringify([...document.images].map(i => [i.naturalWidth, i.naturalHeight, "
    "i.complete]))));</script>"
)


@pytest.mark.skipif(
    _CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)
def test_the_html_page_renders_its_verdicts_and_heatmaps_in_headless_chromium(tmp_path):
    out = tmp_path / "audit"
    page = models.write_html(_audit(), out)
    probe = out / "probe.html"
    probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
    command = [
        _CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000", "--dump-dom", probe.as_uri(),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'data-images="([^"]*)"', done.stdout)
    assert found, done.stdout[:500]
    images = json.loads(html.unescape(found.group(1)))
    assert len(images) == 2  # one SVG heatmap per preset, each decoded at a real size
    assert all(complete and w > 400 and h > 200 for w, h, complete in images)
    assert 'class="probable"' in done.stdout
    assert 'class="not-within"' in done.stdout
    assert "probably within (P &gt;= 0.99)" in done.stdout


def test_the_page_links_each_png_and_escapes_text(tmp_path):
    result = _audit()
    text = models.html_page(result)
    for name in result.presets:
        assert f'src="heatmap-{name}.svg"' in text
        assert f'href="heatmap-{name}.png"' in text
    assert "P &gt;= 0.99" in text
    assert "P >= 0.99" not in text
    assert Path(result.model).name in text
