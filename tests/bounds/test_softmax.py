"""Tests of ``mhanum.bounds.softmax``: soundness against an mpmath softmax, tightness, exp accuracy.

Soundness is the central property: the measured error of :func:`mhanum.softmax` never exceeds
:func:`softmax_bound` on logits that satisfy its assumptions. An ``inf`` bound (overflow or total
underflow not excluded, naive softmax only) makes no claim and is skipped.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
from hypothesis import event, example, given, reject
from hypothesis import strategies as st

import mhanum
from mhanum import InvalidArgument, Numerics
from mhanum.bounds.softmax import (
    logit_perturbation,
    lse_bound,
    softmax_bound,
    summation_gamma,
)
from mhanum.formats import get_format, round_to, ulp

FORMATS = ("float32", "bfloat16", "float16", "float64")
ALGORITHMS = ("naive", "safe", "online(4)", "online(16)")
ORDERS = ("native", "sequential", "pairwise", "blocked(8)", "kahan")
KINDS = ("normal", "range", "ties", "dominant", "underflow", "mixed", "increasing", "masked_prefix")

# ln(smallest subnormal): below it exp underflows to 0 in the format.
_UNDERFLOW = {"float32": -103.0, "bfloat16": -92.0, "float16": -17.0, "float64": -744.0}

_CTX = mpmath.MPContext()
_CTX.prec = 120


def _exact_softmax(row: np.ndarray) -> np.ndarray:
    """softmax of the binary values in ``row`` (``-inf`` entries are 0), to 120 bits."""
    finite = [_CTX.mpf(float(v)) for v in row if np.isfinite(v)]
    m = max(finite)
    total = _CTX.fsum(_CTX.exp(v - m) for v in finite)
    return np.array(
        [float(_CTX.exp(_CTX.mpf(float(v)) - m) / total) if np.isfinite(v) else 0.0 for v in row]
    )


def _row(rng: np.random.Generator, kind: str, n: int, fmt: str, naive: bool) -> np.ndarray:
    """One adversarial row of logits, representable in ``fmt``."""
    low = _UNDERFLOW[fmt]
    if kind == "normal":
        x = rng.normal(size=n) * rng.choice([0.1, 1.0, 8.0])
    elif kind == "range":
        x = rng.uniform(low if not naive else -8.0, 0.0, size=n)
    elif kind == "ties":
        base = rng.normal() * 4
        x = base + rng.integers(-3, 4, size=n) * float(ulp(base, fmt))
    elif kind == "dominant":
        x = np.full(n, -rng.uniform(1.0, -low / 2))
        x[rng.integers(n)] = 0.0
        x = x + rng.normal(size=n) * 0.01
    elif kind == "underflow":
        x = low + rng.uniform(-2.0, 8.0, size=n)
        x[rng.integers(n)] = 0.0 if not naive else low + 20.0
    elif kind == "increasing":  # the running maximum changes in every block: most rescalings
        x = np.sort(rng.uniform(low / 3 if not naive else -8.0, 0.0, size=n))
    elif kind == "masked_prefix":  # leading fully-masked blocks of the online softmax
        x = rng.normal(size=n) * 5
        x[: rng.integers(0, n)] = -np.inf
    else:
        x = rng.normal(size=n) * 3
        x[rng.random(n) < 0.3] = -np.inf
        x[rng.integers(n)] = rng.normal()
    if naive and fmt in ("float16", "bfloat16") and kind != "underflow":
        x = np.clip(x, -9.0, 9.0)
    return round_to(x, fmt)


def _numerics(fmt: str, alg: str, order: str) -> Numerics:
    return Numerics(input=fmt, accum=fmt, softmax=alg, summation=order)


def _check(x: np.ndarray, num: Numerics) -> np.ndarray:
    """Assert soundness on every row of ``x``; return measured/bound where both are positive."""
    got = np.asarray(mhanum.softmax(x, numerics=num), dtype=np.float64)
    bound = softmax_bound(x, num).total
    ratios = []
    for row, p_hat, b in zip(x, got, bound, strict=True):
        if not np.isfinite(b).all():
            continue
        err = np.abs(p_hat - _exact_softmax(row))
        assert np.isfinite(p_hat).all(), (num.describe(), row)
        bad = err > b
        assert not bad.any(), (num.describe(), row[bad], err[bad], b[bad])
        ratios.extend((err[b > 0] / b[b > 0]).tolist())
    return np.array(ratios)


@pytest.fixture(scope="module")
def tightness() -> dict[str, list[float]]:
    return {}


@pytest.mark.parametrize("alg", ALGORITHMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_bound_holds_for_every_order(fmt: str, alg: str, tightness: dict[str, list[float]]) -> None:
    """One seeded batch of adversarial rows (n up to 256) per format, algorithm and order."""
    rng = np.random.default_rng(2021)
    naive = alg == "naive"
    rows = [_row(rng, KINDS[i % len(KINDS)], 256, fmt, naive) for i in range(16)]
    x = np.stack(rows)
    for order in ORDERS:
        ratios = _check(x, _numerics(fmt, alg, order))
        tightness.setdefault(alg.split("(")[0], []).extend(ratios.tolist())


def test_tightness_report(tightness: dict[str, list[float]]) -> None:
    """measured/bound per algorithm over the sweep: the bound is not vacuous (worst >= 5%)."""
    if not tightness:
        pytest.skip("runs after the sweep")
    for alg, ratios in sorted(tightness.items()):
        r = np.array(ratios)
        print(f"{alg:7s} median {np.median(r):.3g}  worst {np.max(r):.3g}  ({r.size} entries)")
        assert np.max(r) <= 1
        assert np.max(r) >= 0.05


@given(
    data=st.data(),
    fmt=st.sampled_from(FORMATS),
    alg=st.sampled_from(ALGORITHMS),
    order=st.sampled_from(ORDERS),
    kind=st.sampled_from(KINDS),
    n=st.sampled_from([1, 2, 7, 64, 256]),
)
@example(data=None, fmt="float32", alg="safe", order="sequential", kind="underflow", n=256)
def test_bound_holds_on_generated_logits(
    data: st.DataObject | None, fmt: str, alg: str, order: str, kind: str, n: int
) -> None:
    seed = 0 if data is None else data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    x = np.stack([_row(rng, kind, n, fmt, alg == "naive") for _ in range(3)])
    _check(x, _numerics(fmt, alg, order))


def test_mixed_formats_round_logits_into_the_softmax_format() -> None:
    """float32 scores, bfloat16 softmax: the logits' rounding is in the bound (term ``shift``)."""
    rng = np.random.default_rng(7)
    x = round_to(rng.normal(size=(4, 64)) * 5, "float32")
    num = Numerics(input="float32", accum="float32", softmax_format="bfloat16")
    _check(x, num)
    assert float(np.max(softmax_bound(x, num).terms["shift"])) > 0


def test_terms_add_up_and_name_the_sources() -> None:
    x = round_to(np.linspace(-20, 0, 300), "float32")[None]
    b = softmax_bound(x, Numerics(softmax="online(16)", summation="sequential"))
    assert set(b.terms) == {
        "shift", "exp", "sum", "division", "rescaling", "underflow", "second_order",
    }  # fmt: skip
    np.testing.assert_allclose(sum(b.terms.values()), b.total, rtol=1e-12)
    assert b.theorem == "papers/softmax.md Theorem S.3"


def test_first_order_forms_match_bhh() -> None:
    """With exact exp/div (1/2 ulp) the total is BHH's (n+3)u and (n+2+2(xmax-xmin))u to first order."""
    u = get_format("float32").u
    x = round_to(np.array([[0.0, -1.0, -2.0, -3.0]]), "float32")
    num = Numerics(summation="sequential", exp_ulps=0.5, div_ulps=0.5)
    naive = softmax_bound(x, num.replace(softmax="naive")).total
    safe = softmax_bound(x, num).total
    p = _exact_softmax(x[0])
    assert np.all(naive / p <= (4 + 3) * u * (1 + 1e-5))
    assert np.all(safe / p <= (4 + 2 + 2 * 3) * u * (1 + 1e-5))


def _lse_emulated(x: np.ndarray, fmt: str, shifted: bool) -> float:
    """BHH Algorithms 3.1 / 4.1 with every operation in float64 rounded once to ``fmt``.

    float64 exp/log/log1p rounded once are within 1/2 ulp + 2^-53 relative of the exact value,
    so within ``exp_ulps = 2`` and ``log_ulps = 1``.
    """

    def fl(v: float) -> float:
        return float(round_to(v, fmt))

    fin = x[np.isfinite(x)]
    if not shifted:
        s = 0.0
        for v in fin:
            s = fl(s + fl(math.exp(v)))
        return fl(math.log(s))
    k = int(np.argmax(fin))
    a = float(fin[k])
    s = 0.0
    for i, v in enumerate(fin):
        if i != k:
            s = fl(s + fl(math.exp(fl(v - a))))
    return fl(a + fl(math.log1p(s)))


def _exact_lse(x: np.ndarray) -> float:
    """``m + log1p(Σ_{i≠k} e^{x_i - m})``: log1p keeps the digits of an LSE near 0."""
    fin = sorted(_CTX.mpf(float(v)) for v in x if np.isfinite(v))
    m = fin[-1]
    return float(m + _CTX.log1p(_CTX.fsum(_CTX.exp(v - m) for v in fin[:-1])))


@given(
    data=st.data(),
    fmt=st.sampled_from(("float32", "bfloat16", "float16")),
    kind=st.sampled_from(KINDS),
    n=st.sampled_from([1, 2, 10, 64]),
    shifted=st.booleans(),
)
def test_lse_bound_holds(data: st.DataObject, fmt: str, kind: str, n: int, shifted: bool) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    num = _numerics(fmt, "safe", "sequential")
    alg = "shifted" if shifted else "basic"
    for _ in range(3):
        x = _row(rng, kind, n, fmt, naive=not shifted)
        bound = float(lse_bound(x, num, algorithm=alg, log_ulps=1).total)
        if not math.isfinite(bound):
            continue
        with np.errstate(over="ignore"):
            got = _lse_emulated(x, fmt, shifted)
        assert abs(got - _exact_lse(x)) <= bound, (fmt, alg, x)


@given(
    s=st.lists(st.floats(-30, 30), min_size=1, max_size=12),
    d=st.lists(st.floats(-2, 2), min_size=12, max_size=12),
)
def test_logit_perturbation(s: list[float], d: list[float]) -> None:
    s_arr = np.array(s)
    delta = np.array(d[: len(s)])
    p = _exact_softmax(s_arr)
    ctx = mpmath.MPContext()
    ctx.prec = 120
    shifted = [ctx.mpf(a) + ctx.mpf(b) for a, b in zip(s, delta, strict=False)]
    m = max(shifted)
    total = ctx.fsum(ctx.exp(v - m) for v in shifted)
    q = np.array([float(ctx.exp(v - m) / total) for v in shifted])
    b = logit_perturbation(delta, p)
    # float64 evaluation of expm1(.)*p and of p, q: relative error below 2^-50 each.
    assert np.all(np.abs(q - p) <= b.total * (1 + 2.0**-48) + 2.0**-50 * (p + q))
    norm = float(np.max(np.abs(delta)))
    assert np.all(b.terms["log_p"] <= 2 * norm)
    assert np.all(b.total <= logit_perturbation(norm, p).total)


def test_xla_float32_exp_is_within_the_assumed_ulps() -> None:
    """XLA's float32 exp on [-104, 0] is within ``Numerics().exp_ulps`` ulps (normal results)."""
    grid = np.linspace(-104.0, 0.0, 400_001, dtype=np.float32)
    rng = np.random.default_rng(0)
    x = np.unique(np.concatenate([grid, rng.uniform(-104, 0, 200_000).astype(np.float32)]))
    got = np.asarray(jax.jit(jnp.exp)(jnp.asarray(x)), dtype=np.float64)
    ref = np.exp(x.astype(np.float64))  # float64 exp: 2^-52-accurate, ~1e-9 float32 ulps
    fmt = get_format("float32")
    normal = ref >= fmt.smallest_normal
    ulps = np.abs(got - ref)[normal] / ulp(ref[normal], fmt)
    worst = np.argsort(ulps)[-20:]
    for i in worst:  # confirm the worst cases against mpmath
        xi = float(x[normal][i])
        exact = float(_CTX.exp(_CTX.mpf(xi)))
        ulps[i] = abs(got[normal][i] - exact) / float(ulp(exact, fmt))
    max_ulps = float(np.max(ulps))
    print(f"XLA float32 exp on [-104, 0]: max {max_ulps:.3f} ulps")
    assert max_ulps <= Numerics().exp_ulps
    eps_exp = 2 * Numerics().exp_ulps * fmt.u
    sub = ~normal
    assert np.all(np.abs(got - ref)[sub] <= fmt.smallest_normal * (1 + eps_exp))


def test_summation_gamma_orders() -> None:
    u = 2.0**-24
    assert summation_gamma(1, "sequential", u) == 0
    assert summation_gamma(256, "pairwise", u) == pytest.approx(8 * u, rel=1e-5)
    assert summation_gamma(256, "blocked(16)", u) == pytest.approx(30 * u, rel=1e-5)
    assert summation_gamma(256, "native", u) == summation_gamma(256, "sequential", u)
    assert math.isinf(summation_gamma(2**25, "sequential", u))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: softmax_bound([np.nan, 0.0]), "x: expected finite"),
        (lambda: softmax_bound([np.inf, 0.0]), "x: expected finite"),
        (lambda: softmax_bound([[-np.inf, -np.inf]]), "at least one finite"),
        (lambda: softmax_bound(np.zeros((2, 0))), "n >= 1"),
        (lambda: softmax_bound(["a"]), "x: expected a real array"),
        (lambda: softmax_bound([0.1], "fp16"), "representable in the score format float16"),
        (lambda: softmax_bound([0.0], numerics=3), "numerics: expected a Numerics"),
        (lambda: softmax_bound([0.0], numerics="nope"), "name: expected one of"),
        (lambda: logit_perturbation(-1.0), "delta: expected a norm >= 0"),
        (lambda: logit_perturbation([np.nan]), "delta: expected a finite"),
        (lambda: logit_perturbation("x"), "delta: expected a finite"),
        (lambda: logit_perturbation([0.1], [1.5]), "probabilities: expected values in"),
        (lambda: logit_perturbation([0.1, 0.2], [0.5, 0.2, 0.3]), "broadcastable"),
        (lambda: summation_gamma(0, "sequential", 2.0**-24), "n: expected an integer"),
        (lambda: lse_bound([0.0], algorithm="fancy"), "algorithm: expected"),
        (lambda: lse_bound([0.0], log_ulps=-1), "log_ulps: expected"),
        (lambda: lse_bound([np.nan]), "x: expected finite"),
        (lambda: summation_gamma(4, "diagonal", 2.0**-24), "numerics.summation"),
    ],
)
def test_bad_arguments(call: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        call()  # type: ignore[operator]


def test_naive_softmax_whose_sum_flushes_the_reciprocal_is_vacuous():
    # x = (87.5, 87.5) in float32: the sum 2e^87.5 ≈ 2e38 is finite, but XLA multiplies by its
    # reciprocal, 5e-39 < 2^-126, which the CPU flushes to zero: the output is (0, 0).
    num = Numerics(softmax="naive")
    x = np.array([87.5, 87.5])
    out = np.asarray(mhanum.softmax(x, numerics=num), np.float64)
    assert np.all(out == 0.0)
    assert np.all(np.isinf(softmax_bound(x, num).total))


def _edge_rows(fmt: str) -> np.ndarray:
    """Rows whose shifted logits ``x - max`` overflow ``fmt`` (computed ``-inf``, exp 0) or
    reach past ``709/u``, where the exponential's relative error overflows float64."""
    big = get_format(fmt).max_finite
    rows = [[big, big, -big, 0.0], [0.85 * big, 0.0, -1.0, 5.0], [0.3 * big, 0.3 * big, -big, 0.0]]
    return np.asarray(round_to(np.array(rows), fmt), np.float64)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("alg", ["safe", "online(2)"])
def test_shifted_logits_past_the_formats_range_keep_a_finite_bound(fmt: str, alg: str) -> None:
    # The keys far below the maximum contribute e^(x - m) = 0 to every digit: the output is
    # accurate, and the bound is finite (it read 0·inf as NaN, then inf, with a warning).
    num = _numerics(fmt, alg, "sequential")
    x = _edge_rows(fmt)
    bound = softmax_bound(x, num)
    assert np.isfinite(bound.total).all()
    assert not bound.reasons
    got = np.asarray(mhanum.softmax(x, numerics=num), np.float64)
    exact = np.stack([_exact_softmax(row) for row in x])
    assert np.all(np.abs(got - exact) <= bound.total)
    # and the far keys cost nothing but their underflow charges (a few η = u·2^emin each):
    # the bound is that of the row with them masked
    near = x >= x.max(axis=-1, keepdims=True) - 100
    masked = softmax_bound(np.where(near, x, -np.inf), num).total
    eta = get_format(fmt).u * get_format(fmt).smallest_normal
    assert np.allclose(bound.total[near], masked[near], rtol=2.0**-30, atol=8 * x.size * eta)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
def test_lse_bound_on_shifted_logits_past_the_formats_range_is_finite_not_nan(fmt: str) -> None:
    num = _numerics(fmt, "safe", "sequential")
    for x in _edge_rows(fmt):
        bound = float(lse_bound(x, num, algorithm="shifted", log_ulps=1).total)
        assert math.isfinite(bound)  # it was NaN
        assert abs(_lse_emulated(x, fmt, True) - _exact_lse(x)) <= bound
        # the final addition's rounding, u|y|, and little more
        assert bound <= 3 * get_format(fmt).u * abs(_exact_lse(x))


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("form", ["exp2", "exp2-folded"])
@pytest.mark.parametrize("alg", ["safe", "online(2)"])
def test_exp2_forms_whose_maximum_times_log2e_overflows_are_infinite_with_the_reason(
    form: str, alg: str
) -> None:
    # fl(m·log2 e) = inf for m = 0.85·3.4e38 in float32, and the maximum's argument inf - inf is
    # NaN: the output is NaN, the bound infinite, and it says why.
    num = Numerics(softmax=alg, exp_form=form)
    x = _edge_rows("float32")[1:2]
    assert np.isnan(np.asarray(mhanum.softmax(x, numerics=num))).all()
    bound = softmax_bound(x, num)
    assert np.isinf(bound.total).all()
    assert any("times log2 e may overflow float32" in r for r in bound.reasons)
    # an online row whose first block's maximum is past -max/log2 e: NaN too (-inf - -inf)
    y = np.asarray(round_to(np.array([[-0.85 * 3.4e38, -0.85 * 3.4e38, 0.0, 1.0]]), "float32"))
    if alg.startswith("online"):
        assert np.isnan(np.asarray(mhanum.softmax(y, numerics=num))).all()
        assert np.isinf(softmax_bound(y, num).total).all()
    else:  # the safe form shifts by the row's maximum only: no overflow there
        assert not any("log2 e" in r for r in softmax_bound(y.astype(np.float64), num).reasons)


@st.composite
def _edge_row(draw: st.DrawFn, fmt: str, n: int) -> np.ndarray:
    """A row of logits representable in ``fmt``, each near a range edge of it: its largest
    finite value and square root, its smallest normal and subnormals, small values, ``-inf``."""
    f = get_format(fmt)
    sub = f.smallest_normal * 2.0 ** -(f.precision - 1)
    kinds = st.sampled_from(["max", "big", "sqrt", "tiny", "sub", "small", "zero", "masked"])
    row = []
    for _ in range(n):
        kind, sign = draw(kinds), draw(st.sampled_from([1.0, -1.0]))
        j = draw(st.integers(0, 4))
        value = {
            "max": f.max_finite * (1 - j * f.u),
            "big": f.max_finite * 2.0 ** -draw(st.integers(1, 12)),
            "sqrt": math.sqrt(f.max_finite) * (1 + j / 8),
            "tiny": f.smallest_normal * (1 + j),
            "sub": sub * (1 + j),
            "small": draw(st.floats(-40, 40)),
            "zero": 0.0,
            "masked": -math.inf,
        }[kind]
        row.append(value if kind == "masked" else sign * value)
    x = np.asarray(round_to(np.array(row), fmt), np.float64)
    x[np.isinf(x) & (x > 0)] = f.max_finite
    if not np.isfinite(x).any():
        x[draw(st.integers(0, n - 1))] = 0.0
    return x


@pytest.mark.filterwarnings("error")
@given(
    data=st.data(),
    fmt=st.sampled_from(("float32", "bfloat16", "float16", "float64")),
    soft=st.sampled_from((None, "float32", "bfloat16", "float16", "float64")),
    alg=st.sampled_from(("naive", "safe", "online(1)", "online(3)")),
    form=st.sampled_from(("exp", "exp2", "exp2-folded")),
    order=st.sampled_from(("sequential", "pairwise")),
    n=st.sampled_from([4, 7]),
)
def test_softmax_and_lse_bounds_at_the_range_edges(
    data: st.DataObject, fmt: str, soft: str | None, alg: str, form: str, order: str, n: int
) -> None:
    """Where the bound is finite the computed softmax is finite and within it of the exact
    one; where it is infinite it says why; neither bound is ever NaN (nor warns). The logits
    are in ``fmt``, the softmax runs in ``soft`` (``None``: ``fmt`` too)."""
    fields = {"input": fmt, "accum": fmt, "summation": order, "softmax": alg}
    if soft is not None:
        fields |= {"accum": "float32", "score_format": fmt, "softmax_format": soft}
    try:
        num = Numerics(**fields, exp_form=form)
    except InvalidArgument:
        try:
            num = Numerics(**fields)
        except InvalidArgument:
            reject()
    x = data.draw(_edge_row(fmt, n), label="x")
    if np.isinf(round_to(x[np.isfinite(x)], num.format_of("softmax"))).any():
        # the one refusal: logits the softmax format cannot read
        with pytest.raises(InvalidArgument, match="within the range of the softmax format"):
            softmax_bound(x, num)
        reject()
    bound = softmax_bound(x, num)
    assert not np.isnan(bound.total).any()
    if not np.isfinite(bound.total).all():
        assert bound.reasons
    finite = np.isfinite(bound.total)
    event(f"finite bound on {finite.mean():.0%} of the row")
    got = np.asarray(mhanum.softmax(x, numerics=num), np.float64)
    assert np.isfinite(got[finite]).all(), (x, num)
    err = np.abs(got - _exact_softmax(x))
    assert np.all(err[finite] <= bound.total[finite]), (x.tolist(), num)
    if soft is not None:
        return
    lse_num = _numerics(fmt, "safe", "sequential")  # the emulation's order
    for alg_lse in ("shifted", "basic"):
        assert not np.isnan(lse_bound(x, num, algorithm=alg_lse).total)
        lse_b = lse_bound(x, lse_num, algorithm=alg_lse, log_ulps=1)
        lse = float(lse_b.total)
        assert not math.isnan(lse)
        assert math.isfinite(lse) or lse_b.reasons
        if math.isfinite(lse):
            with np.errstate(over="ignore"):
                y = _lse_emulated(x, fmt, alg_lse == "shifted")
            assert abs(y - _exact_lse(x)) <= lse, (x, alg_lse)


@pytest.mark.filterwarnings("error")
def test_rows_found_at_the_range_edges_are_infinite_with_reasons_not_nan() -> None:
    big32, big64 = get_format("float32").max_finite, get_format("float64").max_finite
    # every exponential of the naive softmax underflows (1/S = inf; the underflow term read
    # 0·inf), and the basic log-sum-exp is log 0 (its bound was NaN: 0 roundings times inf)
    x = np.asarray(round_to(np.array([-big32, -big32, -big32, -0.99 * big32]), "float32"))
    assert np.isnan(np.asarray(mhanum.softmax(x, numerics=Numerics(softmax="naive")))).all()
    bound = softmax_bound(x.astype(np.float64), Numerics(softmax="naive"))
    assert np.isinf(bound.total).all()
    assert bound.reasons
    assert not np.isnan(bound.terms["underflow"]).any()
    lse = lse_bound(np.array([-big32, -np.inf]), "fp32", algorithm="basic")
    assert np.isinf(lse.total)
    assert "log 0" in lse.reasons[0]
    # float32 logits that a bfloat16 softmax format rounds by 2^104: the exact shifted logits
    # x - max(x̂) reach e^(±2^104) (inf/inf was NaN, and 1/S overflowed math.exp)
    up = float(np.nextafter(np.float32(2.0**127), np.float32(np.inf)))
    down = float(np.nextafter(np.float32(2.0**127), np.float32(0)))
    for alg in ("naive", "safe", "online(2)"):
        num = Numerics(accum="float32", score_format="float32", softmax_format="bfloat16",
                       softmax=alg)  # fmt: skip
        for row in ([up, up, 0.0, 1.0], [down, down, 0.0, 1.0]):
            b = softmax_bound(np.array(row), num)
            assert not np.isnan(b.total).any()
            assert np.isfinite(b.total).all() or b.reasons
    # float64 logits past 2^1021: the bound's own float64 differences would overflow
    y = np.array([big64, big64, -big64, 0.0])
    num = _numerics("float64", "safe", "sequential")
    for b in (softmax_bound(y, num), lse_bound(y, num)):
        assert np.isinf(b.total).all()
        assert any("beyond 2^1021" in r for r in b.reasons)


@pytest.mark.filterwarnings("error")
def test_float64_exp2_charges_its_own_unit_roundoff() -> None:
    # ρ = (1 + 2^-53)(1 + u)² - 1 evaluated in float64 is 0 for u = 2^-53 (1 + 2^-53 rounds to
    # 1): the base-2 conversion went uncharged, and this row's error (5.29e-23 on its third
    # entry) exceeded the bound (4.86e-23). Products of (1 + r) are now taken in log space.
    x = np.array([-(2.0**1021), 18.078125, 2.0**-1022, -(2.0**512)])
    num = Numerics(input="float64", accum="float64", softmax="safe", exp_form="exp2")
    got = np.asarray(mhanum.softmax(x, numerics=num), np.float64)
    bound = softmax_bound(x, num).total
    assert np.all(np.abs(got - _exact_softmax(x)) <= bound)
