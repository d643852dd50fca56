"""mhanum.bounds.summation: soundness against exact sums, closed forms, the probabilistic bound."""

from __future__ import annotations

import math
import zlib
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhanum import InvalidArgument, get_format, round_to
from mhanum.bounds import softmax
from mhanum.bounds import summation as bs
from mhanum.emulate import summation as impl

FORMATS = ["float32", "bfloat16", "float16", "float64"]
ORDERS = ["native", "sequential", "pairwise", "blocked(1)", "blocked(3)", "blocked(8)", "kahan"]
U32 = 2.0**-24


def _rows(fmt: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows of ``n`` terms with adversarial structure; every other row rounded into ``fmt``."""
    f = get_format(fmt)
    u, tiny, big = f.u, f.smallest_normal, f.max_finite

    def signs(k: int) -> np.ndarray:
        return rng.choice([-1.0, 1.0], k)

    rows = [
        signs(n) * rng.uniform(1, 2, n) * 2.0 ** rng.integers(-12, 12, n),  # wide range
        np.concatenate([[1.0], rng.uniform(0.4, 1.1, n - 1) * u]),  # one big, then absorbed
        (-1.0) ** np.arange(n) * (1 + rng.integers(0, 8, n) * u),  # alternating, cancelling
        np.full(n, rng.uniform(0.5, 1.0)),  # all equal
        signs(n) * rng.uniform(0.5, 1.0, n) * big / (2 * n),  # near the top of the range
        np.full(n, big / 2),  # overflows for n >= 3 (the bound must then be inf)
        signs(n) * rng.uniform(1, 2, n) * tiny * 2.0 ** rng.integers(-f.precision, 3, n),
        rng.uniform(0, 1, n),  # positive: the errors do not cancel
    ]
    out = np.stack(rows)
    out[::2] = round_to(out[::2], fmt)
    return out


def _exact(row: np.ndarray) -> Fraction:
    return sum((Fraction(float(v)) for v in row), Fraction(0))


def _check_sums(x: np.ndarray, order: str, fmt: str, probabilistic: float | None = None) -> float:
    """Assert |ŝ - Σx| <= bound row by row; return the largest measured/bound ratio."""
    got = np.asarray(impl.sum(jnp.asarray(x), order=order, accum=fmt), np.float64)
    bound = bs.sum_bound(x, order, fmt, probabilistic=probabilistic)
    worst = 0.0
    for r in range(x.shape[0]):
        total = float(bound.total[r])
        if not math.isfinite(got[r]):
            assert math.isinf(total), (order, fmt, x[r])
            continue
        if math.isinf(total):
            continue
        err = abs(Fraction(float(got[r])) - _exact(x[r]))
        assert err <= Fraction(total), (order, fmt, r, float(err), total, x[r])
        worst = max(worst, float(err) / total) if total > 0 else worst
    return worst


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
def test_sum_bound_holds_on_adversarial_rows(order, fmt):
    rng = np.random.default_rng(zlib.crc32(f"{order}/{fmt}".encode()))
    _check_sums(_rows(fmt, 33, rng), order, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=8)
@given(data=st.data())
def test_sum_bound_is_sound(fmt, data):
    order = data.draw(st.sampled_from(ORDERS))
    n = data.draw(st.sampled_from([1, 2, 3, 5, 16, 47]))
    x = _rows(fmt, n, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    top = min(1e30, get_format(fmt).max_finite / 64)
    free = data.draw(st.lists(st.floats(-top, top), min_size=n, max_size=n))
    _check_sums(np.vstack([x, np.asarray(free, np.float64)]), order, fmt)


def _check_matmul(a, b, order, fmt, operand=None) -> float:
    got = np.asarray(impl.matmul(a, b, order=order, accum=fmt, operand_format=operand), np.float64)
    bound = bs.matmul_bound(a, b, order, fmt, operand=operand)
    worst = 0.0
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            total = float(bound.total[i, j])
            if not math.isfinite(got[i, j]):
                assert math.isinf(total)
                continue
            if math.isinf(total):
                continue
            exact = sum(
                (
                    Fraction(float(p)) * Fraction(float(q))
                    for p, q in zip(a[i], b[:, j], strict=True)
                ),
                Fraction(0),
            )
            err = abs(Fraction(float(got[i, j])) - exact)
            assert err <= Fraction(total), (order, fmt, operand, i, j, float(err), total)
            worst = max(worst, float(err) / total) if total > 0 else worst
    return worst


def _operands(fmt: str, k: int, rng: np.random.Generator, kind: str) -> tuple[np.ndarray, ...]:
    f = get_format(fmt)
    if kind == "normal":
        a, b = rng.standard_normal((3, k)), rng.standard_normal((k, 4))
    elif kind == "absorb":  # one big product, then products below half an ulp of it
        a = np.concatenate([np.ones((3, 1)), rng.uniform(0.5, 1, (3, k - 1)) * f.u], 1)
        b = np.ones((k, 4))
    elif kind == "cancel":
        a = rng.standard_normal((3, k))
        b = np.repeat(rng.standard_normal((k, 1)), 4, 1) * (-1.0) ** np.arange(4)
        a[:, k // 2 :] = -a[:, : k - k // 2]
    else:  # near underflow: some operands subnormal, others large
        a = rng.uniform(1, 2, (3, k)) * f.smallest_normal * 2.0 ** rng.integers(-4, 2, (3, k))
        b = rng.uniform(1, 2, (k, 4)) * 2.0 ** rng.integers(0, min(20, f.emax), (k, 4))
    if rng.random() < 0.5:
        a, b = round_to(a, fmt), round_to(b, fmt)
    return a, b


@pytest.mark.parametrize(
    ("fmt", "operand"),
    [
        ("float32", None),
        ("float32", "tf32"),
        ("bfloat16", None),
        ("float16", None),
        ("float64", None),
        ("float64", "float32"),
    ],
)
@settings(max_examples=6)
@given(data=st.data())
def test_matmul_bound_is_sound(fmt, operand, data):
    order = data.draw(st.sampled_from(ORDERS))
    k = data.draw(st.sampled_from([1, 2, 7, 16, 40]))
    kind = data.draw(st.sampled_from(["normal", "absorb", "cancel", "underflow"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a, b = _operands(fmt, max(k, 2) if kind == "absorb" else k, rng, kind)
    _check_matmul(a, b, order, fmt, operand)


def test_subnormal_operands_read_as_zero_are_covered():
    # float32 on XLA's CPU: 2**-130 is read as zero, so a product of 2**-110 is lost entirely.
    a = np.array([[2.0**-130, 1.0]])
    b = np.array([[2.0**20], [2.0**-30]])
    got = float(impl.matmul(a, b, order="sequential", accum="float32")[0, 0])
    exact = Fraction(2) ** -110 + Fraction(2) ** -30
    bound = bs.matmul_bound(a, b, "sequential", "float32")
    assert abs(Fraction(got) - exact) <= Fraction(float(bound.total[0, 0]))
    assert float(bound.terms["underflow"][0, 0]) >= 2.0**-110
    # float64 flushes too: four subnormal terms may all be lost
    x = np.full(4, 2.0**-1030)
    assert _check_sums(x[None], "sequential", "float64") <= 1


# Closed forms and tightness ----------------------------------------------------------------------


def test_sequential_float32_one_then_tiny_terms_nearly_attains_the_bound():
    n = 1000
    x = np.array([1.0] + [U32] * (n - 1))  # each 1 + 2**-24 ties to even: every tiny term lost
    got = float(impl.sum(x, order="sequential", accum="float32"))
    assert got == 1.0
    err = (n - 1) * U32
    bound = float(bs.sum_bound(x, "sequential", "float32").total)
    assert err <= bound
    assert err / bound > 0.99
    assert bound == pytest.approx(bs.gamma(n - 1, U32) * (1 + (n - 1) * U32), rel=1e-9)


def test_kahan_reaches_knuths_two_u_but_stays_below_the_proved_three_u():
    x = np.array(
        [4.094959926703723e-09, 3.523195513110977e-09, -3.83341648557689e-06, 6.232312443898991e-10]
    )  # fmt: skip  (found by a search; float32 values)
    got = float(impl.sum(x, order="kahan", accum="float32"))
    err = float(abs(Fraction(got) - _exact(x)))
    size = float(np.sum(np.abs(x)))
    assert err > 1.98 * U32 * size  # the 2u of Knuth / Higham (4.8), attained to 1%
    assert err <= float(bs.sum_bound(x, "kahan", "float32").total)
    assert bs.kahan_factor(4, U32) == pytest.approx(3 * U32, rel=1e-6)


@pytest.mark.parametrize(
    ("n", "order", "height"),
    [
        (1, "sequential", 0),
        (1000, "sequential", 999),
        (1000, "native", 999),
        (1, "pairwise", 0),
        (2, "pairwise", 1),
        (1000, "pairwise", 10),
        (1024, "pairwise", 10),
        (1025, "pairwise", 11),
        (1000, "blocked(32)", 62),
        (1024, "blocked(32)", 62),
        (10, "blocked(32)", 9),
        (10, "blocked(1)", 9),
        (256, "blocked(16)", 30),
    ],
)
def test_tree_height_table(n, order, height):
    assert bs.tree_height(n, order) == height


class _Depth:
    """A stand-in for mhanum.emulate._arith.Arith: ``add`` returns 1 + the depth of its result.

    Leaves are 1 (depth 0); an exact zero (the running sums start from 0, blocks are padded with
    0) leaves the other operand unchanged, as adding an exact zero does.
    """

    dtype = jnp.float32

    @staticmethod
    def add(a, b):
        return jnp.where(a == 0, b, jnp.where(b == 0, a, jnp.maximum(a, b) + 1))


@pytest.mark.parametrize("order", ["sequential", "pairwise", "blocked(3)", "blocked(8)"])
def test_tree_height_is_the_depth_of_the_implemented_tree(order):
    for n in (1, 2, 5, 8, 13, 33):
        depth = impl._reduce(jnp.ones(n, jnp.float32), lambda t: t, n, (), _Depth(), order)
        assert int(depth) - 1 == bs.tree_height(n, order), (order, n)


def test_gamma_closed_forms():
    assert bs.gamma(0, U32) == 0
    assert bs.gamma(3, 2.0**-8) == 3 * 2.0**-8 / (1 - 3 * 2.0**-8)
    assert math.isinf(bs.gamma(2**24, U32))
    # γ_j + γ_k + γ_j γ_k <= γ_{j+k} (Higham 2002, Lemma 3.3), used for the input rounding
    g = bs.gamma
    assert g(5, U32) + g(7, U32) + g(5, U32) * g(7, U32) <= g(12, U32)


def test_sum_factor_matches_softmax_summation_gamma_and_the_native_carrier():
    for order in ORDERS:
        for u in (U32, 2.0**-8, 2.0**-11, 2.0**-53):
            assert softmax.summation_gamma(100, order, u) == bs.sum_factor(100, order, u)
    assert bs.sum_factor(100, "native", U32) == bs.gamma(99, U32)
    u_prime = 2.0**-8 + U32 + U32 * 2.0**-8
    assert bs.sum_factor(100, "native", 2.0**-8) == bs.gamma(99, u_prime)
    assert bs.sum_factor(100, "kahan", U32) == bs.kahan_factor(100, U32)


def test_kahan_factor_is_three_u_plus_four_n_u_squared_to_leading_orders():
    for n in (2, 100, 10**4):
        k = bs.kahan_factor(n, U32)
        assert 3 * U32 < k < 3 * U32 + 4 * n * U32**2 + 20 * U32**2
    assert bs.kahan_factor(1, U32) == 0
    assert math.isinf(bs.kahan_factor(2**32, 2.0**-16))  # n·u·(2u + u²) >= 1 - 2u - u²


def test_dot_factor_exact_products_and_tf32():
    assert bs.dot_factor(64, "pairwise", "float32", input="bfloat16") == bs.gamma(6, U32)
    assert bs.dot_factor(64, "pairwise", "float32") == bs.gamma(7, U32)
    assert bs.dot_factor(64, "sequential", "float64", input="float32") == bs.gamma(63, 2.0**-53)
    u_op = 2.0**-11
    tf32 = bs.dot_factor(64, "sequential", "float32", operand="tf32")
    assert tf32 == pytest.approx((1 + bs.gamma(63, U32)) * (1 + u_op) ** 2 - 1, rel=1e-12)
    # bf16 values are tf32 values: no operand rounding
    assert bs.dot_factor(64, "sequential", "float32", input="bf16", operand="tf32") == bs.gamma(
        63, U32
    )


def test_a_posteriori_accumulation_term_uses_the_exact_product_refinement():
    rng = np.random.default_rng(1)
    a = round_to(rng.standard_normal((2, 32)), "bfloat16")
    b = round_to(rng.standard_normal((32, 3)), "bfloat16")
    got = bs.matmul_bound(a, b, "sequential", "float32")
    scale = np.abs(a) @ np.abs(b)
    np.testing.assert_allclose(got.terms["accumulation"], bs.gamma(31, U32) * scale, rtol=1e-12)
    np.testing.assert_array_equal(got.terms["operands"], 0.0)
    f32 = bs.matmul_bound(rng.standard_normal((2, 32)), rng.standard_normal((32, 3)), "sequential")
    assert np.all(f32.terms["operands"] > 0)  # float64 data rounded to float32


def test_dot_bound_broadcasts_and_agrees_with_matmul_bound():
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 3, 16)), rng.standard_normal((3, 16))
    d = bs.dot_bound(x, y, "pairwise", "float32")
    assert d.total.shape == (4, 3)
    m = bs.matmul_bound(x[1, 2][None], y[2][:, None], "pairwise", "float32")
    assert float(d.total[1, 2]) == pytest.approx(float(m.total[0, 0]), rel=1e-12)
    assert d.theorem.endswith("R.5")


# The probabilistic bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("lam", [1.0, 2.0, 3.0, 5.0])
def test_probabilistic_gamma_closed_forms(lam):
    u = U32
    g, p = bs.probabilistic_gamma(100, u, lam)
    assert g == pytest.approx(math.expm1(lam * 10 * u + 100 * u * u / (1 - u)), rel=1e-14)
    assert p == pytest.approx(max(0.0, 1 - 2 * math.exp(-(lam**2) * (1 - u) ** 2 / 2)), rel=1e-14)
    # γ̃_n(λ) < γ_n once n is large (√n against n)
    assert bs.probabilistic_gamma(10**4, u, lam)[0] < bs.gamma(10**4, u)


def test_probabilistic_bound_holds_in_the_stated_fraction():
    n, u, rng = 256, U32, np.random.default_rng(2024)
    lam = math.sqrt(2 * math.log(2 * n / 0.01)) / (1 - u)  # per entry: Q = 1 - n(1 - P) >= 0.99
    q = 1 - n * (1 - bs.probabilistic_gamma(n, u, lam)[1])
    assert q >= 0.99 - 1e-12
    a = round_to(rng.standard_normal((10, n)), "float32")
    b = round_to(rng.standard_normal((n, 20)), "float32")
    got = np.asarray(impl.matmul(a, b, order="sequential", accum="float32"), np.float64)
    bound = bs.matmul_bound(a, b, "sequential", "float32", probabilistic=lam)
    assert f"{q:.6g}" in " ".join(bound.assumptions)
    assert bound.probability == pytest.approx(q, rel=1e-12)
    det = bs.matmul_bound(a, b, "sequential", "float32")
    assert np.all(bound.total < det.total / 3)
    exact = a @ b  # float64: within 2^-40 relative of the exact products for these sizes
    fails = int(np.sum(np.abs(got - exact) > bound.total - 2.0**-40 * (np.abs(a) @ np.abs(b))))
    trials = got.size
    # Under the model, fails ~ Binomial(trials, <= 0.01): allow c with P(X > c) < 1e-6
    c = next(c for c in range(trials) if _binomial_tail(trials, 0.01, c) < 1e-6)
    assert fails <= c


def _binomial_tail(n: int, p: float, c: int) -> float:
    """P(X > c) for X ~ Binomial(n, p)."""
    return 1 - sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(c + 1))


def test_probabilistic_bound_is_only_a_model_for_round_to_nearest():
    # Every 1 + 2**-24 ties back to 1: all rounding errors have the same sign, not mean zero.
    n = 1000
    x = np.array([1.0] + [U32] * (n - 1))
    got = float(impl.sum(x, order="sequential", accum="float32"))
    err = float(abs(Fraction(got) - _exact(x)))
    lam = 4.0
    assert err > float(bs.sum_bound(x, "sequential", probabilistic=lam).total)
    assert err <= float(bs.sum_bound(x, "sequential").total)


def test_kahan_probabilistic_falls_back_to_the_deterministic_bound():
    x = np.arange(1.0, 20.0)
    det = bs.sum_bound(x, "kahan")
    prob = bs.sum_bound(x, "kahan", probabilistic=3.0)
    assert float(prob.total) == float(det.total)
    assert prob.probability == det.probability == 1.0
    assert any("deterministic" in a for a in prob.assumptions)


# Bad arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: bs.gamma(-1, U32), "n: expected an integer >= 0"),
        (lambda: bs.gamma(3, 0.0), "u: expected a unit roundoff"),
        (lambda: bs.gamma(3, 0.5), "u: expected a unit roundoff"),
        (lambda: bs.tree_height(0, "sequential"), "n: expected an integer >= 1"),
        (lambda: bs.tree_height(True, "sequential"), "n: expected an integer"),
        (lambda: bs.tree_height(4, "diagonal"), "order: expected a summation order"),
        (lambda: bs.tree_height(4, "blocked(0)"), "order: expected"),
        (lambda: bs.tree_height(4, "kahan"), "order: expected a summation tree order"),
        (lambda: bs.sum_factor(4, 3, U32), "order: expected"),
        (lambda: bs.kahan_factor(0, U32), "n: expected"),
        (lambda: bs.dot_factor(4, "native", "tf32"), "accum: expected one of"),
        (lambda: bs.dot_factor(4, "native", "float32", operand="f7"), "operand: expected"),
        (lambda: bs.dot_factor(4, "native", "float32", input="f7"), "input: expected"),
        (lambda: bs.probabilistic_gamma(4, U32, 0.0), "probabilistic: expected a finite"),
        (lambda: bs.sum_bound([1.0, np.nan]), "x: expected finite"),
        (lambda: bs.sum_bound([1.0, np.inf]), "x: expected finite"),
        (lambda: bs.sum_bound(["a"]), "x: expected a real array"),
        (lambda: bs.sum_bound(np.zeros((2, 0))), "x: expected shape"),
        (lambda: bs.sum_bound([1.0], axis=1), "axis: expected an axis"),
        (lambda: bs.sum_bound([1.0], order="fast"), "order: expected"),
        (lambda: bs.sum_bound([1.0], accum="e4m3"), "accum: expected one of"),
        (lambda: bs.sum_bound([1.0], probabilistic=-1), "probabilistic: expected"),
        (lambda: bs.dot_bound([1.0, 2.0], [1.0]), "y: expected shape"),
        (lambda: bs.dot_bound(np.ones((2, 3)), np.ones((3, 3))), "y: expected leading"),
        (lambda: bs.matmul_bound(np.ones((2, 3)), np.ones((2, 3))), "b: expected shape"),
        (lambda: bs.matmul_bound(np.ones(3), np.ones((3, 1))), "a: expected shape"),
        (
            lambda: bs.matmul_bound(np.ones((2, 2, 3)), np.ones((3, 3, 1))),
            "b: expected batch dimensions",
        ),
        (lambda: bs.matmul_bound(np.ones((1, 1)), [[np.nan]]), "b: expected finite"),
        (lambda: bs.matmul_bound(np.ones((1, 1)), np.ones((1, 1)), operand="x"), "operand:"),
    ],
)
def test_bad_arguments_raise(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()
