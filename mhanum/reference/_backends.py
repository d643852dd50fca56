"""The exact (rational/dyadic) and the naive mpmath backends: the attention and multi-head attention at one working precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mpmath
import numpy as np

from mhanum.params import MHAParams
from mhanum.reference import _exact
from mhanum.reference._spec import (
    ARGMAX_SCALE_BITS,
    SCALE_GUARD_BITS,
    Compute,
    ScoreSpec,
    float_pair,
    scale_dyadic,
)

# --- exact backend -----------------------------------------------------------------------------

# An exact-backend stage at one working precision: exact values (probabilities, or outputs before
# their final rounding) and the undefined rows.
_Stage = Callable[[mpmath.MPContext], tuple[_exact.Floating, np.ndarray]]


def exact_attention(
    q: _exact.Dyadic, k: _exact.Dyadic, v: _exact.Dyadic, spec: ScoreSpec
) -> _Stage:
    """The computation of ``o = P @ v`` at a working precision (scores computed once, here)."""
    probabilities = _exact_probabilities(q, k, spec)

    def outputs(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        probs, undefined = probabilities(ctx)
        return _exact.rows_matmul(probs, v, prec=ctx.prec), undefined

    return outputs


def exact_mha(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: ScoreSpec
) -> _Stage:
    """The computation of ``y`` at a working precision (everything exact computed once, here).

    ``y = sum_h P_h @ (v_h @ wo_h) + bo``: the products ``v_h @ wo_h`` are exact and independent
    of the precision, so the probabilities, which are rounded, are multiplied once, and no
    rounded intermediate (such as a head output) can lose bits that a later cancellation needs.
    """
    q, k, v = (
        exact_affine(x, w, b).map(lambda a: _split_heads(a, num_heads))
        for x, w, b in (
            (x_q, params.wq, params.bq),
            (x_kv, params.wk, params.bk),
            (x_kv, params.wv, params.bv),
        )
    )
    probabilities = _exact_probabilities(q, k, spec)
    paths = _value_paths(v, params, num_heads)
    with_bias = params.bo is not None

    def outputs(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        probs, undefined = probabilities(ctx)
        merged = probs.map(_merge_heads)
        if with_bias:
            merged = _append_one(merged)
        return _exact.rows_matmul(merged, paths, prec=ctx.prec), np.any(undefined, axis=-2)

    return outputs


def exact_affine(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> _exact.Dyadic:
    product = _exact.matmul(_exact.Dyadic.from_float64(x), _exact.Dyadic.from_float64(w))
    return product if b is None else _exact.add(product, _exact.Dyadic.from_float64(b))


def _value_paths(v: _exact.Dyadic, params: MHAParams, num_heads: int) -> _exact.Dyadic:
    """``[v_1 @ wo_1; ...; v_H @ wo_H; bo]``, ``(..., H*Lk (+1), d_out)``, exactly.

    Row ``h*Lk + j`` is what key ``j`` of head ``h`` contributes to the output per unit weight;
    the last row, present when ``bo`` is, is the bias (the weights get a column of ones).
    """
    wo = params.wo.reshape(num_heads, params.v_width // num_heads, params.d_out)
    per_head = _exact.matmul(v, _exact.Dyadic.from_float64(wo))
    paths = per_head.map(
        lambda a: a.reshape((*a.shape[:-3], a.shape[-3] * a.shape[-2], a.shape[-1]))
    )
    if params.bo is None:
        return paths
    bias = _exact.Dyadic.from_float64(params.bo)
    bias = bias.map(lambda a: np.broadcast_to(a, (*paths.shape[:-2], 1, a.shape[-1])))
    return _exact.concatenate([paths, bias], axis=-2)


def _exact_probabilities(q: _exact.Dyadic, k: _exact.Dyadic, spec: ScoreSpec) -> _Stage:
    """Precompute the exact score differences; return the probabilities at a working precision.

    Each row's logits are taken relative to its largest score, key ``m``: ``d_ij = scale *
    (S_ij - S_im) + (b_ij - b_im)`` with the differences exact and ``scale`` a dyadic within
    ``2**-(prec+64)`` of the exact one (equal to it when it is dyadic), so ``d`` is exact and
    ``exp`` is the first rounding. (A shift of a row leaves its softmax unchanged; ``m`` only keeps
    ``exp`` small, so it is chosen with a 64-bit scale.)
    """
    shape = spec.excluded.shape
    scores = _exact.matmul(q, k.map(lambda a: np.swapaxes(a, -1, -2)))
    scores = scores.map(lambda a: np.broadcast_to(a, shape))
    bias = None if spec.bias is None else _exact.Dyadic.from_float64(spec.bias)
    top = _row_argmax(scores, bias, spec)
    delta_scores = _minus_at(scores, top)
    delta_bias = None if bias is None else _minus_at(bias, top)

    def probabilities(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        logits = _scaled(delta_scores, scale_dyadic(spec, ctx.prec + SCALE_GUARD_BITS))
        if delta_bias is not None:
            logits = _exact.add(logits, delta_bias)
        return _exact_softmax(ctx, _dyadic_logits(ctx, logits), spec)

    def capped(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        scaled = _scaled(scores, scale_dyadic(spec, ctx.prec + SCALE_GUARD_BITS))
        assert spec.softcap is not None
        cap = ctx.mpf(spec.softcap)

        def row_logits(row: tuple[int, ...], keep: np.ndarray) -> list[Any]:
            t = {
                int(j): cap * ctx.tanh(ctx.ldexp(int(scaled.ints[(*row, j)]), scaled.exp) / cap)
                for j in np.flatnonzero(keep)
            }
            m = int(top[(*row, 0)])
            return [
                _plus_exact(ctx, t[j] - t[m], None if delta_bias is None else delta_bias, (*row, j))
                if kept
                else ctx.zero
                for j, kept in enumerate(keep)
            ]

        return _exact_softmax(ctx, row_logits, spec)

    return probabilities if spec.softcap is None else capped


def _dyadic_logits(ctx: mpmath.MPContext, logits: _exact.Dyadic) -> _RowLogits:
    """Each row's logits as exact mpf numbers (``ctx.ldexp``: no rounding)."""

    def row_logits(row: tuple[int, ...], keep: np.ndarray) -> list[Any]:
        return [
            ctx.ldexp(int(m), logits.exp) if kept else ctx.zero
            for m, kept in zip(logits.ints[row], keep, strict=True)
        ]

    return row_logits


def _plus_exact(
    ctx: mpmath.MPContext, x: mpmath.mpf, delta: _exact.Dyadic | None, index: tuple[int, ...]
) -> mpmath.mpf:
    """``x`` plus the exact dyadic ``delta[index]``, added exactly (no rounding)."""
    if delta is None:
        return x
    return ctx.fadd(x, ctx.ldexp(int(delta.ints[index]), delta.exp), exact=True)


def _scaled(x: _exact.Dyadic, scale: tuple[int, int]) -> _exact.Dyadic:
    man, exp = scale
    return _exact.Dyadic(x.exp + exp, ints=x.ints * man)


def _row_argmax(scores: _exact.Dyadic, bias: _exact.Dyadic | None, spec: ScoreSpec) -> np.ndarray:
    """Index ``(..., Lq, 1)`` of (approximately) the largest included score of each row."""
    logits = _scaled(scores, scale_dyadic(spec, ARGMAX_SCALE_BITS))
    if bias is not None:
        logits = _exact.add(logits, bias)
    below = min(logits.ints.flat, default=0) - 1
    return np.argmax(np.where(spec.excluded, below, logits.ints), axis=-1)[..., None]


def _minus_at(x: _exact.Dyadic, index: np.ndarray) -> _exact.Dyadic:
    """``x`` minus its element at ``index`` of each row, exactly."""
    return _exact.Dyadic(x.exp, ints=x.ints - np.take_along_axis(x.ints, index, axis=-1))


# A row's logits at a working precision: (row index, attended keys) -> mpf per key (0 if not).
_RowLogits = Callable[[tuple[int, ...], np.ndarray], list[Any]]


def _exact_softmax(
    ctx: mpmath.MPContext, row_logits: _RowLogits, spec: ScoreSpec
) -> tuple[_exact.Floating, np.ndarray]:
    """Probabilities at the working precision (exactly 0 for excluded keys), and undefined rows.

    Exact logits are mpf numbers made with ``ctx.ldexp`` (``ctx.mpf`` would round them to the
    working precision, and a rounded ``-1e60 - 1`` loses the ``- 1`` at 100 and at 200 bits
    alike); soft-capped ones are rounded only in their irrational part.
    """
    shape = spec.excluded.shape
    man = np.empty(shape, dtype=object)
    exp = np.empty(shape, dtype=object)
    undefined = np.zeros(shape[:-1], dtype=bool)
    for row in np.ndindex(shape[:-1]):
        keep = ~spec.excluded[row]
        if keep.any():
            logits = row_logits(row, keep)
            weights = [
                ctx.exp(logit) if kept else ctx.zero
                for logit, kept in zip(logits, keep, strict=True)
            ]
            total = ctx.fsum(weights)
            probs = _object_row([weight / total for weight in weights])
        else:
            probs, undefined[row] = _fully_masked_row(ctx, spec.fully_masked, shape[-1])
        # Probabilities are not negative, so mpf.man_exp (which drops the sign) is exact.
        man[row], exp[row] = zip(*(p.man_exp for p in probs), strict=True)
    return _exact.Floating(man, exp), undefined


def _fully_masked_row(ctx: mpmath.MPContext, policy: str, l_k: int) -> tuple[np.ndarray, bool]:
    """Weights of a fully-masked row and whether the row is undefined."""
    if policy == "uniform":
        return _object_row([ctx.one / l_k] * l_k), False
    return _object_row([ctx.zero] * l_k), policy == "nan"


def _object_row(values: list[Any]) -> np.ndarray:
    row = np.empty(len(values), dtype=object)
    row[:] = values
    return row


def _split_heads(a: np.ndarray, num_heads: int) -> np.ndarray:
    """``(..., L, H*d)`` to ``(..., H, L, d)``."""
    return np.moveaxis(a.reshape((*a.shape[:-1], num_heads, a.shape[-1] // num_heads)), -2, -3)


def _merge_heads(a: np.ndarray) -> np.ndarray:
    """``(..., H, L, d)`` to ``(..., L, H*d)``, heads in order."""
    moved = np.moveaxis(a, -3, -2)
    return moved.reshape((*moved.shape[:-2], moved.shape[-2] * moved.shape[-1]))


def _append_one(x: _exact.Floating) -> _exact.Floating:
    """Append a column of ones, so that a bias row appended to the weights is added."""
    ones = np.ones((*x.man.shape[:-1], 1), dtype=np.int64).astype(object)
    return _exact.Floating(
        np.concatenate([x.man, ones], axis=-1), np.concatenate([x.exp, ones * 0], axis=-1)
    )


def floating_outputs(core: _Stage) -> Compute:
    """Round a core's exact outputs to the working precision (the last rounding)."""

    def compute(ctx: mpmath.MPContext) -> tuple[np.ndarray, np.ndarray]:
        out, undefined = core(ctx)
        values = np.empty(out.man.shape, dtype=object)
        for index, man in np.ndenumerate(out.man):
            values[index] = ctx.mpf((man, out.exp[index]))
        return values, np.broadcast_to(undefined[..., None], values.shape)

    return compute


# --- mpmath (naive) backend --------------------------------------------------------------------


def bind_naive_attention(
    q: _exact.Floating, k: _exact.Floating, v: _exact.Floating, spec: ScoreSpec
) -> Compute:
    batch = spec.excluded.shape[:-2]
    v = v.map(lambda a: np.broadcast_to(a, batch + a.shape[-2:]))

    def compute(ctx: mpmath.MPContext) -> tuple[np.ndarray, np.ndarray]:
        probs, undefined = _naive_probabilities(ctx, q, k, spec)
        out = np.empty((*probs.shape[:-1], v.man.shape[-1]), dtype=object)
        for index in np.ndindex(out.shape):
            *row, c = index
            terms = [_times(p, *v.pair((*row[:-1], j, c))) for j, p in enumerate(probs[tuple(row)])]
            out[index] = ctx.mpf(_exact.sum_exact(terms, ctx.prec))
        return out, np.broadcast_to(undefined[..., None], out.shape)

    return compute


def bind_naive_mha(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: ScoreSpec
) -> Compute:
    """Exact projections; then, at a working precision, each output as one exact sum.

    ``y_ic = sum_h sum_j sum_t p_hij v_hjt wo_(h,t)c + bo_c``, the probabilities being the only
    rounded numbers in it.
    """
    q, k, v = (
        _naive_affine(_exact.Floating.from_float64(x), w, b).map(
            lambda a: _split_heads(a, num_heads)
        )
        for x, w, b in (
            (x_q, params.wq, params.bq),
            (x_kv, params.wk, params.bk),
            (x_kv, params.wv, params.bv),
        )
    )
    batch, d_v = spec.excluded.shape[:-3], v.man.shape[-1]
    v = v.map(lambda a: np.broadcast_to(a, batch + a.shape[-3:]))
    wo = _exact.Floating.from_float64(params.wo)
    bo = None if params.bo is None else _exact.Floating.from_float64(params.bo)

    def compute(ctx: mpmath.MPContext) -> tuple[np.ndarray, np.ndarray]:
        probs, undefined = _naive_probabilities(ctx, q, k, spec)
        out = np.empty((*probs.shape[:-3], probs.shape[-2], params.d_out), dtype=object)
        for index in np.ndindex(out.shape):
            *b, i, c = index
            terms = [] if bo is None else [bo.pair(c)]
            for (h, j), p in np.ndenumerate(probs[(*b, slice(None), i)]):
                for t in range(d_v):
                    terms.append(
                        _product(_times(p, *v.pair((*b, h, j, t))), wo.pair((h * d_v + t, c)))
                    )
            out[index] = ctx.mpf(_exact.sum_exact(terms, ctx.prec))
        rows = np.any(undefined, axis=-2)
        return out, np.broadcast_to(rows[..., None], out.shape)

    return compute


def _naive_affine(x: _exact.Floating, w: np.ndarray, b: np.ndarray | None) -> _exact.Floating:
    """``x @ w + b`` exactly, element by element."""
    w_exact = _exact.Floating.from_float64(w)
    b_exact = None if b is None else _exact.Floating.from_float64(b)
    n, width = w.shape
    man = np.empty((*x.man.shape[:-1], width), dtype=object)
    exp = np.empty_like(man)
    for index in np.ndindex(man.shape):
        *row, c = index
        terms = [_product(x.pair((*row, t)), w_exact.pair((t, c))) for t in range(n)]
        if b_exact is not None:
            terms.append(b_exact.pair(c))
        man[index], exp[index] = _exact.sum_exact(terms)
    return _exact.Floating(man, exp)


def _naive_probabilities(
    ctx: mpmath.MPContext, q: _exact.Floating, k: _exact.Floating, spec: ScoreSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax by loops: exact dot products, ``p_j = exp(s_j - s_m) / sum_l exp(s_l - s_m)``.

    ``s_j - s_m = scale * (q.k_j - q.k_m) + (b_j - b_m)`` is formed from exact differences (only
    an irrational scale rounds), ``m`` being the key of the largest score.

    Returns:
        ``(probs, undefined)``: mpf probabilities ``(..., Lq, Lk)`` (fully-masked rows per the
        policy, zeros where undefined) and the undefined rows ``(..., Lq)``.
    """
    shape = spec.excluded.shape
    batch, l_k = shape[:-2], shape[-1]
    q, k = (x.map(lambda a: np.broadcast_to(a, batch + a.shape[-2:])) for x in (q, k))
    scale = spec.scale if spec.scale is not None else 1 / ctx.sqrt(spec.d_k)
    probs = np.empty(shape, dtype=object)
    undefined = np.zeros(shape[:-1], dtype=bool)
    for row in np.ndindex(shape[:-1]):
        keys = [j for j in range(l_k) if not spec.excluded[(*row, j)]]
        if not keys:
            probs[row], undefined[row] = _fully_masked_row(ctx, spec.fully_masked, l_k)
            continue
        dots = {j: _naive_dot(q, k, row, j) for j in keys}
        biases = {j: _naive_bias(spec, row, j) for j in keys}
        if spec.softcap is not None:
            # c·tanh(s_j/c) - c·tanh(s_m/c) at the working precision, plus b_j - b_m exactly
            cap = ctx.mpf(spec.softcap)
            capped = {
                j: cap * ctx.tanh(_naive_logit(ctx, scale, dots[j], (0, 0)) / cap) for j in keys
            }
            m = max(keys, key=lambda j: capped[j] + ctx.ldexp(*biases[j]))
            logits = {
                j: ctx.fadd(
                    capped[j] - capped[m], ctx.ldexp(*_minus(biases[j], biases[m])), exact=True
                )
                for j in keys
            }
        else:
            m = max(keys, key=lambda j: _naive_logit(ctx, scale, dots[j], biases[j]))
            logits = {
                j: _naive_logit(ctx, scale, _minus(dots[j], dots[m]), _minus(biases[j], biases[m]))
                for j in keys
            }
        exps = {j: ctx.exp(logit) for j, logit in logits.items()}
        total = ctx.fsum(exps.values())
        probs[row] = _object_row([exps[j] / total if j in exps else ctx.zero for j in range(l_k)])
    return probs, undefined


def _naive_dot(
    q: _exact.Floating, k: _exact.Floating, row: tuple[int, ...], j: int
) -> tuple[int, int]:
    """``q_i . k_j`` exactly, as a pair."""
    return _exact.sum_exact(
        _product(q.pair((*row, t)), k.pair((*row[:-1], j, t))) for t in range(q.man.shape[-1])
    )


def _naive_bias(spec: ScoreSpec, row: tuple[int, ...], j: int) -> tuple[int, int]:
    return (0, 0) if spec.bias is None else float_pair(spec.bias[(*row, j)])


def _minus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """``a - b`` exactly, for pairs."""
    return _exact.sum_exact([a, (-b[0], b[1])])


def _naive_logit(
    ctx: mpmath.MPContext,
    scale: tuple[int, int] | mpmath.mpf,
    dot: tuple[int, int],
    bias: tuple[int, int],
) -> mpmath.mpf:
    """``scale * dot + bias`` as an mpf: exact for a dyadic scale, else one rounding (the product)."""
    if isinstance(scale, tuple):
        product = _product(scale, dot)
    else:
        product = _exact.mpf_pair(scale * ctx.ldexp(*dot))
    return ctx.ldexp(*_exact.sum_exact([product, bias]))


def _times(p: mpmath.mpf, man: int, exp: int) -> tuple[int, int]:
    """The exact product of an mpf and ``man * 2**exp`` as a pair."""
    return _product(_exact.mpf_pair(p), (man, exp))


def _product(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The exact product of two pairs."""
    return a[0] * b[0], a[1] + b[1]
