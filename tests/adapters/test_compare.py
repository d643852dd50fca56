"""mhanum.compare and the attribution of differences, on jax.nn and mhanum's own model (no
optional framework needed): planted causes are recovered and named."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument
from mhanum.adapters import _common as C
from mhanum.adapters import model as model_adapter
from mhanum.adapters.compare import CAUSES, Side, attribute, compare
from mhanum.cli import main
from tests.adapters import _check


def _side(numerics="fp32", params=None, raw_mask=None, fully_masked="nan"):
    _, p = _check.inputs()
    layer = model_adapter.load(
        params or p, _check.HEADS, numerics=numerics, fully_masked=fully_masked
    )
    return Side("model", layer, raw_mask=raw_mask)


def _attribute(b: Side, mask=None):
    x, _ = _check.inputs()
    return attribute(_side(), b, x, x, _check.HEADS, mask=mask)


def test_identical_layers_differ_by_nothing():
    result = _attribute(_side())
    assert result.difference == 0.0
    assert all(c.size == 0.0 for c in result.causes)
    assert {c.name for c in result.causes} == set(CAUSES)


def test_planted_weights_are_the_dominant_cause():
    _, p = _check.inputs()
    swapped = dataclasses.replace(p, wq=p.wk, wk=p.wq)
    result = _attribute(_side(params=swapped))
    assert result.dominant().name == "weights"
    assert result.dominant().size > 0.01
    assert "wq" in result.dominant().detail or "wk" in result.dominant().detail
    assert result["summation order"].size == 0.0  # the model is its own model


def test_planted_inverted_mask_is_mask_polarity():
    mask = _check.mask_of("causal")
    result = _attribute(_side(raw_mask=~mask | np.eye(_check.LENGTH, dtype=bool)), mask=mask)
    assert result.dominant().name == "mask polarity"
    assert result.dominant().size > 0.01
    assert "attends differently" in result.dominant().detail


def test_planted_additive_constant_is_the_masking_constant():
    """-1e9 added to every float32 logit (a mask that masks everything, additively)."""
    add = mn.Numerics(mask_mode="add", mask_value=-1e9)
    every_key_masked = np.zeros((_check.LENGTH, _check.LENGTH), bool)
    result = _attribute(_side(add, raw_mask=every_key_masked, fully_masked="unmasked"))
    assert result.dominant().name == "masking constant"
    assert result.dominant().size > 0.1
    assert "multiple of 64" in result.dominant().detail
    assert result["mask polarity"].size == 0.0  # a uniform shift: nothing in exact arithmetic


def test_planted_tf32_is_the_matmul_precision():
    result = _attribute(_side("tf32"))
    assert result.dominant().name == "matmul precision"
    assert 1e-5 < result.dominant().size < 1e-2


def test_causes_add_up_to_the_difference_with_the_same_weights():
    mask = _check.mask_of("causal")
    b = _side(mn.Numerics(operand_format="tf32", mask_mode="fill", mask_value=-1e4))
    result = _attribute(b, mask=mask)
    assert result.difference <= sum(c.size for c in result.causes) * (1 + 1e-12)
    assert json.loads(json.dumps(result.as_dict()))["causes"]
    assert "matmul precision" in result.render()


def test_compare_measures_every_path_within_its_bound():
    x, params = _check.inputs()
    result = compare(x, x, params, _check.HEADS, mask=_check.mask_of("causal"),
                     frameworks=("jax", "model"))  # fmt: skip
    assert [(m.framework, m.path) for m in result.measurements] == [("jax", "xla"),
                                                                     ("model", "model")]  # fmt: skip
    for m in result.measurements:
        assert m.within, m.bound_note
        assert m.errors.max_abs <= m.bound
    assert "err/bnd" in result.render()
    json.dumps(result.as_dict())


def test_compare_bounds_a_fully_masked_row_that_its_numerics_describe():
    """jax.nn replaces masked logits by a finite constant: the row is the mean of the values,
    which Theorem A.2 bounds like any other row."""
    x, params = _check.inputs()
    result = compare(x, x, params, _check.HEADS, mask=_check.mask_of("empty-row"),
                     frameworks=("jax",))  # fmt: skip
    (m,) = result.measurements
    assert m.within is True
    assert m.bound is not None
    assert np.isfinite(m.bound)
    assert m.convention_rows == 0
    assert m.follows_convention is None
    assert "bounded by Theorem A.2" in m.rows_note


def test_compare_keeps_the_bound_of_the_other_rows_under_minus_inf():
    """-inf masking: the fully-masked row is NaN by convention (no error, no bound); every other
    row keeps its bound."""
    x, params = _check.inputs()
    mask = _check.mask_of("empty-row")
    result = compare(x, x, params, _check.HEADS, mask=mask, frameworks=("model",))
    (m,) = result.measurements
    assert m.within is True
    assert m.bound is not None
    assert np.isfinite(m.bound)
    assert m.convention_rows == 1
    assert m.follows_convention is True
    assert m.errors.n_undefined == x.shape[-1]  # the NaN row is excluded, not an error
    assert np.isfinite(m.errors.max_abs)
    text = result.render()
    assert "fully-masked rows (1 of 12 rows attend no key)" in text
    assert "model/model: NaN in 1 row (as its convention says)" in text


def test_compare_prints_the_ratio_with_three_significant_digits():
    x, params = _check.inputs()
    result = compare(x, x, params, _check.HEADS, frameworks=("jax",))
    (m,) = result.measurements
    assert 0 < m.ratio < 0.1  # three significant digits differ from three decimals here
    row = result.render().splitlines()[3]
    assert f"{m.ratio:.3g}" in row.split()
    assert f"{m.ratio:.3g}" != f"{m.ratio:.3f}"
    assert "0.000" not in row


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, p: compare(x, x, p, 3), "num_heads"),
        (lambda x, p: compare(x[..., :8], x, p, 4), "x_q: expected shape"),
        (lambda x, p: compare(x, x, p, 4, frameworks=("caffe",)), "framework"),
        (lambda x, p: compare(x, x, p, 4, mask=np.ones((2, 6, 6))), "mask: expected a boolean"),
        (lambda x, p: compare(x, x, p, 4, mask=np.ones((3, 6, 6), bool)), "broadcastable"),
        (lambda x, p: compare(x, x, dataclasses.replace(p, bo=None), 4), "biases"),
        (lambda x, p: compare(x, x, p, 4, frameworks=()), r"^frameworks: expected at least one"),
        (
            lambda x, p: compare(x, x, p, 4, frameworks=("jax",), paths={"torch": ("sdpa",)}),
            r"^paths: expected keys among the frameworks compared \('jax',\), got \['torch'\]",
        ),
    ],
)
def test_bad_arguments(call, match):
    x, params = _check.inputs()
    with pytest.raises(InvalidArgument, match=match):
        call(x, params)


def test_one_framework_and_one_path_may_be_named_alone():
    x, params = _check.inputs()
    alone = compare(x, x, params, 4, frameworks="jax", paths={"jax": "xla"})
    listed = compare(x, x, params, 4, frameworks=("jax",), paths={"jax": ("xla",)})
    assert [(m.framework, m.path) for m in alone.measurements] == [("jax", "xla")]
    assert alone.measurements[0].errors == listed.measurements[0].errors


def test_path_model_rejects_unknown_row_policy():
    with pytest.raises(InvalidArgument, match="fully_masked"):
        C.PathModel("x", "y", mn.Numerics(), "random", "")


def test_cli_compare_json(capsys):
    argv = ["compare", "--frameworks", "jax", "--d-model", "8", "--heads", "2", "--length", "4",
            "--mask", "causal", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measurements"][0]["within"] is True


def test_cli_attribute_model_vs_jax(capsys):
    argv = ["compare", "--attribute", "jax", "model", "--independent", "--d-model", "8",
            "--heads", "2", "--length", "4"]  # fmt: skip
    assert main(argv) == 0
    assert "weights" in capsys.readouterr().out.splitlines()[4]


def test_cli_unknown_framework_exits_2(capsys):
    assert main(["compare", "--frameworks", "caffe"]) == 2
    assert "framework" in capsys.readouterr().err


def test_planted_row_policy_is_the_fully_masked_rows_cause():
    """-inf masking (NaN row) against finfo.min (uniform row): only the empty row differs."""
    uniform = _side(mn.Numerics(mask_value="finfo.min"), fully_masked="uniform")
    result = _attribute(uniform, mask=_check.mask_of("empty-row"))
    assert result.dominant().name == "fully-masked rows"
    assert result.dominant().size == np.inf  # NaN on one side, a number on the other
    assert "a: nan, b: uniform" in result.dominant().detail
    assert result["masking constant"].size < 1e-6  # finfo.min leaks nothing elsewhere


def test_constant_and_precision_planted_together_are_separated():
    """TF32 and a leaky additive -10 on masked logits: each cause gets its own share."""
    mask = _check.mask_of("causal")
    both = mn.Numerics(operand_format="tf32", mask_mode="add", mask_value=-10.0)
    result = _attribute(_side(both), mask=mask)
    tf32_only = _attribute(_side("tf32"), mask=mask)
    assert result["matmul precision"].size == pytest.approx(
        tf32_only["matmul precision"].size, rel=0.5
    )
    assert result["masking constant"].size > 1e-6  # e^-10 of the weight leaks to masked keys
