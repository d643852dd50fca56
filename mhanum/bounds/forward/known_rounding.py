"""Lemma 6k and when steps 6k and 6r take it (papers/attention.md): rounding to nearest is
monotone, so a value known to lie in ``[a, b]`` rounds into ``[A, B]``, one value of the
format where no rounding boundary lies between ``a`` and ``b``; and ``[a, b]`` itself, the
enclosure of the weight a kernel rounds into the probability format (which step 6 reads too)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mhanum._types import NumpyArray
from mhanum.bounds.factors import conversion_eta, evaluation_rounding, operand_error_of
from mhanum.bounds.forward.evaluation import dot, on, quiet, times_expm1
from mhanum.bounds.forward.extremes import PerKey, per_key
from mhanum.bounds.forward.stage import Context, Enclosure, Values
from mhanum.formats import round_to
from mhanum.numerics import Numerics
from mhanum.units import Online

__all__ = [
    "coarser_probabilities",
    "flush_floor",
    "kernel_weights",
    "known_roundings",
    "online_row_sum",
    "online_weights_lower_end",
    "rounded_range",
    "row_factor_known",
    "underflow_charge",
    "weights_before_rounding",
]


def coarser_probabilities(num: Numerics) -> bool:
    """Whether ``num`` stores its probabilities in a coarser format than its softmax computes
    them in: where steps 6k and 6r (and 3k through them) may apply."""
    return num.format_of("prob").u > num.format_of("softmax").u


def known_roundings(ctx: Context) -> bool:
    """Whether steps 6k and 6r may take the weights' roundings as known: asked for, the
    weights stored in a coarser format than the softmax computes them in, not lifted
    (``prob_offset``), and read by the dot exactly (:func:`operand_error_of`)."""
    num = ctx.num
    return (
        ctx.known
        and coarser_probabilities(num)
        and not num.prob_offset
        and not operand_error_of(num, num.format_of("prob"))[0]
    )


def underflow_charge(num: Numerics) -> float:
    """Step 6: the absolute error of rounding a weight below ``F_p``'s smallest normal number
    ``η_p``: ``η_p`` where the rounding may flush it to zero (``prob_underflow="flush"``),
    ``u_p·η_p``, half the subnormal spacing, under gradual underflow.

    Examples:
        >>> num = Numerics(input="float16", accum="float32", prob_format="float16")
        >>> underflow_charge(num) == 2.0**-14
        True
        >>> underflow_charge(num.replace(prob_underflow="gradual")) == 2.0**-25
        True
    """
    f_p = num.format_of("prob")
    return f_p.smallest_normal * (f_p.u if num.prob_underflow == "gradual" else 1.0)


def flush_floor(num: Numerics) -> float:
    """Lemma 6k: below this value the rounding into ``F_p`` may give 0 besides its nearest
    values: ``F_p``'s smallest normal number where it may flush, 0 under gradual underflow."""
    return 0.0 if num.prob_underflow == "gradual" else num.format_of("prob").smallest_normal


def rounded_range(
    num: Numerics, before: tuple[NumpyArray, NumpyArray]
) -> tuple[NumpyArray, NumpyArray]:
    """Lemma 6k: ``[A_j, B_j]``, the values ``fl_p`` may give for a value in ``[a_j, b_j]``:
    the nearest values of ``F_p`` to the float64 neighbours below ``a_j`` and above ``b_j``,
    and 0 below the smallest normal number of ``F_p`` (unless it underflows gradually:
    :func:`flush_floor`) or of the dot's read of it (a flush is one more way down to 0).

    Examples:
        >>> import numpy as np
        >>> num = Numerics(input="bfloat16", accum="float32", softmax_format="float32",
        ...                prob_format="bfloat16")
        >>> low, high = rounded_range(num, (np.array([1 / 3 - 1e-7]), np.array([1 / 3 + 1e-7])))
        >>> float(low[0]) == float(high[0]) == 0.333984375  # fl(1/3), known
        True
    """
    f_p = num.format_of("prob")
    eta_read = operand_error_of(num, f_p)[1] + conversion_eta(num, num.operand_rounding or f_p)
    a, b = before
    low = round_to(np.nextafter(np.maximum(a, 0.0), -np.inf), f_p)
    low = np.where(a >= max(flush_floor(num), eta_read), low, 0.0)
    return low, round_to(np.nextafter(b, np.inf), f_p)


def weights_before_rounding(
    enc: Enclosure, ctx: Context, pk: PerKey, x: NumpyArray, soft: NumpyArray
) -> tuple[NumpyArray, NumpyArray]:
    """``[a_j, b_j]``, an enclosure of the value the kernel rounds into ``F_p``: the normalised
    ``p̂_j`` (steps 4, 5: ``p̃_j`` within ``[lo_j, hi_j]`` and ``p̂_j`` within ``soft_j`` of
    it), or, online, the unnormalised ``ê_j = fl(exp(fl(ŝ_j - m)))`` with ``m`` the running
    maximum when ``j``'s block is visited: at least the largest logit of ``j``'s own block and
    at most the row's, whatever the blocks' order, and the exponential within the factor
    ``e^{±x_j}`` of step 5 (``x``, which covers the argument's rounding, the fold and the
    rescalings after it) and ``η_m``."""
    num = ctx.num
    if not isinstance(num.softmax_algorithm, Online):
        ev_rel = evaluation_rounding(enc.s.shape[-1])
        return pk.lo * (1 - ev_rel) - soft, pk.hi + soft
    block = num.softmax_algorithm.block
    n = enc.s.shape[-1]
    low = on(enc.live, pk.sc - enc.delta, -np.inf)
    pad = (-n) % block
    padded = np.pad(low, ((0, 0), (0, pad)), constant_values=-np.inf)
    own = padded.reshape(low.shape[0], -1, block).max(axis=-1)
    own = np.repeat(own, block, axis=-1)[:, :n]
    fold = 0.0 if enc.fold is None else enc.fold
    x_hi = pk.sc + enc.delta - own + fold + x
    eta_m = num.format_of("softmax").smallest_normal
    return online_weights_lower_end(enc, ctx, pk, x), np.exp(x_hi) * (1 + 2.0**-50) + eta_m


def online_weights_lower_end(enc: Enclosure, ctx: Context, pk: PerKey, x: NumpyArray) -> NumpyArray:
    """``a_j`` of :func:`weights_before_rounding` for the online softmax alone: the running
    maximum is at most the row's largest logit, and the exponential within ``e^{-x_j}(1 -
    expm1(x_j)²)`` and ``η_m`` (step 6 reads it to charge a flush only where ``ê_j`` may lie
    below ``F_p``'s smallest normal number).

    ``e^{-x_j}`` alone is not a lower factor: ``x_j = σ_j + Σ_i log1p(ε_i)`` (the argument's
    error, then the exponentials' and the rescalings' relative errors ``ε_i``), and a value
    ``ε_i`` below is ``1 - ε_i = (1 - ε_i²)/(1 + ε_i)``, so the factor is at least
    ``e^{-x_j}(1 - (Σ_i ε_i)²)`` with ``Σ_i ε_i <= expm1(x_j)`` (step 6r, papers/attention.md)."""
    top = on(enc.live, pk.sc + enc.delta, -np.inf).max(axis=-1, keepdims=True)
    fold = 0.0 if enc.fold is None else enc.fold
    x_lo = pk.sc - enc.delta - top - fold - x
    below = np.maximum(1 - np.expm1(x) ** 2, 0.0) * (1 - 2.0**-50)
    return np.exp(x_lo) * below - ctx.num.format_of("softmax").smallest_normal


def online_row_sum(
    before: tuple[NumpyArray, NumpyArray], live: NumpyArray, g_sum: float | NumpyArray, eta_m: float
) -> tuple[NumpyArray, NumpyArray]:
    """Step 6k online: ``[l_lo, l_hi]`` holds the row sum ``l̂`` a one-block online kernel
    divides by, the float sum in any order of its unrounded weights ``ê_j`` in ``[a_j, b_j]``
    (:func:`weights_before_rounding`; 0 on a masked key): within step 5's factor ``g_sum`` of
    their exact sum, and ``n·η_m`` for partial sums flushed below ``F_m``'s smallest normal
    number. Evaluated in float64 and rounded outward (``l_lo`` may be 0 or less: no bound).

    Examples:
        >>> import numpy as np
        >>> live = np.array([[True, True, False]])
        >>> before = (np.array([[0.5, 0.25, 9.0]]), np.array([[0.5, 0.25, 9.0]]))
        >>> lo, hi = online_row_sum(before, live, 2.0**-23, 2.0**-126)
        >>> bool(lo[0, 0] < 0.75 < hi[0, 0]) and float(hi[0, 0] - lo[0, 0]) < 2e-7
        True
    """
    a, b = before
    n = live.shape[-1]
    out = 1 + evaluation_rounding(n) + 2.0**-50
    with quiet():
        low = np.where(live, np.maximum(a, 0.0), 0.0).sum(axis=-1, keepdims=True)
        high = np.where(live, b, 0.0).sum(axis=-1, keepdims=True)
        return low * (1 - g_sum) / out - n * eta_m, high * (1 + g_sum) * out + n * eta_m


def kernel_weights(
    enc: Enclosure,
    kernel: tuple[NumpyArray, NumpyArray],
    sound: NumpyArray,
    soft_args: tuple[NumpyArray, NumpyArray],
    before: tuple[NumpyArray, NumpyArray],
) -> tuple[NumpyArray, NumpyArray]:
    """``[a_j, b_j]`` narrowed by step 3k: the kernel's scores lie in the box ``kernel`` too,
    so its ``p̃_j`` lies within that box's extremes (step 4) and ``p̂_j`` within ``soft_j`` of
    it (step 5, with the factors of ``enc``'s wider box, which cover the kernel's scores;
    ``sound``: the rows step 5 bounds).
    Both enclosures hold the value the kernel rounds (not online): their intersection."""
    y, eta_soft = soft_args
    pk = per_key(dataclasses.replace(enc, s=kernel[0], delta=kernel[1]))
    soft = on(sound, times_expm1(pk.hi, y), 0.0) + eta_soft
    ev_rel = evaluation_rounding(enc.s.shape[-1])
    return np.maximum(before[0], pk.lo * (1 - ev_rel) - soft), np.minimum(before[1], pk.hi + soft)


ROW_PIECES = 4
"""The most pieces step 6k's row factor is cut into (each one more pair of products)."""


def row_factor_known(
    enc: Enclosure,
    ctx: Context,
    weights: tuple[NumpyArray, NumpyArray, NumpyArray],
    values: Values,
    target: tuple[NumpyArray, NumpyArray, NumpyArray],
    unknown_keys: NumpyArray,
) -> NumpyArray | None:
    """Step 6k with the row's common factor (not online; papers/attention.md): a bound on
    ``|Σ_j fl_p(p̂_j) ṽ_j - o|``, or ``None`` where the step is not taken.

    The kernel's ``p̂_j = fl(ê_j/d̂)`` is ``G_j/Λ`` up to its own roundings, with ``G_j =
    e^{ŝ_j - t}`` times the exponential's factor (in ``[e^{-x_j}(1 - expm1(x_j)²), e^{x_j}]``)
    and ``Λ = d̂·e^{m̂ - t}`` one number for the row (``t`` the row's largest centre): ``Λ =
    (1 + τ)Σ_k e^{ŝ_k - t}`` with ``|τ| <= T`` (step 5), in ``[Λ_-, Λ_+]``. For ``Λ`` in a piece
    ``[Λ_a, Λ_b]`` of that interval, ``p̂_j`` lies in ``[G_j^-(1 - ε_÷)/Λ_b - η, G_j^+(1 +
    ε_÷)/Λ_a + η]`` (``η`` step 5's absolute part, ``eta_soft``), narrower than step 6k's
    ``[a_j, b_j]`` by the row sum's and the normalisation's spread, which are common to the row;
    Lemma 6k rounds it, and step 6k's bound for that piece follows. The kernel's ``Λ`` lies in
    one piece, so the largest of the pieces' bounds holds. ``weights``: step 5's ``x``, ``T``
    and ``eta_soft``; ``target``: the float64 output ``o``, its evaluation error and the values'
    errors ``v̄ - |v|``; ``unknown_keys``: where step 6k's own ``[A_j, B_j]`` holds two values.
    Taken on the rows where that is so for at least an eighth of the live keys and the spread
    is at least a key's own (else ``inf``, and ``None`` for no row), in up to
    :data:`ROW_PIECES` pieces.
    """
    x, t_sum, eta = weights
    o, ev_out, v_extra = target
    live, n = enc.live, enc.s.shape[-1]
    if enc.fold is not None or isinstance(ctx.num.softmax_algorithm, Online):
        return None
    ev = evaluation_rounding(n)
    with quiet():  # the rows where at least an eighth of the roundings are not known
        unknown = on(live, unknown_keys, False).sum(-1, keepdims=True) * 8 >= live.sum(
            -1, keepdims=True
        )
    if not unknown.any():
        return None
    s_lo, s_hi = enc.s - enc.delta, enc.s + enc.delta
    if enc.kernel is not None:  # step 3k: the kernel's scores lie in its box too
        s_lo = np.maximum(s_lo, enc.kernel[0] - enc.kernel[1])
        s_hi = np.minimum(s_hi, enc.kernel[0] + enc.kernel[1])
    with quiet():
        top = on(live, enc.s, -np.inf).max(axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        below = np.maximum(1 - np.expm1(x) ** 2, 0.0)
        g_lo = on(live, np.exp(s_lo - top - x) * below, 0.0) * (1 - ev)
        g_hi = on(live, np.exp(s_hi - top + x), 0.0) * (1 + ev)
        lam_lo = (1 - t_sum) * on(live, np.exp(s_lo - top), 0.0).sum(-1, keepdims=True)
        lam_hi = (1 + t_sum) * on(live, np.exp(s_hi - top), 0.0).sum(-1, keepdims=True)
        lam_lo, lam_hi = lam_lo * (1 - ev), lam_hi * (1 + ev)
        spread = np.log(lam_hi / lam_lo)
        # a key's own spread, log(G_j^+/G_j^-), averaged over the row's live keys
        own = on(live, s_hi - s_lo + 2 * x - np.log(below), 0.0)
        width = own.sum(-1, keepdims=True) / live.sum(-1, keepdims=True) + 2 * ev
        # each row's own number of pieces: the bound of a row is the row's alone
        pieces = np.minimum(np.ceil(spread / np.maximum(width, 2.0**-52)), ROW_PIECES)
    ok = (lam_lo > 0) & np.isfinite(spread) & (pieces >= 2) & unknown
    if not ok.any():
        return None
    pieces = np.where(ok, pieces, 1.0)
    ratio = np.where(ok, spread / pieces, 0.0)
    u_div = ctx.u_div
    worst = np.zeros_like(o)
    for piece in range(int(pieces.max())):
        with quiet():  # (a row of fewer pieces repeats its last, which reaches Λ_+)
            index = np.minimum(piece, pieces - 1)
            lam_a = np.where(ok, lam_lo * np.exp(ratio * index) * (1 - 2.0**-50), 1.0)
            upper = np.where(index == pieces - 1, lam_hi, lam_lo * np.exp(ratio * (index + 1)))
            lam_b = np.where(ok, upper * (1 + 2.0**-50), 1.0)
            a = g_lo * (1 - u_div) / lam_b * (1 - ev) - eta
            b = g_hi * (1 + u_div) / lam_a * (1 + ev) + eta
            low, high = rounded_range(ctx.num, (a, b))
            low, high = on(live, low, 0.0), on(live, high, 0.0)
            centre, radius = (low + high) / 2, (high - low) / 2
            shift = np.abs(centre @ values.v - o) * (1 + 2.0**-52)
            spread_v = (radius + ev * centre) @ values.v_abs + dot(high, v_extra, values.extra_any)
            worst = np.maximum(worst, (shift + spread_v + ev_out) * (1 + ev))
    return np.where(ok, worst, np.inf)
