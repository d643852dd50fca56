"""Hypothesis strategies for attention numerics, in the style of ``hypothesis.extra.numpy``.

Every function is keyword-only, named for what its strategy produces, accepts values *or*
strategies for its arguments, and rejects a bad value with
:class:`hypothesis.errors.InvalidArgument` when it is called (a bad value drawn from a strategy
argument raises the same error when it is drawn).

* :func:`formats` — :class:`~mhanum.formats.Format` objects;
* :func:`numerics` — :class:`~mhanum.Numerics`, presets and free combinations;
* :func:`attention_inputs` — :class:`AttentionInputs` ``(q, k, v)`` whose values lie in a format,
  with error-provoking structure (:data:`STRUCTURES`) on request and mixed in by default;
* :func:`masks` — boolean masks (True = attend): padding, causal, random, fully-masked rows on
  request;
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
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from mhanum._errors import InvalidArgument as _MhanumInvalid
from mhanum.formats import FORMATS, Format, get_format, round_to
from mhanum.numerics import PRESETS, Numerics
from mhanum.params import MHAParams

__all__ = [
    "MASK_KINDS",
    "STRUCTURES",
    "AttentionInputs",
    "attention_inputs",
    "formats",
    "masks",
    "mha_params",
    "numerics",
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


MASK_KINDS = ("none", "padding", "causal", "random")
"""Kinds of :func:`masks`."""

_SUMMATIONS = ("native", "sequential", "pairwise", "kahan", "blocked(8)", "blocked(32)")
_SOFTMAXES = ("naive", "safe", "online(8)", "online(32)")
_ACCUMS = ("float64", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Queries, keys and values drawn by :func:`attention_inputs`.

    Attributes:
        q: ``(batch, heads, q_len, d_k)`` float64 array whose values lie in ``fmt``.
        k: ``(batch, heads, kv_len, d_k)``, likewise.
        v: ``(batch, heads, kv_len, d_v)``, likewise.
        fmt: name of the format the values lie in.
        structure: the structures applied (a subset of :data:`STRUCTURES`).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    fmt: str
    structure: frozenset[str]

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


def _check_structure(value: Any) -> frozenset[str] | None:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        _fail("structure", f"None, a name or names from {STRUCTURES}", value)
    names = tuple(names)
    unknown = [n for n in names if n not in STRUCTURES and n != "plain"]
    if unknown:
        _fail("structure", f"names from {STRUCTURES} (or 'plain')", unknown)
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
) -> st.SearchStrategy[Numerics]:
    """:class:`~mhanum.Numerics`: named presets and free combinations of formats and orders.

    Args:
        presets: ``True`` for every preset of :data:`mhanum.PRESETS`, a list of names, or
            ``False`` for none.
        free: whether to draw free combinations of ``input``, ``accum``, ``summation`` and
            ``softmax`` as well.
        input, accum, summation, softmax: values or strategies for the free combinations (default:
            every format, order and algorithm; an ``accum`` less precise than ``input`` is
            replaced by the least precise accumulation format at least as precise).
        bounded: keep only numerics that :func:`mhanum.bounds.attention_bound` covers (scale on the
            scores, ``-inf`` masking, score format no wider than the softmax format).

    Raises:
        InvalidArgument: for an unknown preset, neither presets nor free combinations, or a field
            value ``Numerics`` rejects.
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
    if not names and not free:
        _fail("presets/free", "presets or free combinations", (presets, free))
    for value, name in ((input, "input"), (accum, "accum")):
        if value is not None and not isinstance(value, st.SearchStrategy):
            _check_format(value, name)
    for value, name in ((summation, "summation"), (softmax, "softmax")):
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
                _field(input, ("float64", "float32", "bfloat16", "float16")),
                _field(accum, _ACCUMS),
                _field(summation, _SUMMATIONS),
                _field(softmax, _SOFTMAXES),
            )
        )
    strategy = st.one_of(*choices)
    return strategy.filter(_bounded) if bounded else strategy


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


def _bounded(num: Numerics) -> bool:
    score, soft, acc = (num.format_of(r).precision for r in ("score", "softmax", "accum"))
    online_ok = num.softmax_kind != "online" or acc <= soft
    return num.scale == "scores" and num.mask_value == -math.inf and score <= soft and online_ok


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
    fmt: Any = "float32",
    structure: Any = None,
    accum: Any = None,
    scale: float | None = None,
) -> st.SearchStrategy[AttentionInputs]:
    """Queries, keys and values of shape ``(batch, heads, length, width)`` with values in ``fmt``.

    The base values are standard normal times ``2^j`` (``j`` drawn in ``[-3, 3]`` per array,
    rounded into ``fmt``); the structures of
    :data:`STRUCTURES` are applied on top. Every value is finite and a value of ``fmt``, and
    ``scale·|q|·|k| <= 2^12`` (the range :func:`mhanum.bounds.attention_bound` evaluates).

    Args:
        q_len, kv_len, d_k: query length, key length and query/key width (values or strategies).
        d_v: value width (default ``d_k``).
        batch, heads: leading dimensions (default 1 each).
        fmt: the format of the values (a name, a :class:`~mhanum.formats.Format`, or a strategy
            such as :func:`formats`).
        structure: ``None`` (default) mixes in no structure, one, or a pair of
            :data:`STRUCTURES`, uniformly; ``"plain"`` or ``()`` for none; a name or names for exactly those; or a
            strategy of these.
        accum: the accumulation format, where ``absorption`` places its small addends (default:
            ``fmt``).
        scale: the logit scale the ``large_logits`` structure aims at (default ``1/sqrt(d_k)``).

    Raises:
        InvalidArgument: for a non-positive size, an unknown format or structure name.
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
    if scale is not None and (not isinstance(scale, (int, float)) or not scale > 0):
        _fail("scale", "a positive number or None", scale)
    return _attention_inputs(sizes, fmt, structure, accum, scale)


@st.composite
def _attention_inputs(
    draw: Any, sizes: dict[str, Any], fmt: Any, structure: Any, accum: Any, scale: float | None
) -> AttentionInputs:
    n = {name: _resolve_int(draw, value, name) for name, value in sizes.items()}
    n.setdefault("d_v", n["d_k"])
    f = _check_format(draw(fmt) if isinstance(fmt, st.SearchStrategy) else fmt, "fmt")
    a = (
        f
        if accum is None
        else _check_format(draw(accum) if isinstance(accum, st.SearchStrategy) else accum, "accum")
    )
    chosen = _check_structure(draw(structure) if isinstance(structure, st.SearchStrategy)
                              else structure)  # fmt: skip
    if chosen is None:
        chosen = draw(st.sampled_from(_MIXES))
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
    return AttentionInputs(q, k, v, f.name, chosen)


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
    top = c * float(np.max(np.abs(q) @ np.swapaxes(np.abs(k), -1, -2), initial=0.0))
    if top > 2.0**11:  # keep within the range attention_bound evaluates (2^12), with a margin
        shrink = 2.0 ** -math.ceil(math.log2(top / 2.0**11) / 2)
        q, k = q * shrink, k * shrink
    return tuple(_into(x, f) for x in (q, k, v))  # type: ignore[return-value]


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
            ``"random"``, a strategy of these, or ``None`` for any of them.
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
