"""``exp_form="exp2-folded"``: exp2 with the scale folded into the exponent (step 3'').

The kernels of FlashAttention-2/3 and Triton leave the scores unscaled and compute
``exp2(fl(fl(t·c2) - fl(m·c2)))``: the rounding of the product and of each block's shift grows
with the row maximum. The emulation computes that form; Theorem A.1 charges it; the bound covers
the measured error on rows with large maxima and small spreads (where the shift's rounding is
largest against the logits' differences), in every format and softmax algorithm, and the
argument errors that do not cancel under the online softmax.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics
from mhanum.bounds import attention_bound, attention_bound_a_priori, mha_bound


def _fold(**kw: object) -> Numerics:
    return Numerics(exp_form="exp2-folded", **kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"exp_form": "exp3"},
            r"^numerics.exp_form: expected one of \('exp', 'exp2', 'exp2-folded', 'exp2-scaled'\)",
        ),
        ({"exp_form": "exp2-folded", "scale": "q"}, r"^numerics.scale: expected 'scores'"),
        ({"exp_form": "exp2-folded", "softmax": "naive"}, r"^numerics.softmax: expected 'safe'"),
        ({"exp_form": "exp2-folded", "mask_value": -1e9}, r"^numerics.mask_value: expected -inf"),
    ],
)
def test_bad_combinations_raise_naming_the_field(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        Numerics(**kw)


def test_a_bias_is_refused_where_it_would_be_scaled():
    q = np.ones((2, 4))
    num = _fold()
    for call in (
        lambda: mn.attention(q, q, q, bias=np.zeros((2, 2)), numerics=num),
        lambda: attention_bound(q, q, q, bias=np.zeros((2, 2)), numerics=num),
    ):
        with pytest.raises(InvalidArgument, match=r"^bias: expected None with numerics.exp_form"):
            call()


def test_the_a_priori_theorem_says_it_does_not_cover_the_form():
    with pytest.raises(InvalidArgument, match=r"^numerics.exp_form: the a priori bound \(A.4\)"):
        attention_bound_a_priori(4, 4, 4, q_norm=1.0, k_norm=1.0, v_max=1.0, numerics=_fold())


CASES = [
    (fmt, softmax)
    for fmt in ("float32", "bfloat16", "float16")
    for softmax in ("safe", "online(8)", "online(3)")
]


@pytest.mark.parametrize(("fmt", "softmax"), CASES)
def test_large_row_maxima_with_small_spreads_are_covered(fmt, softmax):
    rng = np.random.default_rng(len(fmt) * 10 + len(softmax))
    num = _fold(input=fmt, accum="float32", softmax=softmax, prob_format=fmt, output_format=fmt)
    shares = []
    for offset in (1e1, 1e3, 3e4):
        # logits t_j = A + d_j (q = (A, 1), k_j = (1, d_j), exact in float32): a row maximum
        # near A with a spread of about 4, so the roundings of t·c2 and m·c2 (about u·A) are
        # large against the logits' differences
        a = float(mn.round_to(offset, fmt))
        q = np.zeros((16, 4))
        q[:, 0], q[:, 1] = a, 1.0
        k = np.zeros((24, 4))
        k[:, 0], k[:, 1] = 1.0, np.asarray(mn.round_to(rng.uniform(0, 4, 24), fmt))
        v = np.asarray(mn.round_to(rng.standard_normal((24, 4)), fmt), np.float64)
        mask = rng.random((16, 24)) < 0.8
        mask[:, 0] = True
        bound = attention_bound(q, k, v, mask, numerics=num, scale=1.0)
        out = np.asarray(mn.attention(q, k, v, mask, numerics=num, scale=1.0), np.float64)
        exact = np.asarray(mn.reference.attention(q, k, v, mask=mask, scale=1.0), np.float64)
        err = np.abs(out - exact)
        assert np.all(err <= bound.total), (offset, float(np.max(err / bound.total)))
        assert np.all(np.isfinite(bound.total))
        shares.append(float(np.max(bound.parts["logits"]["exp_fold"] / bound.total)))
    if fmt == "float32":
        # at the largest maximum the folded term is a real part of the bound (the case tests
        # it; in half precision the probabilities' and the output's roundings dominate)
        assert shares[-1] > 0.1


def test_the_folded_term_is_in_the_logits_breakdown():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((8, 16)) for _ in range(3))
    bound = attention_bound(q * 100, k, v, numerics=_fold(softmax="online(4)"))
    fold = bound.parts["logits"]["exp_fold"]
    assert np.all(fold > 0)
    assert np.all(fold <= bound.terms["logits"] * (1 + 1e-9))
    plain = attention_bound(q * 100, k, v, numerics=Numerics(softmax="online(4)"))
    assert "exp_fold" not in plain.parts["logits"]


def test_tiny_and_negative_scales_are_infinite_with_the_reason():
    q, k, v = (np.ones((2, 4)) for _ in range(3))
    tiny = attention_bound(q, k, v, numerics=_fold(softmax="online(2)"), scale=1e-45)
    assert np.all(np.isinf(tiny.total))
    assert any("subnormal or zero" in r for r in tiny.reasons)
    negative = attention_bound(q, k, v, numerics=_fold(), scale=-0.5)
    assert np.all(np.isinf(negative.total))
    assert any("negative scale" in r for r in negative.reasons)


def test_multi_head_attention_with_the_folded_form_is_covered():
    params = mn.MHAParams.random(16, seed=4)
    x = np.random.default_rng(4).standard_normal((1, 12, 16)) * 8
    num = _fold(input="bfloat16", accum="float32", softmax="online(4)")
    bound = mha_bound(x, x, params, 2, numerics=num)
    out = np.asarray(mn.multi_head_attention(x, x, params, 2, numerics=num), np.float64)
    exact = np.asarray(mn.reference.multi_head_attention(x, x, params, 2), np.float64)
    assert np.all(np.abs(out - exact) <= bound.total)
    assert math.isfinite(float(np.max(bound.total)))
