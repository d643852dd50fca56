"""Strategies for formats and numerics (:func:`formats`, :func:`numerics`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from mhanum._errors import InvalidArgument as _MhanumInvalid
from mhanum.formats import FORMATS, Format, get_format
from mhanum.numerics import PRESETS, Numerics
from mhanum.strategies._common import ACCUMS, SOFTMAXES, SUMMATIONS, check_count, check_format, fail
from mhanum.units import (
    ACCUM_FORMATS,
    Naive,
    Online,
    Safe,
    SplitBF16,
    SummationOrder,
    TensorCoreDot,
    summation_order,
    summation_orders,
)
from mhanum.units.tensorcore import MODELS

T = TypeVar("T")

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
    pool = [check_format(n, "names") for n in (FORMATS if names is None else names)]
    lo = check_count(min_precision, "min_precision")
    hi = check_count(max_precision, "max_precision")
    chosen = [f for f in pool if lo <= f.precision <= hi]
    if not chosen:
        fail("min_precision/max_precision", "a range holding some format", (lo, hi))
    return st.sampled_from(chosen)


def _field(value: T | st.SearchStrategy[T] | None, choices: Iterable[T]) -> st.SearchStrategy[T]:
    if value is None:
        return st.sampled_from(tuple(choices))
    if isinstance(value, st.SearchStrategy):
        return value
    return st.just(value)


def numerics(
    *,
    presets: bool | Iterable[str] = True,
    free: bool = True,
    input: str | Format | st.SearchStrategy[str | Format] | None = None,
    accum: str | Format | st.SearchStrategy[str | Format] | None = None,
    summation: str | st.SearchStrategy[str] | None = None,
    softmax: str | st.SearchStrategy[str] | None = None,
    bounded: bool = False,
    custom: bool = False,
    scale: str | st.SearchStrategy[str] | None = None,
    exp_form: str | st.SearchStrategy[str] | None = None,
    online_sums: str | st.SearchStrategy[str] | None = None,
    kv_splits: int | st.SearchStrategy[int] | None = None,
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
        fail("presets", "True, False or a list of preset names", presets)
    else:
        names = tuple(presets)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            fail("presets", f"names from {tuple(PRESETS)}", unknown)
    for flag, name in ((free, "free"), (bounded, "bounded"), (custom, "custom")):
        if not isinstance(flag, bool):
            fail(name, "a bool", flag)
    if not names and not free and not custom:
        fail("presets/free/custom", "presets, free or custom combinations",
              (presets, free, custom))  # fmt: skip
    for value, name in ((input, "input"), (accum, "accum")):
        if value is not None and not isinstance(value, st.SearchStrategy):
            check_format(value, name)
    values: dict[str, Any] = {"summation": summation, "softmax": softmax, "scale": scale,
                              "exp_form": exp_form, "kv_splits": kv_splits}  # fmt: skip
    for name, given in values.items():
        if given is not None and not isinstance(given, st.SearchStrategy):
            try:
                Numerics(**{name: given})
            except _MhanumInvalid as exc:
                raise InvalidArgument(str(exc)) from None
    choices: list[st.SearchStrategy[Numerics]] = []
    if names:
        choices.append(st.sampled_from([PRESETS[n] for n in names]))
    if free:
        choices.append(
            _free_numerics(
                _field(input, ACCUM_FORMATS),
                _field(accum, ACCUMS),
                _field(summation, SUMMATIONS),
                _field(softmax, SOFTMAXES),
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
def _split(
    draw: st.DrawFn, numerics: st.SearchStrategy[Numerics], splits: st.SearchStrategy[int]
) -> Numerics:
    num = draw(numerics)
    count = draw(splits)
    try:
        return num.replace(kv_splits=count)
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


@st.composite
def _free_numerics(
    draw: st.DrawFn,
    input: st.SearchStrategy[Any],
    accum: st.SearchStrategy[Any],
    summation: st.SearchStrategy[Any],
    softmax: st.SearchStrategy[Any],
) -> Numerics:
    fin = check_format(draw(input), "input")
    acc = check_format(draw(accum), "accum")
    if acc.precision < fin.precision:  # the least precise accumulation format that fits
        wide = [get_format(a) for a in ACCUMS if get_format(a).precision >= fin.precision]
        acc = min(wide, key=lambda f: f.precision)
    try:
        return Numerics(input=fin.name, accum=acc.name, summation=draw(summation),
                        softmax=draw(softmax))  # fmt: skip
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


_CUSTOM_FORMATS = ("float64", "float32", "tf32", "bfloat16", "float16", "float8_e4m3fn",
                   "float8_e5m2")  # fmt: skip
_CUSTOM_SOFTMAXES = (Naive(), Safe(), Online(1), Online(3), Online(8), Online(32))
_OPERAND_FORMATS = ("tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_DOTS = (SplitBF16(1), SplitBF16(3), SplitBF16(6), *(TensorCoreDot(m) for m in MODELS))
_MASK_VALUES: tuple[float | str, ...] = (-math.inf, "finfo.min", "0.7*finfo.min", -1e9, -1e4,
                                          -30.0, 0.0)  # fmt: skip


def _custom_summations() -> tuple[SummationOrder, ...]:
    """Every registered order's examples (:meth:`mhanum.units.SummationOrder.examples`)."""
    return tuple(order for cls in summation_orders() for order in cls.examples())


def _resumable_summations() -> tuple[SummationOrder, ...]:
    """The orders a sum can resume in: a tensor core's and the running online sums'."""
    return tuple(order for order in _custom_summations() if order.resumable)


def _resumes(value: object) -> bool:
    """Whether ``value`` is an order a sum can resume in (an unknown one is not)."""
    try:
        return summation_order(value).resumable
    except _MhanumInvalid:
        return False


def _least_accum(*needs: Format) -> str:
    """The least precise accumulation format at least as precise as every one of ``needs``."""
    p = max(f.precision for f in needs)
    return min((get_format(a) for a in ACCUMS if get_format(a).precision >= p),
               key=lambda f: f.precision).name  # fmt: skip


@st.composite
def _custom_numerics(draw: st.DrawFn, fields: dict[str, Any], bounded: bool) -> Numerics:
    def pick(name: str, choices: tuple[Any, ...]) -> Any:
        value = fields.get(name)
        if value is None:
            return draw(st.sampled_from(choices))
        return draw(value) if isinstance(value, st.SearchStrategy) else value

    def maybe(choices: tuple[str, ...]) -> str | None:
        return draw(st.one_of(st.none(), st.sampled_from(choices)))

    fin = check_format(pick("input", _CUSTOM_FORMATS), "input")
    dot = draw(st.sampled_from(_DOTS)) if draw(st.integers(0, 3)) == 0 else "ieee"
    if fin.precision > 24:
        dot = "ieee"
    operand = maybe(_OPERAND_FORMATS) if dot == "ieee" else None
    acc = check_format(pick("accum", ACCUMS), "accum")
    needs = [fin] + ([get_format(operand)] if operand else [])
    if dot != "ieee":
        acc = get_format("float32")
    elif acc.precision < max(f.precision for f in needs):
        acc = get_format(_least_accum(*needs))
    summation = pick("summation", _custom_summations())
    if dot.startswith("tensor-core") and not _resumes(summation):
        summation = draw(st.sampled_from(_resumable_summations()))
    kw: dict[str, Any] = {
        "input": fin.name,
        "accum": acc.name,
        "summation": summation,
        "softmax": pick("softmax", _CUSTOM_SOFTMAXES),
        "softmax_format": maybe(ACCUMS),
        "score_format": maybe(_CUSTOM_FORMATS),
        "prob_format": maybe(_CUSTOM_FORMATS),
        "output_format": maybe(_CUSTOM_FORMATS),
        "operand_format": operand,
        "dot": dot,
        "scale": pick("scale", ("scores", "q", "qk")),
        "scale_format": maybe(_CUSTOM_FORMATS),
        "mask_mode": draw(st.sampled_from(("fill", "add"))),
        "mask_value": draw(st.sampled_from(_MASK_VALUES)),
        "prob_underflow": draw(st.sampled_from(("flush", "gradual"))),
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
        if not _resumes(kw["summation"]):
            kw["summation"] = draw(st.sampled_from(_resumable_summations()))
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
