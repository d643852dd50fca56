"""Outputs that are 0, or nearly: certified by every backend of ``mhanum.reference``.

A relative accuracy cannot be reached at an exact 0, so the contract (the module docstring of
``mhanum.reference``) certifies an output when its relative accuracy reaches ``digits``, or its
exact value is proved 0 (it is then exactly 0), or a rigorous enclosure lies within
``[-2**-1075, 2**-1075]``, where every real number rounds to a float64 zero (it is then 0).
The cases: values that cancel exactly under uniform attention, in every backend and through
every reference (attention, multi-head attention, both gradients); an output near 0 checked
against an independent mpmath evaluation with the contract's tolerance; and a correct kernel
checked by ``mhanum.testing`` on the uniform case.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import mpmath
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mhanum import CertificationError, MHAParams, reference
from mhanum.testing import assert_attention_close

DIGITS = 20
# Half the smallest subnormal: every real number within it rounds to a float64 zero.
HALF_SUBNORMAL = Fraction(1, 2**1075)

# Uniform attention over 3 keys (every score is 0); value column 0 is 1, -1/2, -1/2, whose mean
# is exactly 0 although the weights 1/3 are not dyadic.
Q, K = np.zeros((1, 2)), np.ones((3, 2))
V = np.array([[1.0, 2.0], [-0.5, 0.0], [-0.5, 1.0]])


def _fraction(x) -> Fraction:
    """A finite mpf of any context as an exact Fraction (``mpmath.mpf(x)`` would round it to 53
    bits, and ``x.man_exp`` drops its sign)."""
    sign, man, exp, _ = x._mpf_
    return (-1) ** sign * Fraction(int(man)) * Fraction(2) ** int(exp)


# --- exact zeros, every backend ----------------------------------------------------------------


@pytest.mark.parametrize("backend", reference.BACKENDS)
def test_uniform_attention_whose_values_cancel_is_exactly_zero(backend):
    floats, values = reference.attention(Q, K, V, backend=backend, return_mpf=True)
    np.testing.assert_array_equal(floats, [[0.0, 1.0]])
    assert values[0, 0] == 0


@pytest.mark.parametrize("backend", reference.BACKENDS)
def test_exact_zeros_among_other_rows_masks_and_batches(backend):
    # batch 0: q = 0, uniform over three keys (a fourth is masked out): column 0 is 0 in both
    # rows; batch 1: the logits differ and nothing cancels. A sink (one more key, of value 0)
    # keeps column 0 of batch 0 at 0.
    q = np.stack([np.zeros((2, 2)), np.array([[1.0, 0.0], [0.5, -1.0]])])
    k = np.array([[1.0, 1.0], [1.0, 2.0], [2.0, 1.0], [5.0, -3.0]])
    v = np.concatenate([V, [[7.0, 7.0]]])
    mask = np.array([True, True, True, False])
    for sink in (None, np.array([0.5, 0.5])):
        floats = reference.attention(q, k, v, mask=mask, sink=sink, backend=backend)
        naive = reference.attention(q, k, v, mask=mask, sink=sink, backend="mpmath")
        np.testing.assert_array_equal(floats[0, :, 0], [0.0, 0.0])
        assert np.all(floats[1] != 0)
        np.testing.assert_array_equal(floats, naive)


@pytest.mark.parametrize("backend", ["auto", "exact", "mpmath", "arb"])
def test_exact_zeros_are_certified_at_any_digits(backend):
    floats, values = reference.attention(Q, K, V, digits=60, backend=backend, return_mpf=True)
    np.testing.assert_array_equal(floats, [[0.0, 1.0]])
    assert values[0, 0] == 0


def _uniform_layer() -> tuple[np.ndarray, np.ndarray, MHAParams]:
    """One head with ``wq = 0`` (uniform attention) whose value column 0 is ``V``'s."""
    params = MHAParams(np.zeros((2, 2)), np.eye(2), np.eye(2), np.eye(2))
    return np.ones((1, 2)), V, params


def _two_head_layer() -> tuple[np.ndarray, np.ndarray, MHAParams]:
    """Two heads whose logits differ (1, 2 and 3, 5); every value of head 0 is 1, of head 1 -1.

    Each head is then a weighted mean of equal values: exactly 1 and -1, so output column 0
    (their sum) is exactly 0 and column 1 (head 1) exactly -1.
    """
    wk = np.array([[1.0, 3.0], [2.0, 5.0]])
    wv = np.array([[1.0, -1.0], [1.0, -1.0]])
    wo = np.array([[1.0, 0.0], [1.0, 1.0]])
    return np.ones((1, 2)), np.eye(2), MHAParams(np.eye(2), wk, wv, wo)


def _shifted_heads() -> tuple[np.ndarray, np.ndarray, MHAParams]:
    """Two heads whose scores differ by a shift (0, 1 and 5, 6) and whose values are opposite
    (5, 6 and -5, -6): their probabilities are equal, and the output, their sum, is exactly 0."""
    wv = np.array([[0.0, 0.0], [1.0, -1.0]])
    params = MHAParams(np.eye(2), np.eye(2), wv, np.ones((2, 1)))
    return np.ones((1, 2)), np.array([[0.0, 5.0], [1.0, 6.0]]), params


@pytest.mark.parametrize("backend", reference.BACKENDS)
@pytest.mark.parametrize(
    ("layer", "heads", "expected"),
    [
        (_uniform_layer, 1, [[0.0, 1.0]]),
        (_two_head_layer, 2, [[0.0, -1.0]]),
        (_shifted_heads, 2, [[0.0]]),
    ],
)
def test_multi_head_attention_whose_paths_cancel_is_exactly_zero(backend, layer, heads, expected):
    x_q, x_kv, params = layer()
    floats, values = reference.multi_head_attention(
        x_q, x_kv, params, heads, backend=backend, return_mpf=True
    )
    np.testing.assert_array_equal(floats, expected)
    assert values[0, 0] == 0


@pytest.mark.parametrize("backend", ["auto", "exact", "mpmath", "arb"])
def test_shifted_heads_under_a_soft_cap_do_not_cancel(backend):
    # c tanh(s/c) is no shift of the scores: the heads' probabilities differ and the output is
    # not 0 (no proof of a zero may merge the heads); checked against mpmath at 300 bits.
    x_q, x_kv, params = _shifted_heads()
    got = reference.multi_head_attention(x_q, x_kv, params, 2, softcap=2.0, backend=backend)
    ctx = mpmath.MPContext()
    ctx.prec = 300

    def head(scores):
        weights = [ctx.exp(2 * ctx.tanh(ctx.mpf(s) / 2)) for s in scores]
        return (5 * weights[0] + 6 * weights[1]) / (weights[0] + weights[1])

    exact = head((0, 1)) - head((5, 6))
    assert got[0, 0] != 0
    assert got[0, 0] == float(_fraction(exact))


def test_gradients_that_are_exactly_zero_are_certified():
    # q.k_j = 0 for every key: uniform; dP = (1, 2, 3), D = 2, so dS = (-1, 0, 1) / 3 and
    # dk_1 = c dS_1 q = 0; every other gradient is nonzero.
    q, k = np.array([[1.0, -1.0]]), np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    v, d_out = np.array([[1.0], [2.0], [3.0]]), np.ones((1, 1))
    got = reference.attention_grad(q, k, v, d_out)
    c = 2**-0.5
    np.testing.assert_array_equal(got.dbias, [[-1 / 3, 0.0, 1 / 3]])
    np.testing.assert_array_equal(got.dk[1], [0.0, 0.0])
    np.testing.assert_allclose(got.dk[[0, 2]], [[-c / 3, c / 3], [c / 3, -c / 3]], rtol=1e-15)
    np.testing.assert_allclose(got.dq, [[2 * c / 3, 2 * c / 3]], rtol=1e-15)
    np.testing.assert_array_equal(got.dv, np.full((3, 1), 1 / 3))


def test_a_query_gradient_that_cancels_across_keys_is_exactly_zero():
    # Uniform over keys 1, 2, 3 (q = 0); dP = v = (1, -2, 1), D = 0, dS = (1, -2, 1) / 3 and
    # dq = c sum_j dS_j k_j = c (1 - 4 + 3) / 3 = 0, though no dS is 0.
    q, k = np.zeros((1, 2)), np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    v, d_out = np.array([[1.0], [-2.0], [1.0]]), np.ones((1, 1))
    got = reference.attention_grad(q, k, v, d_out)
    np.testing.assert_array_equal(got.dq, [[0.0, 0.0]])
    np.testing.assert_array_equal(got.dbias, [[1 / 3, -2 / 3, 1 / 3]])


def test_layer_gradients_that_are_exactly_zero_are_certified():
    # The previous case as a layer: k = x_kv[:, 0], v = x_kv[:, 1], q = x_q wq + bq = 0. dQ = 0,
    # so dwq and dbq are 0; dK, dV are attention_grad's.
    x_q, x_kv = np.ones((1, 2)), np.array([[1.0, 1.0], [2.0, -2.0], [3.0, 1.0]])
    params = MHAParams(
        np.zeros((2, 1)),
        np.array([[1.0], [0.0]]),
        np.array([[0.0], [1.0]]),
        np.ones((1, 1)),
        bq=np.zeros(1),
    )
    got = reference.mha_grad(x_q, x_kv, params, 1, np.ones((1, 1)))
    single = reference.attention_grad(np.zeros((1, 1)), x_kv[:, :1], x_kv[:, 1:], np.ones((1, 1)))
    np.testing.assert_array_equal(got.params.wq, [[0.0], [0.0]])
    np.testing.assert_array_equal(got.params.bq, [0.0])
    np.testing.assert_array_equal(got.dx_kv, np.concatenate([single.dk, single.dv], axis=1))


# --- outputs near 0 against an independent evaluation --------------------------------------------

_SCALES = [1.0, -3.0, 2.0**-1000, 5e-324, 2.0**1000]
# b = -a (1 + t): t = 0 cancels the values exactly, the others leave a residue of a t.
_RESIDUES = [0.0, 2.0**-52, -(2.0**-30), 0.5]


def _three_key_exact(x: float, a: float, b: float) -> Fraction | None:
    """``(a + b e**x) / (2 + e**x)`` (logits 0, 0, x; values a, 0, b) at 8000 bits, in an mpmath
    context of its own; ``None`` for a result that is exactly 0 (x = 0 and b = -a)."""
    if x == 0 and a + b == 0:
        return None
    ctx = mpmath.MPContext()
    ctx.prec = 8000
    e = ctx.exp(ctx.mpf(x))
    return _fraction((ctx.mpf(a) + ctx.mpf(b) * e) / (2 + e))


@pytest.mark.parametrize("backend", reference.BACKENDS)
@given(
    exponent=st.integers(0, 1074),
    sign=st.sampled_from([1.0, -1.0]),
    a=st.sampled_from(_SCALES),
    t=st.sampled_from(_RESIDUES),
)
@example(exponent=0, sign=0.0, a=1.0, t=0.0)  # exactly 0
@example(exponent=0, sign=0.0, a=5e-324, t=0.0)
@example(exponent=1074, sign=1.0, a=5e-324, t=0.0)  # 2**-2149: no float but 0
@example(exponent=1074, sign=-1.0, a=3.0, t=0.0)  # just below 2**-1075: 0
@example(exponent=1073, sign=-1.0, a=3.0, t=0.0)  # just below 2**-1074: the smallest subnormal
@example(exponent=60, sign=1.0, a=1.0, t=0.0)
@example(exponent=1, sign=1.0, a=2.0**1000, t=0.5)
def test_outputs_near_zero_are_within_the_contract_of_an_independent_evaluation(
    backend, exponent, sign, a, t
):
    # logits 0, 0 and x = sign 2**-exponent (scale 1, keys 0, 0, 1), values a, 0 and
    # b = -a (1 + t): the output cancels to about -a (x + t) / 3, exactly 0 for x = t = 0 (with
    # weights 1/3, which no finite binary number is).
    x = sign * 2.0**-exponent
    b = -a * (1 + t)
    q, k, v = np.array([[x]]), np.array([[0.0], [0.0], [1.0]]), np.array([[a], [0.0], [b]])
    exact = _three_key_exact(x, a, b)
    try:
        floats, values = reference.attention(q, k, v, scale=1.0, backend=backend, return_mpf=True)
    except CertificationError:
        # the enclosure alone refuses what it cannot certify; a proved zero it certifies
        assert backend == "dd"
        assert exact is not None
        return
    got, value = float(floats[0, 0]), _fraction(values[0, 0])
    if exact is None:
        assert got == 0.0
        assert value == 0
        return
    if value == 0 and abs(exact) <= HALF_SUBNORMAL:
        # certified as 0 within half the smallest subnormal: its float64 is 0
        assert got == 0.0
        return
    # certified to DIGITS digits, and the float64 is that value correctly rounded, so it lies
    # between the roundings of the ends of the certified interval (rounding to nearest is
    # monotone; a Fraction's float is correctly rounded, subnormals included)
    tolerance = Fraction(1, 10**DIGITS) * abs(exact)
    assert abs(value - exact) <= tolerance
    assert float(exact - tolerance) <= got <= float(exact + tolerance)


# --- a correct kernel passes mhanum.testing on an exact zero -------------------------------------


def test_a_correct_kernel_passes_the_oracle_where_the_output_is_exactly_zero():
    q, k = np.zeros((3, 4), np.float32), np.ones((3, 4), np.float32)
    v = np.array([[1.0, 2.0, 0.0, 1.0], [-0.5, 0.0, -3.0, 1.0], [-0.5, 1.0, 3.0, 1.0]], np.float32)
    out = np.asarray(jax.nn.dot_product_attention(q[:, None], k[:, None], v[:, None]))[:, 0]
    assert_attention_close(out, q, k, v, kernel="jax-xla")
    scores = (q.astype(np.float64) @ k.T.astype(np.float64)) / 2.0
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    plain = (weights / weights.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)
    assert_attention_close(plain, q, k, v, kernel="jax-xla")
