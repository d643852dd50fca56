"""Theorem A.3e (papers/attention.md): one martingale per output entry. The ``Q Kᵀ`` dots'
roundings (A.3'), the probabilities' roundings (A.3'') and ``P·V``'s (R.8') are increments of
one martingale in the order the kernel computes them, so their bounds add as a root-sum-square
under one event per entry, not as three sums under three; the row sum's additions join them
(never alone: they have no event of their own)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.factors import chain, evaluation_rounding, order_of
from mhanum.bounds.forward.evaluation import quiet
from mhanum.bounds.forward.stage import RoundingKeys
from mhanum.numerics import Numerics

__all__ = [
    "GROUPS",
    "Increments",
    "one_martingale_step",
    "replace_group",
    "rounding_martingale",
    "row_sum_martingale",
]

# the terms each martingale bounds: the logits' (A.3'), P·V's (R.8'), the probabilities'
# (A.3''), the row sum's (its additions' roundings, common to the row)
GROUPS = {
    "logits": ("logits",),
    "pv": ("pv",),
    "rounding": ("probability_rounding", "operands"),
    "softmax": ("softmax",),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Increments:
    """A term's bound in martingale form, per output entry: on its event the term is at most
    ``fixed + divided·λ·spread``, where ``spread >= (Σ_k b_k²)^½`` over the bounds ``b_k`` on
    the increments of a martingale, ``fixed`` bounds the deterministic rest and ``divided >=
    1/Z`` the factor that divides the martingale (the logits' row sum in A.3'; ``None``: 1).
    ``det`` bounds the martingale's sum itself with probability 1 (for ``divided is None``)."""

    fixed: NumpyArray
    spread: NumpyArray
    divided: NumpyArray | None = None
    det: NumpyArray | float = 0.0

    def bound(self, lam: float) -> NumpyArray:
        """The term's bound on this martingale's own event (Azuma-Hoeffding with ``λ``)."""
        with quiet():
            scale = 1.0 if self.divided is None else self.divided
            return self.fixed + scale * (lam * self.spread)

    def scaled(self, factor: float | NumpyArray) -> Increments:
        """The bound of the term times ``factor >= 1`` (a later rounding's, ``scale_out``)."""
        with quiet():
            return Increments(
                self.fixed * factor, self.spread * factor, self.divided, self.det * factor
            )


def one_martingale_step(
    terms: dict[str, NumpyArray], forms: Mapping[str, Sequence[Increments]], lam: float
) -> None:
    """Theorem A.3e (papers/attention.md): the terms of the groups :data:`GROUPS` with a
    martingale form (``forms``), merged where that is smaller. Updates ``terms``.

    For the chosen groups ``S`` the error is ``Σ_{g∈S} (M_g/Z_g + R_g)`` with ``|R_g| <=
    fixed_g``, ``Z_g = Z`` for the logits and 1 otherwise; ``M_L/Z + Σ M_g = (1/Z)ΣM +
    (1 - 1/Z)Σ_{g≠L} M_g`` and ``|1 - 1/Z| <= z - 1`` for ``z >= 1/Z``; ``ΣM`` is one
    martingale in the kernel's order (every coefficient is fixed by earlier roundings), so by
    Azuma-Hoeffding ``|ΣM| <= λ(Σ_g spread_g²)^½`` with probability ``1 - 2e^{-λ²/2}``. The
    group choice (one of each group's forms, or its present term) is made entry by entry on the
    inputs only, so each entry's bound is one event; the merged amount is apportioned to the
    terms in proportion to ``spread_g²``."""
    options = [(GROUPS[g], [None, *alts]) for g, alts in forms.items() if alts]
    if len(options) < 2:
        return
    current = [_sum(terms, names) for names, _ in options]
    best, new = sum(current), list(current)
    for combo in itertools.product(*(alts for _, alts in options)):
        if sum(inc is not None for inc in combo) < 2:
            continue  # (one form alone is the group's own bound, taken already)
        values = _merged(combo, current, lam)
        with quiet():
            total = sum(values)
            better = total < best  # (False where either is NaN)
        best = np.where(better, total, best)
        new = [np.where(better, v, n) for v, n in zip(values, new, strict=True)]
    for (names, _), value in zip(options, new, strict=True):
        replace_group(terms, names, value)


def replace_group(terms: dict[str, NumpyArray], names: Sequence[str], value: NumpyArray) -> None:
    """Where ``value`` is below the sum of the terms ``names``, it replaces them, shared in
    their present proportions (a choice on the inputs only). Updates ``terms``."""
    old = _sum(terms, names)
    with quiet():
        smaller = value < old
        if len(names) == 1:
            terms[names[0]] = np.where(smaller, value, old)
            return
        share = np.where(old > 0, terms[names[0]] / old, 1.0)
        first, second = value * share, value * (1 - share)
    terms[names[0]] = np.where(smaller, first, terms[names[0]])
    terms[names[1]] = np.where(smaller, second, terms[names[1]])


def _sum(terms: dict[str, NumpyArray], names: Sequence[str]) -> NumpyArray:
    """The sum of the terms ``names``."""
    total = terms[names[0]]
    for name in names[1:]:
        total = total + terms[name]
    return total


def _merged(
    combo: Sequence[Increments | None], current: Sequence[NumpyArray], lam: float
) -> list[NumpyArray]:
    """Each group's share of the merged bound of the groups ``combo`` takes (``None``: the
    group keeps its present term)."""
    chosen = [inc for inc in combo if inc is not None]
    z: NumpyArray | float = 1.0
    for form in chosen:
        if form.divided is not None:
            z = np.maximum(z, form.divided)
    with quiet():
        spread = np.sqrt(sum(form.spread * form.spread for form in chosen))
        values = []
        for inc, cur in zip(combo, current, strict=True):
            if inc is None:
                values.append(cur)
                continue
            share = np.where(spread > 0, inc.spread * inc.spread / spread, 0.0)
            undivided = 0.0 if inc.divided is not None else np.where(z > 1, (z - 1) * inc.det, 0.0)
            values.append(inc.fixed + z * (lam * share) + undivided)
    return values


def rounding_martingale(
    keys: RoundingKeys, charges: tuple[NumpyArray, NumpyArray], v_abs: NumpyArray, rest: NumpyArray
) -> Increments:
    """Theorem A.3'' (papers/attention.md): the keys' relative roundings into the probability
    and operand formats as a martingale, with increments at most ``u_p p̄_j v̄_j`` and ``u_op(1
    + u_p) p̄_j v̄_j`` on the keys in their normal ranges (``keys``: ``(p̄, c2, normal,
    η_conv)``, ``c2 = u_p² + u_op²(1 + u_p)²``); the other keys keep their step-6 charges
    (``charges``: per key, the probabilities' and the operands'), and ``rest`` is the part of
    ``operands`` no rounding of ``p̂`` makes (the values' errors). The martingale's sum is at
    most ``(u_p + u_op(1 + u_p)) Σ_j p̄_j v̄_j <= (2 c2)^½ Σ_j p̄_j v̄_j`` (``det``)."""
    w_keys, c2, normal, eta_conv = keys
    prob, operand_p = charges
    ev_rel = evaluation_rounding(v_abs.shape[-2])
    with quiet():
        spread = np.sqrt(c2 * ((w_keys * w_keys) @ (v_abs * v_abs))) * (1 + ev_rel)
        kept = np.where(normal, 0.0, prob) @ v_abs + np.where(normal, eta_conv, operand_p) @ v_abs
        det = np.sqrt(2 * c2) * (w_keys @ v_abs) * (1 + ev_rel)
        return Increments(kept * (1 + ev_rel) + rest, spread, None, det)


def row_sum_martingale(
    num: Numerics,
    live: NumpyArray,
    common: tuple[NumpyArray, NumpyArray],
    row: tuple[NumpyArray, ...],
    scale: float | NumpyArray,
) -> Increments | None:
    """Theorem A.3e, the row sum (papers/attention.md): the computed row sum is ``D(1 + μ)``
    plus its additions' underflow, ``D`` the exact sum of the computed exponentials and ``μ =
    Σ_k δ_k T_k / D`` over its additions' roundings (``T_k`` the exact sum of the addition's
    computed operands, ``0 <= T_k <= (1 + γ)(1 + under/(1 - T_e))D``), so step 5''s common
    part ``(1/(1 + τ) - 1)õ`` is ``-μõ``, a martingale with increments at most ``u(1 + u)Õ``
    times that factor (``n_live - 1`` additions, each rounded twice where the backend may carry
    a narrower format in float32), plus ``(gT + T_e(1 + g) + under)/(1 - T)·Õ``, where ``T =
    (1 + T_e)(1 + g) - 1 + under``. ``common = (apart, Õ)``: step 5''s form without its
    common part, and ``Õ >= |õ|``; ``row = (T, g, T_e, under, sound)`` per row (step 5;
    ``g >= |μ|`` the sum's factor, ``sound`` the rows step 5 bounds); ``scale``: the output's
    factor. ``None`` for a sum that is not a summation tree (Kahan's). The online softmax's row
    sum on one block is the same sum (it starts from ``0·0``, exactly); over several blocks its
    rescalings depend on later maxima, and the caller does not take this form."""
    unit = order_of(num.summation)
    if not unit.tree:
        return None
    apart, o_tilde = common
    t, g, t_exp, under, sound = row
    u = num.format_of("softmax").u
    n = live.shape[-1]
    twice = 2 if unit.carried and u > 2.0**-24 else 1  # (rounded to float32, then to F_m)
    g_det = chain(n, num.summation, u, None, products=False)
    additions = np.maximum(live.sum(axis=-1, keepdims=True) - 1, 0)
    ev = 1 + evaluation_rounding(n)
    with quiet():
        rest = (g * t + t_exp * (1 + g) + under) / (1 - t) * o_tilde
        fixed = np.where(sound, (apart + rest) * ev, np.inf)
        # a computed partial sum is at most (1 + γ)(D + nη_m) <= (1 + γ)(1 + under/(1 - T_e))D
        most = (1 + g_det) * (1 + under / (1 - t_exp))
        spread = o_tilde * (u * (1 + u)) * most * np.sqrt(twice * additions) * ev
        det = g_det * o_tilde * ev
    return Increments(fixed * scale, spread * scale, None, det * scale)
