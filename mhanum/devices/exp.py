"""The exp record: ``jnp.exp`` in float32 measured against the correctly rounded value, since every
bound assumes ``Numerics.exp_ulps``."""

from __future__ import annotations

import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import mpmath
import numpy as np

from mhanum.devices.platforms import device_for, environment
from mhanum.devices.records import SCHEMA, Record
from mhanum.numerics import Numerics

__all__ = ["exp_record"]

_EXP_RANGES = ((-104.0, 0.0), (-88.0, 88.0))
"""Ranges sampled densely: the shifted logits of a float32 softmax, and exp's whole finite range."""
_EXP_DENSE = 2**20
"""Points per dense range (evenly spaced, rounded to float32)."""
_EXP_ALL = ((-1.0, -0.5), (0.5, 1.0), (2.0**-10, 2.0**-9), (-88.0, -86.0))
"""Intervals in which every float32 value is measured (two binades near 0, one small binade, and
the values around -87.3, where float32 exp leaves the normal range)."""


def _float32_between(lo: float, hi: float) -> np.ndarray:
    """Every float32 value in ``[lo, hi)``."""
    a, b = np.float32(lo), np.float32(hi)
    if lo >= 0:
        bits = np.arange(a.view(np.uint32), b.view(np.uint32), dtype=np.uint32)
    else:  # negative floats: the bit pattern grows as the value falls
        bits = np.arange(
            (-b).view(np.uint32) + (1 if hi <= 0 else 0), (-a).view(np.uint32) + 1, dtype=np.uint32
        )
        return -bits.view(np.float32)
    return bits.view(np.float32)


def _exp_points() -> Iterable[np.ndarray]:
    for lo, hi in _EXP_RANGES:
        yield np.linspace(lo, hi, _EXP_DENSE).astype(np.float32)
    for lo, hi in _EXP_ALL:
        x = _float32_between(lo, hi)
        for start in range(0, x.size, 2**22):
            yield x[start : start + 2**22]


@jax.jit
def _exp(x: jax.Array) -> jax.Array:
    return jnp.exp(x)


def _exact_exp_ulps(x: float, y: float) -> tuple[float, float]:
    """(ulps of float32 at exp(x), |y - exp(x)|) with exp(x) from mpmath at 80 bits."""
    ctx = mpmath.MPContext()
    ctx.prec = 80
    e = ctx.exp(ctx.mpf(float(x)))
    diff = abs(ctx.mpf(float(y)) - e)
    _, exponent = ctx.frexp(e)
    ulp = ctx.ldexp(1, max(int(exponent) - 1, -126) - 23)
    return float(diff / ulp), float(diff)


def exp_record(backend: str | None = None, *, assumed_ulps: float | None = None) -> Record:
    """The accuracy of ``jnp.exp`` in float32 on a backend, as an ``"exp"`` record.

    Every bound assumes ``exp`` within ``Numerics.exp_ulps`` ulps of the softmax format (and an
    absolute error below ``2^-126`` where the result leaves the normal range, XLA's flush to
    zero). This measures it densely on the record's ``ranges`` (``dense_points`` evenly spaced
    points each) and on every float32 value in its ``all_values_in``, against float64 ``exp``
    (whose error is below ``2^-29`` float32 ulps); the 64 worst points are re-measured against
    mpmath at 80 bits, and the worst of those is reported.

    Returns:
        A record with ``max_ulps`` (ulps of float32 at the exact value, normal results),
        ``max_abs_subnormal_in_eta`` (the largest error where ``exp(x) < 2^-126``, in units of
        ``2^-126``), ``exp_zero_is_one``, and ``assumed_exp_ulps``.
    """
    device = device_for(backend)
    assumed = Numerics().exp_ulps if assumed_ulps is None else float(assumed_ulps)
    tiny = 2.0**-126
    worst: list[tuple[float, float, float]] = []
    worst_tiny = (0.0, 0.0)
    n_points = 0
    start = time.perf_counter()
    with jax.default_device(device):
        one = float(np.asarray(_exp(jnp.zeros((1,), jnp.float32)))[0])
        for x in _exp_points():
            y = np.asarray(_exp(jnp.asarray(x))).astype(np.float64)
            ref = np.exp(x.astype(np.float64))
            diff = np.abs(y - ref)
            normal = ref >= tiny
            _, e = np.frexp(ref)
            ulps = np.where(normal, diff / np.ldexp(1.0, np.maximum(e - 1, -126) - 23), 0.0)
            top = np.argpartition(ulps, -64)[-64:] if ulps.size > 64 else range(ulps.size)
            worst.extend((float(ulps[i]), float(x[i]), float(y[i])) for i in top)
            worst = sorted(worst)[-64:]
            small = np.where(normal, 0.0, diff / tiny)
            i = int(np.argmax(small))
            if small[i] > worst_tiny[0]:
                worst_tiny = (float(small[i]), float(x[i]))
            n_points += x.size
    exact = [(_exact_exp_ulps(x, y)[0], x, y) for _, x, y in worst]
    max_ulps, arg, value = max(exact)
    return {
        "schema": SCHEMA,
        "kind": "exp",
        **environment(device),
        "status": "measured",
        "dtype": "float32",
        "ranges": [list(r) for r in _EXP_RANGES],
        "dense_points": _EXP_DENSE,
        "all_values_in": [list(r) for r in _EXP_ALL],
        "n_points": n_points,
        "max_ulps": max_ulps,
        "argmax_x": arg,
        "argmax_x_hex": float(arg).hex(),
        "computed_at_argmax": value,
        "max_abs_subnormal_in_eta": worst_tiny[0],
        "argmax_subnormal_x": worst_tiny[1],
        "exp_zero_is_one": one == 1.0,
        "assumed_exp_ulps": assumed,
        "timing_s": {"exp": time.perf_counter() - start},
    }
