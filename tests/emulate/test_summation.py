"""mhanum.emulate.summation: each order against hand-worked values and a plain-Python model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mhanum import InvalidArgument, round_to
from mhanum.emulate import summation

E = 2.0**-24  # half an ulp of 1 in float32: 1 + E ties back to 1


@pytest.mark.parametrize(
    ("n_small", "order", "expected_multiple"),
    [
        # 1 followed by 7 copies of 2**-24 (exact sum 1 + 7E):
        (7, "sequential", 0),  # each 1 + E ties to even: 1
        (7, "pairwise", 6),  # (1+E)->1 loses one E; (E+E), (E+E)+(E+E)... are exact: 1 + 6E
        (7, "blocked(4)", 4),  # [1,E,E,E] -> 1; [E,E,E,E] -> 4E; 1 + 4E
        (7, "blocked(2)", 6),  # [1,E]->1, then 2E blocks added to 1 one by one: 1 + 6E
        (7, "kahan", 8),  # correctly rounded 1 + 7E: tie between 1+6E and 1+8E, to even
        # 1 followed by 1023 copies (exact 1 + 1023E):
        (1023, "sequential", 0),
        (1023, "pairwise", 1022),
        (1023, "blocked(32)", 992),  # first block absorbs 31 E's, the 31 others give 32E each
        (1023, "kahan", 1024),
    ],
)
def test_float32_sums_of_one_and_many_tiny_terms(n_small, order, expected_multiple):
    x = np.array([1.0] + [E] * n_small, np.float32)
    assert float(summation.sum(x, order=order, accum="float32")) == 1 + expected_multiple * E


def _rnd(fmt):
    return lambda v: float(round_to(v, fmt))


def _model(order: str, terms: list[float], rnd) -> float:
    """The order written out in plain Python, each addition rounded."""
    if order == "sequential":
        s = 0.0
        for t in terms:
            s = rnd(s + t)
        return s
    if order == "pairwise":
        level = list(terms)
        size = 1 << max(0, (len(level) - 1).bit_length())
        level += [0.0] * (size - len(level))
        while len(level) > 1:
            level = [rnd(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
        return level[0]
    if order.startswith("blocked"):
        b = int(order[8:-1])
        total = 0.0
        for i in range(0, len(terms), b):
            total = rnd(total + _model("sequential", terms[i : i + b], rnd))
        return total
    assert order == "kahan"
    s = c = 0.0
    for t in terms:
        y = rnd(t - c)
        u = rnd(s + y)
        c = rnd(rnd(u - s) - y)
        s = u
    return s


ORDERS = ["sequential", "pairwise", "blocked(3)", "blocked(8)", "kahan"]
# Term counts, bucketed so that examples reuse compiled sums: 1, the edges of the blocks (3, 8)
# and of pairwise trees (powers of two) on either side, and the largest, 40.
SIZES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 24, 31, 33, 40)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("order", ORDERS)
@given(data=st.data())
def test_sum_matches_the_python_model(fmt, order, data):
    # XLA's CPU backend flushes float32 subnormals to zero (bfloat16 shares float32's range), so
    # the terms stay at magnitudes where no sum of them is subnormal.
    n = data.draw(st.sampled_from(SIZES))
    magnitude = st.floats(2.0**-20, 1e3) | st.just(0.0)
    signed = st.tuples(magnitude, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])
    raw = data.draw(st.lists(signed, min_size=n, max_size=n))
    terms = [float(v) for v in round_to(raw, fmt)]
    got = float(summation.sum(np.array(terms), order=order, accum=fmt))
    assert got == _model(order, terms, _rnd(fmt))


@pytest.mark.parametrize("order", ORDERS)
@given(data=st.data())
def test_matmul_rounds_every_product_then_sums_in_order(order, data):
    k = data.draw(st.sampled_from((1, 2, 3, 4, 5, 8, 9, 12)))  # bucketed, edges kept
    vals = st.floats(-8, 8, allow_subnormal=False)
    a = round_to(data.draw(st.lists(vals, min_size=2 * k, max_size=2 * k)), "float16").reshape(2, k)
    b = round_to(data.draw(st.lists(vals, min_size=3 * k, max_size=3 * k)), "float16").reshape(k, 3)
    got = np.asarray(summation.matmul(a, b, order=order, accum="float16"), np.float64)
    rnd = _rnd("float16")
    for i in range(2):
        for j in range(3):
            products = [rnd(a[i, t] * b[t, j]) for t in range(k)]
            assert got[i, j] == _model(order, products, rnd)


def test_float32_products_are_rounded_not_fused():
    # (1 + 2**-20)**2 - 1: a fused multiply-add keeps the 2**-40 that a rounded product drops.
    a = np.array([[1 + 2.0**-20, 1.0]], np.float32)
    b = np.array([[1 + 2.0**-20], [-1.0]], np.float32)
    for order in ORDERS:
        assert float(summation.matmul(a, b, order=order, accum="float32")[0, 0]) == 2.0**-19


def test_tf32_operands_are_rounded_before_the_product():
    a = np.array([[1 + 2.0**-11]], np.float32)  # a tie at 10 fraction bits: rounds to 1
    b = np.array([[3.0]], np.float32)
    assert float(summation.matmul(a, b, operand_format="tf32")[0, 0]) == 3.0
    assert float(summation.matmul(a, b)[0, 0]) == 3 * (1 + 2.0**-11)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: summation.sum(np.ones(3), order="random"), "order: expected"),
        (lambda: summation.sum(np.ones(3), accum="tf32"), "accum: expected float64"),
        (lambda: summation.sum(np.ones((2, 3)), axis=2), "axis: expected an axis of an array of 2"),
        (lambda: summation.sum(np.float32(1.0)), "axis: expected an axis of an array of 0"),
        (lambda: summation.sum(np.ones(3), axis=0.0), "axis: expected an integer, got 0.0"),
        (
            lambda: summation.matmul(np.ones((2, 3)), np.ones((2, 3))),
            r"b: expected shape \(\.\.\., 3, N\)",
        ),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()


def test_a_sum_along_another_axis_and_inside_a_callers_jit_is_the_same_sum():
    x = np.array([[1.0, E, E, E], [E, 1.0, -1.0, E]], np.float32).T  # the terms along axis 0
    expected = [1.0, E]  # sequential: 1 absorbs each E (a tie, to even), so E + 1 - 1 + E = E
    assert summation.sum(x, axis=0).tolist() == expected
    assert summation.sum(x.T).tolist() == expected
    assert jax.jit(lambda y: summation.sum(y, axis=0))(x).tolist() == expected


@pytest.mark.parametrize("order", ["native", *ORDERS])
def test_an_empty_sum_and_an_empty_dot_are_positive_zero(order):
    # no term: the empty sum's +0 in every order, as a kernel's loop over no term returns it
    total = np.asarray(summation.sum(np.ones((3, 0), np.float32), order=order))
    product = np.asarray(
        summation.matmul(np.ones((2, 0), np.float32), np.ones((0, 4), np.float32), order=order)
    )
    assert total.shape == (3,)
    assert product.shape == (2, 4)
    for zeros in (total, product):
        assert (zeros == 0).all()
        assert not np.signbit(zeros).any()
