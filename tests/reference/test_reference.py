"""mhanum.reference: closed forms, masking policies, certification, backend agreement, bad input.

Exact expectations are computed with ``fractions.Fraction`` (whose ``float()`` rounds correctly).
A float64 result is compared exactly only where the exact value is not within the certified
tolerance of a float64 rounding boundary (the documented limit of correct rounding).
"""

from __future__ import annotations

import ast
import math
import pathlib
from fractions import Fraction

import jax.numpy as jnp
import ml_dtypes
import mpmath
import numpy as np
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mhanum import CertificationError, InvalidArgument, MHAParams, reference
from mhanum.reference import _exact

DIGITS = 20
TOL = Fraction(1, 10**DIGITS)


# --- helpers -----------------------------------------------------------------------------------


def _fraction(value) -> Fraction:
    """The exact value of a float or of a finite mpf of moderate exponent."""
    if isinstance(value, float):
        return Fraction(value)
    man, exp = _exact.mpf_pair(value)
    return man * Fraction(2) ** exp


def _rounding(exact: Fraction, rel: Fraction) -> float | None:
    """The float64 to which every value within ``rel`` (relative) of ``exact`` rounds, if one."""
    spread = abs(exact) * rel
    try:
        low, high = float(exact - spread), float(exact + spread)
    except OverflowError:
        return math.copysign(math.inf, exact) if abs(exact) > 2**1024 else None
    return low if low == high else None


def _certified_rounding(value, rel: Fraction) -> float | None:
    """:func:`_rounding` of an mpf, whose exponent may be far outside the float64 range."""
    man, exp = _exact.mpf_pair(value)
    top = exp + abs(man).bit_length()
    sign = -1.0 if man < 0 else 1.0  # man may be too large for a float
    if top < -1100:
        return math.copysign(0.0, sign)
    if top > 1100:
        return math.copysign(math.inf, sign)
    return _rounding(man * Fraction(2) ** exp, rel)


def _assert_agree(a, b, rel: Fraction) -> None:
    """mpf arrays agree componentwise, ``|a - b| <= rel * max(|a|, |b|)``, and NaN where NaN.

    The check runs at 4000 bits, so it is exact to a relative 2**-4000 (mpf exponents can be far
    too large for exact rational arithmetic).
    """
    assert a.shape == b.shape
    ctx = mpmath.MPContext()
    ctx.prec = 4000
    tolerance = ctx.mpf(rel.numerator) / rel.denominator
    for index, x in np.ndenumerate(a):
        y = b[index]
        assert mpmath.isnan(x) == mpmath.isnan(y), index
        if not mpmath.isnan(x):
            x, y = ctx.mpf(x), ctx.mpf(y)
            assert abs(x - y) <= tolerance * max(abs(x), abs(y)), (index, x, y)


def _floats_match_where_unambiguous(floats: np.ndarray, values: np.ndarray, rel: Fraction) -> None:
    """``floats`` equal the rounding of the certified ``values`` wherever that is unambiguous."""
    for index, value in np.ndenumerate(values):
        if mpmath.isnan(value):
            assert math.isnan(floats[index])
            continue
        expected = _certified_rounding(value, rel)
        if expected is not None:
            assert floats[index] == expected, index


def _float64_attention(q, k, v, scale):
    s = q @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


# --- strategies --------------------------------------------------------------------------------

_EXTREMES = [0.0, 1.0, -1.0, 0.5, 3.0, 1e-30, -1e-30, 1e30, -1e30, 2.0**-60]
_ELEMENTS = st.one_of(st.floats(-4, 4), st.sampled_from(_EXTREMES))


@st.composite
def _attention_inputs(draw):
    batch = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=2))
    l_q, l_k = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d_k, d_v = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from([np.float64, ml_dtypes.bfloat16]))

    def array(shape):
        return draw(hnp.arrays(np.float64, shape, elements=_ELEMENTS)).astype(dtype)

    k_batch = draw(st.sampled_from([batch, batch[1:]]))
    q, k, v = array((*batch, l_q, d_k)), array((*k_batch, l_k, d_k)), array((*batch, l_k, d_v))
    mask_shape = draw(st.sampled_from([(l_q, l_k), (*batch, l_q, l_k), (l_k,)]))
    mask = draw(st.none() | hnp.arrays(np.bool_, mask_shape))
    bias = draw(
        st.none()
        | hnp.arrays(np.float64, (l_q, l_k), elements=st.floats(-50, 50) | st.just(-math.inf))
    )
    scale = draw(st.none() | st.sampled_from([1.0, 0.375, -2.0, 1e-3]))
    return q, k, v, {"mask": mask, "bias": bias, "scale": scale}


@st.composite
def _mha_inputs(draw):
    num_heads, d_k, d_v = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d_model, d_out = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    weight = st.floats(-2, 2) | st.sampled_from([1e-30, -1e20, 0.0])

    def array(shape):
        return draw(hnp.arrays(np.float64, shape, elements=weight))

    widths = [num_heads * d_k, num_heads * d_k, num_heads * d_v, d_out]
    biases = [array((width,)) for width in widths] if draw(st.booleans()) else []
    params = MHAParams(
        array((d_model, num_heads * d_k)),
        array((d_model, num_heads * d_k)),
        array((d_model, num_heads * d_v)),
        array((num_heads * d_v, d_out)),
        *biases,
    )
    batch = draw(hnp.array_shapes(min_dims=0, max_dims=1, max_side=2))
    l_q, l_k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    x_q = draw(hnp.arrays(np.float64, (*batch, l_q, d_model), elements=_ELEMENTS))
    x_kv = draw(hnp.arrays(np.float64, (l_k, d_model), elements=_ELEMENTS))
    mask_shape = draw(st.sampled_from([(l_q, l_k), (num_heads, l_q, l_k)]))
    mask = draw(st.none() | hnp.arrays(np.bool_, mask_shape))
    return x_q, x_kv, params, num_heads, mask


# --- closed forms ------------------------------------------------------------------------------


@given(
    v=hnp.arrays(
        np.float64,
        st.tuples(st.integers(1, 7), st.integers(1, 3)),
        elements=st.floats(-1e6, 1e6) | st.sampled_from([1e-300, -1e-300, 5e-324, 1e300]),
    ),
    d_k=st.integers(1, 5),
)
def test_equal_scores_give_the_correctly_rounded_mean_of_v(v, d_k):
    l_k = v.shape[0]
    q, k = np.zeros((1, d_k)), np.random.default_rng(0).standard_normal((l_k, d_k))
    out, values = reference.attention(q, k, v, return_mpf=True)
    for c in range(v.shape[1]):
        mean = sum(Fraction(x) for x in v[:, c]) / l_k
        if _rounding(mean, TOL) is not None:
            assert out[0, c] == float(mean)
        assert abs(_fraction(values[0, c]) - mean) <= TOL * abs(mean)


@pytest.mark.parametrize(
    ("v_column", "expected"),
    [
        ([5e-324, 0.0], 0.0),  # 2**-1075: a tie, to even
        ([3 * 5e-324, 0.0], 2 * 5e-324),  # 1.5 * 2**-1074: a tie, to even
        ([5e-324, 5e-324, 5e-324, 0.0], 5e-324),  # 0.75 * 2**-1074: up
        ([5e-324, 0.0, 0.0, 0.0], 0.0),  # 0.25 * 2**-1074: down
        ([1.0, 1.0 + 2.0**-52], 1.0),  # 1 + 2**-53: a tie, to even
    ],
)
def test_mean_rounds_once_to_nearest_even(v_column, expected):
    v = np.array(v_column)[:, None]
    out = reference.attention(np.zeros((1, 1)), np.zeros((len(v), 1)), v)
    assert out[0, 0] == expected
    assert math.copysign(1.0, out[0, 0]) == 1.0


@given(
    v=hnp.arrays(
        np.float64,
        st.tuples(st.integers(2, 5), st.integers(1, 3)),
        elements=st.just(0.0) | st.floats(1e-6, 1e6) | st.floats(-1e6, -1e-6),
    ),
    data=st.data(),
)
def test_one_dominant_score_selects_its_value_row(v, data):
    # Scores differ by >= 800: the other weights are < e**-800 < 1e-347, so they move the output
    # by less than 1e-347 * 1e6 / 1e-6 = 1e-335 relative, far below half an ulp (or 0 underflows).
    l_k = v.shape[0]
    winner = data.draw(st.integers(0, l_k - 1))
    k = np.zeros((l_k, 1))
    k[winner, 0] = 1.0
    q = np.array([[data.draw(st.sampled_from([800.0, 1000.0, 1e30]))]])
    out = reference.attention(q, k, v, scale=1.0)
    np.testing.assert_array_equal(out[0], v[winner])


@given(inputs=_attention_inputs())
def test_a_single_key_returns_its_value(inputs):
    q, k, v, options = inputs
    out = reference.attention(q, k[..., :1, :], v[..., :1, :], scale=options["scale"])
    expected = np.broadcast_to(v[..., :1, :].astype(np.float64), out.shape)
    np.testing.assert_array_equal(out, expected)


def test_a_mask_keeping_one_key_returns_its_value():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    mask = np.zeros((4, 5), dtype=bool)
    keep = [2, 0, 4, 2]
    mask[np.arange(4), keep] = True
    for backend in ("exact", "mpmath"):
        np.testing.assert_array_equal(
            reference.attention(q, k, v, mask=mask, backend=backend), v[keep]
        )


def test_float64_attention_is_within_its_error_bound_of_the_reference():
    # The convention (scale 1/sqrt(d_k) = 0.5, keys along rows) checked against float64 attention,
    # whose error is bounded to first order in u = 2**-53 (exp assumed within 4 ulps):
    # each score is off by at most gamma(d_k + 1) * 0.5 * sum_t |q_t k_t|; a weight
    # exp(s_j - max s) then by twice that (both scores move) plus 5u; p_j = e_j / sum e adds
    # gamma(L_k) + u; o = sum_j p_j v_j adds gamma(L_k) relative to sum_j p_j |v_j| <= max |v|.
    # The factor 1 + 1e-6 covers the second-order terms (all below 1e-12 relative here).
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    u = 2.0**-53
    score = 5 * u * 0.5 * (np.abs(q) @ np.abs(k).T).max(axis=1, keepdims=True)
    weight = 2 * score + 5 * u + 7 * u + u
    bound = (weight + 7 * u) * np.abs(v).max(axis=0) * (1 + 1e-6)
    error = np.abs(reference.attention(q, k, v) - _float64_attention(q, k, v, 0.5))
    assert (error <= bound).all()


def test_one_head_mha_equals_attention_on_exact_projections():
    # Small integers and eighths: every x @ w + b below is exact in float64, and wo = I, bo = None
    # make y = o, so both computations certify the same real numbers.
    rng = np.random.default_rng(3)
    d_model, d_k = 4, 3
    x_q = rng.integers(-3, 4, (2, 5, d_model)).astype(np.float64)
    x_kv = rng.integers(-3, 4, (2, 6, d_model)).astype(np.float64)
    w = [rng.integers(-16, 17, (d_model, d_k)) / 8 for _ in range(3)]
    b = [rng.integers(-3, 4, d_k).astype(np.float64) for _ in range(3)]
    params = MHAParams(w[0], w[1], w[2], np.eye(d_k), b[0], b[1], b[2], None)
    mask = rng.random((5, 6)) < 0.7
    q, k, v = x_q @ w[0] + b[0], x_kv @ w[1] + b[1], x_kv @ w[2] + b[2]
    y, y_values = reference.multi_head_attention(x_q, x_kv, params, 1, mask=mask, return_mpf=True)
    _, o_values = reference.attention(q, k, v, mask=mask, return_mpf=True)
    _assert_agree(y_values, o_values, 2 * TOL)
    _floats_match_where_unambiguous(y, o_values, 2 * TOL)


def test_heads_are_column_blocks_in_order():
    # Two heads with identical weights in both blocks and wo stacking [I; 0] gives head 0 alone.
    rng = np.random.default_rng(4)
    w = rng.integers(-2, 3, (3, 2)).astype(np.float64)
    x = rng.integers(-2, 3, (4, 3)).astype(np.float64)
    wv = np.concatenate([w, np.zeros((3, 2))], axis=1)
    wo = np.concatenate([np.eye(2), np.eye(2) * 0], axis=0)
    params = MHAParams(np.tile(w, 2), np.tile(w, 2), wv, wo)
    two_heads = reference.multi_head_attention(x, x, params, 2)
    one_head = reference.attention(x @ w, x @ w, x @ w)
    np.testing.assert_array_equal(two_heads, one_head)


@pytest.mark.parametrize("backend", ["exact", "mpmath"])
def test_huge_logits_are_differenced_exactly(backend):
    # Scores 1 and -2**200: the logit difference -2**200 - 1 needs 201 bits, so rounding it to the
    # working precision loses the -1 at p and at 2p alike, and the two would agree on e**(-2**200)
    # instead of e**(-2**200 - 1).
    q = np.array([[1.0, 2.0**100]])
    k = np.array([[1.0, 0.0], [0.0, -(2.0**100)]])
    v = np.array([[0.0], [1.0]])
    _, value = reference.attention(q, k, v, scale=1.0, backend=backend, return_mpf=True)
    ctx = mpmath.MPContext()
    ctx.prec = 300
    weight = ctx.exp(-(ctx.mpf(2) ** 200) - 1)
    _assert_agree(value, np.array([[weight / (1 + weight)]], dtype=object), TOL)


@pytest.mark.parametrize("backend", ["exact", "mpmath"])
@pytest.mark.parametrize(("logit", "v_far"), [(-500.0, 1e200), (-1e4, 1e300), (-100.0, 1e-300)])
def test_tiny_weights_survive_cancellation_of_the_large_ones(backend, logit, v_far):
    # Keys 0 and 1 have equal weights and opposite values, which cancel exactly; the output is the
    # far smaller contribution of key 2, e**logit * v_far / (2 + e**logit).
    v = np.array([[1.0], [-1.0], [v_far]])
    bias = np.array([[0.0, 0.0, logit]])
    _, value = reference.attention(
        np.zeros((1, 1)), np.zeros((3, 1)), v, bias=bias, backend=backend, return_mpf=True
    )
    ctx = mpmath.MPContext()
    ctx.prec = 300
    weight = ctx.exp(logit)
    _assert_agree(value, np.array([[weight * v_far / (2 + weight)]], dtype=object), TOL)


@pytest.mark.parametrize("backend", ["exact", "mpmath"])
def test_mha_keeps_the_small_part_of_values_whose_large_parts_cancel(backend):
    # v = [[1e100, 1e100], [1, 0]] and wo = [[1], [-1]]: y = p_0 (1e100 - 1e100) + p_1 (1 - 0), so
    # y = p_1 = 1 / (1 + e) exactly; a head output rounded to fewer than 333 + 60 bits has lost it.
    params = MHAParams(
        wq=np.array([[1.0], [0.0]]),
        wk=np.array([[1.0], [0.0]]),
        wv=np.array([[1e100, 1e100], [1.0, 0.0]]),
        wo=np.array([[1.0], [-1.0]]),
    )
    x_q, x_kv = np.array([[1.0, 0.0]]), np.eye(2)
    _, value = reference.multi_head_attention(
        x_q, x_kv, params, 1, backend=backend, return_mpf=True
    )
    ctx = mpmath.MPContext()
    ctx.prec = 300
    _assert_agree(value, np.array([[1 / (1 + ctx.e)]], dtype=object), TOL)


@pytest.mark.parametrize("exponent", [100, 300])
def test_mha_with_scores_far_apart_attends_each_rows_top_key(exponent):
    # x ~ 2**exponent: each head's scores lie some 2**(2 exponent - 4) apart, so every weight but
    # the top key's is below e**(-2**190) and the output is y = sum_h v_top(h) wo_h + bo (the fast
    # path's probability balls are not finite there: it hands the rows to the exact backend).
    rng = np.random.default_rng(exponent)
    x = np.ldexp(rng.standard_normal((3, 4)), exponent)
    params = MHAParams.random(4, seed=exponent)
    _, value = reference.multi_head_attention(x, x, params, 2, return_mpf=True)
    ctx = mpmath.MPContext()
    ctx.prec = 3000
    exactly = np.vectorize(ctx.mpf, otypes=[object])
    names = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
    p = [exactly(getattr(params, name)) for name in names]
    q, k, v = (exactly(x) @ p[i] + p[4 + i] for i in range(3))
    expected = np.empty((3, 4), dtype=object)
    for r in range(3):
        heads = []
        for h in range(2):
            cols = slice(2 * h, 2 * h + 2)
            scores = [sum(q[r, cols] * k[j, cols]) for j in range(3)]
            heads.extend(v[max(range(3), key=lambda j: scores[j]), cols])
        expected[r] = np.array(heads, dtype=object) @ p[3] + p[7]
    _assert_agree(value, expected, TOL)


# --- masking -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["exact", "mpmath"])
@pytest.mark.parametrize("fully_masked", ["nan", "zero", "uniform"])
def test_fully_masked_rows_follow_the_policy_and_leave_other_rows(backend, fully_masked):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    mask = rng.random((4, 5)) < 0.6
    mask[[0, 2]] = True
    mask[1] = False
    bias = np.zeros((4, 5))
    bias[3] = -np.inf
    out = reference.attention(
        q, k, v, mask=mask, bias=bias, fully_masked=fully_masked, backend=backend
    )
    expected_row = {"nan": np.full(2, np.nan), "zero": np.zeros(2), "uniform": None}[fully_masked]
    if expected_row is None:
        mean = [float(sum(Fraction(x) for x in v[:, c]) / 5) for c in range(2)]
        expected_row = np.array(mean)
    for row in (1, 3):
        np.testing.assert_array_equal(out[row], expected_row)
    alone = reference.attention(q[[0, 2]], k, v, mask=mask[[0, 2]], backend=backend)
    np.testing.assert_array_equal(out[[0, 2]], alone)


def test_fully_masked_row_in_one_head_is_nan_in_mha():
    params = MHAParams.random(4, seed=0)
    x = np.random.default_rng(6).standard_normal((3, 4))
    mask = np.ones((2, 3, 3), dtype=bool)
    mask[1, 2] = False
    y = reference.multi_head_attention(x, x, params, 2, mask=mask)
    assert np.isnan(y[2]).all()
    assert np.isfinite(y[:2]).all()
    zero = reference.multi_head_attention(x, x, params, 2, mask=mask, fully_masked="zero")
    np.testing.assert_array_equal(zero[:2], y[:2])


@given(inputs=_attention_inputs())
def test_minus_inf_bias_is_a_mask(inputs):
    q, k, v, options = inputs
    mask, bias = options["mask"], options["bias"]
    assume(mask is not None)
    bias = np.zeros(mask.shape[-2:]) if bias is None else bias
    as_mask = reference.attention(q, k, v, mask=mask, bias=bias, scale=options["scale"])
    as_bias = reference.attention(
        q, k, v, bias=bias + np.where(mask, 0.0, -np.inf), scale=options["scale"]
    )
    np.testing.assert_array_equal(as_mask, as_bias)


# --- certification -----------------------------------------------------------------------------


@given(inputs=_attention_inputs())
@example(
    inputs=(
        np.array([[0, 0, 0], [1, -1.00026e30, 0]], dtype=ml_dtypes.bfloat16),
        np.array([[1, 0, 0], [0, 1.00026e30, 0]], dtype=ml_dtypes.bfloat16),
        np.array([[0, 0], [1, 0]], dtype=ml_dtypes.bfloat16),
        {"mask": None, "bias": None, "scale": 1.0},
    )
)
def test_certified_digits_hold_against_a_more_precise_run(inputs):
    q, k, v, options = inputs
    _, low = reference.attention(q, k, v, **options, return_mpf=True)
    _, high = reference.attention(q, k, v, **options, digits=60, return_mpf=True)
    # |low - x| <= 1e-20 |x| and |high - x| <= 1e-60 |x| give |low - high| <= (1e-20 + 2e-60) |high|,
    # except where low is certified as 0 within 2**-1075 (the example's e**-1e60 at 20 digits,
    # from the "arb" enclosure of "auto"; at 60 digits "auto" runs "exact")
    half_subnormal = mpmath.mpf(2) ** -1075
    below = np.vectorize(lambda x, y: x == 0 and abs(y) <= half_subnormal, otypes=[bool])
    _assert_agree(low, np.where(below(low, high), low, high), TOL + Fraction(2, 10**60))


def _ill_conditioned():
    """o = p1 * 1 + p2 * (-fl(p1/p2)): about 16 of the digits of p1 cancel."""
    q, k = np.array([[1.0]]), np.array([[0.0], [1.0]])
    p1, p2 = 1 / (1 + math.e), math.e / (1 + math.e)
    return q, k, np.array([[1.0], [-(p1 / p2)]])


def test_ill_conditioned_output_raises_when_max_prec_is_too_small():
    # 30 digits need p = 132 bits; at 132 bits only ~40 - 16 = 24 digits survive the cancellation,
    # and the next attempt (p = 264) is beyond max_prec.
    q, k, v = _ill_conditioned()
    with pytest.raises(CertificationError, match=r"30 digits.*index \(0, 0\).*agrees to 2\d\.\d"):
        reference.attention(q, k, v, scale=1.0, digits=30, max_prec=200)


def test_ill_conditioned_output_is_certified_with_enough_precision():
    q, k, v = _ill_conditioned()
    for backend in ("exact", "mpmath"):
        _, value = reference.attention(
            q, k, v, scale=1.0, digits=30, max_prec=300, backend=backend, return_mpf=True
        )
        ctx = mpmath.MPContext()
        ctx.prec = 400
        p1 = 1 / (1 + ctx.e)
        exact = p1 + (1 - p1) * ctx.mpf(float(v[1, 0]))
        assert abs(_fraction(value[0, 0]) - _fraction(exact)) <= Fraction(1, 10**30) * abs(
            _fraction(exact)
        )


def test_the_global_mpmath_precision_is_neither_read_nor_changed():
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    before = reference.attention(q, k, v, digits=25)
    old = mpmath.mp.prec
    try:
        mpmath.mp.prec = 10
        assert np.array_equal(reference.attention(q, k, v, digits=25), before)
        assert mpmath.mp.prec == 10
    finally:
        mpmath.mp.prec = old


def test_the_reference_imports_no_implementation_under_test():
    allowed = {
        "mhanum",
        "mhanum.reference",
        "mhanum.reference._dd",
        "mhanum._errors",
        "mhanum._threads",  # how many BLAS threads its products run on: no arithmetic
        "mhanum._validate",
        "mhanum.masks",  # which keys a mask attends: data, checked against the frameworks
        "mhanum.problem",  # the arguments checked together: data, no arithmetic
        "mhanum.params",
        "mhanum.gradients",  # the NamedTuple the gradients are returned in: data, no arithmetic
        "mhanum._types",  # annotation aliases only: no code
    }
    package = pathlib.Path(reference.__file__).parent
    files = sorted(package.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "_exact.py", "_dd.py", "_fastref.py"}
    for path in [*files, package.parent / "_validate.py", package.parent / "problem.py"]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "mhanum").startswith("mhanum"):
                own = node.module.startswith("mhanum.reference.")  # the reference's own modules
                assert own or node.module in allowed, (path.name, node.module)
                if node.module == "mhanum":
                    names = {alias.name for alias in node.names}
                    assert names <= {"_validate", "masks"}, path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("mhanum") for a in node.names), path.name


# --- backends agree ----------------------------------------------------------------------------


@given(inputs=_attention_inputs(), fully_masked=st.sampled_from(["nan", "zero", "uniform"]))
def test_exact_and_mpmath_backends_agree_on_attention(inputs, fully_masked):
    q, k, v, options = inputs
    results = [
        reference.attention(
            q, k, v, **options, fully_masked=fully_masked, backend=backend, return_mpf=True
        )
        for backend in ("exact", "mpmath")
    ]
    (exact, exact_values), (naive, naive_values) = results
    _assert_agree(exact_values, naive_values, 2 * TOL)
    _floats_match_where_unambiguous(exact, naive_values, 2 * TOL)
    _floats_match_where_unambiguous(naive, exact_values, 2 * TOL)


@given(inputs=_mha_inputs())
def test_exact_and_mpmath_backends_agree_on_mha(inputs):
    x_q, x_kv, params, num_heads, mask = inputs
    results = [
        reference.multi_head_attention(
            x_q, x_kv, params, num_heads, mask=mask, backend=backend, return_mpf=True
        )
        for backend in ("exact", "mpmath")
    ]
    (exact, exact_values), (_, naive_values) = results
    _assert_agree(exact_values, naive_values, 2 * TOL)
    _floats_match_where_unambiguous(exact, naive_values, 2 * TOL)


@pytest.mark.parametrize(
    "dtype", [np.float16, np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn]
)
def test_low_precision_inputs_are_converted_exactly(dtype):
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in ((3, 2), (4, 2), (4, 2)))
    as_float64 = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    np.testing.assert_array_equal(reference.attention(q, k, v), as_float64)
    np.testing.assert_array_equal(
        reference.attention(*(jnp.asarray(x) for x in (q, k, v))), as_float64
    )


def test_mha_output_past_the_float64_range_is_inf():
    params = MHAParams(np.eye(1), np.eye(1), np.eye(1), np.array([[1e300]]))
    x_kv = np.array([[1e300]])
    y, values = reference.multi_head_attention(
        np.ones((1, 1)), x_kv, params, 1, backend="exact", return_mpf=True
    )
    assert y[0, 0] == np.inf
    assert _fraction(values[0, 0]) == Fraction(1e300) ** 2
    # The default backend certifies 20 digits of it (its fallback need not be exact).
    y, values = reference.multi_head_attention(np.ones((1, 1)), x_kv, params, 1, return_mpf=True)
    assert y[0, 0] == np.inf
    assert abs(_fraction(values[0, 0]) - Fraction(1e300) ** 2) <= TOL * Fraction(1e300) ** 2


# --- the exact kernels -------------------------------------------------------------------------

_BIG_INTS = st.integers(-(2**300), 2**300) | st.integers(-5, 5)


@given(data=st.data(), m=st.integers(1, 4), n=st.integers(0, 5), c=st.integers(1, 3))
def test_ozaki_matmul_is_the_exact_integer_product(data, m, n, c):
    a = data.draw(hnp.arrays(object, (m, n), elements=_BIG_INTS))
    b = data.draw(hnp.arrays(object, (n, c), elements=_BIG_INTS))
    product = _exact.matmul(_exact.Dyadic(-3, ints=a), _exact.Dyadic(5, ints=b))
    assert product.exp == 2
    expected = np.array(
        [[sum(a[i, t] * b[t, j] for t in range(n)) for j in range(c)] for i in range(m)],
        dtype=object,
    ).reshape(m, c)
    assert (product.ints == expected).all()


_FINITE = st.floats(allow_nan=False, allow_infinity=False)


@given(data=st.data(), m=st.integers(1, 3), n=st.integers(0, 4), c=st.integers(1, 3))
def test_ozaki_matmul_of_floats_splits_them_exactly(data, m, n, c):
    # Digits of float64 data come from float operations (frexp, ldexp, floor, fmod), subnormals
    # and values near the overflow threshold included; the product must equal the integer one.
    a = data.draw(hnp.arrays(np.float64, (m, n), elements=_FINITE))
    b = data.draw(hnp.arrays(np.float64, (n, c), elements=_FINITE))
    a_exact, b_exact = _exact.Dyadic.from_float64(a), _exact.Dyadic.from_float64(b)
    product = _exact.matmul(a_exact, b_exact)
    assert (product.ints == (a_exact.ints @ b_exact.ints if n else 0)).all()


def test_ozaki_matmul_is_exact_for_a_long_inner_dimension():
    # n = 1000 leaves 21-bit digits; products of 310-bit integers need 15 of them each.
    rng = np.random.default_rng(10)
    a = np.array([[int(rng.integers(1, 2**62)) ** 5 * (-1) ** i for i in range(1000)]] * 2, object)
    b = np.array([[int(rng.integers(1, 2**62)) ** 5] for _ in range(1000)], object)
    product = _exact.matmul(_exact.Dyadic(0, ints=a), _exact.Dyadic(0, ints=b))
    assert (product.ints == a @ b).all()


@given(
    x=hnp.arrays(
        np.float64,
        hnp.array_shapes(max_dims=2),
        elements=_FINITE,
    )
)
def test_float64_arrays_convert_exactly(x):
    d = _exact.Dyadic.from_float64(x)
    for index, value in np.ndenumerate(x):
        assert Fraction(value) == d.ints[index] * Fraction(2) ** d.exp


@given(
    terms=st.lists(st.tuples(_BIG_INTS, st.integers(-3000, 3000)), max_size=8),
    prec=st.integers(10, 200),
)
def test_sum_exact_is_within_its_truncation_bound(terms, prec):
    exact = sum((m * Fraction(2) ** e for m, e in terms), Fraction(0))
    man, exp = _exact.sum_exact(terms, prec)
    assert abs(man * Fraction(2) ** exp - exact) <= abs(exact) * Fraction(1, 2 ** (prec + 7))


@given(terms=st.lists(st.tuples(_BIG_INTS, st.integers(-3000, 3000)), max_size=8))
def test_sum_exact_without_a_precision_is_exact(terms):
    man, exp = _exact.sum_exact(terms)
    assert man * Fraction(2) ** exp == sum((m * Fraction(2) ** e for m, e in terms), Fraction(0))


def test_sum_exact_keeps_small_terms_when_large_ones_cancel():
    # mpmath.fsum gives 0 here at 100 and 200 bits.
    assert _exact.sum_exact([(1, 0), (1, -1000), (-1, 0)], 100) == (1, -1000)


@given(man=st.integers(-(2**200), 2**200), exp=st.integers(-1400, 1100))
def test_to_float64_rounds_once_correctly(man, exp):
    value = man * Fraction(2) ** exp
    try:
        expected = float(value)
    except OverflowError:
        expected = math.copysign(math.inf, man)
    assert _exact.to_float64(man, exp) == expected


def test_to_float64_avoids_the_double_rounding_of_mpf_float():
    # 2**-1075 + 2**-1200 is just above half the smallest subnormal: it rounds up to 2**-1074.
    # float(mpf) rounds to 53 bits first (giving exactly 2**-1075) and then ties to even: 0.
    man, exp = (1 << 125) + 1, -1200
    assert _exact.to_float64(man, exp) == 2.0**-1074


# --- bad input ---------------------------------------------------------------------------------

_Q, _K, _V = np.zeros((2, 3)), np.zeros((4, 3)), np.zeros((4, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"q": np.zeros((2, 3), dtype=np.int32)}, r"^q: expected a floating-point array"),
        ({"q": np.zeros((2, 3), dtype=np.complex128)}, r"^q: expected a floating-point array"),
        ({"q": np.zeros(3)}, r"^q: expected an array with at least 2 dimensions"),
        ({"k": np.zeros((4, 2))}, r"^k: expected last dimension d_k = 3 \(from q\)"),
        (
            {"k": np.zeros((0, 3)), "v": np.zeros((0, 2))},
            r"^k: expected at least one query, one key",
        ),
        ({"v": np.zeros((5, 2))}, r"^v: expected 4 keys \(Lk, from k\)"),
        ({"q": np.full((2, 3), np.nan)}, r"^q: expected finite values"),
        ({"v": np.full((4, 2), np.inf)}, r"^v: expected finite values"),
        ({"q": np.zeros((2, 2, 3)), "k": np.zeros((3, 4, 3))}, r"^q, k, v: expected broadcast"),
        ({"mask": np.ones((2, 4))}, r"^mask: expected a boolean array \(True = attend"),
        ({"mask": np.ones((3, 4), dtype=bool)}, r"^mask: expected a shape broadcastable"),
        ({"bias": np.full((2, 4), np.nan)}, r"^bias: expected finite values or -inf"),
        ({"bias": np.full((2, 4), np.inf)}, r"^bias: expected finite values or -inf"),
        ({"bias": np.zeros((2, 4), dtype=np.int64)}, r"^bias: expected a floating-point"),
        ({"scale": math.nan}, r"^scale: expected None or a finite real number"),
        ({"scale": "0.5"}, r"^scale: expected None or a finite real number"),
        ({"digits": 0}, r"^digits: expected an integer in \[1, 2000\]"),
        ({"digits": 20.0}, r"^digits: expected an integer"),
        ({"digits": True}, r"^digits: expected an integer"),
        ({"max_prec": 32}, r"^max_prec: expected an integer >= 64"),
        ({"digits": 100, "max_prec": 64}, r"^max_prec: expected at least 365 bits"),
        ({"fully_masked": "ignore"}, r"^fully_masked: expected one of"),
        ({"backend": "numpy"}, r"^backend: expected one of 'auto', 'dd', 'exact', 'mpmath', 'arb'"),
        ({"return_mpf": "yes"}, r"^return_mpf: expected a bool"),
    ],
)
def test_bad_attention_arguments_are_named(kwargs, match):
    arrays = {"q": _Q, "k": _K, "v": _V}
    options = {key: kwargs[key] for key in kwargs if key not in arrays}
    q, k, v = (kwargs.get(name, default) for name, default in arrays.items())
    with pytest.raises(InvalidArgument, match=match):
        reference.attention(q, k, v, **options)


_PARAMS = MHAParams.random(4, seed=0)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (
            (np.zeros((2, 3)), np.zeros((2, 4)), _PARAMS, 2),
            {},
            r"^x_q: expected last dimension 4 \(from params\)",
        ),
        (
            (np.zeros((2, 4)), np.zeros((2, 5)), _PARAMS, 2),
            {},
            r"^x_kv: expected last dimension 4 \(from params\)",
        ),
        ((np.zeros((2, 4)), np.full((2, 4), np.nan), _PARAMS, 2), {}, r"^x_kv: expected finite"),
        (
            (np.zeros((2, 4), dtype=int), np.zeros((2, 4)), _PARAMS, 2),
            {},
            r"^x_q: expected a floating",
        ),
        ((np.zeros((2, 4)), np.zeros((2, 4)), _PARAMS, 3), {}, r"^num_heads: expected a divisor"),
        ((np.zeros((2, 4)), np.zeros((2, 4)), "params", 2), {}, r"^params: expected an MHAParams"),
        (
            (np.zeros((2, 4)), np.zeros((2, 4)), _PARAMS, 2),
            {"mask": np.ones((3, 2, 2), dtype=bool)},
            r"^mask: expected a shape broadcastable to \(2, 2, 2\)",
        ),
        (
            (np.zeros((3, 2, 4)), np.zeros((2, 2, 4)), _PARAMS, 2),
            {},
            r"^x_q, x_kv: expected broadcastable batch dimensions",
        ),
    ],
)
def test_bad_mha_arguments_are_named(args, kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        reference.multi_head_attention(*args, **kwargs)


# --- a larger case -----------------------------------------------------------------------------


def test_backends_agree_on_a_four_head_layer():
    params = MHAParams.random(32, seed=1)
    rng = np.random.default_rng(9)
    x_q, x_kv = rng.standard_normal((2, 8, 32)), rng.standard_normal((9, 32))
    mask = rng.random((4, 8, 9)) < 0.8
    exact = reference.multi_head_attention(x_q, x_kv, params, 4, mask=mask, return_mpf=True)
    naive = reference.multi_head_attention(
        x_q, x_kv, params, 4, mask=mask, backend="mpmath", return_mpf=True
    )
    _assert_agree(exact[1], naive[1], 2 * TOL)
    _floats_match_where_unambiguous(exact[0], naive[1], 2 * TOL)


@pytest.mark.parametrize("backend", ["auto", "dd", "exact", "mpmath", "arb"])
def test_mha_takes_a_scale_used_exactly(backend):
    """``scale=`` on every head: scale 1/4 with d_k = 4 (whose default is 1/2) is the default
    scale with ``wq`` and ``bq`` halved (exact), bit for bit, on every backend; and with a rope."""
    import dataclasses

    from mhanum.rope import Rope

    params = MHAParams.random(8, seed=0)
    halved = dataclasses.replace(params, wq=params.wq / 2, bq=params.bq / 2)
    x = np.random.default_rng(0).standard_normal((5, 8))
    digits = 15 if backend == "dd" else 20
    scaled = reference.multi_head_attention(
        x, x, params, 2, scale=0.25, backend=backend, digits=digits
    )
    assert np.array_equal(
        scaled, reference.multi_head_attention(x, x, halved, 2, backend=backend, digits=digits)
    )
    if backend in ("auto", "arb"):
        kw = {"rope": Rope(dim=4, base=500.0), "positions": np.arange(5) + 70, "backend": backend}
        got = reference.multi_head_attention(x, x, params, 2, scale=0.25, **kw)
        assert np.array_equal(got, reference.multi_head_attention(x, x, halved, 2, **kw))
