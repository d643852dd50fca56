"""Hypothesis strategies for attention numerics, in the style of ``hypothesis.extra.numpy``.

Every function is keyword-only, named for what its strategy produces, accepts values *or*
strategies for its arguments, and rejects a bad value with
:class:`hypothesis.errors.InvalidArgument` when it is called (a bad value drawn from a strategy
argument raises the same error when it is drawn).

* :func:`formats` — :class:`~mhanum.formats.Format` objects;
* :func:`numerics` — :class:`~mhanum.Numerics`, presets, free combinations and (on request)
  custom numerics that set every field;
* :func:`attention_inputs` — :class:`AttentionInputs` ``(q, k, v)`` whose values lie in a format,
  with error-provoking structure (:data:`STRUCTURES`) on request and mixed in by default, and
  structures at the edges of every format's range (:data:`RANGE_STRUCTURES`, with a scale and a
  bias) on request;
* :func:`masks` — boolean masks (True = attend): padding, causal, random, fully-masked rows on
  request;
* :func:`mha_inputs` — :class:`MHAInputs` ``(x_q, x_kv)`` for multi-head attention, with
  the token-level structures of :data:`MHA_STRUCTURES`;
* :func:`perturbed_inputs` — a real layer's input perturbed (:data:`PERTURBATIONS`), as
  :class:`MHAInputs` for self-attention;
* :func:`mha_params` — :class:`~mhanum.MHAParams` with values in a format.

The arrays are built by numpy from a drawn seed and a few drawn *structure parameters*
(exponents, positions, counts), so Hypothesis's targeting and shrinking act on the parameters that
matter (how large the logits are, how many keys tie, where the small addends sit) rather than on
thousands of independent floats. :mod:`mhanum.search` drives these strategies with
``hypothesis.target``.

Examples:
    >>> from hypothesis import given
    >>> from mhanum import strategies as mst
    >>> @given(mst.attention_inputs(q_len=2, kv_len=4, d_k=3, d_v=2, fmt="bfloat16"))
    ... def test_shapes(x):
    ...     assert x.q.shape == (1, 1, 2, 3) and x.v.shape == (1, 1, 4, 2)
    >>> test_shapes()
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from mhanum._errors import InvalidArgument as _MhanumInvalid
from mhanum.formats import FORMATS, Format, get_format, round_to
from mhanum.masks import Band
from mhanum.numerics import PRESETS, Numerics
from mhanum.params import MHAParams
from mhanum.units import (
    ACCUM_FORMATS,
    Blocked,
    Kahan,
    Naive,
    Native,
    Online,
    Pairwise,
    Safe,
    Sequential,
    SplitBF16,
    TensorCoreDot,
)
from mhanum.units.tensorcore import MODELS

__all__ = [
    "MASK_KINDS",
    "MHA_STRUCTURES",
    "PERTURBATIONS",
    "RANGE_STRUCTURES",
    "STRUCTURES",
    "AttentionInputs",
    "MHAInputs",
    "attention_inputs",
    "bands",
    "formats",
    "masks",
    "mha_inputs",
    "mha_mixes",
    "mha_params",
    "numerics",
    "perturbed_inputs",
]

STRUCTURES = (
    "large_logits",
    "ties",
    "near_ties",
    "cancellation",
    "outliers",
    "absorption",
    "overflow",
    "underflow",
    "long_rows",
)
"""Error-provoking structures of :func:`attention_inputs`:

* ``large_logits``: q and k scaled so that ``scale·|q|·|k|`` reaches ``2^j`` (``j`` up to 11);
* ``ties``: some keys copies of one key, and some query rows zero (every score of the row ties);
* ``near_ties``: keys a few units in the last place away from one key;
* ``cancellation``: a value column of large alternating-sign entries plus small noise, so
  ``P V`` cancels;
* ``outliers``: a few channels of q, k or v scaled by a large power of two;
* ``absorption``: a value column with one large entry first and every other entry at or just
  below half an ulp of it in the accumulation format (the worst case of sequential summation),
  optionally with some query rows zero so that the weights are equal;
* ``overflow``: v scaled to within a few binades of the format's largest finite value;
* ``underflow``: v scaled to within a few binades of the smallest normal (subnormals included);
* ``long_rows``: q scaled towards zero, so every key of a row carries weight and every sum runs
  over the whole row.
"""

_MIXES = (
    frozenset(),
    *(frozenset({a}) for a in STRUCTURES),
    *(frozenset(pair) for pair in itertools.combinations(STRUCTURES, 2)),
)
"""The default mixture: no structure, each one alone, and each pair (drawn uniformly)."""


def default_mixes() -> tuple[frozenset[str], ...]:
    """The structure sets mixed in by default: none, each structure alone, and each pair."""
    return _MIXES


RANGE_STRUCTURES = (
    "near_max",
    "near_sqrt_max",
    "near_min_normal",
    "subnormal",
    "scale_range",
    "bias_range",
    "softmax_sum",
)
"""Structures at the edges of the formats' ranges, on request only (``structure="range"`` draws
one of them or a pair). They aim at the formats of the numerics passed to
:func:`attention_inputs` (input, accumulation, score, softmax, scale, probability, output and
operand formats; without ``numerics``: ``fmt`` and ``accum``):

* ``near_max``: q, k or v (or several) scaled to within a few binades of the largest finite value
  of one of those formats no larger than ``fmt``'s, sometimes with one entry exactly there;
* ``near_sqrt_max``: q and k scaled so that ``max |q|·|k|`` (or the scaled logits) reaches about
  the largest finite value of one of the formats, and/or v so that its column sums ``Σ_j |v_j|``
  (the unnormalised ``P V`` sums) do;
* ``near_min_normal``: q, k or v (or the products ``|q|·|k|``) scaled to within a few binades of
  the smallest normal number of one of the formats;
* ``subnormal``: a fraction of the entries of q, k or v replaced by subnormal numbers of ``fmt``;
* ``scale_range``: a scale ``±m·2^e`` (or zero) with ``e`` anywhere in the exponent range of the
  format it is rounded into (the score format, or the scale format with the scale on q or q and
  k; on q and k the scale is ``(m·2^e)^2``, never negative), subnormal and overflowing ones
  included; sometimes q and k are rescaled so that ``|scale|·|q|·|k|`` hits a drawn ``2^t`` (a
  tiny scale then comes with large ``q·k``);
* ``bias_range``: an additive bias with entries across the score format's exponent range, near its
  largest finite value, one large constant, or large negative entries (a finite mask);
* ``softmax_sum``: ``m`` keys of every row share the logit ``log(L/m) + δ`` (through q and k, or a
  bias with zero queries), the others lie below, so that ``Σ exp`` of a naive softmax approaches
  ``L``: the softmax format's largest finite value, or ``2^126`` (``2^1022`` for float64) where
  the reciprocal of the row sum flushes to zero.
"""

_RANGE_MIXES = (
    *(frozenset({a}) for a in RANGE_STRUCTURES),
    *(frozenset(pair) for pair in itertools.combinations(RANGE_STRUCTURES, 2)),
)


def range_mixes() -> tuple[frozenset[str], ...]:
    """The structure sets ``structure="range"`` draws from: each range structure, and each pair."""
    return _RANGE_MIXES


MASK_KINDS = ("none", "padding", "causal", "random", "band")
"""Kinds of :func:`masks`."""

_SUMMATIONS = (Native(), Sequential(), Pairwise(), Kahan(), Blocked(8), Blocked(32))
_SOFTMAXES = (Naive(), Safe(), Online(8), Online(32))
_ACCUMS = ACCUM_FORMATS


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Queries, keys and values drawn by :func:`attention_inputs`.

    Attributes:
        q: ``(batch, heads, q_len, d_k)`` float64 array whose values lie in ``fmt``.
        k: ``(batch, heads, kv_len, d_k)``, likewise.
        v: ``(batch, heads, kv_len, d_v)``, likewise.
        fmt: name of the format the values lie in.
        structure: the structures applied (a subset of :data:`STRUCTURES` and
            :data:`RANGE_STRUCTURES`).
        scale: the logit scale to pass to the attention (``scale_range``: any sign, or zero; or
            the ``scale`` asked for), or ``None`` for the default ``1/sqrt(d_k)``.
        bias: an additive bias ``(batch, heads, q_len, kv_len)`` to pass with the inputs
            (``bias_range``, ``softmax_sum``), or ``None``.
        numerics: the numerics the range structures aimed at (the ``numerics`` argument, drawn
            if it was a strategy), or ``None``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    fmt: str
    structure: frozenset[str]
    scale: float | None = None
    bias: np.ndarray | None = dataclasses.field(default=None, repr=False)
    numerics: Numerics | None = None

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q, k, v)``."""
        return self.q, self.k, self.v


# Validation --------------------------------------------------------------------------------------


def _fail(name: str, expected: str, got: Any) -> NoReturn:
    msg = f"{name}: expected {expected}, got {got!r}"
    raise InvalidArgument(msg)


def _check_count(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        _fail(name, f"an integer >= {minimum}", value)
    return int(value)


def _check_format(value: Any, name: str) -> Format:
    try:
        return get_format(value, argname=name)
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


_KNOWN = (*STRUCTURES, *RANGE_STRUCTURES)


def _check_structure(value: Any) -> frozenset[str] | None:
    """The named structures (``"range"`` kept as a marker for a drawn range mix), or ``None``."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        _fail("structure", f"None, a name or names from {_KNOWN}", value)
    names = tuple(names)
    unknown = [n for n in names if n not in _KNOWN and n not in ("plain", "range")]
    if unknown:
        _fail("structure", f"names from {_KNOWN} (or 'plain', 'range')", unknown)
    return frozenset(n for n in names if n != "plain")


def _lazy(value: Any, check: Any) -> st.SearchStrategy[Any]:
    """A strategy of checked values: a value is checked now, a strategy's draws when drawn."""
    if isinstance(value, st.SearchStrategy):
        return value.map(check)
    return st.just(check(value))


# formats / numerics ------------------------------------------------------------------------------


def formats(
    *, names: Iterable[str] | None = None, min_precision: int = 1, max_precision: int = 53
) -> st.SearchStrategy[Format]:
    """Floating-point formats known to mhanum.

    Args:
        names: the formats to draw from (default: all of :data:`mhanum.formats.FORMATS`).
        min_precision, max_precision: keep formats whose precision ``p`` lies in this range.

    Raises:
        InvalidArgument: for an unknown name, or a range no format falls in.
    """
    pool = [_check_format(n, "names") for n in (FORMATS if names is None else names)]
    lo = _check_count(min_precision, "min_precision")
    hi = _check_count(max_precision, "max_precision")
    chosen = [f for f in pool if lo <= f.precision <= hi]
    if not chosen:
        _fail("min_precision/max_precision", "a range holding some format", (lo, hi))
    return st.sampled_from(chosen)


def _field(value: Any, choices: Iterable[Any]) -> st.SearchStrategy[Any]:
    if value is None:
        return st.sampled_from(tuple(choices))
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(value)


def numerics(
    *,
    presets: bool | Iterable[str] = True,
    free: bool = True,
    input: Any = None,
    accum: Any = None,
    summation: Any = None,
    softmax: Any = None,
    bounded: bool = False,
    custom: bool = False,
    scale: Any = None,
    exp_form: Any = None,
    online_sums: Any = None,
    kv_splits: Any = None,
) -> st.SearchStrategy[Numerics]:
    """:class:`~mhanum.Numerics`: named presets, free combinations and custom numerics.

    Args:
        presets: ``True`` for every preset of :data:`mhanum.PRESETS`, a list of names, or
            ``False`` for none.
        free: whether to draw free combinations of ``input``, ``accum``, ``summation`` and
            ``softmax`` as well.
        input, accum, summation, softmax: values or strategies for the free and custom
            combinations (default: every format, order and algorithm; an ``accum`` less precise
            than ``input`` is replaced by the least precise accumulation format at least as
            precise).
        bounded: keep only numerics in the scope of :func:`mhanum.bounds.attention_bound` (a
            score format no wider than the softmax format; for the online softmax, an
            accumulation format no wider than the softmax format). Custom numerics are drawn
            within it rather than filtered.
        custom: whether to draw custom numerics as well: every field drawn, fp8 and tf32 formats
            included, stage formats narrower than the one before them (a float16 score format
            after float32 accumulation, a bfloat16 scale format with float32 inputs, bfloat16
            inputs accumulated in float16, fp8 score or output formats), every dot unit and
            tensor-core model, every scale placement, ``fill`` and ``add`` masks with infinite or
            finite constants (one the score format represents or rounds to ``-inf``).
        scale: the scale placement of custom numerics (``"scores"``, ``"q"``, ``"qk"``, or a
            strategy; default: all three).
        exp_form: the exponential of custom numerics (``"exp"``, ``"exp2"``, ``"exp2-folded"``,
            ``"exp2-scaled"`` or a strategy; default ``"exp"``). Every exp2 form brings ``-inf``
            masking and the safe or online softmax; the folding ones also bring the scale on
            the scores and take no bias: draw inputs without ``bias_range`` and
            ``softmax_sum`` for them.
        online_sums: how custom numerics carry the online softmax's sums (``"block"``,
            ``"running"`` or a strategy; default ``"block"``). ``"running"`` brings the online
            softmax, the native or sequential order and no split dot with it.
        kv_splits: split-KV for every drawn numerics (an integer >= 1 or a strategy of them;
            default: none).

    Raises:
        InvalidArgument: for an unknown preset, neither presets nor free nor custom combinations,
            or a field value ``Numerics`` rejects.
    """
    if presets is True:
        names: tuple[str, ...] = tuple(PRESETS)
    elif presets is False:
        names = ()
    elif isinstance(presets, str) or not isinstance(presets, Iterable):
        _fail("presets", "True, False or a list of preset names", presets)
    else:
        names = tuple(presets)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            _fail("presets", f"names from {tuple(PRESETS)}", unknown)
    for flag, name in ((free, "free"), (bounded, "bounded"), (custom, "custom")):
        if not isinstance(flag, bool):
            _fail(name, "a bool", flag)
    if not names and not free and not custom:
        _fail("presets/free/custom", "presets, free or custom combinations",
              (presets, free, custom))  # fmt: skip
    for value, name in ((input, "input"), (accum, "accum")):
        if value is not None and not isinstance(value, st.SearchStrategy):
            _check_format(value, name)
    for value, name in (
        (summation, "summation"),
        (softmax, "softmax"),
        (scale, "scale"),
        (exp_form, "exp_form"),
        (kv_splits, "kv_splits"),
    ):
        if value is not None and not isinstance(value, st.SearchStrategy):
            try:
                Numerics(**{name: value})
            except _MhanumInvalid as exc:
                raise InvalidArgument(str(exc)) from None
    choices: list[st.SearchStrategy[Numerics]] = []
    if names:
        choices.append(st.sampled_from([PRESETS[n] for n in names]))
    if free:
        choices.append(
            _free_numerics(
                _field(input, ACCUM_FORMATS),
                _field(accum, _ACCUMS),
                _field(summation, _SUMMATIONS),
                _field(softmax, _SOFTMAXES),
            )
        )
    if custom:
        fields = {"input": input, "accum": accum, "summation": summation, "softmax": softmax,
                  "scale": scale, "exp_form": exp_form, "online_sums": online_sums}  # fmt: skip
        choices.append(_custom_numerics(fields, bounded))
    strategy = st.one_of(*choices)
    if kv_splits is not None:
        strategy = _split(strategy, _field(kv_splits, ()))
    return strategy.filter(_bounded) if bounded else strategy


@st.composite
def _split(draw: Any, numerics: st.SearchStrategy[Numerics], splits: Any) -> Numerics:
    num = draw(numerics)
    count = draw(splits)
    try:
        return num.replace(kv_splits=count)
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


@st.composite
def _free_numerics(
    draw: Any,
    input: st.SearchStrategy[Any],
    accum: st.SearchStrategy[Any],
    summation: st.SearchStrategy[Any],
    softmax: st.SearchStrategy[Any],
) -> Numerics:
    fin = _check_format(draw(input), "input")
    acc = _check_format(draw(accum), "accum")
    if acc.precision < fin.precision:  # the least precise accumulation format that fits
        wide = [get_format(a) for a in _ACCUMS if get_format(a).precision >= fin.precision]
        acc = min(wide, key=lambda f: f.precision)
    try:
        return Numerics(input=fin.name, accum=acc.name, summation=draw(summation),
                        softmax=draw(softmax))  # fmt: skip
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


_CUSTOM_FORMATS = ("float64", "float32", "tf32", "bfloat16", "float16", "float8_e4m3fn",
                   "float8_e5m2")  # fmt: skip
_CUSTOM_SUMMATIONS = (*_SUMMATIONS, Blocked(3))
_CUSTOM_SOFTMAXES = (Naive(), Safe(), Online(1), Online(3), Online(8), Online(32))
_OPERAND_FORMATS = ("tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_DOTS = (SplitBF16(1), SplitBF16(3), SplitBF16(6), *(TensorCoreDot(m) for m in MODELS))
_MASK_VALUES: tuple[float | str, ...] = (-math.inf, "finfo.min", "0.7*finfo.min", -1e9, -1e4,
                                          -30.0, 0.0)  # fmt: skip


def _least_accum(*needs: Format) -> str:
    """The least precise accumulation format at least as precise as every one of ``needs``."""
    p = max(f.precision for f in needs)
    return min((get_format(a) for a in _ACCUMS if get_format(a).precision >= p),
               key=lambda f: f.precision).name  # fmt: skip


@st.composite
def _custom_numerics(draw: Any, fields: dict[str, Any], bounded: bool) -> Numerics:
    def pick(name: str, choices: tuple[Any, ...]) -> Any:
        value = fields.get(name)
        if value is None:
            return draw(st.sampled_from(choices))
        return draw(value) if isinstance(value, st.SearchStrategy) else value

    def maybe(choices: tuple[str, ...]) -> str | None:
        return draw(st.one_of(st.none(), st.sampled_from(choices)))

    fin = _check_format(pick("input", _CUSTOM_FORMATS), "input")
    dot = draw(st.sampled_from(_DOTS)) if draw(st.integers(0, 3)) == 0 else "ieee"
    if fin.precision > 24:
        dot = "ieee"
    operand = maybe(_OPERAND_FORMATS) if dot == "ieee" else None
    acc = _check_format(pick("accum", _ACCUMS), "accum")
    needs = [fin] + ([get_format(operand)] if operand else [])
    if dot != "ieee":
        acc = get_format("float32")
    elif acc.precision < max(f.precision for f in needs):
        acc = get_format(_least_accum(*needs))
    summation = pick("summation", _CUSTOM_SUMMATIONS)
    if dot.startswith("tensor-core") and summation not in ("native", "sequential"):
        summation = draw(st.sampled_from(("native", "sequential")))
    kw: dict[str, Any] = {
        "input": fin.name,
        "accum": acc.name,
        "summation": summation,
        "softmax": pick("softmax", _CUSTOM_SOFTMAXES),
        "softmax_format": maybe(_ACCUMS),
        "score_format": maybe(_CUSTOM_FORMATS),
        "prob_format": maybe(_CUSTOM_FORMATS),
        "output_format": maybe(_CUSTOM_FORMATS),
        "operand_format": operand,
        "dot": dot,
        "scale": pick("scale", ("scores", "q", "qk")),
        "scale_format": maybe(_CUSTOM_FORMATS),
        "mask_mode": draw(st.sampled_from(("fill", "add"))),
        "mask_value": draw(st.sampled_from(_MASK_VALUES)),
    }
    form = pick("exp_form", ("exp",))
    if form != "exp":
        kw.update(exp_form=form, mask_value=-math.inf)
        if form != "exp2":  # the scale folded into the exponent's constant
            kw["scale"] = "scores"
        if kw["softmax"] == "naive":
            kw["softmax"] = draw(st.sampled_from(("safe", "online(4)", "online(16)")))
    if pick("online_sums", ("block",)) == "running":
        kw["online_sums"] = "running"
        if not str(kw["softmax"]).startswith("online"):
            kw["softmax"] = draw(st.sampled_from(("online(4)", "online(16)")))
        if kw["summation"] not in ("native", "sequential"):
            kw["summation"] = draw(st.sampled_from(("native", "sequential")))
        if dot.startswith("bf16x"):  # a split dot
            kw["dot"] = "ieee"
    try:
        num = Numerics(**kw)
        if bounded:
            soft = num.format_of("softmax")
            if num.softmax_kind == "online" and acc.precision > soft.precision:
                num = num.replace(softmax_format=None)  # the softmax in accum
                soft = num.format_of("softmax")
            if num.format_of("score").precision > soft.precision:
                narrow = [f for f in _CUSTOM_FORMATS if get_format(f).precision <= soft.precision]
                num = num.replace(score_format=draw(st.sampled_from(narrow)))
        try:
            num.mask_constant()
        except _MhanumInvalid:  # NaN in a format without infinity: its finfo.min instead
            if num.exp2:  # -inf masking: a score format with infinity
                num = num.replace(score_format=num.accum)
            else:
                num = num.replace(mask_value="finfo.min")
        return num
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


def _bounded(num: Numerics) -> bool:
    score, soft, acc = (num.format_of(r).precision for r in ("score", "softmax", "accum"))
    online_ok = num.softmax_kind != "online" or acc <= soft
    return score <= soft and online_ok


# attention inputs --------------------------------------------------------------------------------


def _resolve_int(draw: Any, value: Any, name: str, minimum: int = 1) -> int:
    return _check_count(draw(value) if isinstance(value, st.SearchStrategy) else value, name,
                        minimum)  # fmt: skip


def attention_inputs(
    *,
    q_len: Any,
    kv_len: Any,
    d_k: Any,
    d_v: Any = None,
    batch: Any = 1,
    heads: Any = 1,
    fmt: Any = None,
    structure: Any = None,
    accum: Any = None,
    scale: float | None = None,
    numerics: Any = None,
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
            _check_count(value, name)
    for value, name in ((fmt, "fmt"), (accum, "accum")):
        if value is not None and not isinstance(value, st.SearchStrategy):
            _check_format(value, name)
    if not isinstance(structure, st.SearchStrategy):
        _check_structure(structure)
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
    ):
        _fail("scale", "a positive finite number or None", scale)
    if numerics is not None and not isinstance(numerics, st.SearchStrategy):
        _check_numerics(numerics)
    return _attention_inputs(sizes, fmt, structure, accum, scale, numerics)


def _check_numerics(value: Any) -> Numerics:
    if isinstance(value, str):
        if value not in PRESETS:
            _fail("numerics", f"a Numerics or a preset name from {tuple(PRESETS)}", value)
        return PRESETS[value]
    if not isinstance(value, Numerics):
        _fail("numerics", "a Numerics, a preset name or a strategy of them", value)
    return value


@st.composite
def _attention_inputs(
    draw: Any,
    sizes: dict[str, Any],
    fmt: Any,
    structure: Any,
    accum: Any,
    scale: float | None,
    numerics: Any,
) -> AttentionInputs:
    def value(x: Any) -> Any:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    num = None if numerics is None else _check_numerics(value(numerics))
    n = {name: _resolve_int(draw, size, name) for name, size in sizes.items()}
    n.setdefault("d_v", n["d_k"])
    if fmt is None:
        fmt = "float32" if num is None else num.input
    f = _check_format(value(fmt), "fmt")
    if accum is None and num is not None:
        accum = num.accum
    a = f if accum is None else _check_format(value(accum), "accum")
    chosen = _check_structure(value(structure))
    if chosen is None:
        chosen = draw(st.sampled_from(_MIXES))
    if "range" in chosen:
        chosen = (chosen - {"range"}) | draw(st.sampled_from(_RANGE_MIXES))
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
    draw: Any,
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
    return tuple(_into(x, f) for x in (q, k, v))  # type: ignore[return-value]


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


def _ranged(draw: Any, x: AttentionInputs, lim: _Limits, c: float) -> AttentionInputs:
    """Apply the chosen range structures: values first, then the scale, the logits, the bias.

    Values that leave float64 on the way are clipped into the format (NaN, from ``0·inf``,
    becomes 0).
    """
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        return _ranged_unchecked(draw, x, lim, c)


def _finite_into(x: np.ndarray, f: Format) -> np.ndarray:
    return _into(np.nan_to_num(x, nan=0.0, posinf=f.max_finite, neginf=-f.max_finite), f)


def _ranged_unchecked(draw: Any, x: AttentionInputs, lim: _Limits, c: float) -> AttentionInputs:
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
    draw: Any, lim: _Limits, q: np.ndarray, k: np.ndarray
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
    draw: Any, rng: np.random.Generator, lim: _Limits, q: np.ndarray, k: np.ndarray, c: float
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
    draw: Any,
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


def _into(x: np.ndarray, f: Format) -> np.ndarray:
    """``x`` rounded into ``f``, finite values clipped to the largest finite one first."""
    return round_to(np.clip(x, -f.max_finite, f.max_finite), f)


# masks -------------------------------------------------------------------------------------------


def masks(
    *,
    q_len: Any,
    kv_len: Any,
    batch: Any = 1,
    heads: Any = 1,
    kind: Any = None,
    fully_masked_rows: bool = False,
) -> st.SearchStrategy[np.ndarray]:
    """Boolean masks ``(batch, heads, q_len, kv_len)``; **True means attend**.

    Args:
        q_len, kv_len, batch, heads: sizes (values or strategies).
        kind: ``"none"`` (attend everywhere), ``"padding"`` (per batch entry, keys past a drawn
            length are masked), ``"causal"`` (query ``i`` attends keys ``j <= i + kv_len - q_len``),
            ``"random"``, ``"band"`` (a :func:`bands` band's array), a strategy of these, or
            ``None`` for any of them.
        fully_masked_rows: if ``False`` every row attends at least one key (a row that would not
            attends its last allowed key, key 0); if ``True`` at least one row is fully masked.

    Raises:
        InvalidArgument: for a non-positive size or an unknown kind.
    """
    sizes = {"q_len": q_len, "kv_len": kv_len, "batch": batch, "heads": heads}
    for name, value in sizes.items():
        if not isinstance(value, st.SearchStrategy):
            _check_count(value, name)
    if kind is None:
        kind = st.sampled_from(MASK_KINDS)
    elif not isinstance(kind, st.SearchStrategy) and kind not in MASK_KINDS:
        _fail("kind", f"one of {MASK_KINDS}", kind)
    if not isinstance(fully_masked_rows, bool):
        _fail("fully_masked_rows", "a bool", fully_masked_rows)
    return _masks(sizes, kind, fully_masked_rows)


@st.composite
def _masks(draw: Any, sizes: dict[str, Any], kind: Any, fully_masked: bool) -> np.ndarray:
    n = {name: _resolve_int(draw, value, name) for name, value in sizes.items()}
    k = draw(kind) if isinstance(kind, st.SearchStrategy) else kind
    if k not in MASK_KINDS:
        _fail("kind", f"one of {MASK_KINDS}", k)
    shape = (n["batch"], n["heads"], n["q_len"], n["kv_len"])
    keys = np.arange(n["kv_len"])
    if k == "none":
        mask = np.ones(shape, bool)
    elif k == "padding":
        lengths = [draw(st.integers(1, n["kv_len"])) for _ in range(n["batch"])]
        mask = np.stack([np.broadcast_to(keys < m, shape[1:]) for m in lengths])
    elif k == "causal":
        rows = np.arange(n["q_len"])[:, None] + (n["kv_len"] - n["q_len"])
        mask = np.broadcast_to(keys[None, :] <= rows, shape).copy()
    elif k == "band":
        band = draw(_bands(n["q_len"], n["kv_len"], False))
        mask = np.broadcast_to(band.array(n["q_len"], n["kv_len"]), shape).copy()
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        mask = rng.random(shape) < draw(st.sampled_from((0.25, 0.5, 0.9)))
    mask = np.array(mask, bool)
    if fully_masked:
        b, h, i = (draw(st.integers(0, m - 1)) for m in shape[:3])
        mask[b, h, i, :] = False
    else:
        empty = ~mask.any(axis=-1)
        mask[..., 0] |= empty
    return mask


def bands(*, q_len: Any, kv_len: Any, empty_rows: bool = False) -> st.SearchStrategy[Band]:
    """Structured masks (:class:`mhanum.masks.Band`): causal or windowed, on the main diagonal,
    aligned to the bottom-right corner (``offset = kv_len - q_len``) or shifted.

    Args:
        q_len, kv_len: sizes (values or strategies) the band is drawn for.
        empty_rows: if ``False`` every row attends at least one key; if ``True`` the offset may
            leave rows that attend none.

    Raises:
        InvalidArgument: for a non-positive size.
    """
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, st.SearchStrategy):
            _check_count(value, name)
    if not isinstance(empty_rows, bool):
        _fail("empty_rows", "a bool", empty_rows)
    return _bands(q_len, kv_len, empty_rows)


@st.composite
def _bands(draw: Any, q_len: Any, kv_len: Any, empty_rows: bool) -> Band:
    lq, lk = _resolve_int(draw, q_len, "q_len"), _resolve_int(draw, kv_len, "kv_len")
    side = st.one_of(st.none(), st.integers(0, lk))
    left, right = draw(side), draw(st.one_of(st.just(0), side))
    offset = draw(st.sampled_from((0, lk - lq)) | st.integers(-lq, lk))
    band = Band(left, right, offset)
    if not empty_rows and band.empty_rows(lq, lk).any():
        # unbounded to the left, and reaching key 0 from row 0: every row attends a key
        band = Band(None, None if right is None else max(right, -offset), offset)
    return band


# parameters --------------------------------------------------------------------------------------


def mha_params(
    *,
    d_model: Any,
    d_kv: Any = None,
    d_out: Any = None,
    fmt: Any = "float32",
    bias: Any = True,
    weight_scale: Any = None,
) -> st.SearchStrategy[MHAParams]:
    """:class:`~mhanum.MHAParams` (Glorot-uniform from a drawn seed) with values in ``fmt``.

    Args:
        d_model, d_kv, d_out: widths as for :meth:`mhanum.MHAParams.random` (values or strategies).
        fmt: format of every weight and bias.
        bias: whether the projections have biases (a bool or a strategy of bools).
        weight_scale: a power of two multiplying every weight (``2^j`` for a drawn ``j`` in
            ``[-4, 4]`` by default; large weights grow the logits).

    Raises:
        InvalidArgument: for a non-positive width, an unknown format or a non-positive scale.
    """
    for name, value in (("d_model", d_model), ("d_kv", d_kv), ("d_out", d_out)):
        if value is not None and not isinstance(value, st.SearchStrategy):
            _check_count(value, name)
    if not isinstance(fmt, st.SearchStrategy):
        _check_format(fmt, "fmt")
    if not isinstance(bias, (bool, st.SearchStrategy)):
        _fail("bias", "a bool or a strategy of bools", bias)
    if weight_scale is None:
        weight_scale = st.integers(-4, 4).map(lambda j: 2.0**j)
    elif not isinstance(weight_scale, st.SearchStrategy) and not (
        isinstance(weight_scale, (int, float)) and weight_scale > 0
    ):
        _fail("weight_scale", "a positive number", weight_scale)
    return _mha_params(d_model, d_kv, d_out, fmt, bias, weight_scale)


@st.composite
def _mha_params(
    draw: Any, d_model: Any, d_kv: Any, d_out: Any, fmt: Any, bias: Any, weight_scale: Any
) -> MHAParams:
    def value(x: Any) -> Any:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    width = _check_count(value(d_model), "d_model")
    kv = None if d_kv is None else _check_count(value(d_kv), "d_kv")
    out = None if d_out is None else _check_count(value(d_out), "d_out")
    f = _check_format(value(fmt), "fmt")
    factor = float(value(weight_scale))
    params = MHAParams.random(
        width, seed=draw(st.integers(0, 2**32 - 1)), d_kv=kv, d_out=out, bias=bool(value(bias))
    )
    fields: dict[str, Any] = {
        name: None if w is None else _into(np.asarray(w) * (factor if name[0] == "w" else 1.0), f)
        for name, w in dataclasses.asdict(params).items()
    }
    return MHAParams(**fields)


# multi-head attention inputs ---------------------------------------------------------------------

MHA_STRUCTURES = ("large_logits", "ties", "near_ties", "cancellation", "outliers", "long_rows")
"""Structures of :func:`mha_inputs`, on the layer's inputs (the tokens), before the projections:

* ``large_logits``: ``x_q`` and ``x_kv`` scaled by ``2^j`` (``j`` in ``[1, 6]``), so the
  projected logits grow about as ``4^j``;
* ``ties``: some tokens of ``x_kv`` copies of one token (duplicated tokens: tied keys, equal
  values);
* ``near_ties``: the tokens of ``x_kv`` a few units in the last place from one token;
* ``cancellation``: the tokens of ``x_kv`` one large token with alternating signs plus small
  noise, so the values (and ``P V``) cancel;
* ``outliers``: a few channels of ``x_q``, ``x_kv`` or both scaled by ``2^j`` (``j`` in
  ``[2, 10]``), as the outlier dimensions of trained transformers;
* ``long_rows``: ``x_q`` scaled towards zero (``2^-j``, ``j`` in ``[4, 20]``): the logits are
  the query bias's, nearly equal along a row, and every key carries weight.
"""

_MHA_MIXES = (
    frozenset(),
    *(frozenset({a}) for a in MHA_STRUCTURES),
    *(frozenset(pair) for pair in itertools.combinations(MHA_STRUCTURES, 2)),
)


def mha_mixes() -> tuple[frozenset[str], ...]:
    """The structure sets :func:`mha_inputs` mixes in by default: none, each of
    :data:`MHA_STRUCTURES` alone, and each pair."""
    return _MHA_MIXES


@dataclasses.dataclass(frozen=True)
class MHAInputs:
    """The inputs of one multi-head attention call, drawn by :func:`mha_inputs`.

    Attributes:
        x_q: ``(batch, q_len, d_model)`` float64 array whose values lie in ``fmt``.
        x_kv: ``(batch, kv_len, d_kv)``, likewise (the same array as ``x_q`` for
            self-attention).
        fmt: name of the format the values lie in.
        structure: the structures applied (a subset of :data:`MHA_STRUCTURES`, with
            ``"self_attention"`` where ``x_kv`` is ``x_q``).
    """

    x_q: np.ndarray = dataclasses.field(repr=False)
    x_kv: np.ndarray = dataclasses.field(repr=False)
    fmt: str
    structure: frozenset[str]


def _check_mha_structure(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        _fail("structure", f"None, a name or names from {MHA_STRUCTURES}", value)
    names = tuple(names)
    unknown = [n for n in names if n not in MHA_STRUCTURES and n != "plain"]
    if unknown:
        _fail("structure", f"names from {MHA_STRUCTURES} (or 'plain')", unknown)
    return frozenset(n for n in names if n != "plain")


def mha_inputs(
    *,
    q_len: Any,
    kv_len: Any = None,
    d_model: Any,
    d_kv: Any = None,
    batch: Any = 1,
    fmt: Any = "float32",
    structure: Any = None,
    self_attention: Any = None,
) -> st.SearchStrategy[MHAInputs]:
    """Layer inputs ``x_q`` ``(batch, q_len, d_model)`` and ``x_kv`` ``(batch, kv_len, d_kv)``
    with values in ``fmt``, for :func:`mhanum.multi_head_attention`.

    The base values are standard normal times ``2^j`` (``j`` drawn in ``[-3, 3]`` per array)
    from a drawn seed; the structures of :data:`MHA_STRUCTURES` are applied on top, then every
    value is rounded into ``fmt`` (finite: clipped to its largest value first).

    Args:
        q_len: number of query tokens (a value or a strategy).
        kv_len: number of key/value tokens (default ``q_len``).
        d_model: query input width; d_kv: key/value input width (default ``d_model``).
        batch: leading dimension (default 1).
        fmt: the format of the values (a name, a :class:`~mhanum.formats.Format` or a strategy).
        structure: ``None`` (default) mixes in no structure, one, or a pair of
            :data:`MHA_STRUCTURES`, uniformly; ``"plain"`` or ``()`` for none; a name or names
            for exactly those; or a strategy of these.
        self_attention: ``True``: ``x_kv`` is ``x_q`` (needs equal lengths and widths);
            ``False``: drawn apart; ``None`` (default): drawn, where the sizes allow it.

    Raises:
        InvalidArgument: for a non-positive size, an unknown format or structure name, or
            ``self_attention=True`` with different lengths or widths.

    Examples:
        >>> from hypothesis import given
        >>> from mhanum import strategies as mst
        >>> @given(mst.mha_inputs(q_len=3, kv_len=5, d_model=4, fmt="bfloat16"))
        ... def test_shapes(x):
        ...     assert x.x_q.shape == (1, 3, 4) and x.x_kv.shape == (1, 5, 4)
        >>> test_shapes()
    """
    sizes = {"q_len": q_len, "d_model": d_model, "batch": batch}
    if kv_len is not None:
        sizes["kv_len"] = kv_len
    if d_kv is not None:
        sizes["d_kv"] = d_kv
    for name, value in sizes.items():
        if not isinstance(value, st.SearchStrategy):
            _check_count(value, name)
    if not isinstance(fmt, st.SearchStrategy):
        _check_format(fmt, "fmt")
    if not isinstance(structure, st.SearchStrategy):
        _check_mha_structure(structure)
    if self_attention is not None and not isinstance(self_attention, bool):
        _fail("self_attention", "None or a bool", self_attention)
    pairs = ((q_len, kv_len), (d_model, d_kv))
    if self_attention and any(
        b is not None and not isinstance(a, st.SearchStrategy)
        and not isinstance(b, st.SearchStrategy) and a != b
        for a, b in pairs
    ):  # fmt: skip
        _fail("self_attention", "equal lengths and widths of x_q and x_kv", sizes)
    return _mha_inputs(sizes, fmt, structure, self_attention)


@st.composite
def _mha_inputs(
    draw: Any, sizes: dict[str, Any], fmt: Any, structure: Any, self_attention: bool | None
) -> MHAInputs:
    def value(x: Any) -> Any:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    n = {name: _resolve_int(draw, size, name) for name, size in sizes.items()}
    n.setdefault("kv_len", n["q_len"])
    n.setdefault("d_kv", n["d_model"])
    f = _check_format(value(fmt), "fmt")
    chosen = _check_mha_structure(value(structure))
    if chosen is None:
        chosen = draw(st.sampled_from(_MHA_MIXES))
    fits = n["q_len"] == n["kv_len"] and n["d_model"] == n["d_kv"]
    if self_attention and not fits:
        _fail("self_attention", "equal lengths and widths of x_q and x_kv", n)
    same = fits and (draw(st.booleans()) if self_attention is None else self_attention)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x_q = rng.standard_normal((n["batch"], n["q_len"], n["d_model"])) * 2.0 ** draw(
        st.integers(-3, 3)
    )
    x_kv = rng.standard_normal((n["batch"], n["kv_len"], n["d_kv"])) * 2.0 ** draw(
        st.integers(-3, 3)
    )
    if same:
        x_kv = x_q
    x_q, x_kv = _mha_structured(draw, chosen, x_q, x_kv, f, same)
    return MHAInputs(x_q, x_kv, f.name, chosen | ({"self_attention"} if same else set()))


def _mha_structured(
    draw: Any, chosen: frozenset[str], x_q: np.ndarray, x_kv: np.ndarray, f: Format, same: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the chosen token structures in a fixed order (scales first, exact patterns last);
    with ``same`` every change to the tokens applies to both (they are one array)."""
    x_q = x_q.copy()
    x_kv = x_q if same else x_kv.copy()
    tokens = x_kv.shape[-2]
    if "outliers" in chosen:
        j = draw(st.integers(2, 10))
        which = "both" if same else draw(st.sampled_from(("x_q", "x_kv", "both")))
        chans = sorted(
            {draw(st.integers(0, x_q.shape[-1] - 1)) for _ in range(draw(st.integers(1, 2)))}
        )
        if which != "x_kv":
            x_q[..., chans] *= 2.0**j
        if which != "x_q" and not same:
            x_kv[..., [c % x_kv.shape[-1] for c in chans]] *= 2.0**j
    if "large_logits" in chosen:
        factor = 2.0 ** draw(st.integers(1, 6))
        x_q = x_q * factor
        x_kv = x_q if same else x_kv * factor
    if "long_rows" in chosen and not same:
        x_q = x_q * 2.0 ** -draw(st.integers(4, 20))
    if "ties" in chosen:
        copies = draw(st.integers(2, max(2, tokens)))
        x_kv[..., :copies, :] = x_kv[..., :1, :]
    if "near_ties" in chosen:
        base = round_to(x_kv[..., :1, :], f)
        ulps = draw(st.integers(1, 4))
        spacing = np.abs(base) * 2.0 ** (1 - f.precision)
        signs = np.sign(np.random.default_rng(ulps).standard_normal(x_kv.shape))
        x_kv = base + ulps * spacing * signs
    if "cancellation" in chosen:
        big = 2.0 ** draw(st.integers(0, 8))
        signs = np.where(np.arange(tokens) % 2 == 0, 1.0, -1.0)[:, None]
        x_kv = big * signs * x_kv[..., :1, :] + x_kv * 2.0 ** -draw(st.integers(4, 20))
    if same:  # x_kv holds every change (x_q was changed in place or reassigned with it)
        x_kv = _into(x_kv, f)
        return x_kv, x_kv
    return _into(x_q, f), _into(x_kv, f)


PERTURBATIONS = ("permuted", "duplicated", "sign_flips", "scaled_rows", "outlier_channels")
"""The perturbations :func:`perturbed_inputs` applies to a real layer input ``x``
``(batch, tokens, d_model)``, each with a drawn yes or no, in this order, only ever to the
``valid`` tokens (padding stays as it is):

* ``permuted``: the tokens of each batch element in a random order;
* ``duplicated``: one token copied over 1 to ``tokens - 1`` others (tied keys, equal values);
* ``sign_flips``: 1 to ``tokens`` tokens negated;
* ``scaled_rows``: 1 to ``tokens`` tokens multiplied by ``2^j``, ``j`` in ``[-4, 4]``;
* ``outlier_channels``: the 1 to 3 channels of largest ``max |x|`` (a trained model's outlier
  dimensions), or one drawn channel, multiplied by ``2^j``, ``j`` in ``[1, 6]``.

Every change is exact in float64 (permutations, copies, negations and powers of two), so a
perturbed input is as exactly known as the real one.
"""


def perturbed_inputs(*, x: Any, valid: Any = None) -> st.SearchStrategy[MHAInputs]:
    """Self-attention inputs ``x_q = x_kv`` near a real layer input ``x``: ``x`` with some of
    :data:`PERTURBATIONS` applied (none of them, too: the real input itself).

    The values are not rounded into a format: they are the float64 activations (the attention
    under test rounds them into its input format, and :func:`mhanum.bounds.mha_bound` counts
    that rounding); :attr:`MHAInputs.fmt` is ``"float64"``.

    Args:
        x: the layer input ``(batch, tokens, d_model)``, finite.
        valid: ``(batch, tokens)`` booleans, True at the real tokens (default: every token).

    Raises:
        InvalidArgument: for an ``x`` that is not a finite 3-D float array, or a ``valid`` of
            another shape or without a valid token in some batch element.
    """
    arr = np.asarray(x)
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.floating) or arr.size == 0:
        _fail("x", "a non-empty (batch, tokens, d_model) float array", f"shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        _fail("x", "finite values", "NaN or Inf")
    keep = np.ones(arr.shape[:2], bool) if valid is None else np.asarray(valid)
    if keep.shape != arr.shape[:2] or keep.dtype != bool:
        _fail("valid", f"booleans of shape {arr.shape[:2]}", f"{keep.dtype} {keep.shape}")
    if not keep.any(axis=-1).all():
        _fail("valid", "some valid token in every batch element", "a batch element with none")
    return _perturbed_inputs(arr, keep)


@st.composite
def _perturbed_inputs(draw: Any, x: np.ndarray, valid: np.ndarray) -> MHAInputs:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    chosen = frozenset(p for p in PERTURBATIONS if draw(st.booleans()))
    y = x.copy()
    for b in range(y.shape[0]):
        tokens = np.flatnonzero(valid[b])
        n = tokens.size
        if "permuted" in chosen:
            y[b, tokens] = y[b, rng.permutation(tokens)]
        if "duplicated" in chosen and n > 1:
            src = rng.choice(tokens)
            others = tokens[tokens != src]
            y[b, rng.choice(others, draw(st.integers(1, n - 1)), replace=False)] = y[b, src]
        if "sign_flips" in chosen:
            y[b, rng.choice(tokens, draw(st.integers(1, n)), replace=False)] *= -1.0
        if "scaled_rows" in chosen:
            rows = rng.choice(tokens, draw(st.integers(1, n)), replace=False)
            y[b, rows] *= 2.0 ** draw(st.integers(-4, 4))
    if "outlier_channels" in chosen:
        if draw(st.booleans()):
            top = np.argsort(-np.max(np.abs(x), axis=(0, 1)), kind="stable")
            chans = top[: draw(st.integers(1, 3))]
        else:
            chans = np.array([draw(st.integers(0, x.shape[-1] - 1))])
        y[..., chans] = np.where(valid[..., None], y[..., chans] * 2.0 ** draw(st.integers(1, 6)),
                                 y[..., chans])  # fmt: skip
    return MHAInputs(y, y, "float64", chosen | {"self_attention"})
