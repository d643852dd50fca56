"""The proof steps of ``papers/masking.md`` Theorems M.1–M.6 for one stored masking constant.

:func:`mhanum.bounds.masking.analyze_mask` validates its arguments into a :class:`MaskSetting`,
resolves the constant, and reads each theorem from one step here: :func:`storage` (M.1 and M.2:
the stored constant, its conversion into the softmax format and ``fl_F(s + c)``),
:func:`absorption` (M.3), :func:`exact_leakage` (M.4), :func:`computed_leakage` (M.5) and
:func:`fully_masked` (M.6). The notation is that of :mod:`mhanum.bounds.masking`: ``F`` the score
format, ``F_s`` the softmax format, ``B_F`` the largest value of ``F`` that is ``<= B``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import mpmath

from mhanum.bounds.format_values import (
    fl,
    fl_sum,
    from_ordinal,
    neighbour_gaps,
    ordinal,
    round_down,
)
from mhanum.formats import Format, ulp

__all__ = [
    "Absorption",
    "Leakage",
    "MaskSetting",
    "Storage",
    "absorption",
    "computed_leakage",
    "exact_leakage",
    "fully_masked",
    "storage",
]

# Assumption (U) of papers/masking.md: exp returns 0 below this fraction of half the smallest
# subnormal (a relative margin for the carrier's own exp error).
_UNDERFLOW_MARGIN = 1.0 - 2.0**-8
_MP = mpmath.MPContext()
_MP.prec = 113


@dataclasses.dataclass(frozen=True)
class MaskSetting:
    """The validated question about a constant: the score format ``fmt`` (``F``), the softmax
    format (``F_s``), the mask ``mode`` (``"fill"`` or ``"add"``), the ``softmax`` kind
    (``"naive"``, ``"safe"`` or ``"online"``), ``score_bound`` (``B``), ``n_keys`` (or ``None``)
    and the accuracies ``exp_ulps`` (``k_e``) and ``div_ulps`` (``k_d``) in ulps of ``F_s``."""

    fmt: Format
    softmax_format: Format
    mode: str
    softmax: str
    score_bound: float
    n_keys: int | None
    exp_ulps: float
    div_ulps: float


@dataclasses.dataclass(frozen=True)
class Storage:
    """Theorems M.1 and M.2: ``bf`` (``B_F``), the stored constant ``c = fl_F(c_requested)``,
    ``c_s = fl_{F_s}(c)``, the extreme rounded logits ``low = fl_F(c - B_F)`` and ``high = fl_F(c + B_F)`` (``c`` where
    ``c`` is infinite), the largest masked logit ``masked_max`` (``c`` for fill, ``high`` for add),
    the overflows, and the notes in words."""

    bf: float
    c: float
    c_s: float
    low: float
    high: float
    masked_max: float
    stored_overflow: bool
    softmax_overflow: bool
    add_can_overflow: bool
    overflows: bool
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Absorption:
    """Theorem M.3: the spacing ``ulp`` of ``F`` at ``c``, the ``radius`` below which an added score
    is absorbed, the logit error bound ``err`` (each ``None`` for an infinite ``c``), whether every
    score ``|s| <= B`` is absorbed, and the note in words (empty when there is none)."""

    ulp: float | None
    radius: float | None
    err: float | None
    absorbs: bool
    notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Leakage:
    """Theorem M.5: the bound on each masked key's computed probability, on their total (``None``
    without ``n_keys``), whether it is exactly 0, the largest argument ``x_arg`` of ``exp`` at a
    masked key, the underflow threshold of assumption U, and the note in words."""

    per_key: float
    bound: float | None
    is_zero: bool
    x_arg: float
    zero_below: float
    notes: tuple[str, ...]


def storage(setting: MaskSetting, real: float, c: float) -> Storage:
    """Theorems M.1 (the stored constant and its conversion into ``F_s``) and M.2 (whether
    ``fl_F(s + c)`` can overflow to ``-inf``) for the requested value ``real`` stored as ``c``."""
    f, fs, mode = setting.fmt, setting.softmax_format, setting.mode
    notes: list[str] = []
    bf = round_down(setting.score_bound, f)
    c_s = fl(c, fs)
    stored_overflow = math.isfinite(real) and not math.isfinite(c)
    if stored_overflow:
        notes.append(f"M.1: {real!r} exceeds the range of {f.name} and is stored as -inf.")
    # M.2: fl(s + c) is monotone in s, so the most negative result is at s = -B_F.
    low = fl_sum(c, -bf, f) if math.isfinite(c) else c
    high = fl_sum(c, bf, f) if math.isfinite(c) else c
    add_can_overflow = math.isfinite(c) and not math.isfinite(low)
    if add_can_overflow:
        notes.append(
            f"M.2: fl({c!r} + s) = -inf in {f.name} for scores s <= {_add_overflow_threshold(c, f)!r}"
            f" (|s| <= {bf!r} allowed)."
        )
    masked_max = c if mode == "fill" else high
    masked_min = c if mode == "fill" else low
    softmax_overflow = (math.isfinite(masked_min) and not math.isfinite(fl(masked_min, fs))) or (
        math.isfinite(c) and not math.isfinite(c_s)
    )
    if softmax_overflow:
        notes.append(
            f"M.1: a finite masked logit becomes -inf on conversion into {fs.name} "
            f"(largest finite {fs.max_finite!r})."
        )
    overflows = stored_overflow or softmax_overflow or (mode == "add" and add_can_overflow)
    return Storage(
        bf=bf,
        c=c,
        c_s=c_s,
        low=low,
        high=high,
        masked_max=masked_max,
        stored_overflow=stored_overflow,
        softmax_overflow=softmax_overflow,
        add_can_overflow=add_can_overflow,
        overflows=overflows,
        notes=tuple(notes),
    )


def _add_overflow_threshold(c: float, f: Format) -> float:
    """The largest score ``s`` of ``f`` with ``fl(s + c) = -inf`` (``s`` in ``[-max, 0]``)."""
    lo, hi = ordinal(-f.max_finite, f), 0
    while lo < hi:  # find the largest ordinal whose score overflows
        mid = (lo + hi + 1) // 2
        if math.isinf(fl_sum(c, from_ordinal(mid, f), f)):
            lo = mid
        else:
            hi = mid - 1
    return from_ordinal(lo, f)


def absorption(setting: MaskSetting, stored: Storage) -> Absorption:
    """Theorem M.3: the absorption of scores by an added constant (the spacing of ``F`` at ``c``);
    every score is absorbed by an infinite constant."""
    c, f = stored.c, setting.fmt
    if not math.isfinite(c):
        return Absorption(None, None, None, True, ())
    bf = stored.bf
    spacing = float(ulp(c, f))
    toward, away = neighbour_gaps(c, f)
    radius = min(toward, away) / 2
    absorbs = stored.low == c == stored.high
    err = float(ulp(abs(c) + bf, f)) / 2
    notes: tuple[str, ...] = ()
    if setting.mode == "add":
        notes = (
            f"M.3: an added constant quantises a logit s to fl(s + c): spacing {spacing!r}"
            f" at c, error <= {err!r}; |s| < {radius!r} is absorbed entirely"
            + (" (every |s| <= B is)." if absorbs else "."),
        )
    return Absorption(spacing, radius, err, absorbs, notes)


def exact_leakage(setting: MaskSetting, stored: Storage) -> tuple[float, float | None]:
    """Theorem M.4: ``e^{c⁺ + B_F}`` (each masked key's probability over an attended key's, in the
    exact softmax of the stored logits), and the total masked probability over ``n_keys`` keys
    (``None`` without ``n_keys``), both rounded up."""
    bf, n, masked_max = stored.bf, setting.n_keys, stored.masked_max
    ratio = _exp_up(masked_max + bf) if math.isfinite(masked_max) else _MP.zero
    leakage_exact = None if n is None else _up((n - 1) * ratio / (1 + (n - 1) * ratio))
    return _up(ratio), leakage_exact


def computed_leakage(setting: MaskSetting, stored: Storage) -> Leakage:
    """Theorem M.5: the probability of masked keys in the computed softmax (rounding included),
    and whether it is exactly 0 (assumption U)."""
    fs, kind, n = setting.softmax_format, setting.softmax, setting.n_keys
    ke, kd = setting.exp_ulps, setting.div_ulps
    bs = fl(stored.bf, fs)
    zero_below = _exp_zero_below(fs)
    masked_s = fl(stored.masked_max, fs)
    x_arg = fl_sum(masked_s, bs, fs) if kind != "naive" else masked_s
    u, alpha = fs.u, fs.smallest_subnormal
    if x_arg <= zero_below:
        per_key = 0.0
        leak_zero = True
    else:
        leak_zero = False
        num = _exp_up(x_arg) * (1 + 2 * ke * u) + ke * alpha
        if kind == "naive":
            den = _MP.exp(-_MP.mpf(bs)) * (1 - 2 * ke * u)
            if den < fs.smallest_normal:
                den = _MP.zero
        else:
            den = _MP.one
        per_key = (
            _up(num / den * (1 + _MP.mpf(u)) ** (2 * kd) + kd * alpha) if den > 0 else math.inf
        )
    leakage_bound = None if n is None else (0.0 if leak_zero else _up(_MP.mpf(per_key) * (n - 1)))
    notes: tuple[str, ...] = ()
    if leak_zero:
        why = (
            f"M.5: exp of every masked logit (argument <= {x_arg!r}) underflows to 0 in {fs.name}:"
            " masked keys get probability exactly 0."
        )
        notes = (why,)
    return Leakage(per_key, leakage_bound, leak_zero, x_arg, zero_below, notes)


def _exp_zero_below(fs: Format) -> float:
    """Assumption U: ``exp(x)`` is 0 in ``F_s`` when ``e^x <= (1 - 2^-8) α/2``."""
    return math.log(fs.smallest_subnormal) - math.log(2) + math.log(_UNDERFLOW_MARGIN)


def _exp_up(x: float) -> mpmath.mpf:
    return _MP.exp(_MP.mpf(x)) if x < math.inf else _MP.inf


def _up(x: Any) -> float:
    """A float64 ``>=`` the mpmath number ``x``."""
    f = float(x)
    return math.nextafter(math.nextafter(f, math.inf), math.inf) if math.isfinite(f) else f


def _positive_exp(x: float, fs: Format, ke: float) -> bool:
    """``exp(x)`` is certainly a positive normal number of ``fs`` (assumption E)."""
    return math.isfinite(x) and math.exp(x) * (1 - 2 * ke * fs.u) >= fs.smallest_normal


def fully_masked(
    setting: MaskSetting, stored: Storage, equal: bool, zero_below: float
) -> tuple[str, str]:
    """Theorem M.6: the computed softmax of a row whose every key is masked: ``"nan"``,
    ``"uniform"``, ``"quantised"`` or ``"nan_possible"``, and why. ``equal``: every logit of
    the row is the same (a filled row, or an added constant that absorbs every score);
    ``zero_below`` the underflow threshold of assumption U."""
    fs, kind, ke = setting.softmax_format, setting.softmax, setting.exp_ulps
    if setting.mode == "fill":
        if not math.isfinite(stored.c_s):
            return "nan", (
                "M.6: every masked logit is -inf in the softmax format: a fully-masked row is NaN"
                " (-inf - (-inf) after the max shift; 0/0 in the naive and online softmax)."
            )
        lo_s = hi_s = stored.c_s
    else:
        lo_s, hi_s = fl(stored.low, fs), fl(stored.high, fs)
        if not math.isfinite(hi_s):
            return "nan", "M.6: fl(s + c) = -inf for every score: a fully-masked row is NaN."
        if not math.isfinite(lo_s):
            return "nan_possible", (
                "M.6: fl(s + c) overflows to -inf for the most negative scores: a row whose every "
                "logit overflows is NaN; other rows are the softmax of the finite logits."
            )
    finite = "uniform" if equal else "quantised"
    what = (
        "all logits equal c: exactly uniform"
        if equal
        else "the softmax of the quantised logits fl(s + c)"
    )
    if kind != "naive":
        return finite, f"M.6: the max shift makes the row finite: {what}."
    if hi_s <= zero_below:
        return "nan", (
            f"M.6: the naive softmax underflows exp({hi_s!r}) to 0 for every key: 0/0 = NaN."
        )
    if _positive_exp(lo_s, fs, ke):
        return finite, f"M.6: exp of every logit is positive in the naive softmax: {what}."
    return "nan_possible", (
        "M.6: exp of the masked logits is near underflow in the naive softmax: NaN (0/0) for "
        "some rows or exp implementations."
    )
