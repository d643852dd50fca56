"""The structures' names, the inputs' record and the validation every strategy shares."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from mhanum._errors import InvalidArgument as _MhanumInvalid
from mhanum.formats import Format, get_format
from mhanum.numerics import Numerics
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
)

if TYPE_CHECKING:
    from collections.abc import Callable

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

MIXES = (
    frozenset(),
    *(frozenset({a}) for a in STRUCTURES),
    *(frozenset(pair) for pair in itertools.combinations(STRUCTURES, 2)),
)
"""The default mixture: no structure, each one alone, and each pair (drawn uniformly)."""


def default_mixes() -> tuple[frozenset[str], ...]:
    """The structure sets mixed in by default: none, each structure alone, and each pair."""
    return MIXES


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

RANGE_MIXES = (
    *(frozenset({a}) for a in RANGE_STRUCTURES),
    *(frozenset(pair) for pair in itertools.combinations(RANGE_STRUCTURES, 2)),
)


def range_mixes() -> tuple[frozenset[str], ...]:
    """The structure sets ``structure="range"`` draws from: each range structure, and each pair."""
    return RANGE_MIXES


MASK_KINDS = ("none", "padding", "causal", "random", "band")
"""Kinds of :func:`masks`."""

SUMMATIONS = (Native(), Sequential(), Pairwise(), Kahan(), Blocked(8), Blocked(32))
SOFTMAXES = (Naive(), Safe(), Online(8), Online(32))
ACCUMS = ACCUM_FORMATS


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


def fail(name: str, expected: str, got: object) -> NoReturn:
    msg = f"{name}: expected {expected}, got {got!r}"
    raise InvalidArgument(msg)


def check_count(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        fail(name, f"an integer >= {minimum}", value)
    return int(value)


def check_format(value: object, name: str) -> Format:
    try:
        return get_format(value, argname=name)
    except _MhanumInvalid as exc:
        raise InvalidArgument(str(exc)) from None


_KNOWN = (*STRUCTURES, *RANGE_STRUCTURES)


def check_structure(value: str | Iterable[str] | None) -> frozenset[str] | None:
    """The named structures (``"range"`` kept as a marker for a drawn range mix), or ``None``."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, Iterable):
        fail("structure", f"None, a name or names from {_KNOWN}", value)
    names = tuple(names)
    unknown = [n for n in names if n not in _KNOWN and n not in ("plain", "range")]
    if unknown:
        fail("structure", f"names from {_KNOWN} (or 'plain', 'range')", unknown)
    return frozenset(n for n in names if n != "plain")


def _lazy(value: object, check: Callable[[object], object]) -> st.SearchStrategy[Any]:
    """A strategy of checked values: a value is checked now, a strategy's draws when drawn."""
    if isinstance(value, st.SearchStrategy):
        return value.map(check)
    return st.just(check(value))
