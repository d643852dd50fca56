"""mhanum.reference backends: every backend agrees with the naive mpmath path to its digits.

The fast path (``"dd"``, ``mhanum.reference._dd`` and ``mhanum.reference._fastref``) is tested twice: its enclosures
``|exact - (hi + lo)| <= rad`` against references certified to 40 digits (so the slack of the
reference, ``10**-40`` relative, is far below any radius), stage by stage (``exp``, ``matmul``,
the whole attention), and its certified outputs against ``backend="mpmath"``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from fractions import Fraction

import mpmath
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from mhanum import CertificationError, InvalidArgument, MHAParams, reference
from mhanum.reference import _dd, _exact, _fastref
from mhanum.reference._spec import float_pair
from tests.reference.test_reference import _assert_agree

DIGITS = 20
TOL = Fraction(1, 10**DIGITS)
FAST = ("auto", "dd", "arb")


def _assert_encloses(ball: _dd.Ball, exact, slack: Fraction = Fraction(0)) -> None:
    """``|exact - (hi + lo)| <= rad + slack |exact|`` componentwise (exact values mpf or Fraction).

    Checked at 4000 bits (mpf exponents can be far too large for Fractions), with ``2**-3990``
    relative added to the slack for that rounding.
    """
    ctx = mpmath.MPContext()
    ctx.prec = 4000
    rad = np.zeros_like(ball.hi) if ball.rad is None else ball.rad
    relative = ctx.mpf(slack.numerator) / slack.denominator + ctx.mpf(2) ** -3990
    for index, value in np.ndenumerate(exact):
        if not math.isfinite(rad[index]):
            continue
        if isinstance(value, Fraction):
            exact_value = ctx.mpf(value.numerator) / value.denominator
        elif mpmath.isnan(value):
            continue
        else:
            exact_value = ctx.mpf(value)
        center = ctx.mpf(float(ball.hi[index])) + ctx.mpf(float(ball.lo[index]))
        bound = ctx.mpf(float(rad[index])) + relative * abs(exact_value)
        assert abs(exact_value - center) <= bound, (index, exact_value, center)


def _without_doubling_zeros(naive, rigorous):
    """``naive`` with its exact zeros replaced by the rigorous value where that is below 2**-2000,
    and its values within ``2**-1075`` of 0 replaced by 0 where the rigorous value is 0.

    Precision doubling certifies an output that is 0 at ``p`` and ``2p`` bits, which is wrong when
    probabilities differ by less than ``2**-p`` and the values cancel (the xfail test below);
    the arb enclosure resolves them. Conversely an enclosure within ``2**-1075`` of 0 certifies
    the output as 0 (the **Zeros** of ``mhanum.reference``), where doubling goes on to the tiny
    value. Such outputs are far below any float.
    """
    out = naive.copy()
    for index, value in np.ndenumerate(naive):
        other = rigorous[index]
        if mpmath.isnan(value):
            continue
        resolved = value == 0 and abs(other) < mpmath.mpf(2) ** -2000
        below_every_float = other == 0 and abs(value) <= mpmath.mpf(2) ** -1075
        if resolved or below_every_float:
            out[index] = other
    return out


# --- strategies --------------------------------------------------------------------------------

_SUBNORMAL = 5e-324
_EXTREMES = [0.0, 1.0, -1.0, 0.5, 3.0, 1e-30, 1e30, -1e30, 2.0**-60, _SUBNORMAL, -1e-310, 1e300]
_ELEMENTS = st.one_of(st.floats(-4, 4), st.sampled_from(_EXTREMES))


@st.composite
def _attention_inputs(draw):
    batch = draw(hnp.array_shapes(min_dims=0, max_dims=1, max_side=2))
    l_q, l_k = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d_k, d_v = draw(st.integers(1, 3)), draw(st.integers(1, 2))

    def array(shape):
        return draw(hnp.arrays(np.float64, shape, elements=_ELEMENTS))

    q, k = array((*batch, l_q, d_k)), array((l_k, d_k))
    v = array((*batch, l_k, d_v))
    if draw(st.booleans()):
        # Cancellation in the output: values of opposite signs and nearly equal magnitudes.
        v = np.concatenate([v[..., :1, :], -v[..., :1, :] * (1 + 2.0**-40), v[..., 2:, :]], -2)[
            ..., :l_k, :
        ]
    mask = draw(st.none() | hnp.arrays(np.bool_, (l_q, l_k)))
    bias = draw(
        st.none()
        | hnp.arrays(
            np.float64, (l_q, l_k), elements=st.floats(-50, 50) | st.sampled_from([-math.inf, 1e30])
        )
    )
    scale = draw(st.none() | st.sampled_from([1.0, 0.375, -2.0, 1e-3]))
    return q, k, v, {"mask": mask, "bias": bias, "scale": scale}


@st.composite
def _mha_inputs(draw):
    num_heads, d_k, d_v = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d_model, d_out = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    weight = st.floats(-2, 2) | st.sampled_from([1e-30, -1e20, 0.0, _SUBNORMAL])

    def array(shape):
        return draw(hnp.arrays(np.float64, shape, elements=weight))

    widths = [num_heads * d_k, num_heads * d_k, num_heads * d_v, d_out]
    biases = [array((width,)) for width in widths] if draw(st.booleans()) else [None] * 4
    params = MHAParams(
        array((d_model, num_heads * d_k)),
        array((d_model, num_heads * d_k)),
        array((d_model, num_heads * d_v)),
        array((num_heads * d_v, d_out)),
        *biases,
    )
    l_q, l_k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    x_q, x_kv = array((l_q, d_model)), array((l_k, d_model))
    mask = draw(st.none() | hnp.arrays(np.bool_, (num_heads, l_q, l_k)))
    return x_q, x_kv, params, num_heads, mask


# --- the enclosures (stage by stage) -----------------------------------------------------------


@given(
    x=st.floats(-800, 1) | st.sampled_from([0.0, -690.0, -689.9, -1e-300, 0.5 * 2.0**-11]),
    low=st.floats(-1, 1),
)
@example(x=-745.0, low=0.0)
@example(x=-(2.0**-40), low=0.5)
def test_exp_encloses_the_exact_value(x, low):
    hi, lo = _dd.two_sum(np.asarray(x), np.asarray(low * 2.0**-53 * abs(x)))
    with np.errstate(all="ignore"):
        ball = _dd.exp(_dd.Ball(hi, lo, None))
    ctx = mpmath.MPContext()
    ctx.prec = 300
    exact = ctx.exp(ctx.mpf(float(hi)) + ctx.mpf(float(lo)))
    _assert_encloses(ball, np.array([exact], dtype=object).reshape(()), Fraction(1, 2**250))
    assert float(ball.rad) <= 2.0**-90 * max(float(ball.hi), 2.0**-900)


@given(
    a=hnp.arrays(np.float64, (2, 5), elements=_ELEMENTS),
    b=hnp.arrays(np.float64, (5, 3), elements=_ELEMENTS),
)
def test_matmul_encloses_the_exact_product(a, b):
    with np.errstate(all="ignore"):  # overflow is a result (inf), not an error
        ball = _dd.matmul(a, b)
    exact = np.empty((2, 3), dtype=object)
    for i, j in np.ndindex(exact.shape):
        exact[i, j] = sum((Fraction(a[i, t]) * Fraction(b[t, j]) for t in range(5)), Fraction(0))
    finite = np.isfinite(ball.hi)
    assert finite.all() or math.log2(np.abs(a).max()) + math.log2(np.abs(b).max()) > 1000
    exact[~finite] = Fraction(0)
    _assert_encloses(_dd.Ball(*(np.where(finite, x, 0.0) for x in ball)), exact)


@given(
    fmt=st.sampled_from([np.float32, np.float16]),
    spread=st.integers(0, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_matmul_of_short_floats_takes_few_digits_and_encloses_the_product(fmt, spread, seed):
    # float32 and float16 values within 2**spread of their line's largest have at most two
    # digits of beta >= 20 bits, so the splitting stops there; the product is still enclosed
    rng = np.random.default_rng(seed)

    def draw(shape: tuple[int, int]) -> np.ndarray:
        sign = rng.choice([-1.0, 1.0], shape)
        x = sign * rng.uniform(1, 2, shape) * np.exp2(rng.integers(-spread, 1, shape)) / 2
        return x.astype(fmt).astype(np.float64)

    a, b = draw((2, 300)), draw((300, 3))
    count, beta = _dd._digit_plan(300)
    for x, axis in ((a, -1), (b, -2)):
        assert len(_dd._digits(x, _dd._row_exponents(x, axis), beta, count)) <= 2 < count
    ball = _dd.matmul(a, b)
    exact = np.empty((2, 3), dtype=object)
    for i, j in np.ndindex(exact.shape):
        exact[i, j] = sum((Fraction(a[i, t]) * Fraction(b[t, j]) for t in range(300)), Fraction(0))
    _assert_encloses(ball, exact)


@given(inputs=_attention_inputs(), fully_masked=st.sampled_from(["nan", "zero", "uniform"]))
def test_fast_attention_encloses_the_reference(inputs, fully_masked):
    q, k, v, options = inputs
    floats, values = reference.attention(
        q, k, v, **options, fully_masked=fully_masked, digits=40, backend="exact", return_mpf=True
    )
    mask, bias = options["mask"], options["bias"]
    shape = (*np.broadcast_shapes(q.shape[:-2], v.shape[:-2]), q.shape[-2], k.shape[-2])
    excluded = np.zeros(shape, bool) if mask is None else ~np.broadcast_to(mask, shape)
    bias_full = None
    if bias is not None:
        excluded = excluded | np.isneginf(np.broadcast_to(bias, shape))
        bias_full = np.where(np.isneginf(bias), 0.0, np.broadcast_to(bias, shape))
    scale = None if options["scale"] is None else float_pair(options["scale"])
    with np.errstate(all="ignore"):
        out, undefined = _fastref.attention(
            q, k, v, excluded, bias_full, _fastref.scale_ball(scale, q.shape[-1]), fully_masked
        )
    assert np.array_equal(np.broadcast_to(undefined[..., None], floats.shape), np.isnan(floats))
    usable = np.isfinite(out.hi) & np.isfinite(out.lo) & np.isfinite(out.rad)
    usable &= ~np.broadcast_to(undefined[..., None], usable.shape)
    _assert_encloses(
        _dd.Ball(*(np.where(usable, x, 0.0) for x in out)),
        np.where(usable, values, mpmath.mpf(0)),
        Fraction(1, 10**39),
    )


# --- every backend agrees with mpmath ------------------------------------------------------------


@pytest.mark.parametrize("backend", FAST)
@given(inputs=_attention_inputs(), fully_masked=st.sampled_from(["nan", "zero", "uniform"]))
def test_backends_agree_with_mpmath_on_attention(backend, inputs, fully_masked):
    if backend == "arb":
        pytest.importorskip("flint")
    q, k, v, options = inputs
    _, naive = reference.attention(
        q, k, v, **options, fully_masked=fully_masked, backend="mpmath", return_mpf=True
    )
    try:
        floats, values = reference.attention(
            q, k, v, **options, fully_masked=fully_masked, backend=backend, return_mpf=True
        )
    except CertificationError:
        assert backend == "dd"  # the enclosure alone may not certify; "auto" always does
        return
    if backend in ("arb", "auto"):
        naive = _without_doubling_zeros(naive, values)
    _assert_agree(values, naive, 2 * TOL)
    # Every backend returns its certified value correctly rounded (exponents may be far out of
    # range, so no Fraction here).
    expected = [
        math.nan if mpmath.isnan(x) else _exact.to_float64(*_exact.mpf_pair(x)) for x in values.flat
    ]
    np.testing.assert_array_equal(floats.ravel(), np.array(expected))


@pytest.mark.parametrize("backend", FAST)
@given(inputs=_mha_inputs(), fully_masked=st.sampled_from(["nan", "zero", "uniform"]))
def test_backends_agree_with_mpmath_on_mha(backend, inputs, fully_masked):
    if backend == "arb":
        pytest.importorskip("flint")
    x_q, x_kv, params, num_heads, mask = inputs
    options = {"mask": mask, "fully_masked": fully_masked, "return_mpf": True}
    _, naive = reference.multi_head_attention(
        x_q, x_kv, params, num_heads, backend="mpmath", **options
    )
    try:
        _, values = reference.multi_head_attention(
            x_q, x_kv, params, num_heads, backend=backend, **options
        )
    except CertificationError:
        assert backend == "dd"
        return
    if backend in ("arb", "auto"):
        naive = _without_doubling_zeros(naive, values)
    _assert_agree(values, naive, 2 * TOL)


@pytest.mark.parametrize("backend", ["mpmath", "exact"])
def test_doubling_backends_resolve_probabilities_that_differ_below_the_working_precision(backend):
    # Probabilities 1/2 -+ 5e-246 round to 1/2 at p and 2p bits, so o = 5e-324 (p0 - p1) is 0 at
    # both; that zero is not provably exact (the logits differ), so the precision keeps doubling
    # (to -4.7e-569, checked against an independent evaluation at 4000 bits).
    q, k = np.array([[1.88610288e-245]]), np.array([[0.0], [1.0]])
    v = np.array([[5e-324], [-5e-324]])
    ctx = mpmath.MPContext()
    ctx.prec = 4000
    e = ctx.exp(ctx.mpf(float(q[0, 0])))
    exact = ctx.mpf(5e-324) * (1 - e) / (1 + e)
    floats, doubled = reference.attention(q, k, v, backend=backend, return_mpf=True)
    assert exact < 0
    assert floats[0, 0] == 0.0
    assert math.copysign(1.0, floats[0, 0]) == -1.0
    _assert_agree(np.array([[exact]], dtype=object), doubled, 2 * TOL)


@pytest.mark.parametrize("backend", ["mpmath", "exact"])
def test_doubling_backends_accept_only_provable_zeros(backend):
    # Equal logits: o = (v_0 + v_1) / 2 is exactly 0 in column 0 (and the MHA output column 1 is
    # 1/2 - 1/2); with max_prec at the start
    # precision a zero that is not provable (column 1: logits differ below 2**-p) is refused.
    q, k = np.array([[0.0], [1.88610288e-245]]), np.array([[0.0], [1.0]])
    v = np.array([[1.0, 5e-324], [-1.0, -5e-324]])
    floats = reference.attention(q[:1], k, v, backend=backend)
    np.testing.assert_array_equal(floats, [[0.0, 0.0]])
    with pytest.raises(CertificationError, match="could not certify 20 digits"):
        reference.attention(q[1:], k, v, backend=backend, max_prec=200)
    _, mha_values = reference.multi_head_attention(
        np.zeros((1, 2)),
        np.array([[1.0, 0.0], [0.0, 1.0]]),
        MHAParams(np.eye(2), np.eye(2), np.eye(2), np.array([[1.0, 1.0], [1.0, -1.0]])),
        1,
        backend=backend,
        return_mpf=True,
    )
    assert mha_values[0, 0] == 1
    assert mha_values[0, 1] == 0


def test_auto_recomputes_only_what_the_enclosure_cannot_certify():
    # Row 0 cancels to tanh(2**-61), about 2**-61, of which a radius near 2**-95 (of the values)
    # does not certify 20 digits; row 1 does not cancel. (An exact 0 the enclosure certifies:
    # tests/reference/test_zeros.py.)
    q = np.array([[2.0**-60], [1.0]])
    k = np.array([[1.0], [0.0]])
    v = np.array([[1.0, 1.0], [-1.0, 2.0]])
    with pytest.raises(CertificationError, match=r"backend 'dd' could not certify 20 digits"):
        reference.attention(q, k, v, scale=1.0, backend="dd")
    floats, values = reference.attention(q, k, v, scale=1.0, return_mpf=True)
    naive_floats, naive = reference.attention(q, k, v, scale=1.0, backend="mpmath", return_mpf=True)
    assert 0 < floats[0, 0] < 2.0**-60
    np.testing.assert_array_equal(floats, naive_floats)
    _assert_agree(values, naive, 2 * TOL)


def test_a_larger_layer_is_certified_by_the_enclosure_alone():
    params = MHAParams.random(32, seed=3)
    x = np.random.default_rng(3).standard_normal((2, 16, 32))
    fast, fast_values = reference.multi_head_attention(
        x, x, params, 4, backend="dd", return_mpf=True
    )
    exact, exact_values = reference.multi_head_attention(
        x, x, params, 4, backend="exact", return_mpf=True
    )
    _assert_agree(fast_values, exact_values, 2 * TOL)
    np.testing.assert_array_equal(fast, exact)


# --- digits a backend can certify ----------------------------------------------------------------


def test_each_backend_says_how_many_digits_it_certifies():
    assert {b: reference.max_digits(b) for b in reference.BACKENDS} == {
        "auto": 2000,
        "dd": 26,
        "exact": 2000,
        "mpmath": 2000,
        "arb": 2000,
    }
    with pytest.raises(InvalidArgument, match=r"^backend: expected one of 'auto'"):
        reference.max_digits("numpy")


def test_dd_refuses_more_digits_than_it_certifies_and_auto_falls_back():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    with pytest.raises(CertificationError, match=r"backend 'dd' certifies at most 26 digits"):
        reference.attention(q, k, v, digits=27, backend="dd")
    _, auto = reference.attention(q, k, v, digits=40, return_mpf=True)
    _, naive = reference.attention(q, k, v, digits=40, backend="mpmath", return_mpf=True)
    _assert_agree(auto, naive, Fraction(2, 10**40))


def test_arb_refuses_what_max_prec_cannot_certify():
    pytest.importorskip("flint")
    # o = (e - fl(e)) / (e + 1): 53 bits cancel, more than 200 bits leave for 30 digits.
    q, k, v = np.ones((1, 1)), np.array([[1.0], [0.0]]), np.array([[1.0], [-math.e]])
    with pytest.raises(CertificationError, match=r"backend 'arb'"):
        reference.attention(q, k, v, scale=1.0, digits=30, max_prec=200, backend="arb")
    value = reference.attention(q, k, v, scale=1.0, digits=30, max_prec=300, backend="arb")
    assert value[0, 0] == reference.attention(q, k, v, scale=1.0, digits=30, max_prec=300)[0, 0]


def test_arb_without_python_flint_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flint", None)
    with pytest.raises(ImportError, match=r"pip install python-flint"):
        reference.attention(np.zeros((1, 1)), np.zeros((1, 1)), np.ones((1, 1)), backend="arb")


def test_arb_leaves_the_flint_precision_as_it_was():
    flint = pytest.importorskip("flint")
    before = flint.ctx.prec
    reference.attention(np.zeros((1, 1)), np.zeros((2, 1)), np.ones((2, 1)), backend="arb")
    assert flint.ctx.prec == before


def _cancelling_layer() -> tuple[np.ndarray, MHAParams]:
    """A layer whose output column 0 is ``o_0 - o_1`` for value columns equal to ``2**-45``.

    The enclosure's radius is about ``2**-95`` of ``|o|``, short of ``2**-67`` of ``2**-45 |o|``.
    """
    params = MHAParams.random(8, seed=5)
    wv = params.wv.copy()
    wv[:, 1] = wv[:, 0] * (1 + 2.0**-45)
    bv = params.bv.copy()
    bv[1] = bv[0] * (1 + 2.0**-45)
    wo = params.wo.copy()
    wo[:, 0] = 0.0
    wo[0, 0], wo[1, 0] = 1.0, -1.0
    bo = params.bo.copy()
    bo[0] = 0.0
    layer = dataclasses.replace(params, wv=wv, bv=bv, wo=wo, bo=bo)
    return np.random.default_rng(5).standard_normal((3, 8)), layer


@pytest.mark.parametrize("refine", [True, False])
def test_auto_certifies_rows_the_enclosure_misses_by_refining_them(monkeypatch, refine):
    pytest.importorskip("flint")
    from mhanum.reference import _arbref

    x, params = _cancelling_layer()
    with pytest.raises(CertificationError, match=r"backend 'dd' could not certify 20 digits"):
        reference.multi_head_attention(x, x, params, 2, backend="dd")
    refined = []
    original = _arbref.refine_mha_rows

    def spy(*args):
        result = original(*args) if refine else None
        refined.append(result is not None)
        return result

    monkeypatch.setattr(_arbref, "refine_mha_rows", spy)
    floats, values = reference.multi_head_attention(x, x, params, 2, return_mpf=True)
    naive_floats, naive = reference.multi_head_attention(
        x, x, params, 2, backend="mpmath", return_mpf=True
    )
    assert refined == [refine]
    assert 0 < abs(floats[0, 0]) < 2.0**-40
    np.testing.assert_array_equal(floats, naive_floats)
    _assert_agree(values, naive, 2 * TOL)


def test_refined_rows_of_a_batch_element_keep_their_heads_and_mask():
    """The rows refined in one batch element get that element's mask, head by head (indexing
    the batch element and the rows at once once put the rows' axis before the heads')."""
    pytest.importorskip("flint")
    x, params = _cancelling_layer()
    mask = np.ones((1, 2, 3, 3), bool)
    mask[0, 0, :, 2] = False  # head 0 never sees key 2
    mask[0, 1, 1:, 0] = False  # head 1: rows 1 and 2 never see key 0
    got = reference.multi_head_attention(x[None], x[None], params, 2, mask=mask)
    want = reference.multi_head_attention(x[None], x[None], params, 2, mask=mask, backend="mpmath")
    np.testing.assert_array_equal(got, want)
