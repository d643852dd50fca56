"""Provably exact zeros of the output (Lindemann-Weierstrass), and the scale as an exact dyadic."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from mhanum.params import MHAParams
from mhanum.reference import _exact
from mhanum.reference._backends import exact_affine
from mhanum.reference._spec import ExactZero, ScoreSpec

# --- provably exact zeros ----------------------------------------------------------------------
#
# A row's output is ``o = sum_g e**(l_g) W_g / Z`` over the groups ``g`` of included keys with equal
# logits ``l_g`` (``W_g`` the sum of their values, rational; the logits algebraic, since the scale
# is a float or ``1/sqrt(d_k)``). By the Lindemann-Weierstrass theorem the ``e**(l_g)`` of distinct
# algebraic ``l_g`` are linearly independent over the algebraic numbers, so ``o = 0`` exactly iff
# every ``W_g = 0``. Keys are grouped by an exact key of their logit (:func:`_logit_key`): equal
# keys have equal logits, and distinct keys distinct logits unless there is a soft-cap (splitting
# a group only makes the test stricter). A zero is accepted only when so proved; otherwise the
# precision keeps doubling.


def _fraction(x: float) -> Fraction:
    return Fraction(float(x))


def _rational_scale(spec: ScoreSpec) -> Fraction | None:
    """The scale as a Fraction where it is rational (given, or ``1/sqrt(d_k)`` of a square)."""
    if spec.scale is not None:
        man, exp = spec.scale
        return man * Fraction(2) ** exp
    root = math.isqrt(spec.d_k)
    return Fraction(1, root) if root * root == spec.d_k else None


def _logit_key(
    dot: Fraction, bias: Fraction, scale: Fraction | None, spec: ScoreSpec
) -> tuple[Fraction, Fraction]:
    """An exact pair, equal for two keys of one row exactly where their logits are equal.

    The logit is ``scale·dot + bias`` (soft-capped: ``c·tanh(scale·dot/c) + bias``). With an
    irrational scale, ``1/sqrt(d_k)``, it determines ``(dot, bias)``; with a rational one it is
    itself rational, ``(0, scale·dot + bias)``. With a soft-cap, equal pairs ``(dot, bias)`` give
    equal logits (the converse is not claimed). Differences of keys are differences of logits.
    """
    if scale is None or spec.softcap is not None:
        return dot, bias
    return Fraction(0), scale * dot + bias


def attention_zeros(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: ScoreSpec) -> ExactZero:
    """Whether an output of attention is exactly 0: every group's values sum to 0."""
    batch = spec.excluded.shape[:-2]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    groups: dict[tuple[int, ...], list[list[int]]] = {}

    def exact_zero(index: tuple[int, ...]) -> bool:
        *b, i, c = index
        row = (*b, i)
        values = v[tuple(b)][:, c]
        if not values.any():
            return True
        if row not in groups:
            groups[row] = _logit_groups(q[row], k[tuple(b)], spec, row)
        if groups[row] is None:
            return True
        return all(sum(_fraction(values[j]) for j in group) == 0 for group in groups[row])

    return exact_zero


def value_zeros(v: np.ndarray, spec: ScoreSpec) -> ExactZero:
    """Whether an output is exactly 0 with no test of its logits (those of rotated inputs are
    irrational, and their equalities are not decided): its column of ``v`` is 0 over the keys
    the row attends, or the row is fully masked and its output 0 (``"uniform"``: the column
    sums to 0). Sufficient only; a zero it misses is certified by its enclosure."""
    batch = spec.excluded.shape[:-2]
    v = np.broadcast_to(v, batch + v.shape[-2:])

    def exact_zero(index: tuple[int, ...]) -> bool:
        *b, i, c = index
        keep = ~spec.excluded[(*b, i)]
        values = v[tuple(b)][:, c]
        if keep.any():
            return not values[keep].any()
        if spec.fully_masked != "uniform":
            return True
        return sum(_fraction(x) for x in values) == 0

    return exact_zero


def mha_value_zeros(params: MHAParams) -> ExactZero:
    """Whether an output of multi-head attention is exactly 0 with no test of its logits (those
    of rotated projections are irrational): its column of ``wo`` is 0 and its ``bo`` is 0 or
    absent. Sufficient only; a zero it misses is certified by its enclosure."""
    wo = np.asarray(params.wo)
    bo = None if params.bo is None else np.asarray(params.bo)

    def exact_zero(index: tuple[int, ...]) -> bool:
        c = index[-1]
        return not wo[:, c].any() and (bo is None or not bo[..., c].any())

    return exact_zero


def _logit_groups(
    q_row: np.ndarray, keys: np.ndarray, spec: ScoreSpec, row: tuple[int, ...]
) -> Any:
    """Keys of one row grouped by :func:`_logit_key`; ``None`` for an output that is 0.

    A fully-masked row is 0 (``"zero"``, ``"nan"``) or uniform (one group of every key).
    """
    keep = np.flatnonzero(~spec.excluded[row])
    if not keep.size:
        return None if spec.fully_masked != "uniform" else [list(range(keys.shape[0]))]
    scale = _rational_scale(spec)
    by_logit: dict[tuple[Fraction, Fraction], list[int]] = {}
    for j in keep:
        dot = sum(
            (_fraction(a) * _fraction(b) for a, b in zip(q_row, keys[j], strict=True)), Fraction(0)
        )
        bias = Fraction(0) if spec.bias is None else _fraction(spec.bias[(*row, j)])
        by_logit.setdefault(_logit_key(dot, bias, scale, spec), []).append(int(j))
    return list(by_logit.values())


def mha_zeros(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: ScoreSpec
) -> ExactZero:
    """Whether an output of multi-head attention is provably exactly 0.

    ``y_c = bo_c + sum_h o_hc`` with ``o_hc = sum_j p_hj A_hjc`` and ``A_hj = v_hj wo_h`` exact.
    Within a head, keys are grouped by :func:`_logit_key`; ``o_hc = sum_g e**(l_g) W_g / sum_g
    e**(l_g) n_g`` (``W_g`` the group's sum of ``A_hjc``, ``n_g`` its size) is the rational ``r``
    if every ``W_g = r n_g`` (a single group, or equal paths). The other heads' terms are merged
    by (the head's logit keys relative to their least, with the group sizes; the group's
    relative key), which identifies equal probabilities across heads (with a soft-cap, by the
    keys themselves). ``y_c`` is 0 if the rational parts cancel ``bo_c`` and every merged sum is
    0 (a sufficient test: other zeros are not proved).
    """
    batch = spec.excluded.shape[:-3]
    x_q, x_kv = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (x_q, x_kv))
    d_k, d_v = params.qk_width // num_heads, params.v_width // num_heads
    scale = _rational_scale(spec)
    cache: dict[tuple[int, ...], Any] = {}

    def projections(b: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if b not in cache:
            q, k, v = (
                _fraction_matrix(exact_affine(x, w, bias))
                for x, w, bias in (
                    (x_q[b], params.wq, params.bq),
                    (x_kv[b], params.wk, params.bk),
                    (x_kv[b], params.wv, params.bv),
                )
            )
            cache[b] = q, k, v
        return cache[b]

    def exact_zero(index: tuple[int, ...]) -> bool:
        *b, i, c = index
        if not params.wo[:, c].any():
            return params.bo is None or params.bo[c] == 0
        q, k, v = projections(tuple(b))
        total = Fraction(0) if params.bo is None else _fraction(params.bo[c])
        merged: dict[Any, Fraction] = {}
        for h in range(num_heads):
            row = (*b, h, i)
            keys = slice(h * d_k, (h + 1) * d_k)
            paths = [
                sum(
                    (v[j, h * d_v + t] * _fraction(params.wo[h * d_v + t, c]) for t in range(d_v)),
                    Fraction(0),
                )
                for j in range(v.shape[0])
            ]
            keep = np.flatnonzero(~spec.excluded[row])
            if not keep.size:
                if spec.fully_masked == "uniform":
                    total += sum(paths, Fraction(0)) / len(paths)
                continue
            groups: dict[tuple[Fraction, Fraction], list[int]] = {}
            for j in keep:
                dot = sum((a * e for a, e in zip(q[i, keys], k[j, keys], strict=True)), Fraction(0))
                bias = Fraction(0) if spec.bias is None else _fraction(spec.bias[(*row, j)])
                groups.setdefault(_logit_key(dot, bias, scale, spec), []).append(int(j))
            sums = {
                key: sum((paths[j] for j in group), Fraction(0)) for key, group in groups.items()
            }
            ratio = sum(sums.values(), Fraction(0)) / len(keep)
            if all(sums[key] == ratio * len(group) for key, group in groups.items()):
                total += ratio
                continue
            # a shift of every logit leaves the probabilities alone; a soft-cap's are not shifts
            least = min(groups) if spec.softcap is None else (Fraction(0), Fraction(0))
            relative = {key: (key[0] - least[0], key[1] - least[1]) for key in groups}
            signature = tuple(sorted((pair, len(groups[key])) for key, pair in relative.items()))
            for key, pair in relative.items():
                merged[signature, pair] = merged.get((signature, pair), Fraction(0)) + sums[key]
        return total == 0 and not any(merged.values())

    return exact_zero


def _fraction_matrix(x: _exact.Dyadic) -> np.ndarray:
    """An exact ``Dyadic`` as an object array of ``Fraction``."""
    unit = Fraction(2) ** x.exp
    out = np.empty(x.shape, dtype=object)
    for index, value in np.ndenumerate(x.ints):
        out[index] = int(value) * unit
    return out
