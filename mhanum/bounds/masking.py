"""Is a masking constant safe? Storage, overflow, absorption, leakage and fully-masked rows.

A masked logit is replaced by (``fill``) or added to (``add``) a constant ``c`` in the score format
``F`` (as :mod:`mhanum.emulate.attention` does); the softmax then runs in the softmax format
``F_s``. For unmasked (attended) scores ``|s| <= B`` (``B`` is ``score_bound``) this module
derives, each as a theorem of ``papers/masking.md``:

* M.1 the stored constant ``fl_F(c)`` and whether it overflows (also on conversion into ``F_s``);
* M.2 whether ``fl_F(s + c)`` can overflow to ``-inf``;
* M.3 the absorption of scores by an added constant (the spacing of ``F`` at ``c``);
* M.4 the probability of masked keys in the exact softmax of the stored logits;
* M.5 the probability of masked keys in the *computed* softmax (rounding included), and when it
  is exactly zero;
* M.6 what a fully-masked row becomes (NaN, uniform, or the softmax of quantised logits);
* M.7 the interval of safe constants, and a recommended one.

Throughout, ``B_F`` is the largest value of ``F`` that is ``<= B``: scores are values of ``F``, so
``|s| <= B`` is the same as ``|s| <= B_F``. The steps of the proofs of M.1–M.6 are those of
:mod:`mhanum.bounds.masking_steps`; the arithmetic on single values of a format (rounding, the
ordered list of values M.7 bisects) is :mod:`mhanum.bounds.format_values`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.format_values import fl, fl_sum, from_ordinal, ordinal, round_down
from mhanum.bounds.masking_steps import (
    MaskSetting,
    absorption,
    computed_leakage,
    exact_leakage,
    fully_masked,
    storage,
)
from mhanum.formats import Format, get_format
from mhanum.numerics import Numerics
from mhanum.units import ACCUM_FORMATS, mask_mode, softmax_algorithm

__all__ = [
    "MaskAnalysis",
    "MaskRange",
    "MaskRecommendation",
    "analyze_mask",
    "analyze_numerics",
    "recommend_mask_value",
    "safe_mask_range",
]

Outcome = str  # "nan" | "uniform" | "quantised" | "nan_possible"


@dataclasses.dataclass(frozen=True)
class MaskAnalysis:
    """What a masking constant does in a format (``papers/masking.md`` Theorems M.1–M.6).

    Attributes:
        format: the score format ``F`` the constant is stored in.
        softmax_format: the format ``F_s`` of the softmax arithmetic.
        mode: ``"fill"`` (masked logits replaced by the constant) or ``"add"`` (added to them).
        softmax: ``"naive"``, ``"safe"`` or ``"online"``.
        requested: the constant asked for (a float, ``-inf``, or a ``finfo`` string).
        requested_value: the requested constant as a real number (``finfo`` strings resolved).
        stored_value: ``fl_F(c)``, round-to-nearest (M.1); may be ``-inf``.
        softmax_value: ``fl_{F_s}(fl_F(c))``, the constant as the softmax sees it (M.1).
        score_bound: ``B``.
        score_bound_in_format: ``B_F``, the largest value of ``F`` that is ``<= B``.
        n_keys: keys per row (at most ``n_keys - 1`` masked with one attended), or ``None``.
        stored_overflow: the requested constant is finite, the stored one is not (M.1).
        softmax_overflow: a finite masked logit becomes ``-inf`` on conversion into ``F_s`` (M.1).
        add_can_overflow: ``fl_F(s + c) = -inf`` for some score ``|s| <= B`` (M.2), i.e.
            ``fl_F(c - B_F) = -inf`` while ``c`` is finite.
        overflows: ``stored_overflow`` or ``softmax_overflow`` or (``add`` and
            ``add_can_overflow``).
        absorption_ulp: ``ulp_F(c)``, the spacing of ``F`` at the constant (M.3); ``None`` for an
            infinite constant.
        absorption_radius: scores with ``|s| <`` this value are absorbed, ``fl_F(s + c) = c``
            (half the smaller gap to a neighbour of ``c``; M.3); ``None`` for an infinite constant.
        absorbs_scores: every score ``|s| <= B`` is absorbed when added (M.3).
        logit_error_bound: ``ulp_F(|c| + B_F)/2`` bounds ``|fl_F(s + c) - (s + c)|`` for every
            ``|s| <= B`` without overflow (M.3); ``None`` for an infinite constant.
        masked_logit_max: the largest masked logit in ``F``: ``c`` (fill) or ``fl_F(c + B_F)``
            (add).
        leakage_ratio_exact: ``e^{masked_logit_max + B_F}``: in the exact softmax of the stored
            logits, each masked key's probability is at most this times any attended key's (M.4).
        leakage_exact: with ``n_keys`` keys, at least one attended, an upper bound on the total
            probability of masked keys in the exact softmax of the stored logits (M.4); ``None``
            without ``n_keys``.
        leakage_per_key: an upper bound on each masked key's *computed* probability in ``F_s``,
            rounding included (M.5).
        leakage_bound: ``(n_keys - 1) * leakage_per_key``, an upper bound on the total computed
            probability of masked keys (M.5); ``None`` without ``n_keys``. May exceed 1
            (vacuous).
        leakage_is_zero: every masked key's computed probability is exactly 0, because ``exp`` of
            every masked (shifted) logit underflows to 0 in ``F_s`` (M.5, assumption U).
        exp_argument_max: the largest argument ``X`` of ``exp`` at a masked key (M.5).
        exp_zero_below: ``exp(x)`` is 0 in ``F_s`` for ``x <=`` this (assumption U).
        fully_masked_row: ``"nan"`` (every fully-masked row is NaN), ``"uniform"`` (every one is
            exactly uniform: all probabilities equal), ``"quantised"`` (finite: the softmax of the
            rounded logits ``fl_F(s + c)``) or ``"nan_possible"`` (NaN for some rows with
            ``|s| <= B``, finite for others) (M.6).
        notes: the reasons, in words.
        assumptions: the assumptions the claims rest on.
    """

    format: str
    softmax_format: str
    mode: str
    softmax: str
    requested: float | str
    requested_value: float
    stored_value: float
    softmax_value: float
    score_bound: float
    score_bound_in_format: float
    n_keys: int | None
    stored_overflow: bool
    softmax_overflow: bool
    add_can_overflow: bool
    overflows: bool
    absorption_ulp: float | None
    absorption_radius: float | None
    absorbs_scores: bool
    logit_error_bound: float | None
    masked_logit_max: float
    leakage_ratio_exact: float
    leakage_exact: float | None
    leakage_per_key: float
    leakage_bound: float | None
    leakage_is_zero: bool
    exp_argument_max: float
    exp_zero_below: float
    fully_masked_row: Outcome
    notes: tuple[str, ...]
    assumptions: tuple[str, ...]

    def leakage(self) -> Bound:
        """The computed-leakage bound (papers/masking.md Theorem M.5) as a :class:`Bound`.

        ``total = masked_keys * per_key``; ``exact`` is the bound of Theorem M.4 for the exact
        softmax of the stored logits (not a term of the total, reported for comparison).

        Raises:
            InvalidArgument: if the analysis was made without ``n_keys``.
        """
        if self.n_keys is None or self.leakage_bound is None or self.leakage_exact is None:
            msg = "n_keys: expected the analysis to be made with n_keys, got None"
            raise InvalidArgument(msg)
        return Bound(
            total=self.leakage_bound,
            terms={
                "per_key": self.leakage_per_key,
                "masked_keys": (self.n_keys or 1) - 1,
                "exact": self.leakage_exact,
            },
            theorem="M.5",
            assumptions=self.assumptions,
            source="papers/masking.md",
        )


@dataclasses.dataclass(frozen=True)
class MaskRange:
    """The interval ``[low, high]`` of safe constants in a format (Theorem M.7).

    Every value ``c`` of the format with ``low <= c <= high`` is finite in ``format`` and in
    ``softmax_format``, gives a finite ``fl(s + c)`` (also in ``softmax_format``) for every score
    ``|s| <= B``, and has ``leakage_bound <= leak_tol``. ``low`` is the most negative such value:
    the next value below makes ``fl(-B_F + c)`` overflow. ``high`` is the least negative: the next
    value above leaks more than ``leak_tol``. ``empty`` when no value qualifies (then ``low`` and
    ``high`` are NaN).
    """

    format: str
    softmax_format: str
    mode: str
    score_bound: float
    leak_tol: float
    n_keys: int
    low: float
    high: float
    empty: bool
    reason: str

    def contains(self, c: float) -> bool:
        """Whether ``c`` lies in ``[low, high]``."""
        return not self.empty and self.low <= c <= self.high


@dataclasses.dataclass(frozen=True)
class MaskRecommendation:
    """A recommended constant, its analysis and the reason it was chosen."""

    value: float
    analysis: MaskAnalysis
    range: MaskRange
    reason: str


# Validation ---------------------------------------------------------------------------------------


def _real(value: Any, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"{name}: expected {expected}, got {value!r}"
        raise InvalidArgument(msg)
    return float(value)


def _score_bound(value: Any) -> float:
    b = _real(value, "score_bound", "a finite number >= 0")
    if not math.isfinite(b) or b < 0:
        msg = f"score_bound: expected a finite number >= 0, got {value!r}"
        raise InvalidArgument(msg)
    return b


def _mode(value: Any) -> str:
    return mask_mode(value, "mode")


def _softmax_kind(value: Any) -> str:
    """The kind of a softmax algorithm; a bare ``"online"`` (any block size) is accepted here."""
    if isinstance(value, str) and value.strip().lower() == "online":
        return "online"
    try:
        return softmax_algorithm(value).kind
    except InvalidArgument as err:
        msg = f"softmax: expected 'naive', 'safe', 'online' or 'online(B)', got {value!r}"
        raise InvalidArgument(msg) from err


def _softmax_format(value: Any, fmt: Format) -> Format:
    if value is None:
        return get_format(fmt.name if fmt.name in ACCUM_FORMATS else "float32")
    f = get_format(value, argname="softmax_format")
    if f.name not in ACCUM_FORMATS:
        msg = f"softmax_format: expected one of {ACCUM_FORMATS}, got {value!r}"
        raise InvalidArgument(msg)
    return f


def _n_keys(value: Any, *, required: bool) -> int | None:
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"n_keys: expected an integer >= 1, got {value!r}"
        raise InvalidArgument(msg)
    return int(value)


def _ulps(value: Any, name: str) -> float:
    v = _real(value, name, "a finite number >= 0")
    if not math.isfinite(v) or v < 0:
        msg = f"{name}: expected a finite number >= 0, got {value!r}"
        raise InvalidArgument(msg)
    return v


def _leak_tol(value: Any) -> float:
    t = _real(value, "leak_tol", "a number in [0, 1)")
    if not 0 <= t < 1:
        msg = f"leak_tol: expected a number in [0, 1), got {value!r}"
        raise InvalidArgument(msg)
    return t


def _resolve(value: Any, fmt: Format) -> tuple[float | str, float, float]:
    """(canonical requested value, its real value, stored value), resolved as ``Numerics`` does."""
    try:
        num = Numerics(input="float64", accum="float64", score_format=fmt.name, mask_value=value)
    except InvalidArgument as err:
        msg = (
            "value: expected a number <= 0, -inf, 'finfo.min' or 'c*finfo.min' (0 < c <= 1), "
            f"got {value!r}"
        )
        raise InvalidArgument(msg) from err
    requested = num.mask_value
    if isinstance(requested, str):
        m = re.match(r"^(?:(\d*\.?\d+)\*)?finfo\.min$", requested)
        assert m is not None
        real = -(float(m.group(1)) if m.group(1) else 1.0) * fmt.max_finite
    else:
        real = requested
    return requested, real, num.mask_constant()


# Analysis -----------------------------------------------------------------------------------------


def analyze_mask(
    fmt: Format | str,
    value: float | str,
    mode: str,
    score_bound: float,
    *,
    softmax_format: Format | str | None = None,
    n_keys: int | None = None,
    softmax: str = "safe",
    exp_ulps: float = 2.0,
    div_ulps: float = 1.0,
) -> MaskAnalysis:
    """Analyse a masking constant: papers/masking.md Theorems M.1–M.6.

    Assumptions: round-to-nearest, ties to even; attended scores are values of ``F`` with
    ``|s| <= B``; at least one key of a row is attended (except in M.6); the softmax computes
    ``exp`` in ``F_s`` with error ``<= exp_ulps`` ulps and ``exp(0) = 1`` exactly (E), returns 0
    when ``e^x <= (1 - 2^-8)·α_s/2`` (U; ``α_s`` the smallest subnormal of ``F_s``), divides with
    error ``<= div_ulps`` ulps, and sums nonnegative terms by any summation tree (not compensated).

    Let ``c`` be the stored constant, ``c⁺`` the largest masked logit (``c`` for fill,
    ``fl_F(c + B_F)`` for add), ``u`` and ``α`` the unit roundoff and smallest subnormal of ``F_s``,
    ``X = fl_s(fl_s(c⁺) + fl_s(B_F))`` (safe and online) or ``X = fl_s(c⁺)`` (naive). Then (M.4)
    in the exact softmax of the stored logits of a row of ``n`` keys, ``m`` of them masked,

    .. math::

        \\sum_{j\\ \\mathrm{masked}} p_j \\le \\frac{m\\,e^{c^+ + B_F}}{(n - m) + m\\,e^{c^+ + B_F}}
        \\le \\frac{(n-1)\\,e^{c^+ + B_F}}{1 + (n-1)\\,e^{c^+ + B_F}},

    and (M.5) every masked key's computed probability satisfies, with ``D = 1`` (safe, online) or
    ``D = e^{-fl_s(B_F)}(1 - 2 k_e u)`` (naive),

    .. math::

        \\hat p_j \\le \\frac{e^{X}(1 + 2k_e u) + k_e\\alpha}{D}(1 + 2k_d u) + k_d\\alpha,

    and ``\\hat p_j = 0`` when ``X`` is below the underflow threshold of U.

    Args:
        fmt: the score format ``F`` (where the mask is applied).
        value: the constant: a number ``<= 0``, ``-inf``, ``"finfo.min"`` or ``"c*finfo.min"``
            (resolved in ``F`` exactly as :meth:`mhanum.Numerics.mask_constant` does).
        mode: ``"fill"`` or ``"add"``.
        score_bound: ``B >= 0``, a bound on the magnitude of attended scores.
        softmax_format: ``F_s``, one of float64, float32, bfloat16, float16; default ``F`` when it
            is one of those, else float32.
        n_keys: keys per row, for the total leakage; ``None`` reports per-key bounds only.
        softmax: ``"naive"``, ``"safe"`` or ``"online"``/``"online(B)"``.
        exp_ulps: ``k_e``, the accuracy of ``exp`` in ulps of ``F_s``.
        div_ulps: ``k_d``, the accuracy of division in ulps of ``F_s``.

    Returns:
        A :class:`MaskAnalysis`.

    Raises:
        InvalidArgument: for an unknown format, mode or softmax, a positive or NaN constant, a
            negative or non-finite score bound, or ``n_keys < 1``.

    Examples:
        >>> a = analyze_mask("float16", -1e9, "fill", 10.0)
        >>> a.stored_value, a.overflows, a.fully_masked_row
        (-inf, True, 'nan')
        >>> analyze_mask("float32", -1e9, "add", 10.0).absorption_ulp
        64.0

    References:
        ``papers/masking.md`` (its table lists the constants frameworks use).
    """
    f = get_format(fmt)
    kind = _softmax_kind(softmax)
    m = _mode(mode)
    b = _score_bound(score_bound)
    fs = _softmax_format(softmax_format, f)
    n = _n_keys(n_keys, required=False)
    ke, kd = _ulps(exp_ulps, "exp_ulps"), _ulps(div_ulps, "div_ulps")
    requested, real, c = _resolve(value, f)
    return _analyze(MaskSetting(f, fs, m, kind, b, n, ke, kd), requested, real, c)


def analyze_numerics(
    numerics: Numerics, score_bound: float, *, n_keys: int | None = None
) -> MaskAnalysis:
    """:func:`analyze_mask` for the mask of a :class:`~mhanum.Numerics` (its score and softmax
    formats, mode, constant, softmax algorithm and ``exp``/division accuracy)."""
    if not isinstance(numerics, Numerics):
        msg = f"numerics: expected a Numerics, got {type(numerics).__name__}"
        raise InvalidArgument(msg)
    return analyze_mask(
        numerics.format_of("score"),
        numerics.mask_value,
        numerics.mask_mode,
        score_bound,
        softmax_format=numerics.format_of("softmax"),
        n_keys=n_keys,
        softmax=numerics.softmax,
        exp_ulps=numerics.exp_ulps,
        div_ulps=numerics.div_ulps,
    )


_ASSUMPTIONS = (
    "round-to-nearest, ties to even, in the score and softmax formats",
    "attended scores are values of the score format with |s| <= score_bound",
    "at least one key per row is attended (leakage)",
    "E: exp in the softmax format within exp_ulps ulps, and exp(0) = 1 exactly",
    "U: exp returns 0 when e^x <= (1 - 2^-8) * (smallest subnormal)/2",
    "division within div_ulps ulps; sums of nonnegative terms by a summation tree (not Kahan)",
)


def _analyze(setting: MaskSetting, requested: float | str, real: float, c: float) -> MaskAnalysis:
    """Theorems M.1–M.6 for the constant ``requested`` (real value ``real``) stored as ``c``,
    one step of :mod:`mhanum.bounds.masking_steps` each."""
    n, fs, kind = setting.n_keys, setting.softmax_format, setting.softmax
    stored = storage(setting, real, c)
    absorbed = absorption(setting, stored)
    leakage_ratio, leakage_exact = exact_leakage(setting, stored)
    leak = computed_leakage(setting, stored)
    # A filled row holds c everywhere: equal logits, whatever the scores were.
    equal = absorbed.absorbs or setting.mode == "fill"
    outcome, why = fully_masked(setting, stored, equal, leak.zero_below)
    notes = [*stored.notes, *absorbed.notes, *leak.notes, why]
    if n is not None and outcome == "uniform" and kind != "naive" and n > 2**fs.precision:
        notes.append(
            f"M.6: with {n} > 2^{fs.precision} keys a sum of ones in {fs.name} need not be exact "
            f"(a sequential sum stalls at 2^{fs.precision}): the probabilities are equal but may "
            "not sum to 1."
        )
    return MaskAnalysis(
        format=setting.fmt.name,
        softmax_format=fs.name,
        mode=setting.mode,
        softmax=kind,
        requested=requested,
        requested_value=real,
        stored_value=c,
        softmax_value=stored.c_s,
        score_bound=setting.score_bound,
        score_bound_in_format=stored.bf,
        n_keys=n,
        stored_overflow=stored.stored_overflow,
        softmax_overflow=stored.softmax_overflow,
        add_can_overflow=stored.add_can_overflow,
        overflows=stored.overflows,
        absorption_ulp=absorbed.ulp,
        absorption_radius=absorbed.radius,
        absorbs_scores=absorbed.absorbs,
        logit_error_bound=absorbed.err,
        masked_logit_max=stored.masked_max,
        leakage_ratio_exact=leakage_ratio,
        leakage_exact=leakage_exact,
        leakage_per_key=leak.per_key,
        leakage_bound=leak.bound,
        leakage_is_zero=leak.is_zero,
        exp_argument_max=leak.x_arg,
        exp_zero_below=leak.zero_below,
        fully_masked_row=outcome,
        notes=tuple(notes),
        assumptions=_ASSUMPTIONS,
    )


# Safe range and recommendation ---------------------------------------------------------------------


def safe_mask_range(
    fmt: Format | str,
    score_bound: float,
    leak_tol: float,
    *,
    mode: str = "fill",
    n_keys: int,
    softmax_format: Format | str | None = None,
    softmax: str = "safe",
    exp_ulps: float = 2.0,
    div_ulps: float = 1.0,
) -> MaskRange:
    """The interval of safe masking constants: papers/masking.md Theorem M.7.

    A value ``c`` of ``F`` is safe when it is finite in ``F`` and ``F_s``, ``fl_F(s + c)`` is
    finite (also in ``F_s``) for every score ``|s| <= B`` (whatever the ``mode``: a constant that
    is safe to add is safe to fill), and the computed leakage bound of Theorem M.5 (for ``mode``,
    ``softmax`` and ``n_keys``) is ``<= leak_tol``. Both conditions are monotone in ``c``
    (rounding is monotone), so the safe values form an interval ``[low, high]`` of ``F``, found by
    bisection over the ordered values of ``F``.

    Raises:
        InvalidArgument: as :func:`analyze_mask`, and for ``leak_tol`` outside ``[0, 1)``.
    """
    f = get_format(fmt)
    kind = _softmax_kind(softmax)
    m = _mode(mode)
    b = _score_bound(score_bound)
    tol = _leak_tol(leak_tol)
    n = _n_keys(n_keys, required=True)
    assert n is not None
    fs = _softmax_format(softmax_format, f)
    ke, kd = _ulps(exp_ulps, "exp_ulps"), _ulps(div_ulps, "div_ulps")
    setting = MaskSetting(f, fs, m, kind, b, n, ke, kd)
    bf = round_down(b, f)

    def finite_when_added(i: int) -> bool:
        c = from_ordinal(i, f)
        lo = fl_sum(c, -bf, f)
        return math.isfinite(lo) and math.isfinite(fl(lo, fs)) and math.isfinite(fl(c, fs))

    def leaks_little(i: int) -> bool:
        c = from_ordinal(i, f)
        a = _analyze(setting, c, c, c)
        return a.leakage_bound is not None and a.leakage_bound <= tol

    bottom = ordinal(-f.max_finite, f)
    # low: the smallest ordinal that stays finite (finite_when_added is false below, true above).
    lo, hi = bottom, 0
    if not finite_when_added(hi):
        return _empty(setting, tol, "no constant stays finite when a score is added")
    while lo < hi:
        mid = (lo + hi) // 2
        if finite_when_added(mid):
            hi = mid
        else:
            lo = mid + 1
    low_i = lo
    if not leaks_little(low_i):
        a = _analyze(setting, *(from_ordinal(low_i, f),) * 3)
        return _empty(
            setting, tol,
            f"even the most negative safe constant leaks up to {a.leakage_bound!r} > {tol!r}",
        )  # fmt: skip
    lo, hi = low_i, 0
    while lo < hi:  # largest ordinal that leaks little
        mid = (lo + hi + 1) // 2
        if leaks_little(mid):
            lo = mid
        else:
            hi = mid - 1
    low, high = from_ordinal(low_i, f), from_ordinal(lo, f)
    below = "no finite value lies" if low == -f.max_finite else f"fl(-{bf!r} + c) overflows to -inf"
    reason = (
        f"below {low!r}, {below}; above {high!r}, the leakage bound "
        f"(Theorem M.5, {n} keys, {kind} softmax in {fs.name}) exceeds {tol!r}"
    )
    return MaskRange(f.name, fs.name, m, b, tol, n, low, high, False, reason)


def _empty(setting: MaskSetting, tol: float, reason: str) -> MaskRange:
    """The empty range of Theorem M.7 (no constant is safe), and why."""
    f, fs, n = setting.fmt, setting.softmax_format, setting.n_keys
    assert n is not None
    return MaskRange(
        f.name, fs.name, setting.mode, setting.score_bound, tol, n, math.nan, math.nan, True, reason
    )


def recommend_mask_value(
    fmt: Format | str,
    score_bound: float,
    leak_tol: float,
    *,
    mode: str = "fill",
    n_keys: int,
    softmax_format: Format | str | None = None,
    softmax: str = "safe",
    exp_ulps: float = 2.0,
    div_ulps: float = 1.0,
) -> MaskRecommendation:
    """A safe constant (papers/masking.md Theorem M.7): a negative power of two, exactly representable in every
    binary format, near the geometric middle of the safe range, so that it is as far (in ratio)
    from overflowing as from leaking; the range's least negative end if no power of two fits.

    Raises:
        InvalidArgument: as :func:`safe_mask_range`, and when no constant is safe (``leak_tol``
            too small for ``n_keys`` and ``score_bound`` in the format).
    """
    r = safe_mask_range(
        fmt, score_bound, leak_tol, mode=mode, n_keys=n_keys, softmax_format=softmax_format,
        softmax=softmax, exp_ulps=exp_ulps, div_ulps=div_ulps,
    )  # fmt: skip
    if r.empty:
        msg = (
            f"leak_tol: expected a tolerance some finite constant of {r.format} meets with "
            f"score_bound {r.score_bound!r} and {r.n_keys} keys, got {leak_tol!r} ({r.reason})"
        )
        raise InvalidArgument(msg)
    f = get_format(fmt)
    # the geometric middle in log2 (the product of the ends overflows float64 for float64)
    k = round((math.log2(abs(r.low)) + math.log2(max(abs(r.high), f.smallest_subnormal))) / 2)
    near = (k, k - 1, k + 1, k - 2, k + 2)
    candidates = [-math.ldexp(1.0, j) for j in near if f.emin - f.precision < j <= f.emax]
    chosen = next((c for c in candidates if r.contains(c) and fl(c, f) == c), r.high)
    analysis = analyze_mask(
        f, chosen, r.mode, score_bound, n_keys=n_keys, softmax_format=softmax_format,
        softmax=softmax, exp_ulps=exp_ulps, div_ulps=div_ulps,
    )  # fmt: skip
    headroom = f.max_finite - abs(chosen)
    reason = (
        f"{chosen!r} is exactly representable in {f.name}; safe range [{r.low!r}, {r.high!r}]; "
        f"leakage bound {analysis.leakage_bound!r} <= {r.leak_tol!r}; adding any score up to "
        f"{headroom!r} in magnitude cannot overflow"
    )
    return MaskRecommendation(chosen, analysis, r, reason)
