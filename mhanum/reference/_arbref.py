"""The ``backend="arb"`` reference: python-flint ball arithmetic, certified by its radii.

Imported only when that backend is asked for; python-flint, which provides it,
is a dependency of mhanum. Every input float converts to an exact ``arb``; products, ``exp``,
sums and quotients are Arb's rigorous balls at a working precision ``p``, so each output ball
contains the exact result. An output is certified when its radius is at most
``2**-ceil(digits log2 10) / 2`` of its midpoint (which implies ``10**-digits`` relative, as for
:func:`mhanum.reference._fastref.certified`), or, no relative accuracy being possible at 0 (the
**Zeros** of :mod:`mhanum.reference`), when the ball contains 0 and the caller's exact test
proves the output 0, or when the ball lies within ``[-2**-1075, 2**-1075]``, where every real
number rounds to a float64 zero; both are returned as exactly 0. Otherwise ``p`` doubles, up to
``max_prec``. The flint precision is a global (``flint.ctx.prec``): it is set for the computation
and restored after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import mpmath
import numpy as np

from mhanum._errors import CertificationError
from mhanum.reference import _dd, _exact

if TYPE_CHECKING:
    from types import ModuleType

    from flint import arb, arb_mat

    from mhanum.params import MHAParams
    from mhanum.reference._spec import Options, ScoreSpec

__all__ = ["attention", "attention_grad", "multi_head_attention", "refine_mha_rows"]

_GUARD_BITS = 32
# Half the smallest float64 subnormal: every real number within it rounds to a float64 zero.
_HALF_SUBNORMAL = Fraction(1, 1 << 1075)

# Whether the exact output at an index (of a defined row) is provably 0.
_ExactZero = Callable[[tuple[int, ...]], bool]


def _flint() -> ModuleType:
    try:
        import flint
    except ImportError as error:
        msg = 'backend="arb" needs python-flint; install it with pip install python-flint'
        raise ImportError(msg) from error
    return flint


def _matrix(flint: ModuleType, a: np.ndarray) -> arb_mat:
    """A 2-D float64 array as an exact ``arb_mat`` (an object array of ``arb`` as its balls)."""
    if a.dtype == object:
        return flint.arb_mat(a.tolist())
    return flint.arb_mat([[float(x) for x in row] for row in a])


def _softmax_rows(
    flint: ModuleType,
    scores: arb_mat,
    scale: arb,
    bias: np.ndarray | None,
    excluded: np.ndarray,
    fully_masked: str,
    softcap: float | None = None,
) -> tuple[Any, np.ndarray]:
    """Probabilities ``arb_mat`` from score balls, and the undefined rows.

    Logits are differenced before scaling, ``scale (s_j - s_m) + (b_j - b_m)``, so that equal
    scores give a logit difference of exactly 0 (and exact probabilities), as in the exact backend.
    A soft-cap ``c`` makes them ``c·tanh(scale s_j/c) - c·tanh(scale s_m/c) + (b_j - b_m)``, the
    difference exactly 0 where ``s_j = s_m``.
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
        if softcap is None:
            top = max(keep, key=lambda j: (scores[i, j] * scale + biases[j]).mid())
            weights = {
                j: ((scores[i, j] - scores[i, top]) * scale + (biases[j] - biases[top])).exp()
                for j in keep
            }
        else:
            cap = flint.arb(softcap)
            capped = {j: cap * (scores[i, j] * scale / cap).tanh() for j in keep}
            top = max(keep, key=lambda j: (capped[j] + biases[j]).mid())

            gaps = {
                j: _capped_gap(scores[i, j], scores[i, top], capped[j], capped[top], zero)
                for j in keep
            }
            weights = {j: (gaps[j] + (biases[j] - biases[top])).exp() for j in keep}
        total = sum(weights.values(), zero)
        rows.append([weights[j] / total if j in weights else zero for j in range(l_k)])
    return flint.arb_mat(rows), undefined


def _capped_gap(s_j: arb, s_m: arb, c_j: arb, c_m: arb, zero: arb) -> arb:
    """``c_j - c_m`` for the capped scores of ``s_j`` and ``s_m``: exactly 0 where they are equal."""
    if s_j.is_exact() and s_m.is_exact() and s_j == s_m:
        return zero
    return c_j - c_m


def _scale(flint: ModuleType, scale: tuple[int, int] | None, d_k: int) -> arb:
    if scale is None:
        return flint.arb(d_k).rsqrt()
    man, exp = scale
    return flint.arb(man) * flint.arb(2) ** exp


def _certify(
    run: Callable[[ModuleType], tuple[Any, np.ndarray]],
    shape: tuple[int, ...],
    options: Options,
    start: int,
    exact_zero: _ExactZero | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Run ``run(prec)`` (arb outputs and undefined rows) doubling ``prec`` until certified.

    A ball is certified by its relative radius; or, as exactly 0, if it contains 0 and
    ``exact_zero`` proves the output 0, or if it lies within half the smallest subnormal
    (:func:`_rounds_to_zero`).
    """
    flint = _flint()
    threshold = flint.arb(2) ** -(math.ceil(options.digits * math.log2(10)) + 1)
    proved: dict[tuple[int, ...], bool] = {}
    saved = flint.ctx.prec
    prec = start
    try:
        while True:
            flint.ctx.prec = prec
            outputs, undefined = run(flint)
            worst, zeros = 0, []
            for index in np.ndindex(shape):
                if undefined[index[:-1]]:
                    continue
                ball = outputs[index]
                exact_zero_ball = ball.is_exact() and ball.mid() == 0
                if exact_zero_ball or ball.rad() <= threshold * abs(ball.mid()):
                    continue
                if _rounds_to_zero(ball) or (
                    exact_zero is not None
                    and ball.contains(0)
                    and _proved(proved, exact_zero, index)
                ):
                    zeros.append(index)
                    continue
                worst += 1
            if not worst:
                for index in zeros:
                    outputs[index] = flint.arb(0)
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


def _rounds_to_zero(ball: arb) -> bool:
    """Whether the ball lies within ``[-2**-1075, 2**-1075]``: every number in it rounds to a
    float64 zero (``2**-1075`` itself is a tie, which goes to the even 0).

    Compared by exponents: Arb's can be astronomically large (``exp(-1e60)``).
    """
    if not ball.is_finite():
        return False
    man, exp = (int(t) for t in ball.abs_upper().man_exp())
    return _at_most_half_subnormal(abs(man), exp)


def _at_most_half_subnormal(man: int, exp: int) -> bool:
    """Whether ``man * 2**exp <= 2**-1075`` for an integer ``man >= 0``, exactly."""
    if man == 0:
        return True
    top = exp + man.bit_length()  # 2**(top - 1) <= man * 2**exp < 2**top
    return top <= -1075 or (top == -1074 and man & (man - 1) == 0)


def _proved(
    known: dict[tuple[int, ...], bool], exact_zero: _ExactZero, index: tuple[int, ...]
) -> bool:
    """``exact_zero(index)``, computed once per index (a ball may be looked up at every
    precision)."""
    if index not in known:
        known[index] = exact_zero(index)
    return known[index]


def _results(
    outputs: Any, undefined: np.ndarray, shape: tuple[int, ...], return_mpf: bool
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
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


def _start(options: Options) -> int:
    return math.ceil(options.digits * math.log2(10)) + _GUARD_BITS


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    spec: ScoreSpec,
    options: Options,
    exact_zero: _ExactZero | None = None,
    rotate: Callable[[ModuleType], tuple[np.ndarray, np.ndarray]] | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """``softmax(scale q k^T + bias) v`` certified with Arb balls (see the module docstring);
    ``exact_zero(index)`` proves an output 0 (or is ``None``); ``rotate(flint)``, if given,
    returns the balls of the rotated ``q`` and ``k`` at the working precision, which replace
    ``q`` and ``k`` in the scores (RoPE, :func:`mhanum.reference._rope.arb_rotation`)."""
    batch = spec.excluded.shape[:-2]
    shape = (*batch, q.shape[-2], v.shape[-1])

    def batched(x: np.ndarray) -> np.ndarray:
        return np.broadcast_to(x, batch + x.shape[-2:])

    v = batched(v)

    def run(flint: ModuleType) -> tuple[np.ndarray, np.ndarray]:
        outputs = np.empty(shape, dtype=object)
        undefined = np.zeros(shape[:-1], dtype=bool)
        scale = _scale(flint, spec.scale, spec.d_k)
        qs, ks = (q, k) if rotate is None else rotate(flint)
        qs, ks = batched(qs), batched(ks)
        for b in np.ndindex(batch):
            scores = _matrix(flint, qs[b]) * _matrix(flint, ks[b].T)
            bias = None if spec.bias is None else spec.bias[b]
            probs, undefined[b] = _softmax_rows(
                flint, scores, scale, bias, spec.excluded[b], spec.fully_masked, spec.softcap
            )
            out = probs * _matrix(flint, v[b])
            for i, c in np.ndindex(shape[-2:]):
                outputs[(*b, i, c)] = out[i, c]
        return outputs, undefined

    return _certify(run, shape, options, _start(options), exact_zero)


def _head_grad(
    flint: ModuleType,
    q: arb_mat,
    k: arb_mat,
    v: arb_mat,
    d_out: arb_mat,
    scale: arb,
    bias: np.ndarray | None,
    excluded: np.ndarray,
    softcap: float | None,
) -> tuple[Any, ...]:
    """One head's ``(dq, dk, dv, dS, O)`` from Arb matrices (see :func:`attention_grad`)."""
    l_q, l_k = excluded.shape
    scores = q * k.transpose()
    probs, _ = _softmax_rows(flint, scores, scale, bias, excluded, "zero", softcap)
    d_v = probs.transpose() * d_out
    d_p = d_out * v.transpose()
    # dP_ij - D_i = (dP_ij - r) - Σ_l P_il (dP_il - r) for any r (Σ_l P_il = 1), with
    # r = dP at the row's most probable key: a row whose dP are all equal gets dS = 0
    # exactly, not a ball around 0, and a saturated row (P near one-hot) does not cancel
    # 1 - P against its tiny complement
    rows, tops = [], []
    for i in range(l_q):
        weights = [float(probs[i, j].mid()) for j in range(l_k)]
        top = weights.index(max(weights))
        tops.append(top)
        r = d_p[i, top]
        shifted = [d_p[i, j] - r for j in range(l_k)]
        mean = sum((probs[i, j] * shifted[j] for j in range(l_k)), flint.arb(0))
        rows.append([probs[i, j] * (shifted[j] - mean) for j in range(l_k)])
    d_s = flint.arb_mat(rows)
    d_a = d_s  # the gradient of the scaled scores: through the cap's slope sech²
    if softcap is not None:
        cap = flint.arb(softcap)
        # sech² rather than 1 - tanh²: no cancellation where tanh saturates (|s/c| in the
        # thousands needs thousands of bits the other way)
        slope = [[1 / (scores[i, j] * scale / cap).cosh() ** 2 for j in range(l_k)]
                 for i in range(l_q)]  # fmt: skip
        d_a = flint.arb_mat([[d_s[i, j] * slope[i][j] for j in range(l_k)]
                             for i in range(l_q)])  # fmt: skip
        d_q = d_a * k * scale
    else:
        # Σ_j dS_ij = 0, so dq_i = c Σ_j dS_ij (k_j - k_t) with t the pivot key: keys
        # that are all equal give dq = 0 exactly, not a ball around 0
        d_q = flint.arb_mat(
            [[sum((d_s[i, j] * (k[j, c] - k[tops[i], c]) for j in range(l_k)),
                  flint.arb(0)) for c in range(k.ncols())] for i in range(l_q)]
        ) * scale  # fmt: skip
    d_k = d_a.transpose() * q * scale
    return d_q, d_k, d_v, d_s, probs * v


def attention_grad(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    spec: ScoreSpec,
    options: Options,
    sink_column: bool = False,
) -> tuple[Any, ...]:
    """The gradients ``(dq, dk, dv, dbias)`` of ``<d_out, attention(q, k, v)>``, certified with
    Arb balls: ``P`` as in :func:`attention`, then ``dV = Pᵀ dO``, ``dP = dO Vᵀ``,
    ``D = rowsum(P ∘ dP)``, ``dS = P ∘ (dP - D)`` (evaluated as ``P ∘ ((dP - r) - rowsum(P ∘
    (dP - r)))``, ``r`` the ``dP`` of the row's most probable key, so that equal ``dP`` give an
    exact 0 and a saturated softmax no cancellation), ``dQ = c·dS K``, ``dK = c·dSᵀ Q`` and
    ``dbias = dS`` (the textbook backward; masked keys have ``P = 0`` and gradient 0). A
    soft-cap multiplies ``dS`` by the cap's slope ``1 - tanh²(c·qk/cap)`` before ``dQ`` and
    ``dK``. ``sink_column``: also the sum of ``dS``'s last column (a sink logit's gradient),
    certified with the rest."""
    batch = spec.excluded.shape[:-2]
    q, k, v, d_out = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v, d_out))
    l_q, l_k = spec.excluded.shape[-2:]
    shapes = [q.shape, k.shape, v.shape, (*batch, l_q, l_k)]
    if sink_column:
        shapes.append((*batch, 1, 1))
    sizes = [math.prod(s) for s in shapes]

    def run(flint: ModuleType) -> tuple[np.ndarray, np.ndarray]:
        parts = [np.empty(s, dtype=object) for s in shapes]
        scale = _scale(flint, spec.scale, spec.d_k)
        for b in np.ndindex(batch):
            bias = None if spec.bias is None else spec.bias[b]
            qb, kb, vb, gb = (_matrix(flint, x[b]) for x in (q, k, v, d_out))
            d_q, d_k, d_v, d_s, _ = _head_grad(
                flint,
                qb,
                kb,
                vb,
                gb,
                scale,
                bias,
                spec.excluded[b],
                spec.softcap,
            )
            mats = [d_q, d_k, d_v, d_s]
            if sink_column:
                column = sum((d_s[i, l_k - 1] for i in range(d_s.nrows())), flint.arb(0))
                mats.append(flint.arb_mat([[column]]))
            for part, m in zip(parts, mats, strict=True):
                rows, cols = part.shape[-2:]
                for i in range(rows):
                    for j in range(cols):
                        part[(*b, i, j)] = m[i, j]
        flat = np.concatenate([x.reshape(-1) for x in parts])[:, None]
        return flat, np.zeros(flat.shape[0], dtype=bool)

    flat = _certify(run, (sum(sizes), 1), options, _start(options))
    values = np.asarray(flat if not options.return_mpf else flat[0], np.float64).reshape(-1)
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(values[start : start + size].reshape(shape))
        start += size
    return tuple(out)


def _affine(flint: ModuleType, x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> arb_mat:
    out = _matrix(flint, x) * _matrix(flint, w)
    if b is not None:
        out = out + _matrix(flint, np.broadcast_to(b, (x.shape[0], w.shape[1])))
    return out


def _columns(flint: ModuleType, m: arb_mat, start: int, width: int) -> arb_mat:
    return flint.arb_mat([[m[i, start + c] for c in range(width)] for i in range(m.nrows())])


def _rotated(
    flint: ModuleType,
    m: arb_mat,
    name: str,
    rotate: Callable[[ModuleType, np.ndarray, str], np.ndarray],
) -> arb_mat:
    """A head's projected queries or keys (``name``) rotated as balls."""
    balls = np.empty((m.nrows(), m.ncols()), dtype=object)
    for i, j in np.ndindex(balls.shape):
        balls[i, j] = m[i, j]
    return _matrix(flint, rotate(flint, balls, name))


def _zero_row(flint: ModuleType, m: arb_mat) -> arb_mat:
    """``m`` with one more row of zeros (a sink's key or value)."""
    rows = [[m[i, c] for c in range(m.ncols())] for i in range(m.nrows())]
    return flint.arb_mat([*rows, [0] * m.ncols()])


def _first_rows(flint: ModuleType, m: arb_mat, count: int) -> arb_mat:
    if m.nrows() == count:
        return m
    return flint.arb_mat([[m[i, c] for c in range(m.ncols())] for i in range(count)])


def _merge(flint: ModuleType, heads: list[arb_mat]) -> arb_mat:
    """The heads' ``(L, d)`` matrices side by side, ``(L, H·d)``."""
    width = heads[0].ncols()
    return flint.arb_mat(
        [[heads[t // width][i, t % width] for t in range(len(heads) * width)]
         for i in range(heads[0].nrows())]
    )  # fmt: skip


def mha_grad(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    d_out: np.ndarray,
    params: MHAParams,
    num_heads: int,
    spec: ScoreSpec,
    options: Options,
    sink: bool = False,
    group: int = 1,
) -> tuple[Any, ...]:
    """The gradients of ``<d_out, multi_head_attention(...)>``, certified with Arb balls:
    ``(dx_q, dx_kv, dbias, {name: weight or bias gradient})``. The projections, every head's
    backward (:func:`_head_grad`) and the chain rule through the projections run in balls.
    ``db_k`` is exactly 0 (``Σ_j dS_ij = 0`` in every row, so ``Σ_j dK_j = c Σ_i q_i Σ_j
    dS_ij = 0``; with a soft-cap or a sink it is computed). ``sink``: the last key of every head
    is its sink (zero key and value; ``spec`` holds its bias column), whose ``dS`` column sum is
    ``dsink``, ``(..., H)``, returned last. ``group``: grouped-query attention, ``params``'s key
    and value projections of ``H / group`` heads, head ``h`` reading key/value head
    ``h // group``, whose ``dK`` and ``dV`` are the exact sums of its group's."""
    batch = spec.excluded.shape[:-3]
    x_q, x_kv, d_out = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (x_q, x_kv, d_out))
    l_q, l_k = spec.excluded.shape[-2:]
    keys = l_k - 1 if sink else l_k  # the real keys
    d_k = params.qk_width // num_heads
    d_v = np.shape(params.wo)[0] // num_heads
    names = [n for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
             if getattr(params, n) is not None]  # fmt: skip
    shapes = [x_q.shape, x_kv.shape, (*batch, num_heads, l_q, keys)]
    shapes += [np.shape(getattr(params, n)) for n in names]
    if sink:
        shapes.append((*batch, num_heads))
    sizes = [math.prod(s) for s in shapes]

    def run(flint: ModuleType) -> tuple[np.ndarray, np.ndarray]:
        values: list[Any] = [None] * len(shapes)
        for i in (0, 1, 2, len(shapes) - 1):
            values[i] = np.empty(shapes[i], dtype=object)
        total: dict[str, Any] = {}
        scale = _scale(flint, spec.scale, d_k)
        w = {n: _matrix(flint, getattr(params, n)) for n in ("wq", "wk", "wv", "wo")}
        for b in np.ndindex(batch):
            q = _affine(flint, x_q[b], params.wq, params.bq)
            k = _affine(flint, x_kv[b], params.wk, params.bk)
            v = _affine(flint, x_kv[b], params.wv, params.bv)
            g = _matrix(flint, d_out[b])
            d_o = g * w["wo"].transpose()
            dqs, dks, dvs, outs = [], [], [], []
            for h in range(num_heads):
                bias = None if spec.bias is None else spec.bias[(*b, h)]
                kv = h // group  # the key/value head of the group
                k_h, v_h = _columns(flint, k, kv * d_k, d_k), _columns(flint, v, kv * d_v, d_v)
                if sink:  # the sink: one more key, zero key and value
                    k_h, v_h = (_zero_row(flint, m) for m in (k_h, v_h))
                d_q, d_k_, d_v_, d_s, o = _head_grad(
                    flint,
                    _columns(flint, q, h * d_k, d_k),
                    k_h,
                    v_h,
                    _columns(flint, d_o, h * d_v, d_v),
                    scale,
                    bias,
                    spec.excluded[(*b, h)],
                    spec.softcap,
                )
                dqs.append(d_q)
                dks.append(_first_rows(flint, d_k_, keys))
                dvs.append(_first_rows(flint, d_v_, keys))
                outs.append(o)
                for i, j in np.ndindex(l_q, keys):
                    values[2][(*b, h, i, j)] = d_s[i, j]
                if sink:
                    values[-1][(*b, h)] = sum((d_s[i, keys] for i in range(l_q)), flint.arb(0))
            dks, dvs = (
                [
                    sum(m[j * group + 1 : (j + 1) * group], m[j * group])
                    for j in range(len(m) // group)
                ]
                for m in (dks, dvs)
            )  # a shared head's gradient: the exact sum of its group's
            dq, dk, dv, o = (_merge(flint, m) for m in (dqs, dks, dvs, outs))
            dx_q = dq * w["wq"].transpose()
            dx_kv = dk * w["wk"].transpose() + dv * w["wv"].transpose()
            for i, j in np.ndindex(x_q.shape[-2:]):
                values[0][(*b, i, j)] = dx_q[i, j]
            for i, j in np.ndindex(x_kv.shape[-2:]):
                values[1][(*b, i, j)] = dx_kv[i, j]
            xq, xkv = _matrix(flint, x_q[b]), _matrix(flint, x_kv[b])
            ones_q = flint.arb_mat([[1] * l_q])
            ones_k = flint.arb_mat([[1] * keys])
            parts = {
                "wq": xq.transpose() * dq,
                "wk": xkv.transpose() * dk,
                "wv": xkv.transpose() * dv,
                "wo": o.transpose() * g,
                "bq": ones_q * dq,
                "bk": ones_k * dk,
                "bv": ones_k * dv,
                "bo": ones_q * g,
            }
            for n in names:
                total[n] = parts[n] if n not in total else total[n] + parts[n]
        if "bk" in total and spec.softcap is None and not sink:  # Σ_j dS_ij = 0: exactly 0
            total["bk"] = flint.arb_mat(1, np.shape(params.bk)[-1])  # type: ignore[arg-type]
        for t, n in enumerate(names):
            m = total[n]
            values[3 + t] = np.array(
                [[m[i, j] for j in range(m.ncols())] for i in range(m.nrows())], dtype=object
            ).reshape(shapes[3 + t])
        flat = np.concatenate([x.reshape(-1) for x in values])[:, None]
        return flat, np.zeros(flat.shape[0], dtype=bool)

    flat = _certify(run, (sum(sizes), 1), options, _start(options))
    numbers = np.asarray(flat if not options.return_mpf else flat[0], np.float64).reshape(-1)
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(numbers[start : start + size].reshape(shape))
        start += size
    grads = dict(zip(names, out[3 : 3 + len(names)], strict=True))
    return out[0], out[1], out[2], grads, (out[-1] if sink else None)


def multi_head_attention(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    params: MHAParams,
    num_heads: int,
    spec: ScoreSpec,
    options: Options,
    exact_zero: _ExactZero | None = None,
    rotate: Callable[[ModuleType, np.ndarray, str], np.ndarray] | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Multi-head attention certified with Arb balls (projections and heads in balls too);
    ``exact_zero(index)`` proves an output 0 (or is ``None``); ``rotate(flint, balls, name)``,
    if given, rotates a head's projected queries (``name="q"``) or keys (``"k"``), an object
    array ``(L, d_k)`` of balls (RoPE, :func:`mhanum.reference._rope.arb_rotate`)."""
    batch = spec.excluded.shape[:-3]
    x_q, x_kv = (np.broadcast_to(x, batch + x.shape[-2:]) for x in (x_q, x_kv))
    shape = (*batch, x_q.shape[-2], params.d_out)
    d_k = params.qk_width // num_heads
    d_v = params.v_width // num_heads

    def run(flint: ModuleType) -> tuple[np.ndarray, np.ndarray]:
        outputs = np.empty(shape, dtype=object)
        undefined = np.zeros(shape[:-1], dtype=bool)
        scale = _scale(flint, spec.scale, d_k)
        wo = _matrix(flint, params.wo)
        for b in np.ndindex(batch):
            q = _affine(flint, x_q[b], params.wq, params.bq)
            k = _affine(flint, x_kv[b], params.wk, params.bk)
            v = _affine(flint, x_kv[b], params.wv, params.bv)
            heads = []
            for h in range(num_heads):
                q_h, k_h = _columns(flint, q, h * d_k, d_k), _columns(flint, k, h * d_k, d_k)
                if rotate is not None:
                    q_h, k_h = (_rotated(flint, m, n, rotate) for m, n in ((q_h, "q"), (k_h, "k")))
                scores = q_h * k_h.transpose()
                bias = None if spec.bias is None else spec.bias[(*b, h)]
                probs, empty = _softmax_rows(
                    flint,
                    scores,
                    scale,
                    bias,
                    spec.excluded[(*b, h)],
                    spec.fully_masked,
                    spec.softcap,
                )
                undefined[b] |= empty
                heads.append(probs * _columns(flint, v, h * d_v, d_v))
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

    return _certify(run, shape, options, _start(options), exact_zero)


# Fraction bits of the fixed-point probabilities beyond the Arb precision (refined rows).
_FIXED_GUARD_BITS = 16


def refine_mha_rows(
    x_q: np.ndarray,
    x_kv: np.ndarray,
    params: MHAParams,
    num_heads: int,
    spec: ScoreSpec,
    options: Options,
    exact_zero: _ExactZero | None = None,
) -> np.ndarray | None:
    """A few rows of multi-head attention, certified cheaply: exact linear algebra, Arb softmax.

    The rows that the double-double enclosure did not certify are usually short of a few bits
    because their output cancels. Only their probabilities need more precision; everything
    linear is exact (:mod:`mhanum.reference._exact`), and nothing is computed for all keys at
    once that costs more than a product with ``x_kv``. With ``v_hj = x_j Wv_h + bv_h``,

    .. math::

        y = \\sum_h \\Big(\\sum_j p_{hj} x_j\\, Wv_h + \\big(\\sum_j p_{hj}\\big) bv_h\\Big) Wo_h + bo
          = \\sum_h \\sum_j p_{hj}\\, v_{hj} Wo_h + bo,

    and the scores are ``s_hj = x_j (Wk_h q_h^T) + bk_h . q_h``, exactly. The probabilities are
    Arb balls at precision ``p``; their midpoints are rounded to multiples of ``2**-F`` (``F = p +
    16``), giving ``P~`` with ``|p - P~| <= e`` where ``e = rad + 2**-(F+1)``. The output is
    ``y~``, the exact value of the formula at ``P~``, and since ``y`` is linear in ``p``,

    .. math::

        |y_c - \\tilde y_c| \\le \\sum_h \\Big(\\sum_j e_{hj}\\Big)
            \\max_{j, t} |v_{hjt}| \\sum_t |Wo_{h,tc}|,

    each factor bounded above in float64 (``papers/reference.md``, Theorem 2). A component is
    certified when this radius is 0 or at most ``2**-ceil(digits log2 10) / 2`` of ``|y~|``; or,
    as exactly 0, when its ball contains 0 and ``exact_zero`` proves it 0, or when the ball lies
    within ``[-2**-1075, 2**-1075]`` (the module docstring).

    Args:
        x_q: the rows' query inputs ``(R, d_q)``.
        x_kv: key/value inputs ``(Lk, d_kv)``.
        params: float64 :class:`~mhanum.MHAParams`.
        num_heads: number of heads ``H``.
        spec: the score spec of these rows, ``excluded`` of shape ``(H, R, Lk)``.
        options: the validated options.
        exact_zero: whether the output at ``(r, c)`` is provably 0, or ``None``.

    Returns:
        The certified values ``(R, d_out)`` as mpf numbers (the exact ``y~``, or 0), or ``None``
        if a component is not certified at ``2p`` and ``4p`` bits (``p`` the starting precision)
        or a row is undefined: the caller then recomputes the rows by another backend.
    """
    flint = _flint()
    start = _start(options)
    precisions = [p for p in (2 * start, 4 * start) if p <= options.max_prec] or [start]
    linear = _RowAlgebra(x_q, x_kv, params, num_heads)
    # An overflowing bound is inf (or NaN), which does not certify.
    with np.errstate(over="ignore", invalid="ignore"):
        radius_factors = linear.radius_factors()
    threshold = Fraction(1, 1 << (math.ceil(options.digits * math.log2(10)) + 1))
    scores = linear.scores()
    saved = flint.ctx.prec
    try:
        for prec in precisions:
            flint.ctx.prec = prec
            fixed_bits = prec + _FIXED_GUARD_BITS
            probs = linear.probabilities(flint, scores, spec)
            if probs is None:
                return None
            fixed_point = _fixed_point(probs, fixed_bits)
            if fixed_point is None:
                return None
            fixed, errors = fixed_point
            center = linear.outputs(fixed, fixed_bits)
            with np.errstate(over="ignore", invalid="ignore"):
                radius = _dd.upper_matmul(errors, radius_factors)
            certified = _certified_center(center, radius, threshold, exact_zero)
            if certified is not None:
                return _mpf_values(certified)
    finally:
        flint.ctx.prec = saved
    return None


class _RowAlgebra:
    """The exact linear algebra of :func:`refine_mha_rows` for some query rows."""

    def __init__(
        self, x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int
    ) -> None:
        dyadic = _exact.Dyadic.from_float64
        self.params, self.num_heads = params, num_heads
        self.rows, self.l_k = x_q.shape[0], x_kv.shape[0]
        self.x_kv, self.x_kv_floats = dyadic(x_kv), x_kv
        q = _exact.matmul(dyadic(x_q), dyadic(params.wq))
        if params.bq is not None:
            q = _exact.add(q, dyadic(params.bq))
        self.q = q.map(lambda a: self._heads(a).transpose(1, 2, 0))  # (H, d_k, R)

    def _heads(self, a: np.ndarray) -> np.ndarray:
        """``(n, H*d)`` to ``(n, H, d)``."""
        return a.reshape(a.shape[0], self.num_heads, -1)

    def scores(self) -> _exact.Dyadic:
        """``q_h . k_hj`` exactly, ``(H, R, Lk)``, via ``u_h = Wk_h q_h^T`` and ``x_kv u``."""
        dyadic, heads, rows = _exact.Dyadic.from_float64, self.num_heads, self.rows
        wk = dyadic(np.ascontiguousarray(self._heads(self.params.wk).transpose(1, 0, 2)))
        u = _exact.matmul(wk, self.q)  # (H, d_kv, R)
        u = u.map(lambda a: a.transpose(1, 0, 2).reshape(a.shape[1], heads * rows))
        scores = _exact.matmul(self.x_kv, u)  # (Lk, H*R)
        scores = scores.map(lambda a: a.reshape(self.l_k, heads, rows).transpose(1, 2, 0))
        if self.params.bk is not None:
            bk = dyadic(self.params.bk.reshape(heads, 1, -1))
            scores = _exact.add(scores, _exact.matmul(bk, self.q).map(lambda a: a[..., 0, :, None]))
        return scores

    def probabilities(
        self, flint: ModuleType, scores: _exact.Dyadic, spec: ScoreSpec
    ) -> list[arb_mat] | None:
        """Arb probabilities of each head (``arb_mat`` ``(R, Lk)``), or ``None`` if undefined."""
        scale = _scale(flint, spec.scale, self.params.qk_width // self.num_heads)
        unit = flint.arb(2) ** scores.exp
        heads = []
        for h in range(self.num_heads):
            matrix = flint.arb_mat(
                [[flint.arb(int(s)) * unit for s in row] for row in scores.ints[h]]
            )
            bias = None if spec.bias is None else spec.bias[h]
            probs, undefined = _softmax_rows(
                flint, matrix, scale, bias, spec.excluded[h], spec.fully_masked, spec.softcap
            )
            if undefined.any():
                return None
            heads.append(probs)
        return heads

    def outputs(self, fixed: _exact.Dyadic, fixed_bits: int) -> _exact.Dyadic:
        """``y~``: the output for the fixed-point probabilities ``fixed`` ``(H, R, Lk)``."""
        dyadic, params, heads = _exact.Dyadic.from_float64, self.params, self.num_heads
        weighted = _exact.matmul(fixed, self.x_kv)  # (H, R, d_kv)
        wv = dyadic(np.ascontiguousarray(self._heads(params.wv).transpose(1, 0, 2)))
        per_head = _exact.matmul(weighted, wv)  # (H, R, d_v)
        if params.bv is not None:
            mass = _exact.Dyadic(-fixed_bits, ints=fixed.ints.sum(axis=-1)[..., None])
            bv = dyadic(params.bv.reshape(heads, 1, -1))
            per_head = _exact.add(
                per_head, _exact.Dyadic(mass.exp + bv.exp, ints=mass.ints * bv.ints)
            )
        merged = per_head.map(lambda a: a.transpose(1, 0, 2).reshape(self.rows, -1))
        out = _exact.matmul(merged, dyadic(params.wo))
        if params.bo is not None:
            out = _exact.add(out, dyadic(params.bo))
        return out

    def radius_factors(self) -> np.ndarray:
        """``(H, d_out)``: upper bounds of ``max_{j,t} |v_hjt| sum_t |Wo_{h,tc}|``."""
        params, heads = self.params, self.num_heads
        values = _dd.upper_matmul(np.abs(self.x_kv_floats), np.abs(params.wv))
        if params.bv is not None:
            values = _dd.up(values + np.abs(params.bv))
        largest = self._heads(values).max(axis=(0, 2))  # (H,)
        indicator = np.repeat(np.eye(heads), params.v_width // heads, axis=1)
        column_sums = _dd.upper_matmul(indicator, np.abs(params.wo))
        return _dd.up(largest[:, None] * column_sums)


def _fixed_point(probs: list[Any], bits: int) -> tuple[_exact.Dyadic, np.ndarray] | None:
    """Midpoints rounded to multiples of ``2**-bits`` ``(H, R, Lk)``, and error bounds ``(R, H)``;
    ``None`` where a probability's ball is not finite (its exponential's argument beyond arb's
    reach at this precision: scores some ``2**100`` apart), which certifies nothing.

    The error bound of head ``h`` in row ``r`` is an upper bound, in float64, of ``sum_j (rad_j +
    2**-(bits+1))``: the radii and the rounding of the midpoints.
    """
    heads, rows, l_k = len(probs), probs[0].nrows(), probs[0].ncols()
    ints = np.empty((heads, rows, l_k), dtype=object)
    errors = np.empty((rows, heads))
    for h, matrix in enumerate(probs):
        for r in range(rows):
            radii: list[tuple[int, int]] = [(l_k, -bits - 1)]
            for j in range(l_k):
                ball = matrix[r, j]
                if not ball.is_finite():
                    return None
                man, exp = (int(t) for t in ball.mid().man_exp())
                # Below half a unit (exp(-1e40), say) it rounds to 0, with no huge shift.
                tiny = exp + abs(man).bit_length() < -bits - 1
                ints[h, r, j] = 0 if tiny else _exact.round_shift(man, exp + bits)
                rad_man, rad_exp = ball.rad().man_exp()
                radii.append((int(rad_man), int(rad_exp)))
            # Within 2**-72 of the exact sum, below it at worst; `up` covers that and the rounding.
            errors[r, h] = _exact.to_float64(*_exact.sum_exact(radii, 64))
    return _exact.Dyadic(-bits, ints=ints), _dd.up(errors)


def _certified_center(
    center: _exact.Dyadic,
    radius: np.ndarray,
    threshold: Fraction,
    exact_zero: _ExactZero | None,
) -> _exact.Dyadic | None:
    """``center`` if every component is certified, with the zeros set to 0; else ``None``.

    A component is certified when its ``radius`` is 0 or at most ``threshold`` times ``|center|``
    (exactly); or, set to 0, when its ball lies within half the smallest subnormal, or contains 0
    and ``exact_zero`` proves the output 0.
    """
    unit = Fraction(2) ** center.exp
    if not np.isfinite(radius).all():
        return None
    ints = center.ints.copy()
    for index, rad in np.ndenumerate(radius):
        magnitude = abs(int(center.ints[index])) * unit
        if rad == 0 or Fraction(rad) <= threshold * magnitude:
            continue
        if magnitude + Fraction(rad) <= _HALF_SUBNORMAL or (
            exact_zero is not None
            and magnitude <= Fraction(rad)
            and exact_zero(tuple(int(i) for i in index))
        ):
            ints[index] = 0
            continue
        return None
    return _exact.Dyadic(center.exp, ints=ints)


def _mpf_values(center: _exact.Dyadic) -> np.ndarray:
    """The exact values of ``center`` as mpf numbers of a context precise enough for them."""
    ctx = mpmath.MPContext()
    ctx.prec = max([abs(int(m)).bit_length() for m in center.ints.flat] + [53])
    values = np.empty(center.shape, dtype=object)
    for index, man in np.ndenumerate(center.ints):
        values[index] = ctx.mpf((int(man), center.exp))
    return values
