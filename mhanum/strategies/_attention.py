"""Strategies for the inputs of one attention call, with the error-provoking and range structures."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from hypothesis import strategies as st

from mhanum.formats import Format, get_format, round_to
from mhanum.numerics import PRESETS, Numerics
from mhanum.strategies._common import (
    MIXES,
    RANGE_MIXES,
    RANGE_STRUCTURES,
    AttentionInputs,
    check_count,
    check_format,
    check_structure,
    fail,
)

if TYPE_CHECKING:
    from collections.abc import Iterable


_T = TypeVar("_T")

# attention inputs --------------------------------------------------------------------------------


def resolve_int(
    draw: st.DrawFn, value: int | st.SearchStrategy[int], name: str, minimum: int = 1
) -> int:
    return check_count(draw(value) if isinstance(value, st.SearchStrategy) else value, name,
                        minimum)  # fmt: skip


def attention_inputs(
    *,
    q_len: int | st.SearchStrategy[int],
    kv_len: int | st.SearchStrategy[int],
    d_k: int | st.SearchStrategy[int],
    d_v: int | st.SearchStrategy[int] | None = None,
    batch: int | st.SearchStrategy[int] = 1,
    heads: int | st.SearchStrategy[int] = 1,
    fmt: str | Format | st.SearchStrategy[str | Format] | None = None,
    structure: str | Iterable[str] | st.SearchStrategy[str | Iterable[str]] | None = None,
    accum: str | Format | st.SearchStrategy[str | Format] | None = None,
    scale: float | None = None,
    numerics: Numerics | str | st.SearchStrategy[Numerics | str] | None = None,
) -> st.SearchStrategy[AttentionInputs]:
    """Queries, keys and values of shape ``(batch, heads, length, width)`` with values in ``fmt``.

    The base values are standard normal times ``2^j`` (``j`` drawn in ``[-3, 3]`` per array,
    rounded into ``fmt``); the structures of :data:`STRUCTURES` and, on request,
    :data:`RANGE_STRUCTURES` are applied on top. Every value is finite and a value of ``fmt``.
    The logits are not limited: ``outliers`` and the range structures may make
    ``scale·|q|·|k|`` as large as the format allows, and the range structures aim at overflow on
    purpose (:func:`mhanum.bounds.attention_bound` answers ``inf`` with its reasons there).

    Args:
        q_len, kv_len, d_k: query length, key length and query/key width (values or strategies).
        d_v: value width (default ``d_k``).
        batch, heads: leading dimensions (default 1 each).
        fmt: the format of the values (a name, a :class:`~mhanum.formats.Format`, or a strategy
            such as :func:`formats`; default: ``numerics``'s input format, else ``float32``).
        structure: ``None`` (default) mixes in no structure, one, or a pair of
            :data:`STRUCTURES`, uniformly; ``"plain"`` or ``()`` for none; ``"range"`` for one
            or a pair of :data:`RANGE_STRUCTURES`; a name or names for exactly those (``"range"``
            among them adds a drawn range mix); or a strategy of these.
        accum: the accumulation format, where ``absorption`` places its small addends (default:
            ``numerics``'s, else ``fmt``).
        scale: the logit scale the structures aim at (default ``1/sqrt(d_k)``); reported as
            :attr:`AttentionInputs.scale` (``scale_range`` draws its own).
        numerics: the :class:`~mhanum.Numerics` (or preset name, or a strategy such as
            :func:`numerics`) whose formats the range structures aim at; reported as
            :attr:`AttentionInputs.numerics`.

    Raises:
        InvalidArgument: for a non-positive size, an unknown format, structure name or preset.
    """
    sizes = {"q_len": q_len, "kv_len": kv_len, "d_k": d_k, "batch": batch, "heads": heads}
    if d_v is not None:
        sizes["d_v"] = d_v
    for name, value in sizes.items():
        if not isinstance(value, st.SearchStrategy):
            check_count(value, name)
    for given, name in ((fmt, "fmt"), (accum, "accum")):
        if given is not None and not isinstance(given, st.SearchStrategy):
            check_format(given, name)
    if not isinstance(structure, st.SearchStrategy):
        check_structure(structure)
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
    ):
        fail("scale", "a positive finite number or None", scale)
    if numerics is not None and not isinstance(numerics, st.SearchStrategy):
        _check_numerics(numerics)
    return _attention_inputs(sizes, fmt, structure, accum, scale, numerics)


def _check_numerics(value: object) -> Numerics:
    if isinstance(value, str):
        if value not in PRESETS:
            fail("numerics", f"a Numerics or a preset name from {tuple(PRESETS)}", value)
        return PRESETS[value]
    if not isinstance(value, Numerics):
        fail("numerics", "a Numerics, a preset name or a strategy of them", value)
    return value


@st.composite
def _attention_inputs(
    draw: st.DrawFn,
    sizes: dict[str, Any],
    fmt: str | Format | st.SearchStrategy[str | Format] | None,
    structure: str | Iterable[str] | st.SearchStrategy[str | Iterable[str]] | None,
    accum: str | Format | st.SearchStrategy[str | Format] | None,
    scale: float | None,
    numerics: Numerics | str | st.SearchStrategy[Numerics | str] | None,
) -> AttentionInputs:
    def value(x: _T | st.SearchStrategy[_T]) -> _T:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    num = None if numerics is None else _check_numerics(value(numerics))
    n = {name: resolve_int(draw, size, name) for name, size in sizes.items()}
    n.setdefault("d_v", n["d_k"])
    if fmt is None:
        fmt = "float32" if num is None else num.input
    f = check_format(value(fmt), "fmt")
    if accum is None and num is not None:
        accum = num.accum
    a = f if accum is None else check_format(value(accum), "accum")
    chosen = check_structure(value(structure))
    if chosen is None:
        chosen = draw(st.sampled_from(MIXES))
    if "range" in chosen:
        chosen = (chosen - {"range"}) | draw(st.sampled_from(RANGE_MIXES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lead = (n["batch"], n["heads"])
    q, k, v = (
        rng.standard_normal((*lead, rows, width)) * 2.0 ** draw(st.integers(-3, 3))
        for rows, width in (
            (n["q_len"], n["d_k"]),
            (n["kv_len"], n["d_k"]),
            (n["kv_len"], n["d_v"]),
        )
    )
    c = 1.0 / math.sqrt(n["d_k"]) if scale is None else float(scale)
    q, k, v = _structured(draw, chosen, q, k, v, f, a, c)
    x = AttentionInputs(q, k, v, f.name, chosen, scale=scale, numerics=num)
    if chosen & set(RANGE_STRUCTURES):
        x = _ranged(draw, x, _Limits.of(num, f, a), c)
    return x


def _structured(
    draw: st.DrawFn,
    chosen: frozenset[str],
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    f: Format,
    a: Format,
    c: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Apply the chosen structures in a fixed order (scales first, exact patterns last)."""
    n_keys, d_v = k.shape[-2], v.shape[-1]
    if "outliers" in chosen:
        j = draw(st.integers(2, 12))
        which = draw(st.sampled_from(("q", "k", "v", "qk")))
        chan = draw(st.integers(0, (v if which == "v" else q).shape[-1] - 1))
        if "q" in which:
            q[..., chan] *= 2.0**j
        if "k" in which:
            k[..., chan] *= 2.0**j
        if which == "v":
            v[..., chan] *= 2.0**j
    if "long_rows" in chosen:
        q *= 2.0 ** -draw(st.integers(4, 30))
    if "ties" in chosen:
        copies = draw(st.integers(1, n_keys))
        k[..., :copies, :] = k[..., :1, :]
        if draw(st.booleans()):
            # the tied keys dominate: the others point the other way, q along the tie
            k[..., copies:, :] = -k[..., :1, :]
            q[...] = k[..., :1, :] * 2.0 ** draw(st.integers(-6, 2))
        zero_rows = draw(st.integers(0, q.shape[-2]))
        q[..., :zero_rows, :] = 0.0
    if "near_ties" in chosen:
        k = round_to(k, f)
        ulps = draw(st.integers(1, 4))
        spacing = np.abs(k[..., :1, :]) * 2.0 ** (1 - f.precision)
        signs = np.sign(np.random.default_rng(ulps).standard_normal(k.shape))
        k = k[..., :1, :] + ulps * spacing * signs
    if "large_logits" in chosen:
        target = 2.0 ** draw(st.integers(0, 11))
        top = c * float(np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2), initial=0.0))
        if top > 2.0**-500:
            factor = math.sqrt(target / top)
            q, k = q * factor, k * factor
    if "cancellation" in chosen:
        col = draw(st.integers(0, d_v - 1))
        big = 2.0 ** draw(st.integers(0, 12))
        signs = np.where(np.arange(n_keys) % 2 == 0, 1.0, -1.0)
        v[..., col] = big * signs + v[..., col] * 2.0 ** -draw(st.integers(0, 20))
    if "absorption" in chosen:
        col = draw(st.integers(0, d_v - 1))
        offset = draw(st.integers(-1, 2))
        small = 2.0 ** -(a.precision + offset)
        v[..., col] = small
        v[..., 0, col] = 1.0
        if draw(st.booleans()):  # equal weights: every small addend meets the large one alike
            q[..., : draw(st.integers(1, q.shape[-2])), :] = 0.0
    if "overflow" in chosen:
        top = float(np.max(np.abs(v), initial=0.0)) or 1.0
        # |v| <= top <= 2^e, so |v|·2^(emax - e) <= 2^emax <= the largest finite value
        v = np.ldexp(v, f.emax - math.frexp(top)[1] - draw(st.integers(0, 8)))
    if "underflow" in chosen:
        top = float(np.max(np.abs(v), initial=0.0)) or 1.0
        v = np.ldexp(v, f.emin - math.frexp(top)[1] + draw(st.integers(-3, 8)))
    return tuple(into(x, f) for x in (q, k, v))  # type: ignore[return-value]


# range structures --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Limits:
    """The formats the range structures aim at."""

    value: Format  # the values' format (fmt)
    accum: Format
    score: Format
    softmax: Format
    scale: Format  # the format the scale constant is rounded into
    placement: str
    others: tuple[Format, ...]  # probabilities, output, dot operands

    @classmethod
    def of(cls, num: Numerics | None, f: Format, a: Format) -> _Limits:
        if num is None:
            store = get_format(f.storage)
            return cls(f, a, store, a, store, "scores", ())
        extra = (num.format_of("prob"), num.format_of("output"), num.operand_rounding)
        placement = num.scale
        scale = num.format_of("score" if placement == "scores" else "scale")
        return cls(f, num.format_of("accum"), num.format_of("score"), num.format_of("softmax"),
                   scale, placement, tuple(x for x in extra if x is not None))  # fmt: skip

    @property
    def all(self) -> tuple[Format, ...]:
        return (self.value, self.accum, self.score, self.softmax, self.scale, *self.others)


def _max_dot(q: np.ndarray, k: np.ndarray) -> float:
    """``max |q|·|k|ᵀ`` (inf if it overflows float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        top = float(np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2), initial=0.0))
    return top if not math.isnan(top) else math.inf


def _rescale_to(x: np.ndarray, target: float, exact: bool = False) -> np.ndarray:
    """``x`` scaled so that ``max |x| = target`` (ones if ``x`` is zero); with ``exact`` its
    largest entry set to exactly ``±target``."""
    top = float(np.max(np.abs(x), initial=0.0))
    y = np.full_like(x, target) if top == 0 or not math.isfinite(top) else x / top * target
    if exact:
        i = np.unravel_index(int(np.argmax(np.abs(y))), y.shape)
        y[i] = math.copysign(target, y[i])
    return y


def _dots_to(q: np.ndarray, k: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
    """``q`` and ``k`` scaled alike so that ``max |q|·|k|ᵀ`` is about ``target``."""
    top = _max_dot(q, k)
    if not 0 < top < math.inf:
        return q, k
    factor = math.sqrt(target) / math.sqrt(top)
    return (q * factor, k * factor) if math.isfinite(factor) else (q, k)


def _edges(lo: int, hi: int, *inner: int) -> st.SearchStrategy[int]:
    """An exponent in ``[lo, hi]``: the edges named (and the ends) often, any one otherwise."""
    named = sorted({min(max(e, lo), hi) for e in (lo, hi, *inner)})
    return st.one_of(st.sampled_from(named), st.integers(lo, hi))


def _ranged(draw: st.DrawFn, x: AttentionInputs, lim: _Limits, c: float) -> AttentionInputs:
    """Apply the chosen range structures: values first, then the scale, the logits, the bias.

    Values that leave float64 on the way are clipped into the format (NaN, from ``0·inf``,
    becomes 0).
    """
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        return _ranged_unchecked(draw, x, lim, c)


def _finite_into(x: np.ndarray, f: Format) -> np.ndarray:
    return into(np.nan_to_num(x, nan=0.0, posinf=f.max_finite, neginf=-f.max_finite), f)


def _ranged_unchecked(
    draw: st.DrawFn, x: AttentionInputs, lim: _Limits, c: float
) -> AttentionInputs:
    chosen, f = x.structure, lim.value
    q, k, v = (np.array(a, np.float64) for a in x.arrays)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = {"q": q, "k": k, "v": v}
    scale, bias = x.scale, None
    if "near_max" in chosen:
        top = draw(
            st.sampled_from(sorted({g.max_finite for g in lim.all if g.max_finite <= f.max_finite}))
        )
        which = draw(st.sampled_from(("q", "k", "v", "qk", "qkv")))
        j, exact = draw(st.integers(0, 3)), draw(st.booleans())
        for name in which:
            arrays[name] = _rescale_to(arrays[name], top * 2.0**-j, exact)
    if "near_sqrt_max" in chosen:
        top = draw(st.sampled_from(sorted({g.max_finite for g in lim.all})))
        part = draw(st.sampled_from(("qk", "v", "qkv")))
        target = top * 2.0 ** -draw(st.integers(-1, 3))
        if "qk" in part:
            logits = draw(st.booleans())  # aim the scaled logits rather than the raw products
            aim = target / c if logits else target
            arrays["q"], arrays["k"] = _dots_to(arrays["q"], arrays["k"], aim)
        if "v" in part:
            col = float(np.max(np.abs(arrays["v"]).sum(axis=-2), initial=0.0))
            if 0 < col < math.inf:
                arrays["v"] = arrays["v"] * (target / col)
    if "near_min_normal" in chosen:
        tiny = draw(st.sampled_from(sorted({g.smallest_normal for g in lim.all
                                            if g.smallest_normal >= f.smallest_subnormal})))  # fmt: skip
        part = draw(st.sampled_from(("q", "k", "v", "qk", "qkv", "products")))
        target = tiny * 2.0 ** draw(st.integers(-3, 6))
        if part == "products":
            arrays["q"], arrays["k"] = _dots_to(arrays["q"], arrays["k"], target)
        else:
            for name in part:
                arrays[name] = _rescale_to(arrays[name], target)
    if "subnormal" in chosen:
        part = draw(st.sampled_from(("q", "k", "v", "qkv")))
        share = draw(st.sampled_from((0.25, 0.5, 1.0)))
        steps = 2 ** (f.precision - 1)
        for name in part:
            a = arrays[name]
            sub = rng.integers(1, steps, a.shape) * f.smallest_subnormal
            sub *= np.where(rng.random(a.shape) < 0.5, -1.0, 1.0)
            chosen_entries = rng.random(a.shape) < share
            chosen_entries.flat[int(rng.integers(a.size))] = True  # at least one
            arrays[name] = np.where(chosen_entries, sub, a)
    q, k, v = (_finite_into(arrays[name], f) for name in "qkv")
    if "scale_range" in chosen:
        scale, q, k = _scale_range(draw, lim, q, k)
        c = scale
    if "softmax_sum" in chosen:
        q, k, bias = _softmax_sum(draw, rng, lim, q, k, c)
    if "bias_range" in chosen:
        bias = _bias_range(draw, rng, lim, (*q.shape[:-1], k.shape[-2]), bias)
    q, k, v = (_finite_into(a, f) for a in (q, k, v))
    return dataclasses.replace(x, q=q, k=k, v=v, scale=scale, bias=bias)


def _scale_range(
    draw: st.DrawFn, lim: _Limits, q: np.ndarray, k: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """A scale across the exponent range of the format it is rounded into; q, k sometimes
    rescaled so that the logits hit a drawn power of two."""
    g = lim.scale
    p = g.precision
    # from below the smallest subnormal to above the largest finite value of the format
    e = draw(_edges(max(g.emin - p, -1074), min(g.emax + 1, 1023), g.emin - p + 1, g.emin - 1,
                    g.emin, 0, g.emax))  # fmt: skip
    mant = draw(st.sampled_from((1.0, 1.5, 1 + 2.0**-p, 2 - 2.0**-p, 2 - 2.0 ** (1 - p), 1.2345)))
    try:
        factor = math.ldexp(mant, e)
    except OverflowError:  # 2 - 2^-53 is 2 in float64
        factor = math.inf
    # with the scale on q and k, sqrt(scale) is what is rounded into the format
    scale = factor * factor if lim.placement == "qk" else factor
    if not 0 < scale < math.inf:
        scale = 2.0**-1074 if scale == 0 else sys.float_info.max
    if lim.placement != "qk":  # negative and zero scales (sqrt(scale) needs scale >= 0)
        scale *= draw(st.sampled_from((1.0, 1.0, 1.0, -1.0, 0.0)))
    if draw(st.booleans()):
        target = 2.0 ** draw(st.integers(-8, 12))
        top = _max_dot(q, k)
        if 0 < top < math.inf and scale != 0:
            ratio = target / top / abs(scale)
            if 0 < ratio < math.inf:
                factor = math.sqrt(ratio)
                q, k = q * factor, k * factor
    return scale, q, k


def _softmax_sum(
    draw: st.DrawFn, rng: np.random.Generator, lim: _Limits, q: np.ndarray, k: np.ndarray, c: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``m`` keys per row at the logit ``log(L/m) + δ``, the others below (see
    :data:`RANGE_STRUCTURES`), through q and k along one channel, or a bias with zero queries."""
    m_fmt, f = lim.softmax, lim.value
    n = k.shape[-2]
    ties = draw(st.integers(1, n))
    if draw(st.booleans()):
        limit = m_fmt.max_finite
    else:  # where the reciprocal of the row sum flushes to zero in its carrier
        limit = 2.0**1022 if m_fmt.name == "float64" else 2.0**126
    offset = draw(st.sampled_from((-1.0, -0.1, -0.01, -0.001, 0.0, 0.001, 0.01, 0.1, 1.0)))
    top = math.log(limit / ties) + offset
    logits = np.full(n, top)
    logits[ties:] = top - 2.0 ** rng.uniform(-2, 6, n - ties)
    rng.shuffle(logits)
    if draw(st.booleans()) or c == 0:  # through a bias (the only way with a zero scale)
        bias = np.broadcast_to(logits, (*q.shape[:-1], n)).copy()
        return np.zeros_like(q), k, bias
    q, k = np.zeros_like(q), np.zeros_like(k)
    a = min(math.sqrt(abs(top) / abs(c)) if abs(top) > 0 else 1.0, f.max_finite / 2)
    q[..., 0] = a
    k[..., 0] = logits / (c * a)  # c·q·k = the logits, whatever the sign of c
    return q, k, None


def _bias_range(
    draw: st.DrawFn,
    rng: np.random.Generator,
    lim: _Limits,
    shape: tuple[int, ...],
    bias: np.ndarray | None,
) -> np.ndarray:
    """A bias across the score format's exponent range (added to ``bias``), within its range."""
    g = lim.score
    lo = max(g.emin - g.precision, -1074)
    kind = draw(st.sampled_from(("spread", "near_max", "constant", "negative")))
    signs = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if kind == "spread":
        top = draw(_edges(lo, g.emax, g.emin, 0, g.emax - 1))
        exps = rng.integers(lo, top + 1, shape)
        new = signs * np.ldexp(1 + rng.random(shape), exps)
    elif kind == "near_max":
        near = g.max_finite * (1 - rng.random(shape) * 2.0 ** -draw(st.integers(0, g.precision)))
        new = np.where(rng.random(shape) < draw(st.sampled_from((0.1, 0.5, 1.0))), signs * near,
                       rng.standard_normal(shape))  # fmt: skip
        if draw(st.booleans()):
            new.flat[0] = math.copysign(g.max_finite, new.flat[0])
    elif kind == "constant":
        new = np.full(shape, signs.flat[0] * g.max_finite * 2.0 ** -draw(_edges(0, g.emax, 1)))
    else:  # large negative entries: a finite mask through the bias
        share = draw(st.sampled_from((0.25, 0.5, 0.9)))
        new = np.where(rng.random(shape) < share, -g.max_finite * rng.uniform(0.5, 1, shape), 0.0)
    total = new if bias is None else bias + new
    return np.clip(np.nan_to_num(total, nan=0.0), -g.max_finite, g.max_finite)


def into(x: np.ndarray, f: Format) -> np.ndarray:
    """``x`` rounded into ``f``, finite values clipped to the largest finite one first."""
    return round_to(np.clip(x, -f.max_finite, f.max_finite), f)
