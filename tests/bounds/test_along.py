"""Theorem A.1g: the output's error along a direction per query row (``attention_bound_along``).

The assertion is the theorem: ``|Σ_c g_c (ô_c − o_c)| <= along`` for the emulated output ``ô``
and the certified reference ``o``, measured exactly (``fractions``) from the float64 values, the
reference's own rounding to float64 (half an ulp per entry) added to the bound; and ``along``
never exceeds the entrywise form ``Σ_c |g_c| total_c``. A row with an infinite ``along`` must have
an infinite entry with a reason; a finite ``along`` over a non-finite output is a violation.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import CertificationError, InvalidArgument, Numerics, reference
from mhanum import strategies as mst
from mhanum.bounds import attention_bound, attention_bound_along
from mhanum.formats import round_to

SHAPES = ((1, 1, 1, 1), (2, 4, 4, 2), (3, 16, 8, 3))
"""``(q_len, kv_len, d_k, d_v)``: a few fixed shapes, so the jitted attention compiles once."""

SETTINGS = settings(
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

# one of each softmax kind and family of formats (every preset: the slow tier)
QUICK = ("fp32", "bf16-fp32acc", "fp16", "fp8-e4m3-fp32acc")


def _directional_error(g: np.ndarray, out: np.ndarray, ref: np.ndarray) -> list[Fraction]:
    """``|Σ_c g_c (out_c − ref_c)| + Σ_c |g_c| 2^-53 |ref_c|`` per row (flattened), exactly: the
    second part for the reference's rounding to float64."""
    rows = []
    for gi, oi, ri in zip(g.reshape(-1, g.shape[-1]), out.reshape(-1, g.shape[-1]),
                          ref.reshape(-1, g.shape[-1]), strict=True):  # fmt: skip
        exact = sum(
            Fraction(a) * (Fraction(b) - Fraction(c)) for a, b, c in zip(gi, oi, ri, strict=True)
        )
        slack = (
            sum(abs(Fraction(a)) * abs(Fraction(c)) for a, c in zip(gi, ri, strict=True)) / 2**53
        )
        rows.append(abs(exact) + slack)
    return rows


def _check(q, k, v, g, num, mask=None, bias=None, scale=None, g_error=None, g_exact=None):
    """A.1g on one input; returns ``(along, entrywise form)``."""
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            bound, along = attention_bound_along(
                q, k, v, g, mask, g_error=g_error, bias=bias, numerics=num, scale=scale
            )
            ref = reference.attention(q, k, v, mask=mask, bias=bias, scale=scale)
    except (InvalidArgument, CertificationError):
        assume(False)
        raise
    total = np.asarray(bound.total, np.float64)
    g_up = np.abs(g) + (0.0 if g_error is None else g_error)
    with np.errstate(over="ignore", invalid="ignore"):
        entrywise = (g_up * total).sum(axis=-1)
    assert along.shape == total.shape[:-1]
    assert not np.isnan(along).any()
    # (plus float64's smallest subnormal per product and addition, for underflow)
    floor = (2 * total.shape[-1] + 2) * 2.0**-1074
    assert np.all((along <= entrywise * (1 + 2**-40) + floor) | ~np.isfinite(entrywise))
    finite = np.isfinite(along)
    if not finite.all():
        # an infinite entry (with its reason), or a bound along g past float64's range
        if (~finite & ~np.isfinite(total).all(axis=-1)).any():
            assert bound.reasons, "an infinite bound along g without a reason"
        with np.errstate(over="ignore", invalid="ignore"):
            assert not np.isfinite(entrywise[~finite] * (1 + 2**-30)).any()
    out = mn.attention(q, k, v, mask, bias=bias, numerics=num, scale=scale)
    out = np.asarray(out, np.float64)
    ok_rows = np.isfinite(out).all(axis=-1) & np.isfinite(ref).all(axis=-1)
    assert ok_rows[finite].all(), f"{num.describe()}: a non-finite output under finite along"
    g_true = g if g_exact is None else g_exact
    err = _directional_error(
        np.where(ok_rows[..., None], g_true, 0.0),
        np.where(ok_rows[..., None], out, 0.0),
        np.where(ok_rows[..., None], ref, 0.0),
    )
    bad = [
        (float(e), float(a))
        for e, a, f in zip(err, along.ravel(), finite.ravel(), strict=True)
        if f and e > Fraction(a)
    ]
    assert not bad, f"{num.describe()}: (error, bound) along g {bad}"
    return along, entrywise


def _drawn(data: st.DataObject, num: Numerics) -> None:
    q_len, kv_len, d_k, d_v = data.draw(st.sampled_from(SHAPES), label="shape")
    x = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=kv_len, d_k=d_k, d_v=d_v, structure="range", numerics=num
        )
    )
    mask = None
    if data.draw(st.booleans(), label="masked"):
        mask = data.draw(mst.masks(q_len=q_len, kv_len=kv_len, fully_masked_rows=False))
    e = data.draw(st.integers(-60, 60), label="direction's exponent")
    seed = data.draw(st.integers(0, 2**32 - 1), label="direction's seed")
    g = np.random.default_rng(seed).standard_normal((q_len, d_v)) * 2.0**e
    _check(x.q, x.k, x.v, g, num, mask, x.bias, x.scale)


@pytest.mark.parametrize("preset", QUICK)
@SETTINGS
@given(data=st.data())
def test_the_error_along_a_direction_is_within_a1g(preset, data):
    _drawn(data, Numerics.preset(preset))


@pytest.mark.parametrize("preset", [p for p in Numerics.presets() if p not in QUICK])
@SETTINGS
@given(data=st.data())
def test_every_preset_along_a_direction_at_the_range_edges(preset, data):
    _drawn(data, Numerics.preset(preset))


@SETTINGS
@given(data=st.data())
def test_custom_numerics_along_a_direction_at_the_range_edges(data):
    _drawn(data, data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True)))


def _cancelling(fmt: str, seed: int = 0):
    """Values whose columns 0 and 1 are opposite, and ``g = e_0 + e_1``: ``g·v_j = 0`` for every
    key, so the logits' and the probabilities' roundings' brackets vanish along ``g``."""
    rng = np.random.default_rng(seed)
    q, k = (round_to(rng.standard_normal((16, 8)) * 2, fmt) for _ in range(2))
    v = round_to(rng.standard_normal((16, 4)), fmt)
    v[:, 1] = -v[:, 0]
    g = np.zeros((16, 4))
    g[:, :2] = 1.0
    return q, k, v, g


@pytest.mark.parametrize("preset", ["bf16-fp32acc", "fp16-fp32acc"])
def test_brackets_that_cancel_along_the_direction_are_not_charged(preset):
    """Along ``g = e_0 + e_1`` with ``v_j1 = -v_j0`` the logits' share ``Σ_j (p̃_j - p_j) g·v_j``
    and the probabilities' roundings' ``Σ_j r_j g·v_j`` are 0: A.1g drops them (within the
    float64 products' rounding), which the entrywise form charges in full on both columns."""
    num = Numerics.preset(preset)
    q, k, v, g = _cancelling(num.format_of("input").name)
    along, entrywise = _check(q, k, v, g, num)
    terms = attention_bound(q, k, v, numerics=num, known_rounding=False).terms
    dropped = sum(terms[t][:, :2].sum(axis=-1) for t in ("logits", "probability_rounding"))
    assert (dropped > 0.5 * entrywise).all()  # the two brackets are most of the bound here
    assert (along <= entrywise - 0.99 * dropped / (1 + num.format_of("output").u)).all()


def test_random_directions_are_several_times_below_the_entrywise_form():
    """Random normal inputs at L = d = 64 in bf16-fp32acc: ``g·v_j`` cancels over the columns
    (``|g·v_j| ~ 8`` where ``Σ_c |g_c||v_jc| ~ 41``), and A.1g is below 0.4 of the entrywise
    form on every row (about 0.25 measured)."""
    rng = np.random.default_rng(0)
    q, k, v, g = (round_to(rng.standard_normal((64, 64)), "bfloat16") for _ in range(4))
    along, entrywise = _check(q, k, v, g, Numerics.preset("bf16-fp32acc"))
    assert (along < 0.4 * entrywise).all()


def test_an_inexact_direction_within_g_error_is_covered():
    """``g_error`` bounds ``|g − g*|``: the bound holds along any ``g*`` within it, and grows
    with it."""
    rng = np.random.default_rng(3)
    q, k, v, g = (round_to(rng.standard_normal((16, 8)), "float16") for _ in range(4))
    radius = 0.25 * np.abs(g)
    g_star = g + radius * np.sign(rng.standard_normal(g.shape))
    num = Numerics.preset("fp16-fp32acc")
    tight, _ = _check(q, k, v, g, num)
    loose, _ = _check(q, k, v, g, num, g_error=radius, g_exact=g_star)
    assert (loose > tight).all()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"g": np.ones((3, 4))}, "g: expected a shape broadcastable"),
        ({"g": np.full((4, 4), np.nan)}, "g"),
        ({"g_error": -np.ones((4, 4))}, "g_error: expected finite values >= 0"),
        ({"g_error": np.ones((5, 4))}, "g_error: expected a shape broadcastable"),
    ],
)
def test_bad_directions_are_refused_by_name(kw, message):
    x = np.ones((4, 4))
    args = {"g": x, **kw}
    with pytest.raises(InvalidArgument, match=message):
        attention_bound_along(x, x, x, args.pop("g"), **args)


def test_a_direction_whose_products_underflow_float64_is_still_covered():
    """Pinned (found by the full-profile hunt): along ``g = 2^-1070`` the products
    ``g_c total_c`` underflow float64 to 0 while the error along ``g`` is positive (below
    float64's smallest subnormal); every product and addition is charged ``2^-1074``."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((4, 4)) for _ in range(3))
    g = np.full((4, 4), 2.0**-1070)
    num = Numerics.preset("fp64")
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    ref = reference.attention(q, k, v)
    # the error along g is positive on some row: the float64 difference exceeds the
    # reference's own rounding there
    lower = [
        abs(
            sum(
                Fraction(a) * (Fraction(b) - Fraction(c))
                for a, b, c in zip(gi, oi, ri, strict=True)
            )
        )
        - sum(abs(Fraction(a) * Fraction(c)) for a, c in zip(gi, ri, strict=True)) / 2**53
        for gi, oi, ri in zip(g, out, ref, strict=True)
    ]
    assert max(lower) > 0
    along, _ = _check(q, k, v, g, num)
    assert (along > 0).all()
