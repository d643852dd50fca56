"""Theorem R.8 (papers/summation.md): a dot in any tree order errs by at most
``u_×A + (K - 1)u_*(C + κA) + η(K + (K - 1)(1 + u_*J))``, ``C = max(P, N)`` the larger of the
sums of the positive and of the negative products.

Checked against exact rational arithmetic: each dot is summed by a tree of the model whose every
rounding is chosen against the bound (``δ_v = ±u`` with the sign of the value it rounds and the
products' ``ε_k`` likewise), in the order that adds the larger sign's terms first, largest first
(where the partial sums reach ``P``), and in drawn trees. A.1's step 3 against the worst-case
rounding of every dot: ``tests/test_rounding_floor_benchmark.py``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mhanum import Numerics
from mhanum.bounds.enclosure import one_signed_dot_error, one_signed_total
from mhanum.bounds.factors import gamma

U = 2.0**-24
FP32 = Numerics.preset("fp32")


def _worst_order(y: list[float]) -> list[float]:
    """The larger sign's terms first, largest first, then the others, smallest first."""
    lead = 1.0 if sum(y) >= 0 else -1.0
    first = sorted((t for t in y if t * lead > 0), key=abs, reverse=True)
    rest = sorted((t for t in y if t * lead <= 0), key=abs)
    return first + rest


def _adversarial(
    terms: list[Fraction], u: Fraction, tree: str, rng: np.random.Generator
) -> Fraction:
    """The terms summed by a ``tree`` (``"chain"``: left to right; ``"random"``: two drawn
    neighbours at a time), each addition times ``1 + u`` with the sign of its value (so every
    rounding pushes the sum away from 0)."""
    nodes = list(terms)
    while len(nodes) > 1:
        i = 0 if tree == "chain" else int(rng.integers(len(nodes) - 1))
        t = nodes[i] + nodes[i + 1]
        nodes[i : i + 2] = [t * (1 + u) if t >= 0 else t * (1 - u)]
    return nodes[0]


def _bound(y: list[float], exact_products: bool) -> float:
    a = np.array([[sum(abs(t) for t in y)]])
    signed = np.array([[abs(math.fsum(y))]])
    bits = (8, 8) if exact_products else (24, 24)
    out = one_signed_dot_error(FP32, len(y), bits, a, one_signed_total(a, signed, len(y)))
    assert out is not None
    return float(out[0, 0])


def test_the_closed_form_for_terms_of_both_signs():
    """64 terms ±1, 32 of each sign, products exact: A = 64, C = 32, κ = γ_62(u), and the
    bound is 63u(32 + 64κ) + η(64 + 63(1 + uJ)) (times 1 + 2^-40), against R.5's γ_64·64:
    about half."""
    y = [1.0, -1.0] * 32
    g = gamma(62, U)
    j = 64 * (1 + g) + 62 * (1 + U) ** 62
    eta = 2.0**-126 * (64 + 63 * (1 + U * j))
    a = 64 * (1 + 2.0**-52 * 66)
    want = (63 * U * (32 + g * a) + eta) * (1 + 2.0**-40)
    assert _bound(y, exact_products=True) == pytest.approx(want, rel=1e-12)
    assert _bound(y, exact_products=True) < 0.51 * gamma(64, U) * 64


@pytest.mark.parametrize("exact_products", [True, False])
@given(
    st.lists(
        st.floats(-1e3, 1e3, allow_nan=False, width=32).filter(lambda t: t == 0 or abs(t) > 1e-30),
        min_size=2,
        max_size=48,
    ),
    st.sampled_from(["worst", "chain", "random"]),
    st.integers(0, 2**16),
)
def test_an_adversarial_tree_stays_within_the_bound(exact_products, y, tree, seed):
    u = Fraction(U)
    exact = sum(Fraction(t) for t in y)
    lead = 1 if exact >= 0 else -1
    # the products' roundings pushed the way the sum leans
    terms = [Fraction(t) * (1 + (0 if exact_products else lead) * u) for t in y]
    ordered = _worst_order(y) if tree == "worst" else y
    if tree == "worst":
        terms = [Fraction(t) * (1 + (0 if exact_products else lead) * u) for t in ordered]
    rng = np.random.default_rng(seed)
    computed = _adversarial(terms, u, "chain" if tree == "worst" else tree, rng)
    assert abs(computed - exact) <= Fraction(_bound(y, exact_products))


def test_the_worst_order_comes_near_the_bound():
    """Random normal terms in the worst order with every rounding pushed outwards: the error is
    more than half the bound (the bound's slack is the partial sums below C on the way up)."""
    rng = np.random.default_rng(5)
    y = [float(t) for t in rng.standard_normal(64).astype(np.float32)]
    exact = sum(Fraction(t) for t in y)
    computed = _adversarial([Fraction(t) for t in _worst_order(y)], Fraction(U), "chain", rng)
    ratio = float(abs(computed - exact)) / _bound(y, exact_products=True)
    assert 0.5 < ratio <= 1


def test_the_martingale_form_holds_in_the_stated_fraction():
    """Theorem R.8' with λ = 2: a dot's bound fails with probability at most 2e^-2 = 0.271 when
    the roundings are independent signs ±u (the model at its extreme). 400 dots of 64 random
    normal terms in their worst order, every product and addition rounded by a drawn sign in
    exact arithmetic: at most 133 fail (Binomial(400, 0.271) exceeds 133 with probability below
    1e-6), and the bound is below the deterministic one."""
    rng = np.random.default_rng(9)
    u, fails = Fraction(U), 0
    for _ in range(400):
        y = [float(t) for t in rng.standard_normal(64).astype(np.float32)]
        terms = [Fraction(t) * (1 + int(rng.choice([-1, 1])) * u) for t in _worst_order(y)]
        total = terms[0]
        for t in terms[1:]:
            total = (total + t) * (1 + int(rng.choice([-1, 1])) * u)
        a = np.array([[sum(abs(t) for t in y)]])
        c = one_signed_total(a, np.array([[abs(math.fsum(y))]]), 64)
        bound = one_signed_dot_error(FP32, 64, (24, 24), a, c, lam=2.0)
        assert bound is not None
        assert bound[0, 0] < 0.5 * _bound(y, exact_products=False)
        fails += abs(total - sum(Fraction(t) for t in y)) > Fraction(float(bound[0, 0]))
    assert fails <= 133


def test_not_for_other_units():
    a = np.ones((1, 1))
    split = Numerics.preset("fp32").replace(dot="bf16x3")
    assert one_signed_dot_error(split, 8, (24, 24), a, a) is None
    kahan = Numerics.preset("fp32").replace(summation="kahan")
    assert one_signed_dot_error(kahan, 8, (24, 24), a, a) is None
    assert one_signed_dot_error(FP32, 1, (24, 24), a, a) is None
    # two roundings per addition where float32 may carry bfloat16: no martingale form
    bf16 = Numerics.preset("bf16")
    assert one_signed_dot_error(bf16, 8, (8, 8), a, a) is not None
    assert one_signed_dot_error(bf16, 8, (8, 8), a, a, lam=4.0) is None
