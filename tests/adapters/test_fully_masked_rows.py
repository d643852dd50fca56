"""Fully-masked rows in the real frameworks, with the mask configurations of their own test suites:
``compare`` bounds every other row, answers each fully-masked row by the path's convention (NaN,
the output bias, the mean of the values, the unmasked attention), and ``attribute`` measures each
side under its own convention. Skipped without torch, TensorFlow/Keras and Flax."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'mhanum[torch]')")
pytest.importorskip(
    "tensorflow", reason="tensorflow is not installed (pip install 'mhanum[tensorflow]')"
)
pytest.importorskip("keras", reason="keras is not installed (pip install 'mhanum[tensorflow]')")
pytest.importorskip("flax", reason="flax is not installed (pip install 'mhanum[flax]')")

import mhanum as mn
from mhanum.adapters import _common as C
from mhanum.adapters import flax as flax_adapter
from mhanum.adapters import keras as keras_adapter
from mhanum.adapters import model as model_adapter
from mhanum.adapters import torch as torch_adapter
from mhanum.adapters.compare import Side, attribute, compare

D_MODEL, HEADS = 8, 2  # Keras's test: 8-wide embeddings, 2 heads

# keras/src/layers/attention/multi_head_attention_test.py, test_masking: query tokens
# [[1,2,3,0,0],[3,3,1,1,2],[1,0,0,0,0]] and value tokens [[5,4,0],[3,0,0],[2,1,1]] with
# mask_zero=True give this (query, key) mask (1 = attend); padded queries attend nothing.
KERAS_VALUE_MASK = np.array(
    [
        [[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0], [0, 0, 0]],
        [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]],
        [[1, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
    ],
    bool,
)
# The same test with use_causal_mask=True.
KERAS_CAUSAL = KERAS_VALUE_MASK & np.array([[1, 0, 0], [1, 1, 0], *[[1, 1, 1]] * 3], bool)
# test/inductor/test_flex_attention.py, test_fully_masked_out_rows: mask_mod = q < S // 2
# (as a (q, kv) mask: the queries of the second half attend no key).
S = 8
TORCH_FLEX = np.broadcast_to((np.arange(S) < S // 2)[:, None], (S, S)).copy()

CASES = {
    "keras-test_masking": (KERAS_VALUE_MASK, (3, 5), (3, 3)),
    "keras-test_masking-causal": (KERAS_CAUSAL, (3, 5), (3, 3)),
    "torch-flex-fully_masked_out_rows": (TORCH_FLEX, (2, S), None),
}

# What each path answers for a row with no key (docs/frameworks.md).
CONVENTION = {
    ("torch", "explicit"): "nan",
    ("torch", "sdpa"): "zero",
    ("torch", "fast"): "nan",
    ("keras", "fused"): "uniform",
    ("keras", "explicit"): "zero",
    ("keras", "additive"): "unmasked",
    ("flax", "fused"): "uniform",
    ("flax", "explicit"): "uniform",
    ("jax", "xla"): "uniform",
}


def _inputs(case: str):
    mask, q_shape, kv_shape = CASES[case]
    rng = np.random.default_rng(0)
    x_q = rng.standard_normal((*q_shape, D_MODEL)).astype(np.float32)
    x_kv = x_q  # self-attention: `x_kv is x_q` also runs torch's fast path
    if kv_shape is not None:
        x_kv = rng.standard_normal((*kv_shape, D_MODEL)).astype(np.float32)
    params = C.float32_params(mn.MHAParams.random(D_MODEL, seed=0), HEADS)
    return x_q, x_kv, params, mask


@pytest.fixture(scope="module", params=sorted(CASES))
def comparison(request):
    x_q, x_kv, params, mask = _inputs(request.param)
    dead = int(np.sum(~np.broadcast_to(mask, (x_q.shape[0], *mask.shape[-2:])).any(-1)))
    frameworks = ("torch", "keras", "flax", "jax")
    return compare(x_q, x_kv, params, HEADS, mask=mask, frameworks=frameworks), dead


def test_the_configurations_have_fully_masked_rows(comparison):
    _, dead = comparison
    assert dead > 0


def test_every_path_keeps_its_bound_for_the_other_rows(comparison):
    result, _ = comparison
    assert len(result.measurements) >= 8
    for m in result.measurements:
        where = f"{m.framework}/{m.path}"
        assert m.model.fully_masked == CONVENTION[m.framework, m.path], where
        assert m.bound is not None, (where, m.bound_note)
        assert math.isfinite(m.bound), where
        assert m.ratio is not None, where
        assert m.ratio <= 1, (where, m.ratio)
        assert m.within is True, where
        assert math.isfinite(m.errors.max_abs), where  # a NaN row by convention is no error
        assert m.rows_note, where


def test_rows_outside_the_bound_follow_the_paths_convention(comparison):
    result, dead = comparison
    for m in result.measurements:
        where = f"{m.framework}/{m.path}"
        if m.model.fully_masked in ("nan", "zero"):
            # -inf (torch), or keras's zeroed probabilities after -1e9: not what A.2 bounds.
            assert m.convention_rows == dead, where
            assert m.follows_convention is True, where
            assert "as its convention says" in m.rows_note, where
        else:
            # A replaced finite constant (the mean of the values) or an added one (the
            # unmasked attention): the bound describes the row, which is bounded as usual.
            assert m.convention_rows == 0, where
            assert m.follows_convention is None, where
            assert "bounded by Theorem A.2" in m.rows_note, where
        if m.model.fully_masked == "nan":
            assert m.errors.n_undefined == dead * D_MODEL, where


def test_the_report_names_the_rows_and_their_conventions(comparison):
    result, dead = comparison
    text = result.render()
    assert f"fully-masked rows ({dead} of " in text
    assert "torch/explicit: NaN in" in text
    assert "keras/explicit: the output bias in" in text
    assert "jax/xla: the mean of the values, bounded" in text
    assert "no bound:" not in text


PAIRS = [
    (("torch", "explicit"), ("keras", "fused")),
    (("flax", "fused"), ("torch", "explicit")),
    (("torch", "explicit"), ("torch", "sdpa")),
    (("keras", "explicit"), ("keras", "additive")),
]


@pytest.mark.parametrize(
    ("case", "side_a", "side_b"),
    [(case, a, b) for case in sorted(CASES) for a, b in PAIRS]
    + [("torch-flex-fully_masked_out_rows", ("keras", "explicit"), ("torch", "fast"))],
)
def test_each_side_is_measured_under_its_own_convention(case, side_a, side_b):
    """A NaN row on one side is neither side's error; it is the cause ``fully-masked rows``."""
    x_q, x_kv, params, mask = _inputs(case)
    adapters = {"torch": torch_adapter, "keras": keras_adapter, "flax": flax_adapter}
    sides = [Side(f, adapters[f].load(params, HEADS), p) for f, p in (side_a, side_b)]
    result = attribute(*sides, x_q, x_kv, HEADS, mask=mask)
    for side, error in ((side_a, result.errors_a), (side_b, result.errors_b)):
        if side == ("keras", "additive"):
            # Its fully-masked rows are the unmasked softmax of logits quantised by s + (-1e9):
            # a real error (the masking constant), finite and within the path's bound.
            assert 0.1 < error < math.inf
            assert result["masking constant"].size > 0.1
        else:
            assert error < 1e-5, side
    rows = result["fully-masked rows"]
    conventions = {CONVENTION[side_a], CONVENTION[side_b]}
    assert rows.size == (math.inf if "nan" in conventions else rows.size)
    assert rows.size > 0
    assert f"a: {CONVENTION[side_a]}, b: {CONVENTION[side_b]}" in rows.detail


def test_a_row_that_breaks_the_convention_is_reported(monkeypatch):
    """A path said to answer 0 whose layer returns NaN (mhanum's -inf attention): not within."""
    x_q, x_kv, params, mask = _inputs("keras-test_masking")
    load, run = model_adapter.load, model_adapter.run

    def answers_nan(layer, *args, **kwargs):
        return run(dataclasses.replace(layer, fully_masked="nan"), *args, **kwargs)

    monkeypatch.setattr(model_adapter, "load", lambda p, h: load(p, h, fully_masked="zero"))
    monkeypatch.setattr(model_adapter, "run", answers_nan)
    (m,) = compare(x_q, x_kv, params, HEADS, mask=mask, frameworks=("model",)).measurements
    assert m.follows_convention is False
    assert m.within is False
    assert m.ratio is not None
    assert m.ratio <= 1  # the other rows are still within the bound
    assert "NOT its convention's answer" in m.rows_note
