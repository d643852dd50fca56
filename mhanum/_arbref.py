"""The ``backend="arb"`` reference: python-flint ball arithmetic, certified by its radii.

Imported only when that backend is asked for; python-flint is the optional extra ``arb``
(``pip install "mhanum[arb]"``). Every input float converts to an exact ``arb``; products, ``exp``,
sums and quotients are Arb's rigorous balls at a working precision ``p``, so each output ball
contains the exact result. An output is certified when its radius is at most
``2**-ceil(digits log2 10) / 2`` of its midpoint (which implies ``10**-digits`` relative, as for
:func:`mhanum._fastref.certified`); otherwise ``p`` doubles, up to ``max_prec``. The flint
precision is a global (``flint.ctx.prec``): it is set for the computation and restored after.
"""

from __future__ import annotations

import math
from typing import Any

import mpmath
import numpy as np

from mhanum import _exact
from mhanum._errors import CertificationError

__all__ = ["attention", "multi_head_attention"]

_GUARD_BITS = 32


def _flint() -> Any:
    try:
        import flint
    except ImportError as error:
        msg = 'backend="arb" needs python-flint; install it with pip install "mhanum[arb]"'
        raise ImportError(msg) from error
    return flint


def _matrix(flint: Any, a: np.ndarray) -> Any:
    """A 2-D float64 array as an exact ``arb_mat``."""
    return flint.arb_mat([[float(x) for x in row] for row in a])


def _softmax_rows(
    flint: Any,
    scores: Any,
    scale: Any,
    bias: np.ndarray | None,
    excluded: np.ndarray,
    fully_masked: str,
) -> tuple[Any, np.ndarray]:
    """Probabilities ``arb_mat`` from score balls, and the undefined rows.

    Logits are differenced before scaling, ``scale (s_j - s_m) + (b_j - b_m)``, so that equal
    scores give a logit difference of exactly 0 (and exact probabilities), as in the exact backend.
    """
    l_q, l_k = excluded.shape
    rows, undefined = [], np.zeros(l_q, dtype=bool)
    zero = flint.arb(0)
    for i in range(l_q):
        keep = [j for j in range(l_k) if not excluded[i, j]]
        if not keep:
            undefined[i] = fully_masked == "nan"
            fill = flint.arb(1) / l_k if fully_masked == "uniform" else zero
            rows.append([fill] * l_k)
            continue
        biases = {j: zero if bias is None else flint.arb(float(bias[i, j])) for j in keep}
        top = max(keep, key=lambda j: (scores[i, j] * scale + biases[j]).mid())
        weights = {
            j: ((scores[i, j] - scores[i, top]) * scale + (biases[j] - biases[top])).exp()
            for j in keep
        }
        total = sum(weights.values(), zero)
        rows.append([weights[j] / total if j in weights else zero for j in range(l_k)])
    return flint.arb_mat(rows), undefined


def _scale(flint: Any, scale: tuple[int, int] | None, d_k: int) -> Any:
    if scale is None:
        return flint.arb(d_k).rsqrt()
    man, exp = scale
    return flint.arb(man) * flint.arb(2) ** exp


def _certify(run: Any, shape: tuple[int, ...], options: Any, start: int) -> Any:
    """Run ``run(prec)`` (arb outputs and undefined rows) doubling ``prec`` until certified."""
    flint = _flint()
    threshold = flint.arb(2) ** -(math.ceil(options.digits * math.log2(10)) + 1)
    saved = flint.ctx.prec
    prec = start
    try:
        while True:
            flint.ctx.prec = prec
            outputs, undefined = run(flint)
            worst = 0
            for index in np.ndindex(shape):
                if undefined[index[:-1]]:
                    continue
                ball = outputs[index]
                exact_zero = ball.is_exact() and ball.mid() == 0
                if not exact_zero and not ball.rad() <= threshold * abs(ball.mid()):
                    worst += 1
            if not worst:
                return _results(outputs, undefined, shape, options.return_mpf)
            if 2 * prec > options.max_prec:
                msg = (
                    f"could not certify {options.digits} digits within max_prec="
                    f"{options.max_prec} bits with backend 'arb': {worst} components not "
                    f"certified at {prec} bits"
                )
                raise CertificationError(msg)
            prec *= 2
    finally:
        flint.ctx.prec = saved


def _results(outputs: Any, undefined: np.ndarray, shape: tuple[int, ...], return_mpf: bool) -> Any:
    floats = np.full(shape, math.nan)
    pairs = {}
    for index in np.ndindex(shape):
        if not undefined[index[:-1]]:
            pairs[index] = tuple(int(t) for t in outputs[index].mid().man_exp())
            floats[index] = _exact.to_float64(*pairs[index])
    if not return_mpf:
        return floats
    ctx = mpmath.MPContext()
    ctx.prec = max([abs(man).bit_length() for man, _ in pairs.values()] + [53])
    values = np.full(shape, ctx.nan, dtype=object)
    for index, pair in pairs.items():
        values[index] = ctx.mpf(pair)
    return floats, values


def _start(options: Any) -> int:
    return math.ceil(options.digits * math.log2(10)) + _GUARD_BITS


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: Any, options: Any) -> Any:
    """``softmax(scale q k^T + bias) v`` certified with Arb balls (see the module docstring)."""
    batch = spec.excluded.shape[:-2]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v))
    shape = (*batch, q.shape[-2], v.shape[-1])

    def run(flint: Any) -> tuple[np.ndarray, np.ndarray]:
        outputs = np.empty(shape, dtype=object)
        undefined = np.zeros(shape[:-1], dtype=bool)
        scale = _scale(flint, spec.scale, spec.d_k)
        for b in np.ndindex(batch):
            scores = _matrix(flint, q[b]) * _matrix(flint, k[b].T)
            bias = None if spec.bias is None else spec.bias[b]
            probs, undefined[b] = _softmax_rows(
                flint, scores, scale, bias, spec.excluded[b], spec.fully_masked
            )
            out = probs * _matrix(flint, v[b])
            for i, c in np.ndindex(shape[-2:]):
                outputs[(*b, i, c)] = out[i, c]
        return outputs, undefined

    return _certify(run, shape, options, _start(options))


def multi_head_attention(
    x_q: np.ndarray, x_kv: np.ndarray, params: Any, num_heads: int, spec: Any, options: Any
) -> Any:
    """Multi-head attention certified with Arb balls (projections and heads in balls too)."""
    batch = spec.excluded.shape[:-3]
    x_q, x_kv = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (x_q, x_kv))
    shape = (*batch, x_q.shape[-2], params.d_out)
    d_k = params.qk_width // num_heads
    d_v = params.v_width // num_heads

    def affine(flint: Any, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> Any:
        out = _matrix(flint, x) * _matrix(flint, w)
        if b is not None:
            out = out + _matrix(flint, np.broadcast_to(b, (x.shape[0], w.shape[1])))
        return out

    def columns(flint: Any, m: Any, start: int, width: int) -> Any:
        return flint.arb_mat([[m[i, start + c] for c in range(width)] for i in range(m.nrows())])

    def run(flint: Any) -> tuple[np.ndarray, np.ndarray]:
        outputs = np.empty(shape, dtype=object)
        undefined = np.zeros(shape[:-1], dtype=bool)
        scale = _scale(flint, None, d_k)
        wo = _matrix(flint, params.wo)
        for b in np.ndindex(batch):
            q = affine(flint, x_q[b], params.wq, params.bq)
            k = affine(flint, x_kv[b], params.wk, params.bk)
            v = affine(flint, x_kv[b], params.wv, params.bv)
            heads = []
            for h in range(num_heads):
                scores = (
                    columns(flint, q, h * d_k, d_k) * columns(flint, k, h * d_k, d_k).transpose()
                )
                bias = None if spec.bias is None else spec.bias[(*b, h)]
                probs, empty = _softmax_rows(
                    flint, scores, scale, bias, spec.excluded[(*b, h)], spec.fully_masked
                )
                undefined[b] |= empty
                heads.append(probs * columns(flint, v, h * d_v, d_v))
            merged = flint.arb_mat(
                [
                    [heads[t // d_v][i, t % d_v] for t in range(num_heads * d_v)]
                    for i in range(shape[-2])
                ]
            )
            out = merged * wo
            if params.bo is not None:
                out = out + _matrix(flint, np.broadcast_to(params.bo, (shape[-2], params.d_out)))
            for i, c in np.ndindex(shape[-2:]):
                outputs[(*b, i, c)] = out[i, c]
        return outputs, undefined

    return _certify(run, shape, options, _start(options))
