"""Strategies for multi-head attention: weights, inputs and perturbed inputs."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from hypothesis import strategies as st

from mhanum.formats import Format, round_to
from mhanum.params import MHAParams
from mhanum.strategies._attention import into, resolve_int
from mhanum.strategies._common import check_count, check_format, fail

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

_T = TypeVar("_T")

# parameters --------------------------------------------------------------------------------------


def mha_params(
    *,
    d_model: int | st.SearchStrategy[int],
    d_kv: int | st.SearchStrategy[int] | None = None,
    d_out: int | st.SearchStrategy[int] | None = None,
    fmt: str | Format | st.SearchStrategy[str | Format] = "float32",
    bias: bool | st.SearchStrategy[bool] = True,
    weight_scale: float | st.SearchStrategy[float] | None = None,
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
            check_count(value, name)
    if not isinstance(fmt, st.SearchStrategy):
        check_format(fmt, "fmt")
    if not isinstance(bias, (bool, st.SearchStrategy)):
        fail("bias", "a bool or a strategy of bools", bias)
    if weight_scale is None:
        weight_scale = st.integers(-4, 4).map(lambda j: 2.0**j)
    elif not isinstance(weight_scale, st.SearchStrategy) and not (
        isinstance(weight_scale, (int, float)) and weight_scale > 0
    ):
        fail("weight_scale", "a positive number", weight_scale)
    return _mha_params(d_model, d_kv, d_out, fmt, bias, weight_scale)


@st.composite
def _mha_params(
    draw: st.DrawFn,
    d_model: int | st.SearchStrategy[int],
    d_kv: int | st.SearchStrategy[int] | None,
    d_out: int | st.SearchStrategy[int] | None,
    fmt: str | Format | st.SearchStrategy[str | Format],
    bias: bool | st.SearchStrategy[bool],
    weight_scale: float | st.SearchStrategy[float],
) -> MHAParams:
    def value(x: _T | st.SearchStrategy[_T]) -> _T:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    width = check_count(value(d_model), "d_model")
    kv = None if d_kv is None else check_count(value(d_kv), "d_kv")
    out = None if d_out is None else check_count(value(d_out), "d_out")
    f = check_format(value(fmt), "fmt")
    factor = float(value(weight_scale))
    params = MHAParams.random(
        width, seed=draw(st.integers(0, 2**32 - 1)), d_kv=kv, d_out=out, bias=bool(value(bias))
    )
    fields: dict[str, Any] = {
        name: None if w is None else into(np.asarray(w) * (factor if name[0] == "w" else 1.0), f)
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


def _check_mha_structure(value: str | Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        fail("structure", f"None, a name or names from {MHA_STRUCTURES}", value)
    names = tuple(names)
    unknown = [n for n in names if n not in MHA_STRUCTURES and n != "plain"]
    if unknown:
        fail("structure", f"names from {MHA_STRUCTURES} (or 'plain')", unknown)
    return frozenset(n for n in names if n != "plain")


def mha_inputs(
    *,
    q_len: int | st.SearchStrategy[int],
    kv_len: int | st.SearchStrategy[int] | None = None,
    d_model: int | st.SearchStrategy[int],
    d_kv: int | st.SearchStrategy[int] | None = None,
    batch: int | st.SearchStrategy[int] = 1,
    fmt: str | Format | st.SearchStrategy[str | Format] = "float32",
    structure: str | Iterable[str] | st.SearchStrategy[str | Iterable[str]] | None = None,
    self_attention: bool | None = None,
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
            check_count(value, name)
    if not isinstance(fmt, st.SearchStrategy):
        check_format(fmt, "fmt")
    if not isinstance(structure, st.SearchStrategy):
        _check_mha_structure(structure)
    if self_attention is not None and not isinstance(self_attention, bool):
        fail("self_attention", "None or a bool", self_attention)
    pairs = ((q_len, kv_len), (d_model, d_kv))
    if self_attention and any(
        b is not None and not isinstance(a, st.SearchStrategy)
        and not isinstance(b, st.SearchStrategy) and a != b
        for a, b in pairs
    ):  # fmt: skip
        fail("self_attention", "equal lengths and widths of x_q and x_kv", sizes)
    return _mha_inputs(sizes, fmt, structure, self_attention)


@st.composite
def _mha_inputs(
    draw: st.DrawFn,
    sizes: dict[str, Any],
    fmt: str | Format | st.SearchStrategy[str | Format],
    structure: str | Iterable[str] | st.SearchStrategy[str | Iterable[str]] | None,
    self_attention: bool | None,
) -> MHAInputs:
    def value(x: _T | st.SearchStrategy[_T]) -> _T:
        return draw(x) if isinstance(x, st.SearchStrategy) else x

    n = {name: resolve_int(draw, size, name) for name, size in sizes.items()}
    n.setdefault("kv_len", n["q_len"])
    n.setdefault("d_kv", n["d_model"])
    f = check_format(value(fmt), "fmt")
    chosen = _check_mha_structure(value(structure))
    if chosen is None:
        chosen = draw(st.sampled_from(_MHA_MIXES))
    fits = n["q_len"] == n["kv_len"] and n["d_model"] == n["d_kv"]
    if self_attention and not fits:
        fail("self_attention", "equal lengths and widths of x_q and x_kv", n)
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
    draw: st.DrawFn,
    chosen: frozenset[str],
    x_q: np.ndarray,
    x_kv: np.ndarray,
    f: Format,
    same: bool,
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
        x_kv = into(x_kv, f)
        return x_kv, x_kv
    return into(x_q, f), into(x_kv, f)


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


def perturbed_inputs(
    *, x: ArrayLike, valid: ArrayLike | None = None
) -> st.SearchStrategy[MHAInputs]:
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
        fail("x", "a non-empty (batch, tokens, d_model) float array", f"shape {arr.shape}")
    arr = arr.astype(np.float64)
    if not np.all(np.isfinite(arr)):
        fail("x", "finite values", "NaN or Inf")
    keep = np.ones(arr.shape[:2], bool) if valid is None else np.asarray(valid)
    if keep.shape != arr.shape[:2] or keep.dtype != bool:
        fail("valid", f"booleans of shape {arr.shape[:2]}", f"{keep.dtype} {keep.shape}")
    if not keep.any(axis=-1).all():
        fail("valid", "some valid token in every batch element", "a batch element with none")
    return _perturbed_inputs(arr, keep)


@st.composite
def _perturbed_inputs(draw: st.DrawFn, x: np.ndarray, valid: np.ndarray) -> MHAInputs:
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
