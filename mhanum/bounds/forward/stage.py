"""What the stages of Theorem A.1 pass on (papers/attention.md, steps 0-7): one head's inputs
and setting, the logits' enclosure handed to the softmax, the values as the ``P·V`` dot reads
them, and the names of the side terms a stage carries out with its terms."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mhanum.bounds.forward.centring import centred
from mhanum.bounds.forward.keys import BandRows
from mhanum.bounds.forward.ranges import Ranges
from mhanum.numerics import Numerics

__all__ = [
    "ALONG",
    "KNOWN",
    "PLAIN",
    "PROJECTED",
    "SOFTMAX_PROJECTED",
    "STORED_DOTS",
    "STORED_PARTS",
    "STORED_PV",
    "UNSHAPED",
    "WHOLE",
    "Context",
    "Enclosure",
    "Head",
    "Projection",
    "RoundingKeys",
    "Setting",
    "Stored",
    "StoredSplit",
    "Values",
]

PLAIN = "output:plain"  # the plain output term, carried with the logits' parts out of a head
# A.2: the logits term through the output projection's weights (step (c')), carried likewise
PROJECTED = "logits:projected"
# A.2: the softmax term through the output projection's weights (step (c'')), carried likewise
SOFTMAX_PROJECTED = "softmax:projected"
# Theorem A.1g: the output's error along a direction g per row, less its entrywise form
ALONG = "along:coupled"
# Step 6k: the weights' terms at once, from the rounded probabilities known to within their
# enclosure (a term of the bound, named here because Theorem A.5' must not take it apart)
KNOWN = "known_probabilities"
# Step W: the computed output's magnitude, whatever the logit errors (safe softmax)
WHOLE = "output:whole"
# Theorem A.3‴: a head's parts for the projections', the scores' and the probabilities'
# roundings through the output projection, each entry's (:mod:`mhanum.bounds.forward.stored`);
# the first two shaped like the head's output, the rest like the layer's
STORED_PARTS = ("stored:rest", "stored:first", "stored:var_q", "stored:var_kv", "stored:second")
# Theorem A.3‴: a head's P·V roundings (R.8') through the output projection, shaped like the
# head's output: their increments' squared bounds, their bound with probability 1 and their
# deterministic rest (:func:`mhanum.bounds.forward.stored.stored_pv`)
STORED_PV = ("stored:pv_var", "stored:pv_first", "stored:pv_second")
# Theorem A.3‴: a head's QKᵀ dots' martingale (A.3') through ``ŵ`` with its signs instead of
# through ``|ŵ|`` on its own event: the rest without it (``rest_signed``, shaped like the head's
# output), its increments' squared bounds (``dots_var``, like the layer's output), its rest and
# its bound with probability 1 (``dots_second`` like the layer's, ``dots_first`` like the head's)
STORED_DOTS = ("stored:rest_signed", "stored:dots_var", "stored:dots_second", "stored:dots_first")
# the side parts a head carries out whose shape is not the output's
UNSHAPED = frozenset((PROJECTED, SOFTMAX_PROJECTED, ALONG, *STORED_PARTS, *STORED_PV, *STORED_DOTS))
# Theorem A.3'': the keys whose weights' relative roundings join the martingale, as ``(w, c2,
# keys, kept)``: ``w_j`` bounds the rounding's coefficient, ``c2`` the squared relative
# roundings' bound (``u_p² + u_op²(1 + u_p)²``), ``keys`` those keys (the others keep step 6's
# charge) and ``kept`` what each of them keeps deterministic (a conversion's or a flush's
# absolute part; a number or an array over the keys)
RoundingKeys = tuple[np.ndarray, float, np.ndarray, "float | np.ndarray"]


@dataclasses.dataclass(frozen=True, eq=False)
class Stored:
    """A.2 under A.3's model (Theorem A.3‴): the projections' relative roundings (their dots',
    biases' and the storage's) as martingale increments. ``moved`` bounds their sum in each
    entry of the head's ``q``, ``k``, ``v`` (the rest of each operand's error is ``errors -
    moved``) and ``sigma`` the root-sum-square of their bounds
    (:meth:`mhanum.bounds.projections.Linear.roundings`); ``w`` is the head's rows of the
    output projection's weights as the kernel reads them (signed); ``lam`` the ``λ`` of the
    layer's per-entry and per-row events (its martingales', A.3‴), ``None``: the head's."""

    moved: tuple[np.ndarray, np.ndarray, np.ndarray]
    sigma: tuple[np.ndarray, np.ndarray, np.ndarray]
    w: np.ndarray
    lam: float | None = None

    def rows(self, cut: Callable[[np.ndarray], np.ndarray]) -> Stored:
        """The query rows of this head (``cut`` applied to the queries' parts)."""
        m, s = self.moved, self.sigma
        return Stored((cut(m[0]), m[1], m[2]), (cut(s[0]), s[1], s[2]), self.w, self.lam)


@dataclasses.dataclass(frozen=True, eq=False)
class StoredSplit:
    """Theorem A.3‴ at the logits (:func:`mhanum.bounds.forward.across_keys.stored_split`):
    ``(b, rest)`` A.3''s split with the projections' relative roundings (and, where A.3''s second
    split takes them, the scores' roundings) taken out of ``rest``; ``moved`` bounds their
    part of each logit's error; ``w_k`` and ``w_s`` the squared increments of the keys' and
    the scores' roundings per key (before the weights ``p_j (v_j - o)``); ``c2_sig_q`` the
    queries' ``c²σ_q²`` and ``k`` the keys (the exact target's); ``dot_det`` bounds the dots'
    part of each logit's error (the martingale of ``b``) with probability 1."""

    b: np.ndarray
    rest: np.ndarray
    moved: np.ndarray
    w_k: np.ndarray
    w_s: np.ndarray
    c2_sig_q: np.ndarray
    k: np.ndarray
    stored: Stored
    dot_det: np.ndarray


class Projection(NamedTuple):
    """A.2 (c') and (c''): a head's values through its rows ``ŵ`` of the output projection's
    weights (as rounded to the input format; the kernel reads ``ŵ_op``, within ``slope``).
    ``centred`` ``B_jm >= |v*_j·ŵ_op,m - c_m|`` (``c_m`` the keys' median of ``v_j·ŵ_m``),
    ``plain`` ``>= |v*_j·ŵ_op,m|``, for the exact values ``v*``; ``slope >= |ŵ_op|``."""

    centred: np.ndarray
    slope: np.ndarray
    plain: np.ndarray
    weights: np.ndarray


@dataclasses.dataclass(frozen=True, eq=False)
class Head:
    """One head's inputs, 2-D (papers/attention.md, A.1; A.2 step (b)).

    ``keep`` marks the attended keys (the exact attention's), ``bias`` is finite where ``keep``.
    ``masked`` (only for a finite masking constant) marks the keys the mask excludes (step 3');
    ``replaced`` the logits the mask replaces by a constant (their scores never reach the
    softmax). ``errors`` bound ``|q_used - q|`` etc., the operands the dots read before any
    operand-format rounding (step 1); ``given`` bounds the errors of the float64 ``q, k, v``
    themselves against the exact values (A.2: float64 projections; the scale on q and k).
    ``project`` (A.2, step (c')) and ``along`` (A.1g) couple the logits' errors through the
    output projection's weights and along a direction per row (:func:`softmax_pv`); ``stored``
    (A.2 with ``lam``, Theorem A.3‴) the projections' relative roundings.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    keep: np.ndarray
    errors: tuple[Any, Any, Any]
    bias: np.ndarray | None = None
    given: tuple[Any, Any, Any] | None = None
    masked: np.ndarray | None = None
    replaced: np.ndarray | None = None
    project: Projection | None = None
    along: tuple[np.ndarray, np.ndarray] | None = None
    stored: Stored | None = None

    def rows(self, sl: slice) -> Head:
        """The query rows ``sl`` of this head (the keys and values enter every row alike)."""
        n = self.q.shape[-2]

        def cut(x: Any) -> Any:
            if isinstance(x, BandRows):
                return x.rows(sl)
            if isinstance(x, np.ndarray) and x.ndim >= 2 and x.shape[-2] == n:
                return x[..., sl, :]
            return x

        e, g, a, st = self.errors, self.given, self.along, self.stored
        return dataclasses.replace(
            self,
            q=cut(self.q),
            keep=cut(self.keep),
            bias=cut(self.bias),
            errors=(cut(e[0]), e[1], e[2]),
            given=None if g is None else (cut(g[0]), g[1], g[2]),
            masked=cut(self.masked),
            replaced=cut(self.replaced),
            along=None if a is None else (cut(a[0]), cut(a[1])),
            stored=None if st is None else st.rows(cut),
        )


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one head is computed: the numerics, the scale (``default_scale``: ``1/sqrt(d_k)``,
    irrational unless ``d_k = 4^m``), ``lam`` (A.3), the soft-cap (step 3c) and
    ``loose_constant`` (fp8 descaling: the scale constant charged as up to three roundings of
    its format, and its product as rounded, whatever value the kernel's constant takes);
    ``known_rounding``: steps 6k and 6r may replace the weights' charges (:class:`Context`);
    ``lam_entries``: the ``λ`` of the per-entry martingales of Theorems A.3', A.3'' and A.3e
    where they are a class of events of their own (``None``: ``lam``)."""

    num: Numerics
    scale: float
    default_scale: bool
    lam: float | None = None
    softcap: float | None = None
    loose_constant: bool = False
    known_rounding: bool = True
    lam_entries: float | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Enclosure:
    """The logits as steps 4-7 take them: ``s`` (``-inf`` where not live) off by at most
    ``delta``; ``fold`` the part of ``delta`` the exponent's argument carries beyond
    ``|ŝ_j - m|`` (step 3''), ``across`` A.3''s splits ``(b, δ')`` of the errors, ``lift_arg``
    each row's largest argument of a lifted exponential (``prob_offset``, step 3''), and
    ``kernel`` step 3k's enclosure of the kernel's scores (centre ``-inf`` where not live,
    radius), where some are known; ``stored`` Theorem A.3‴'s split (A.2 with ``lam``)."""

    s: np.ndarray
    delta: np.ndarray
    live: np.ndarray
    fold: np.ndarray | None = None
    across: list[tuple[np.ndarray, np.ndarray]] | None = None
    lift_arg: np.ndarray | None = None
    kernel: tuple[np.ndarray, np.ndarray] | None = None
    stored: StoredSplit | None = None

    def keys(self, cut: slice) -> Enclosure:
        """The keys ``cut`` (a split of split-KV, A.6)."""
        return Enclosure(
            self.s[:, cut],
            self.delta[:, cut],
            self.live[:, cut],
            None if self.fold is None else self.fold[:, cut],
            None if self.across is None else [(b[:, cut], d[:, cut]) for b, d in self.across],
            self.lift_arg,
            None if self.kernel is None else (self.kernel[0][:, cut], self.kernel[1][:, cut]),
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Values:
    """The values as ``P·V`` reads them (step 1): ``v`` and ``v_abs >= |ṽ|``, the operand bits
    of the probabilities and the values, the tensor-core unit's anchor (0 for none) and the
    keys' median of ``v`` per column (``centre``, step 4 centred; ``None``: taken where needed).
    What the stages read of them (``|v|``, the values' errors, their centred bound, the
    column sums and maxima of ``v_abs``) is taken once, on first use (:meth:`evaluated`)."""

    v: np.ndarray
    v_abs: np.ndarray
    bits_pv: tuple[int, int]
    anchor: float
    centre: np.ndarray | None = None

    def keys(self, cut: slice) -> Values:
        """The values of the keys ``cut`` (whose median is their own)."""
        return Values(self.v[cut], self.v_abs[cut], self.bits_pv, self.anchor)

    def evaluated(self) -> Values:
        """These values, with what the stages read of them taken: once for every chunk of a
        head's query rows, before the chunks' threads read them."""
        for name in ("abs_v", "extra", "extra_any", "deviation", "abs_sum", "abs_max", "abs_v_max"):
            getattr(self, name)
        return self

    @functools.cached_property
    def abs_v(self) -> np.ndarray:
        """``|v|``."""
        return np.abs(self.v)

    @functools.cached_property
    def extra(self) -> np.ndarray:
        """``v_abs - |v|``: the values' errors (0 for values read exactly)."""
        return self.v_abs - self.abs_v

    @functools.cached_property
    def extra_any(self) -> bool:
        """Whether a value has an error (an entry of :attr:`extra` other than zero)."""
        return bool(np.any(self.extra))

    @functools.cached_property
    def deviation(self) -> np.ndarray:
        """``|ṽ_j - c|``'s bound (step 4, centred: :func:`centred`)."""
        return centred(self.v, self.extra, self.centre)

    @functools.cached_property
    def abs_sum(self) -> np.ndarray:
        """``Σ_j v_abs_j`` per column."""
        return self.v_abs.sum(axis=0)

    @functools.cached_property
    def abs_max(self) -> np.ndarray:
        """``max_j v_abs_j`` per column (0 for no key)."""
        return self.v_abs.max(axis=0, initial=0.0)

    @functools.cached_property
    def abs_v_max(self) -> np.ndarray:
        """``max_j |v_j|`` per column (0 for no key)."""
        return self.abs_v.max(axis=0, initial=0.0)


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What every stage of steps 4-7 reads: the numerics, ``lam`` (A.3), the division's
    relative error, the range record the stages add to, and whether steps 6k and 6r (the
    rounded probabilities known where their enclosure lies within one rounding interval) may
    replace the charges of steps 4-6 (``False``: the classic steps, which Theorem A.5' takes
    apart)."""

    num: Numerics
    lam: float | None
    u_div: float
    ranges: Ranges
    known: bool = False
    lam_entries: float | None = None

    @property
    def lam_e(self) -> float | None:
        """The ``λ`` of the per-entry martingales (A.3', A.3'', A.3e): ``lam_entries``, or
        ``lam`` where every event shares one."""
        return self.lam if self.lam_entries is None else self.lam_entries
