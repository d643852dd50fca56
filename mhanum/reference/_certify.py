"""Certification: the fast double-double path, the doubling of the working precision, and the float64 rounding of certified values."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mpmath
import numpy as np

from mhanum._errors import CertificationError, InvalidArgument
from mhanum.reference import _dd, _exact, _fastref
from mhanum.reference._dd import Ball
from mhanum.reference._rope import arb_rotate, arb_rotation
from mhanum.reference._spec import (
    BACKENDS,
    MAX_DIGITS,
    Compute,
    ExactZero,
    Options,
    ScoreSpec,
    start_prec,
)

if TYPE_CHECKING:
    from types import ModuleType

# --- the fast path ------------------------------------------------------------------------------

# The certified mpf values of some rows (an index array of the query axis) of one batch element.
_ExactRows = Callable[[tuple[int, ...], np.ndarray], np.ndarray]


def nearest_float64(x: mpmath.mpf) -> float:
    """A finite mpf correctly rounded to float64 (nearest, ties to even; ``inf`` past the range).

    ``float(mpf)`` rounds to 53 bits first and so rounds twice in the subnormal range; this rounds
    once, subnormals included.

    >>> import mpmath
    >>> nearest_float64(mpmath.mpf(2) ** -1074 * mpmath.mpf("1.5"))
    1e-323
    """
    return _exact.to_float64(*_exact.mpf_pair(x))


def max_digits(backend: str) -> int:
    """The most significant digits ``backend`` certifies; asking for more raises or falls back.

    ``"auto"``, ``"exact"``, ``"mpmath"`` and ``"arb"`` certify any number of digits up to 2000
    (given ``max_prec``). ``"dd"``, the double-double enclosure alone, certifies at most 26: its
    error bounds are near ``2**-95`` of the values (``papers/reference.md``, Theorem 1); with
    more digits ``backend="dd"`` raises :class:`~mhanum.CertificationError` and ``"auto"`` runs
    the exact backend on every row.

    Raises:
        InvalidArgument: for an unknown backend.

    Examples:
        >>> from mhanum import reference
        >>> reference.max_digits("dd"), reference.max_digits("auto")
        (26, 2000)
    """
    if backend not in BACKENDS:
        msg = f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        raise InvalidArgument(msg)
    return _fastref.MAX_DIGITS if backend == "dd" else MAX_DIGITS


def exact_product(x: np.ndarray, factor: float, name: str) -> np.ndarray:
    """``x·factor`` in float64, refused unless every product is exact (their significant bits
    fit 53 and no product leaves float64's normal range)."""
    product = x * factor

    def bits(a: np.ndarray) -> np.ndarray:
        m, _ = np.frexp(np.abs(a))
        ints = (m * 2.0**53).astype(np.uint64)
        low = ints & (~ints + np.uint64(1))  # the lowest set bit
        return 53 - np.log2(np.maximum(low, 1).astype(np.float64)).astype(np.int64)

    with np.errstate(over="ignore", under="ignore"):
        ok = (x == 0) | (
            (bits(x) + int(bits(np.asarray(factor))) <= 53)
            & (np.abs(product) >= np.finfo(np.float64).tiny)
            & np.isfinite(product)
        )
    if not np.all(ok):
        msg = (
            f"descale: expected {name}·d_{name} exact in float64 (inputs of at most 29 "
            f"significant bits with a float32 factor), got inexact products"
        )
        raise InvalidArgument(msg)
    return product


def check_softcap_backend(spec: ScoreSpec, options: Options) -> None:
    """The double-double enclosure has no ``tanh``: ``"dd"`` refuses a soft-cap."""
    if spec.softcap is not None and options.backend == "dd":
        msg = "backend 'dd' does not take softcap (it has no tanh); use backend='auto' or 'exact'"
        raise CertificationError(msg)


def _check_rotation_backend(options: Options) -> None:
    if options.backend not in ("auto", "arb"):
        msg = (
            f"backend: {options.backend!r} does not take rope= (the rotated entries are "
            "irrational: only Arb balls enclose them); use backend='auto' or 'arb'"
        )
        raise InvalidArgument(msg)


def rotation(
    rope: Any,
    queries: tuple[np.ndarray, np.ndarray],
    keys: tuple[np.ndarray, np.ndarray],
    options: Options,
) -> Callable[[ModuleType], tuple[np.ndarray, np.ndarray]]:
    """The exact rotations of ``(q, positions)`` and ``(k, positions)`` as Arb balls at flint's
    working precision (:func:`mhanum.reference._rope.arb_rotation`), for the ``"arb"`` backend; the
    other backends take floats and refuse a rotation, whose entries are irrational."""
    _check_rotation_backend(options)

    def rotate(flint: ModuleType) -> tuple[np.ndarray, np.ndarray]:
        return arb_rotation(*queries, rope, flint), arb_rotation(*keys, rope, flint)

    return rotate


def head_rotation(
    rope: Any, positions: dict[str, np.ndarray], options: Options
) -> Callable[[ModuleType, np.ndarray, str], np.ndarray]:
    """The exact rotation of a head's projected queries or keys (balls) at ``positions[name]``
    (:func:`mhanum.reference._rope.arb_rotate`), for the ``"arb"`` backend of multi-head attention."""
    _check_rotation_backend(options)

    def rotate(flint: ModuleType, balls: np.ndarray, name: str) -> np.ndarray:
        return arb_rotate(balls, positions[name], rope, flint)

    return rotate


def fast_path_applies(options: Options) -> bool:
    """Whether to try the double-double enclosure (``"dd"`` refuses what it cannot certify).

    Its bounds assume gradual underflow, which a library loaded into the process can switch off.
    """
    if not _dd.gradual_underflow():
        if options.backend == "dd":
            msg = "backend 'dd' needs gradual underflow, but float64 subnormals are flushed"
            raise CertificationError(msg)
        return False
    if options.digits <= _fastref.MAX_DIGITS:
        return True
    if options.backend == "dd":
        msg = (
            f"backend 'dd' certifies at most {_fastref.MAX_DIGITS} digits, got digits="
            f"{options.digits}; use backend='auto' or 'exact'"
        )
        raise CertificationError(msg)
    return False


def batch_element(x: np.ndarray, batch: tuple[int, ...], index: tuple[int, ...]) -> np.ndarray:
    """Batch element ``index`` of ``x`` broadcast to the batch shape ``batch``."""
    return np.broadcast_to(x, batch + x.shape[-2:])[index]


def sub_spec(spec: ScoreSpec, index: tuple[Any, ...]) -> ScoreSpec:
    """The score spec restricted by ``index`` (a batch element and some query rows)."""
    bias = None if spec.bias is None else spec.bias[index]
    return dataclasses.replace(spec, excluded=spec.excluded[index], bias=bias)


def fast_certified(
    out: Ball,
    undefined: np.ndarray,
    batch: tuple[int, ...],
    exact_rows: _ExactRows,
    options: Options,
    exact_zero: ExactZero,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The enclosed outputs where they certify ``digits``; elsewhere the exact rows (or raise).

    An undefined row is NaN. A component whose enclosure contains 0 without certifying it is
    exactly 0 where ``exact_zero`` proves it. A row with a component still not certified is
    recomputed by ``exact_rows`` (``"auto"``: refined or recomputed with ``"arb"`` where
    python-flint is installed, else recomputed with ``"exact"``); with ``"dd"`` that raises
    :class:`~mhanum.CertificationError`.
    """
    good = _fastref.certified(out, options.digits) | undefined[..., None]
    out, good = _proved_zeros(out, good, exact_zero)
    floats = np.where(undefined[..., None], np.nan, out.hi)
    values = _dd_to_mpf(out.hi, out.lo, undefined) if options.return_mpf else None
    failed = ~np.asarray(good.all(axis=-1))
    if failed.any() and options.backend == "dd":
        first = tuple(int(i) for i in np.argwhere(~good)[0])
        msg = (
            f"backend 'dd' could not certify {options.digits} digits for {int((~good).sum())} "
            f"of {good.size} components (first at index {first}); use backend='auto'"
        )
        raise CertificationError(msg)
    for index in np.ndindex(batch):
        rows = np.flatnonzero(failed[index])
        if rows.size:
            exact = exact_rows(index, rows)
            floats[(*index, rows)] = _to_float64(exact)
            if values is not None:
                values[(*index, rows)] = exact
    return (floats, values) if values is not None else floats


def _proved_zeros(out: Ball, good: np.ndarray, exact_zero: ExactZero) -> tuple[Ball, np.ndarray]:
    """``out`` set to exactly 0 where a component not ``good`` is proved 0, and the new ``good``.

    An exact 0 lies in its enclosure, so only the enclosures that may contain 0 are looked up:
    ``|hi + lo| <= rad`` implies ``|hi| <= 2 rad`` (``|lo| <= u |hi|``).
    """
    rad = np.zeros_like(out.hi) if out.rad is None else out.rad
    with np.errstate(invalid="ignore", over="ignore"):
        candidates = ~good & (np.abs(out.hi) <= 2 * rad)
    zero = np.zeros(good.shape, dtype=bool)
    for index in np.argwhere(candidates):
        zero[tuple(index)] = exact_zero(tuple(int(i) for i in index))
    if not zero.any():
        return out, good
    cleared = Ball(
        np.where(zero, 0.0, out.hi), np.where(zero, 0.0, out.lo), np.where(zero, 0.0, rad)
    )
    return cleared, good | zero


def _dd_to_mpf(hi: np.ndarray, lo: np.ndarray, undefined: np.ndarray) -> np.ndarray:
    """``hi + lo`` as exact mpf numbers (NaN in undefined rows)."""
    ctx = _context(_exact._FLOAT64_MANTISSA_BITS)
    values = np.empty(hi.shape, dtype=object)
    for index, h in np.ndenumerate(hi):
        if undefined[index[:-1]]:
            values[index] = ctx.nan
        else:
            values[index] = ctx.fadd(ctx.mpf(float(h)), ctx.mpf(float(lo[index])), exact=True)
    return values


def has_flint() -> bool:
    """Whether python-flint (a dependency of mhanum) can be imported."""
    try:
        import flint  # noqa: F401
    except ImportError:
        return False
    return True


def arb_backend() -> ModuleType:
    """The python-flint backend, imported on first use."""
    from mhanum.reference import _arbref

    return _arbref


# --- certification -----------------------------------------------------------------------------


def _context(prec: int) -> mpmath.MPContext:
    """A fresh mpmath context at ``prec`` bits, rounding to nearest."""
    ctx = mpmath.MPContext()
    ctx.prec = prec
    return ctx


def certified(
    compute: Compute, options: Options, exact_zero: ExactZero
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Run ``compute`` at ``p`` and ``2p`` until they agree; the float64 (and mpf) result."""
    values = certify(compute, options, exact_zero)
    floats = _to_float64(values)
    return (floats, values) if options.return_mpf else floats


def certify(compute: Compute, options: Options, exact_zero: ExactZero) -> np.ndarray:
    """Values at ``2p`` that agree with those at ``p``, or exactly 0 where ``exact_zero`` proves it.

    Two zeros do not agree by themselves: probabilities that differ by less than ``2**-2p`` round
    to the same numbers at ``p`` and at ``2p`` bits, and values that cancel then give 0 at both.
    Nor is a proved zero always computed as 0 (equal values weighted by probabilities whose
    rounded sum is not 1), so a component that does not agree is looked up in the proof.
    """
    proved = _memoized(exact_zero)
    prec = start_prec(options.digits)
    low = _with_nan(compute, _context(prec))
    while True:
        ctx = _context(2 * prec)
        high = _with_nan(compute, ctx)
        unproved = {}
        for index, error in _disagreements(ctx, low, high, options.digits).items():
            if proved(index):
                high[index] = ctx.zero
            else:
                unproved[index] = error
        if not unproved:
            return high
        if 2 * prec > options.max_prec:
            index = max(unproved, key=unproved.__getitem__)
            error = unproved[index]
            agreed = max(0.0, -float(ctx.log10(error))) if error != ctx.inf else 0.0
            msg = (
                f"could not certify {options.digits} digits within max_prec={options.max_prec} "
                f"bits: at {prec} and {2 * prec} bits the worst component, at index {index}, "
                f"agrees to {agreed:.1f} digits (value {ctx.nstr(high[index], 10)})"
            )
            raise CertificationError(msg)
        low, prec = high, 2 * prec


def _memoized(exact_zero: ExactZero) -> ExactZero:
    """``exact_zero`` computed once per index (a component may be looked up at every doubling)."""
    known: dict[tuple[int, ...], bool] = {}

    def proved(index: tuple[int, ...]) -> bool:
        if index not in known:
            known[index] = exact_zero(index)
        return known[index]

    return proved


def _with_nan(compute: Compute, ctx: mpmath.MPContext) -> np.ndarray:
    """The outputs of ``compute`` with its undefined rows set to NaN."""
    values, undefined = compute(ctx)
    values[undefined] = ctx.nan
    return values


def _disagreements(
    ctx: mpmath.MPContext, low: np.ndarray, high: np.ndarray, digits: int
) -> dict[tuple[int, ...], Any]:
    """The components that do not agree to ``digits`` digits, with their relative disagreement
    (``inf`` where the value at ``2p`` is 0, two zeros included)."""
    tolerance = ctx.mpf(10) ** -digits
    found = {}
    for index, hi in np.ndenumerate(high):
        if ctx.isnan(hi) or (hi and abs(low[index] - hi) <= tolerance * abs(hi)):
            continue
        found[tuple(int(i) for i in index)] = abs(low[index] - hi) / abs(hi) if hi else ctx.inf
    return found


def _to_float64(values: np.ndarray) -> np.ndarray:
    """mpf values correctly rounded to float64 (NaN kept)."""
    out = np.empty(values.shape, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        out[index] = math.nan if mpmath.isnan(value) else _exact.to_float64(*_exact.mpf_pair(value))
    return out
