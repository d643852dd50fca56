"""Vectorised double-double attention with a rigorous componentwise error bound.

The fast path of :mod:`mhanum.reference` (``backend="dd"`` and the first try of ``"auto"``).
Every quantity is a ball of :mod:`mhanum.reference._dd`: a double-double center and a radius
that bounds its distance to the exact value, so the outputs come with a proven enclosure
``|o - (hi + lo)| <= rad`` (Theorem 1 of ``papers/reference.md``). The caller decides which
components that certifies to the requested digits and recomputes the others exactly.

The computation follows the exact backend's: scores and projections as products of exact floats
(:func:`mhanum.reference._dd.matmul`), logits shifted by a float per row (softmax is invariant
under an exact shift), ``exp``, the row sum, one reciprocal per row, the probabilities and the
output products. Nothing here rounds away a bound: where an input is outside the range an operation
covers (overflow, ``exp`` of a huge argument), the radius is ``inf`` or the center NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from mhanum._threads import bound_threads, map_threads
from mhanum.reference import _dd
from mhanum.reference._dd import Ball

__all__ = [
    "MAX_DIGITS",
    "attention",
    "attention_grad",
    "certified",
    "multi_head_attention",
    "probabilities",
    "scale_ball",
    "softmax",
]

# The most digits the fast path is meant to certify: its error bounds are near 2**-95 of the
# values (Theorem 1), 10**-28.6; asking more is sent to the exact path (or refused for "dd").
MAX_DIGITS = 26


def scale_ball(scale: tuple[int, int] | None, d_k: int) -> Ball:
    """The score scale as a ball: exact for a given float, ``1/sqrt(d_k)`` enclosed otherwise."""
    if scale is not None:
        man, exp = scale
        return _dd.constant(Fraction(man) * Fraction(2) ** exp)
    bits = 200
    low = Fraction(math.isqrt((1 << (2 * bits)) // d_k), 1 << bits)
    ball = _dd.constant(low)
    # 1/sqrt(d_k) - low < 2**-bits (mhanum.reference._spec.scale_dyadic).
    rad = 0.0 if ball.rad is None else float(ball.rad)
    return Ball(ball.hi, ball.lo, _dd.up(rad + 2.0**-bits))


def _exact(x: np.ndarray) -> Ball:
    return Ball(x, np.zeros_like(x), None)


def _map(x: Ball, fn: Callable[[np.ndarray], np.ndarray]) -> Ball:
    return Ball(fn(x.hi), fn(x.lo), None if x.rad is None else fn(x.rad))


def _where(condition: np.ndarray, x: Ball, hi: float, rad: float) -> Ball:
    """``x`` with the center ``hi`` (low part 0) and radius ``rad`` where ``condition`` holds."""
    radius = np.zeros_like(x.hi) if x.rad is None else x.rad
    return Ball(
        np.where(condition, hi, x.hi),
        np.where(condition, 0.0, x.lo),
        np.where(condition, rad, radius),
    )


# Elements per chunk of rows in the softmax, so that its temporaries stay in cache.
_CHUNK = 1 << 15


def probabilities(
    scores: Ball, scale: Ball, bias: np.ndarray | None, excluded: np.ndarray, fully_masked: str
) -> tuple[Ball, np.ndarray]:
    """``softmax(scale * scores + bias)`` by chunks of rows, and the undefined rows.

    Args:
        scores: ``(..., Lq, Lk)``, broadcastable to ``excluded``'s shape.
        scale: a scalar ball.
        bias: float64 of ``excluded``'s shape, or ``None``.
        excluded: ``(..., Lq, Lk)``, True where a key is excluded.
        fully_masked: the policy.
    """
    shape = excluded.shape
    l_k = shape[-1]

    def rows(a: np.ndarray) -> np.ndarray:
        return np.broadcast_to(a, shape).reshape(-1, l_k)

    flat_scores = _map(scores, rows)
    flat_bias = None if bias is None else rows(bias)
    flat_excluded = rows(excluded)
    count = flat_excluded.shape[0]
    hi, lo, rad = (np.empty((count, l_k)) for _ in range(3))
    undefined = np.empty(count, dtype=bool)
    step = max(1, _CHUNK // l_k)
    for start in range(0, count, step):
        part = slice(start, start + step)
        chunk = Ball(
            flat_scores.hi[part],
            flat_scores.lo[part],
            None if flat_scores.rad is None else flat_scores.rad[part],
        )
        logits = _dd.mul(scale, chunk)
        if flat_bias is not None:
            logits = _dd.add(logits, _exact(flat_bias[part]))
        p, undefined[part] = softmax(logits, flat_excluded[part], fully_masked)
        hi[part], lo[part] = p.hi, p.lo
        rad[part] = 0.0 if p.rad is None else p.rad
    return Ball(hi.reshape(shape), lo.reshape(shape), rad.reshape(shape)), undefined.reshape(
        shape[:-1]
    )


def softmax(logits: Ball, excluded: np.ndarray, fully_masked: str) -> tuple[Ball, np.ndarray]:
    """Probabilities (exactly 0 for excluded keys) and the undefined rows (Theorem 1, step 2).

    A fully-masked row is zero (``"zero"``, ``"nan"``, the latter also undefined) or uniform
    (``"uniform"``: every logit of the row replaced by exactly 0).
    """
    empty: np.ndarray = np.asarray(excluded.all(axis=-1))
    if fully_masked == "uniform":
        excluded = excluded & ~empty[..., None]
        logits = _where(np.broadcast_to(empty[..., None], excluded.shape), logits, 0.0, 0.0)
    top = np.where(excluded, -np.inf, logits.hi).max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    shifted = _dd.add(logits, _exact(np.broadcast_to(-top, logits.hi.shape)))
    weights = _where(excluded, _dd.exp(shifted), 0.0, 0.0)
    total = _row_sum(weights)
    probabilities = _dd.mul(weights, _map(_dd.reciprocal(total), lambda a: a[..., None]))
    probabilities = _where(excluded, probabilities, 0.0, 0.0)
    undefined = empty if fully_masked == "nan" else np.zeros_like(empty)
    return probabilities, undefined


def _row_sum(x: Ball) -> Ball:
    """Pairwise sum over the last axis (each level one :func:`mhanum.reference._dd.add`)."""
    while x.hi.shape[-1] > 1:
        if x.hi.shape[-1] % 2:
            x = _map(x, lambda a: np.concatenate([a, np.zeros_like(a[..., :1])], axis=-1))
        x = _dd.add(_map(x, lambda a: a[..., ::2]), _map(x, lambda a: a[..., 1::2]))
    return _map(x, lambda a: a[..., 0])


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    excluded: np.ndarray,
    bias: np.ndarray | None,
    scale: Ball,
    fully_masked: str,
) -> tuple[Ball, np.ndarray]:
    """Enclosure of ``softmax(scale q k^T + bias) v`` and the undefined rows ``(..., Lq)``.

    Every row's enclosure depends on that row of ``q``, ``excluded`` and ``bias`` alone (the
    scores' splitting scales each row by its own power of two, Lemma 4), so blocks of query
    rows are evaluated side by side (:func:`mhanum._threads.map_threads`) and stacked; each
    block's products are bounded in any summation order, as the whole one's are.

    Args:
        q, k, v: float64 ``(..., Lq, d_k)``, ``(..., Lk, d_k)``, ``(..., Lk, d_v)``.
        excluded: ``(..., Lq, Lk)``, True where a key is excluded.
        bias: float64 ``(..., Lq, Lk)`` (0 where excluded) or ``None``.
        scale: the scale as a ball (:func:`scale_ball`).
        fully_masked: ``"nan"``, ``"zero"`` or ``"uniform"``.
    """
    rows = excluded.shape[-2]
    blocks = _row_blocks(rows, excluded.size)
    if len(blocks) == 1:
        return _attention_rows(q, k, v, excluded, bias, scale, fully_masked)

    def block(cut: slice) -> tuple[Ball, np.ndarray]:
        def part(x: np.ndarray) -> np.ndarray:
            return x[..., cut, :] if x.shape[-2] == rows else x

        b = None if bias is None else part(bias)
        with np.errstate(all="ignore"):  # (per thread; the caller's state is ignore too)
            return _attention_rows(part(q), k, v, part(excluded), b, scale, fully_masked)

    done = map_threads(block, blocks)
    hi, lo, rad = (
        np.concatenate([getattr(o, part) for o, _ in done], axis=-2) for part in ("hi", "lo", "rad")
    )
    return Ball(hi, lo, rad), np.concatenate([u for _, u in done], axis=-1)


def _row_blocks(rows: int, logits: int) -> list[slice]:
    """One block of query rows per thread, each of at least ``8·_CHUNK`` logits (smaller
    problems are not worth a thread)."""
    count = max(1, min(bound_threads(), rows, logits // (8 * _CHUNK)))
    step = -(-rows // count)
    return [slice(a, a + step) for a in range(0, rows, step)]


def _attention_rows(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    excluded: np.ndarray,
    bias: np.ndarray | None,
    scale: Ball,
    fully_masked: str,
) -> tuple[Ball, np.ndarray]:
    """:func:`attention` of one block of query rows."""
    shape = excluded.shape
    scores = _dd.matmul(q, np.swapaxes(k, -1, -2))
    probs, undefined = probabilities(scores, scale, bias, excluded, fully_masked)
    values = np.broadcast_to(v, (*shape[:-2], *v.shape[-2:]))
    out = _dd.ball_matmul(probs, _exact(values))
    # Exact zeros: a column of v that is all zeros, and a fully-masked row that is not uniform
    # (the radius, which covers rounding, would not certify them).
    zero = ~np.any(values, axis=-2, keepdims=True)
    if fully_masked != "uniform":
        zero = zero | np.asarray(excluded.all(axis=-1))[..., None]
    return _where(np.broadcast_to(zero, out.hi.shape), out, 0.0, 0.0), undefined


def _negated(x: Ball) -> Ball:
    return Ball(-x.hi, -x.lo, x.rad)


def _transposed(x: Ball) -> Ball:
    return _map(x, lambda a: np.swapaxes(a, -1, -2))


def attention_grad(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    excluded: np.ndarray,
    bias: np.ndarray | None,
    scale: Ball,
) -> tuple[Ball, Ball, Ball, Ball]:
    """Enclosures of the gradients ``(dq, dk, dv, dS)`` of ``<g, softmax(scale q kᵀ + bias) v>``
    (papers/reference.md, Theorem 1 carried through the backward pass): ``P`` as
    :func:`attention` encloses it (excluded keys exactly 0), ``dv = Pᵀ g``, ``dP = g vᵀ`` (exact
    floats, :func:`mhanum.reference._dd.matmul`), ``D = rowsum(P ∘ dP)`` (pairwise, each level a
    ball sum), ``dS = P ∘ (dP - D)`` (exactly 0 at excluded keys), ``dq = scale·(dS k)`` and
    ``dk = scale·(dSᵀ q)``; every operation a ball operation of :mod:`mhanum.reference._dd`, so
    each enclosure is proven. A row that attends one key has ``P = 1`` there and ``D = dP``, so
    its ``dS`` and ``dq`` are exactly 0 (radius 0). Every row must attend some key (the caller
    checks it).

    Args:
        q, k, v, g: float64 ``(..., Lq, d_k)``, ``(..., Lk, d_k)``, ``(..., Lk, d_v)``,
            ``(..., Lq, d_v)``, broadcast to the batch of ``excluded``.
        excluded: ``(..., Lq, Lk)``, True where a key is excluded.
        bias: float64 ``(..., Lq, Lk)`` (0 where excluded) or ``None``.
        scale: the scale as a ball (:func:`scale_ball`).
    """
    shape = excluded.shape
    batch = shape[:-2]
    q, k, v, g = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v, g))
    scores = _dd.matmul(q, np.swapaxes(k, -1, -2))
    probs, _ = probabilities(scores, scale, bias, excluded, "zero")
    dv = _dd.ball_matmul(_transposed(probs), _exact(np.ascontiguousarray(g)))
    dp = _dd.matmul(g, np.swapaxes(v, -1, -2))
    d = _map(_row_sum(_dd.mul(probs, dp)), lambda a: a[..., None])
    ds = _dd.mul(probs, _dd.add(dp, _negated(_map(d, lambda a: np.broadcast_to(a, shape)))))
    # a row that attends one key has P = 1 there and D = dP: its dS (and so its dq) is exactly 0
    single = ((~excluded).sum(axis=-1) == 1)[..., None]
    ds = _where(excluded | single, ds, 0.0, 0.0)
    dq = _dd.mul(scale, _dd.ball_matmul(ds, _exact(np.ascontiguousarray(k))))
    dq = _where(np.broadcast_to(single, dq.hi.shape), dq, 0.0, 0.0)
    dk = _dd.mul(scale, _dd.ball_matmul(_transposed(ds), _exact(np.ascontiguousarray(q))))
    return dq, dk, dv, ds


def multi_head_attention(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    weights: dict[str, np.ndarray | None],
    num_heads: int,
    excluded: np.ndarray,
    bias: np.ndarray | None,
    fully_masked: str,
    scale: tuple[int, int] | None = None,
) -> tuple[Ball, np.ndarray]:
    """Enclosure of ``concat_h(attention_h) wo + bo`` and the undefined rows ``(..., Lq)``.

    Args:
        x_q, x_kv: float64 inputs ``(..., Lq, d_q)``, ``(..., Lk, d_kv)``.
        weights: float64 ``wq, bq, wk, bk, wv, bv, wo, bo`` (biases may be ``None``).
        num_heads: number of heads.
        excluded: ``(..., H, Lq, Lk)``.
        bias: float64 ``(..., H, Lq, Lk)`` or ``None``.
        fully_masked: the policy, per head.
        scale: the score scale as an exact dyadic ``(man, exp)``, or ``None`` for
            ``1/sqrt(d_k)``.
    """

    def project(x: np.ndarray, name: str) -> Ball:
        w, b = weights["w" + name], weights["b" + name]
        assert w is not None
        out = _dd.matmul(x, w)
        out = out if b is None else _dd.add(out, _exact(np.broadcast_to(b, out.hi.shape)))
        return _map(out, lambda a: _split_heads(a, num_heads))

    q, k, v = project(x_q, "q"), project(x_kv, "k"), project(x_kv, "v")
    shape = excluded.shape
    scores = _dd.ball_matmul(q, _map(k, lambda a: np.swapaxes(a, -1, -2)))
    ball = scale_ball(scale, q.hi.shape[-1])
    probs, undefined = probabilities(scores, ball, bias, excluded, fully_masked)
    values = _map(v, lambda a: np.broadcast_to(a, (*shape[:-2], *a.shape[-2:])))
    heads = _map(_dd.ball_matmul(probs, values), _merge_heads)
    wo, bo = weights["wo"], weights["bo"]
    assert wo is not None
    out = _dd.ball_matmul(heads, _exact(wo))
    if bo is not None:
        out = _dd.add(out, _exact(np.broadcast_to(bo, out.hi.shape)))
    return out, np.any(undefined, axis=-2)


def _split_heads(a: np.ndarray, num_heads: int) -> np.ndarray:
    """``(..., L, H*d)`` to ``(..., H, L, d)``."""
    return np.moveaxis(a.reshape((*a.shape[:-1], num_heads, a.shape[-1] // num_heads)), -2, -3)


def _merge_heads(a: np.ndarray) -> np.ndarray:
    """``(..., H, L, d)`` to ``(..., L, H*d)``, heads in order."""
    moved = np.moveaxis(a, -3, -2)
    return moved.reshape((*moved.shape[:-2], moved.shape[-2] * moved.shape[-1]))


def certified(out: Ball, digits: int) -> np.ndarray:
    """Where the enclosure proves ``|o - (hi + lo)| <= 10**-digits |o|`` (Theorem 1, last step).

    The test is ``rad <= 2**-ceil(digits log2 10) |hi| / 2``, which implies it since
    ``|o| >= |hi| (1 - u) - rad``.
    """
    threshold = math.ldexp(0.5, -math.ceil(digits * math.log2(10)))
    rad = np.zeros_like(out.hi) if out.rad is None else out.rad
    finite = np.isfinite(out.hi) & np.isfinite(out.lo)
    return finite & ((rad <= threshold * np.abs(out.hi)) | ((rad == 0) & (out.hi == 0)))
