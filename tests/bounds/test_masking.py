"""Tests of mhanum.bounds.masking against the real mhanum.softmax / mhanum.attention."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import mhanum
from mhanum import InvalidArgument, Numerics, round_to
from mhanum.bounds import masking
from mhanum.bounds.format_values import from_ordinal, ordinal
from mhanum.bounds.masking import analyze_mask, recommend_mask_value, safe_mask_range

_ACCUM = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def _numerics(fmt: str, value: float | str, mode: str, softmax: str, soft: str | None) -> Numerics:
    return Numerics(
        input=fmt,
        accum=_ACCUM[fmt] if soft is None else max(_ACCUM[fmt], soft, key=_precision),
        softmax=softmax,
        softmax_format=soft or fmt,
        mask_mode=mode,
        mask_value=value,
    )


def _precision(name: str) -> int:
    return mhanum.get_format(name).precision


def _softmax(x: np.ndarray, mask: np.ndarray, num: Numerics) -> np.ndarray:
    return np.asarray(mhanum.softmax(x, mask, numerics=num), dtype=np.float64)


# The seed facts ------------------------------------------------------------------------------------


def test_minus_1e9_in_float16_is_stored_as_minus_inf() -> None:
    a = analyze_mask("float16", -1e9, "fill", 10.0)
    assert a.stored_value == -math.inf
    assert a.stored_overflow
    assert a.overflows
    assert a.fully_masked_row == "nan"


def test_finfo_min_plus_minus_16_overflows_in_float16_and_the_row_is_nan() -> None:
    a = analyze_mask("float16", "finfo.min", "add", 16.0)
    assert a.stored_value == -65504.0
    assert not a.stored_overflow
    assert a.add_can_overflow
    assert a.overflows
    assert a.fully_masked_row == "nan_possible"
    assert float(round_to(-65504.0 - 16.0, "float16")) == -math.inf
    num = Numerics(input="float16", accum="float16", mask_mode="add", mask_value="finfo.min")
    rows = np.array([[-16.0] * 4, [0.0] * 4])
    p = _softmax(rows, np.zeros((2, 4), bool), num)
    assert np.isnan(p[0]).all()  # every logit fl(-16 + finfo.min) = -inf
    assert (p[1] == 0.25).all()  # fl(0 + finfo.min) = finfo.min: finite, uniform


def test_minus_1e9_added_to_every_float32_logit_gives_exactly_uniform_attention() -> None:
    a = analyze_mask("float32", -1e9, "add", 31.0)
    assert a.absorption_ulp == 64.0
    assert a.absorption_radius == 32.0
    assert a.absorbs_scores
    assert a.logit_error_bound == 32.0
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 6, 8))
    scores = q @ k.T / math.sqrt(8)
    assert np.abs(scores).max() < 31
    out = np.asarray(mhanum.attention(q, k, v, bias=np.full((6, 6), -1e9), numerics="fp32"))
    uniform = np.asarray(mhanum.attention(np.zeros_like(q), k, v, numerics="fp32"))
    assert np.array_equal(out, uniform)
    assert not np.array_equal(out, np.asarray(mhanum.attention(q, k, v, numerics="fp32")))


def test_an_added_constant_quantises_logits_to_its_ulp() -> None:
    a = analyze_mask("float32", -1e9, "add", 100.0)
    assert not a.absorbs_scores
    assert a.logit_error_bound == 32.0
    s = np.linspace(-100, 100, 41)
    shifted = round_to(s + -1e9, "float32")
    assert np.all(np.abs(shifted - (s - 1e9)) <= a.logit_error_bound)
    assert np.all((shifted - -1e9) % a.absorption_ulp == 0)


# Fully-masked rows: the prediction against the real softmax -----------------------------------------

_COMBOS = [
    # fmt, value, mode, softmax, softmax_format
    ("float32", -math.inf, "fill", "safe", None),
    ("float32", -math.inf, "fill", "naive", None),
    ("float32", -math.inf, "fill", "online(2)", None),
    ("float16", -1e9, "fill", "safe", None),
    ("float16", -1e9, "fill", "online(2)", None),
    ("float32", -1e9, "fill", "safe", None),
    ("float32", -1e9, "fill", "naive", None),
    ("float32", -1e9, "fill", "online(2)", None),
    ("float32", "finfo.min", "fill", "safe", None),
    ("float32", "finfo.min", "fill", "safe", "bfloat16"),
    ("float32", "0.7*finfo.min", "fill", "safe", "bfloat16"),
    ("float32", -1e9, "fill", "safe", "float16"),
    ("float32", -10.0, "fill", "naive", None),
    ("bfloat16", "finfo.min", "fill", "naive", None),
    ("bfloat16", -1e4, "fill", "safe", None),
    ("float16", -3e4, "fill", "safe", None),
    ("float16", -65504.0, "fill", "naive", None),
    ("float16", "finfo.min", "add", "safe", None),
    ("float16", "finfo.min", "add", "online(2)", None),
    ("float16", -3e4, "add", "safe", None),
    ("float16", -1e4, "add", "safe", None),
    ("float16", -1e4, "add", "naive", None),
    ("float32", -1e9, "add", "safe", None),
    ("float32", -1e9, "add", "naive", None),
    ("float32", -1e4, "add", "safe", None),
    ("float32", -50.0, "add", "naive", None),
    ("float32", -100.0, "add", "naive", None),
    ("bfloat16", -1e9, "add", "safe", None),
    ("bfloat16", "0.7*finfo.min", "add", "online(2)", None),
    ("float64", -1e9, "add", "safe", None),
]

_B = 16.0


def _rows(fmt: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = np.array(
        [[-_B] * 4, [_B] * 4, [0.0] * 4, [-_B, 0.0, 3.0, _B], *rng.uniform(-_B, _B, (4, 4))]
    )
    return round_to(rows, fmt)


@pytest.mark.parametrize(("fmt", "value", "mode", "softmax", "soft"), _COMBOS)
def test_fully_masked_row_prediction_matches_the_real_softmax(
    fmt: str, value: float | str, mode: str, softmax: str, soft: str | None
) -> None:
    a = analyze_mask(fmt, value, mode, _B, softmax=softmax, softmax_format=soft)
    num = _numerics(fmt, value, mode, softmax, soft)
    assert masking.analyze_numerics(num, _B) == a
    rows = _rows(fmt)
    p = _softmax(rows, np.zeros(rows.shape, bool), num)
    nan_rows = np.isnan(p).all(axis=1)
    finite_rows = np.isfinite(p).all(axis=1)
    assert (nan_rows | finite_rows).all()
    if a.fully_masked_row == "nan":
        assert nan_rows.all()
    elif a.fully_masked_row == "nan_possible":
        assert nan_rows[0]
        assert not nan_rows.all()
    else:
        assert finite_rows.all()
        equal = (p == p[:, :1]).all(axis=1)
        if a.fully_masked_row == "uniform":
            assert equal.all()
        else:
            assert a.fully_masked_row == "quantised"
            assert not equal.all()


@pytest.mark.parametrize(
    ("fmt", "value", "mode"),
    [("float16", -1e9, "fill"), ("float32", -1e9, "fill"), ("float16", "finfo.min", "add")],
)
def test_fully_masked_row_prediction_matches_real_attention(
    fmt: str, value: float | str, mode: str
) -> None:
    a = analyze_mask(fmt, value, mode, _B, softmax_format="float32")
    num = Numerics(input=fmt, accum="float32", mask_mode=mode, mask_value=value)
    k = np.array([[1.0, 1.0], [2.0, -1.0], [0.0, 3.0]])
    v = np.arange(6.0).reshape(3, 2)
    q = np.array([[-2.0, -2.0]])  # scores -2.8, -0.7, -4.2: none reaches -16
    out = np.asarray(mhanum.attention(q, k, v, np.zeros((1, 3), bool), numerics=num))
    if a.fully_masked_row == "nan":
        assert np.isnan(out).all()
    else:  # -1e9 filled, or finfo.min + (scores > -16), absorbed: equal weights, the mean of v
        assert a.fully_masked_row in ("uniform", "nan_possible")
        assert np.allclose(out, v.mean(axis=0), rtol=2**-9)


def test_uniform_rows_need_not_sum_to_one_beyond_2_to_the_p_keys() -> None:
    a = analyze_mask("float16", -1e4, "fill", 8.0, n_keys=4096)
    assert a.fully_masked_row == "uniform"
    assert any("may not sum to 1" in note for note in a.notes)
    num = Numerics(input="float16", accum="float16", summation="sequential", mask_value=-1e4)
    p = _softmax(np.zeros(4096), np.zeros(4096, bool), num)
    assert (p == 2.0**-11).all()  # equal, but the sum of ones stalled at 2^11 = 2048


# Leakage -----------------------------------------------------------------------------------------

_LEAK_CASES = [
    # fmt, value, mode, B, softmax, softmax_format
    ("float64", -20.0, "fill", 4.0, "safe", None),
    ("float32", -20.0, "fill", 4.0, "safe", None),
    ("float32", -12.0, "add", 4.0, "safe", None),
    ("float32", -20.0, "fill", 4.0, "naive", None),
    ("float32", -20.0, "fill", 4.0, "online(3)", None),
    ("float16", -8.0, "fill", 4.0, "safe", None),
    ("float16", -8.0, "add", 2.0, "safe", "float16"),
    ("bfloat16", -10.0, "fill", 2.0, "safe", "bfloat16"),
    ("float16", -1e4, "fill", 8.0, "safe", None),
    ("float32", -1e9, "fill", 8.0, "naive", None),
    ("float16", -8.0, "fill", 4.0, "safe", "float32"),
    ("bfloat16", -6.0, "add", 2.0, "online(3)", "float32"),
    ("float32", -30.0, "add", 8.0, "naive", "float64"),
]
_N = 8


@pytest.mark.parametrize(("fmt", "value", "mode", "b", "softmax", "soft"), _LEAK_CASES)
@given(data=st.data())
def test_masked_probability_is_within_the_leakage_bounds(
    fmt: str, value: float, mode: str, b: float, softmax: str, soft: str | None, data: st.DataObject
) -> None:
    a = analyze_mask(fmt, value, mode, b, n_keys=_N, softmax=softmax, softmax_format=soft)
    assert a.leakage_bound is not None
    assert a.leakage_exact is not None
    logit = st.floats(-b, b, allow_nan=False)
    s = round_to(np.array(data.draw(st.lists(logit, min_size=_N, max_size=_N))), fmt)
    attend = np.array(data.draw(st.lists(st.booleans(), min_size=_N, max_size=_N)))
    attend[data.draw(st.integers(0, _N - 1))] = True
    p = _softmax(s, attend, _numerics(fmt, value, mode, softmax, soft))
    leaked = math.fsum(p[~attend])
    assert leaked <= a.leakage_bound
    if a.leakage_is_zero:
        assert leaked == 0
    masked = s + a.stored_value if mode == "add" else np.full(_N, a.stored_value)
    logits = np.where(attend, s, round_to(masked, fmt))
    with mpmath.workdps(50):
        weights = [mpmath.exp(mpmath.mpf(float(x))) for x in logits]
        exact = mpmath.fsum(w for w, t in zip(weights, attend, strict=True) if not t)
        assert exact / mpmath.fsum(weights) <= a.leakage_exact


@pytest.mark.parametrize(("fmt", "value", "mode", "b", "softmax", "soft"), _LEAK_CASES)
def test_leakage_bound_is_nearly_reached_by_the_worst_row(
    fmt: str, value: float, mode: str, b: float, softmax: str, soft: str | None
) -> None:
    a = analyze_mask(fmt, value, mode, b, n_keys=_N, softmax=softmax, softmax_format=soft)
    assert a.leakage_bound is not None
    # One key attended at -B; the masked scores at +B (they matter when the constant is added).
    s = np.full(_N, b)
    s[0] = -b
    attend = np.arange(_N) == 0
    p = _softmax(s, attend, _numerics(fmt, value, mode, softmax, soft))
    leaked = math.fsum(p[1:])
    assert leaked <= a.leakage_bound
    if a.leakage_is_zero:
        assert leaked == 0
    else:  # first-order tight: the worst row reaches the bound up to (1 + t)(1 + O(u)) factors
        assert leaked >= a.leakage_bound / 2


def test_leakage_as_a_bound() -> None:
    a = analyze_mask("float32", -20.0, "fill", 4.0, n_keys=16)
    bound = a.leakage()
    assert bound.theorem == "M.5"
    assert bound.total == a.leakage_bound
    assert bound.terms["masked_keys"] == 15
    assert bound.total >= bound.terms["masked_keys"] * bound.terms["per_key"]
    with pytest.raises(InvalidArgument, match="n_keys: expected the analysis"):
        analyze_mask("float32", -20.0, "fill", 4.0).leakage()


@pytest.mark.parametrize("n", [2, 5, 64])
def test_exact_leakage_bound_is_attained(n: int) -> None:
    a = analyze_mask("float64", -10.0, "fill", 3.0, n_keys=n)
    t = mpmath.exp(-7)
    worst = (n - 1) * t / (1 + (n - 1) * t)
    assert a.leakage_exact is not None
    assert float(worst) <= a.leakage_exact <= float(worst) * (1 + 2**-50)


@pytest.mark.parametrize("soft", ["float64", "float32", "bfloat16", "float16"])
def test_assumptions_e_and_u_hold_for_the_real_softmax(soft: str) -> None:
    a = analyze_mask(soft, -1.0, "fill", 0.0)
    num = Numerics(input=soft, accum=_ACCUM[soft], softmax_format=soft)
    below = float(round_to(a.exp_zero_below, soft))
    if below > a.exp_zero_below:
        below = _neighbour(below, soft, -1)
    x = np.array([0.0, below, _neighbour(below, soft, -1)])
    p = _softmax(x, np.ones(3, bool), num)
    assert p.tolist() == [1.0, 0.0, 0.0]


# Safe range -----------------------------------------------------------------------------------------


def _neighbour(c: float, fmt: str, step: int) -> float:
    f = mhanum.get_format(fmt)
    return from_ordinal(ordinal(c, f) + step, f)


@pytest.mark.parametrize(
    ("fmt", "b", "tol", "mode", "n"),
    [
        ("float16", 16.0, 1e-6, "fill", 64),
        ("float16", 5.0, 0.0, "add", 8),
        ("bfloat16", 30.0, 1e-3, "fill", 128),
        ("float32", 16.0, 1e-9, "add", 1024),
    ],
)
def test_safe_range_endpoints_are_safe_and_their_neighbours_are_not(
    fmt: str, b: float, tol: float, mode: str, n: int
) -> None:
    r = safe_mask_range(fmt, b, tol, mode=mode, n_keys=n)
    assert not r.empty
    assert r.low < r.high < 0
    num_args = {"fmt": fmt, "mode": mode, "softmax": "safe", "soft": None}
    # low: finite when the most negative score is added; one value below overflows, for real.
    for c in (r.low, r.high):
        a = analyze_mask(fmt, c, mode, b, n_keys=n)
        assert not a.overflows
        assert not a.add_can_overflow
        assert a.leakage_bound is not None
        assert a.leakage_bound <= tol
    below = _neighbour(r.low, fmt, -1)
    assert float(round_to(below - b, fmt)) == -math.inf
    outside = analyze_mask(fmt, below, mode, b)
    if r.low == -mhanum.get_format(fmt).max_finite:  # nothing finite lies below
        assert outside.stored_overflow
    else:
        assert outside.add_can_overflow
        num = _numerics(value=below, **{**num_args, "mode": "add"})
        assert np.isnan(_softmax(np.array([-b, -b]), np.zeros(2, bool), num)).all()
    # high: the worst row (one key attended at -B, the rest masked) leaks at most tol, for real;
    # one value above, the bound of Theorem M.5 exceeds tol.
    x = round_to(np.full(n, -b), fmt)
    attend = np.zeros(n, bool)
    attend[0] = True
    p = _softmax(x, attend, _numerics(value=r.high, **num_args))
    assert math.fsum(p[1:]) <= tol
    above = _neighbour(r.high, fmt, 1)
    bound = analyze_mask(fmt, above, mode, b, n_keys=n).leakage_bound
    assert bound is not None
    assert bound > tol


@given(b=st.floats(0, 100), tol=st.floats(0, 0.5), n=st.integers(1, 10_000))
@example(b=0.0, tol=0.0, n=1)
def test_recommended_value_lies_in_the_safe_range(b: float, tol: float, n: int) -> None:
    rec = recommend_mask_value("float16", b, tol, n_keys=n)
    assert rec.range.contains(rec.value)
    assert float(round_to(rec.value, "float16")) == rec.value
    assert rec.analysis.leakage_bound is not None
    assert rec.analysis.leakage_bound <= tol
    assert not rec.analysis.overflows


@pytest.mark.parametrize("fmt", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("b", "tol", "n"), [(1.0, 0.5, 2), (1e3, 1e-12, 10**6), (0.0, 0.0, 1)])
def test_a_safe_constant_is_recommended_in_every_format(fmt, b, tol, n) -> None:
    """The geometric middle of the safe range is taken in log2: in float64 the product of its
    ends overflows."""
    rec = recommend_mask_value(fmt, b, tol, n_keys=n)
    assert rec.range.contains(rec.value)
    assert rec.value < 0
    assert float(round_to(rec.value, fmt)) == rec.value
    assert math.frexp(rec.value)[0] == -0.5  # a power of two
    assert rec.analysis.leakage_bound is not None
    assert rec.analysis.leakage_bound <= tol
    assert not rec.analysis.overflows


def test_no_safe_constant_is_reported() -> None:
    r = safe_mask_range("float16", 65504.0, 0.0, n_keys=2)
    assert r.empty
    with pytest.raises(InvalidArgument, match="leak_tol: expected a tolerance"):
        recommend_mask_value("float16", 65504.0, 0.0, n_keys=2)


# Bad arguments ---------------------------------------------------------------------------------------

_GOOD = {"fmt": "float16", "value": -1e4, "mode": "fill", "score_bound": 8.0}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"fmt": "float12"}, "fmt: expected one of"),
        ({"value": 1.0}, "value: expected a number <= 0"),
        ({"value": math.nan}, "value: expected a number <= 0"),
        ({"value": "2*finfo.min"}, "value: expected a number <= 0"),
        ({"value": True}, "value: expected a number <= 0"),
        ({"mode": "replace"}, "mode: expected one of"),
        ({"score_bound": -1.0}, "score_bound: expected a finite number >= 0"),
        ({"score_bound": math.inf}, "score_bound: expected a finite number >= 0"),
        ({"score_bound": "8"}, "score_bound: expected a finite number >= 0"),
        ({"softmax": "flash"}, "softmax: expected 'naive', 'safe'"),
        ({"softmax_format": "tf32"}, "softmax_format: expected one of"),
        ({"n_keys": 0}, "n_keys: expected an integer >= 1"),
        ({"n_keys": 2.0}, "n_keys: expected an integer >= 1"),
        ({"exp_ulps": -1.0}, "exp_ulps: expected a finite number >= 0"),
        ({"div_ulps": math.nan}, "div_ulps: expected a finite number >= 0"),
    ],
)
def test_analyze_mask_rejects_bad_arguments(changes: dict[str, object], match: str) -> None:
    kwargs = {**_GOOD, **changes}
    with pytest.raises(InvalidArgument, match=match):
        analyze_mask(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"leak_tol": 1.0}, r"leak_tol: expected a number in \[0, 1\)"),
        ({"leak_tol": -1e-3}, r"leak_tol: expected a number in \[0, 1\)"),
        ({"n_keys": None}, "n_keys: expected an integer >= 1"),
        ({"mode": "mul"}, "mode: expected one of"),
        ({"score_bound": math.nan}, "score_bound: expected a finite number >= 0"),
    ],
)
@pytest.mark.parametrize("function", [safe_mask_range, recommend_mask_value])
def test_range_functions_reject_bad_arguments(
    function: object, changes: dict[str, object], match: str
) -> None:
    kwargs = {"fmt": "float16", "score_bound": 8.0, "leak_tol": 1e-6, "n_keys": 4, **changes}
    with pytest.raises(InvalidArgument, match=match):
        function(**kwargs)  # type: ignore[operator]


def test_analyze_numerics_rejects_a_non_numerics() -> None:
    with pytest.raises(InvalidArgument, match="numerics: expected a Numerics"):
        masking.analyze_numerics("fp16", 8.0)  # type: ignore[arg-type]
