"""The float64 evaluation model of ``mhanum.bounds.evaluation`` against mpmath (papers/evaluation.md).

Each figure of :data:`XLA_FLOAT64` is a hypothesis the jitted stages rely on. These tests measure
the installed XLA over the whole argument ranges a bound uses (the exponent range of float64,
both signs, the neighbourhoods of 0 and 1) and require every measured relative error to be at
most **half** the stated one: the margin covers points the sample misses. A failure here means
the model, not the bound, must change (a new jaxlib whose ``exp`` is less accurate).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest

from mhanum import InvalidArgument
from mhanum.bounds.evaluation import FLUSH, U64, XLA_FLOAT64, expm1, log1p

jax.config.update("jax_enable_x64", True)

_CTX = mpmath.MPContext()
_CTX.prec = 160
_MARGIN = 2.0  # measured error <= stated / _MARGIN
_POINTS = 3000  # per region: the mpmath reference dominates the time


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, n: int) -> np.ndarray:
    return np.exp(rng.uniform(math.log(lo), math.log(hi), n))


def _worst_relative(f, exact, x: np.ndarray) -> tuple[float, float]:
    """The largest ``|f(x) - exact(x)| / |exact(x)|`` over the normal results, in units of
    ``u = 2^-53``, and where; subnormal results must be within ``FLUSH`` (absolute)."""
    got = np.asarray(jax.jit(f)(jnp.asarray(x, jnp.float64)))
    worst, at = 0.0, math.nan
    for xi, yi in zip(x, got, strict=True):
        ref = exact(_CTX.mpf(float(xi)))
        if not _CTX.isfinite(ref) or abs(ref) > np.finfo(np.float64).max:
            assert np.isinf(yi) or abs(yi) >= np.finfo(np.float64).max * (1 - 4 * U64), (xi, yi)
            continue
        err = abs(_CTX.mpf(float(yi)) - ref)
        if abs(ref) < FLUSH:
            assert err <= FLUSH, (xi, yi)
            continue
        rel = float(err / abs(ref)) / U64
        if rel > worst:
            worst, at = rel, float(xi)
    return worst, at


def _regions(rng: np.random.Generator, name: str) -> np.ndarray:
    """The arguments a bound's stages pass to ``name``, over the whole float64 range."""
    n = _POINTS
    big = float(np.finfo(np.float64).max)
    tiny = 2.0**-1074
    if name in ("exp", "expm1"):
        return np.concatenate(
            [
                rng.uniform(-745.2, 709.7, n),
                _log_uniform(rng, tiny, 1.0, n),
                -_log_uniform(rng, tiny, 1.0, n),
                rng.uniform(-1.0, 1.0, n),
                [-745.13, -708.4, 709.78, 0.0, 2.0**-1022, -(2.0**-1022)],
            ]
        )
    if name == "log":
        return np.concatenate(
            [
                _log_uniform(rng, 2.0**-1022, big, n),
                rng.uniform(0.5, 2.0, n),
                1.0 + rng.uniform(-1e-12, 1e-12, n),
                [2.0**-1022, big, 1.0, 1.0 + 2 * U64, 1.0 - U64],
            ]
        )
    if name == "log1p":
        return np.concatenate(
            [
                -_log_uniform(rng, tiny, 1.0 - U64, n),
                _log_uniform(rng, tiny, big, n),
                rng.uniform(-0.5, -0.1, n),  # where XLA's own log1p errs by > 100 ulps
                rng.uniform(-1e-8, 1e-8, n),
                [-1.0 + U64, -0.5, 0.0, U64, -U64 / 2, 2.0**53, big],
            ]
        )
    if name == "tanh":
        return np.concatenate(
            [_log_uniform(rng, tiny, 40.0, n), -_log_uniform(rng, tiny, 40.0, n), [0.0, 1e300]]
        )
    raise AssertionError(name)


_FUNCTIONS = {
    "exp": (jnp.exp, _CTX.exp),
    "log": (jnp.log, _CTX.log),
    "tanh": (jnp.tanh, _CTX.tanh),
    "log1p": (log1p, _CTX.log1p),
    "expm1": (expm1, _CTX.expm1),
}


@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
def test_elementary_functions_are_within_half_the_stated_error(name: str) -> None:
    """XLA's ``exp``, ``log``, ``tanh`` and this module's ``log1p``, ``expm1``: the measured
    relative error over the whole range is at most half of ``XLA_FLOAT64.relative(name)``."""
    f, exact = _FUNCTIONS[name]
    x = _regions(np.random.default_rng(sorted(_FUNCTIONS).index(name)), name)
    worst, at = _worst_relative(f, exact, x)
    stated = XLA_FLOAT64.relative(name) / U64
    print(f"{name}: max {worst:.3f} u at {at!r} (stated {stated:g} u)")
    assert worst <= stated / _MARGIN


def test_division_by_a_variable_is_correctly_rounded_and_by_a_constant_within_two_roundings() -> (
    None
):
    """Theorem E.0 (division): ``x / y`` for a traced ``y`` is the correctly rounded quotient;
    a constant divisor is a product by its rounded reciprocal, within ``(1 + u)^2 - 1``."""
    rng = np.random.default_rng(7)
    a = _log_uniform(rng, 2.0**-500, 2.0**500, 20_000) * rng.choice([-1.0, 1.0], 20_000)
    b = _log_uniform(rng, 2.0**-500, 2.0**500, 20_000)
    got = np.asarray(jax.jit(lambda a, b: a / b)(a, b))
    assert np.array_equal(got, a / b)  # numpy's division is IEEE's
    for c in (3.0, 10.0, 0.1, 7.0):
        by_c = np.asarray(jax.jit(lambda a, c=c: a / c)(a))
        for xi, yi in zip(a[:2000], by_c[:2000], strict=True):
            ref = _CTX.mpf(float(xi)) / _CTX.mpf(c)
            assert abs(_CTX.mpf(float(yi)) - ref) <= XLA_FLOAT64.relative("divide") * abs(ref)


def test_subnormals_are_read_and_produced_as_zero_within_flush() -> None:
    """Theorem E.0 (flush): an operation reads each operand off by less than ``FLUSH`` (a
    subnormal operand is read as 0) and flushes a subnormal result (less than ``FLUSH``):
    ``ab`` is within ``u|ab| + (1 + u)·FLUSH·(|a| + |b| + FLUSH) + FLUSH``, ``a/b`` within
    ``u|a/b| + (1 + u)·FLUSH/|b| + FLUSH`` (``b`` normal), ``a + b`` within
    ``u|a + b| + (3 + 2u)·FLUSH``."""
    rng = np.random.default_rng(3)
    x = _log_uniform(rng, 2.0**-1074, 2.0**-1000, 2000)
    y = _log_uniform(rng, 2.0**-60, 2.0**60, 2000)
    z = _log_uniform(rng, 2.0**-1074, 2.0**-1020, 2000)
    cases = (
        (lambda a, b: a * b, y, lambda a, b: (1 + U64) * FLUSH * (abs(a) + abs(b) + FLUSH)),
        (lambda a, b: a / b, y, lambda a, b: (1 + U64) * FLUSH / abs(b)),
        (lambda a, b: a + b, z, lambda a, b: (2 + 2 * U64) * FLUSH),
    )
    for f, other, reads in cases:
        got = np.asarray(jax.jit(f)(x, other))
        flushed = 0
        for xi, yi, gi in zip(x, other, got, strict=True):
            a, b = _CTX.mpf(float(xi)), _CTX.mpf(float(yi))
            ref = f(a, b)
            bound = U64 * abs(ref) + reads(a, b) + FLUSH
            assert abs(_CTX.mpf(float(gi)) - ref) <= bound, (xi, yi, gi)
            flushed += bool(gi == 0 and ref != 0)
        if jax.default_backend() == "cpu":
            assert flushed > 0  # XLA's CPU does flush: the model's FLUSH is not idle


def test_sums_and_dots_in_any_order_are_within_gamma() -> None:
    """Theorem E.0 (reductions): ``jnp.sum`` and ``jnp.dot`` of ``n`` float64 terms, whatever
    order XLA takes, are within ``γ_{n-1}``, resp. ``γ_n``, of the sum of magnitudes."""
    rng = np.random.default_rng(11)
    for n in (2, 17, 1000, 65_537):
        x = rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))
        y = rng.standard_normal(n)
        s = float(jax.jit(jnp.sum)(x))
        exact = _CTX.fsum(_CTX.mpf(float(v)) for v in x)
        assert abs(_CTX.mpf(s) - exact) <= XLA_FLOAT64.sum_relative(n) * float(np.abs(x).sum())
        d = float(jax.jit(jnp.dot)(x, y))
        exact = _CTX.fsum(
            _CTX.mpf(float(a)) * _CTX.mpf(float(b)) for a, b in zip(x, y, strict=True)
        )
        magnitudes = float(np.abs(x) @ np.abs(y))
        assert abs(_CTX.mpf(d) - exact) <= XLA_FLOAT64.dot_relative(n) * magnitudes * (1 + 4 * U64)


def test_a_contracted_multiply_add_is_within_the_model() -> None:
    """Theorem E.0 (contraction): ``a*b + c`` may be one fused rounding; either way it is
    within ``(1 + u)^2 - 1`` of ``|ab| + |c|``, the two-rounding model's bound."""
    rng = np.random.default_rng(5)
    a, b = 1 + rng.uniform(-1e-8, 1e-8, (2, 5000))
    c = -(a * b) + rng.uniform(-1e-20, 1e-20, 5000)
    got = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
    for ai, bi, ci, gi in zip(a, b, c, got, strict=True):
        ref = _CTX.mpf(float(ai)) * _CTX.mpf(float(bi)) + _CTX.mpf(float(ci))
        size = abs(_CTX.mpf(float(ai)) * _CTX.mpf(float(bi))) + abs(_CTX.mpf(float(ci)))
        assert abs(_CTX.mpf(float(gi)) - ref) <= ((1 + U64) ** 2 - 1) * size


def test_log1p_lemma_the_corrections_factor_moves_by_at_most_u() -> None:
    """Lemma E.1's hypothesis: ``ψ(t) = |1/log1p(t) - (1 + t)/t| <= 1`` for every ``t > -1``,
    so ``|log h(w) - log h(x)| <= u(1 + u)`` for ``h(t) = log1p(t)/t`` and ``w = fl(1 + x) - 1``."""
    ts = [-1 + _CTX.mpf(2) ** -k for k in range(1, 60)]
    ts += [_CTX.mpf(2) ** k for k in range(-60, 1024, 7)]
    ts += [-(_CTX.mpf(2) ** -k) for k in range(1, 60)]
    psi = [abs(1 / _CTX.log1p(t) - (1 + t) / t) for t in ts]
    assert max(psi) <= 1


def test_expm1_lemma_the_corrections_factor_has_slope_below_one() -> None:
    """Lemma E.2's hypothesis: ``0 < d/dt log(expm1(t)/t) = e^t/expm1(t) - 1/t < 1``."""
    ts = [_CTX.mpf(2) ** k for k in range(-60, 10)]
    ts += [-(_CTX.mpf(2) ** k) for k in range(-60, 10)]
    slopes = [_CTX.exp(t) / _CTX.expm1(t) - 1 / t for t in ts]
    assert min(slopes) > 0
    assert max(slopes) < 1


def test_an_operation_the_model_does_not_state_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"operation: expected one of .*got 'erf'"):
        XLA_FLOAT64.relative("erf")
    assert XLA_FLOAT64.sources.keys() == XLA_FLOAT64.relatives.keys()


def test_the_corrected_functions_refuse_to_run_in_float32() -> None:
    """Outside JAX's 64-bit mode ``jnp.float64`` silently means float32: refused, by name."""
    jax.config.update("jax_enable_x64", False)
    try:
        for f in (log1p, expm1):
            with pytest.raises(InvalidArgument, match="x: the bound's evaluation is float64"):
                f(0.5)
    finally:
        jax.config.update("jax_enable_x64", True)
