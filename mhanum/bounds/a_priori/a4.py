"""Theorem A.4 (papers/attention.md): a priori componentwise bounds for attention and MHA from
sizes and norms; the steps of A.1 at their worst are those of :mod:`mhanum.bounds.a_priori.logits`,
:mod:`mhanum.bounds.a_priori.softcap` and :mod:`mhanum.bounds.a_priori.softmax_pv`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.bounds._result import Bound
from mhanum.bounds.a_priori.logits import logit_error, read_values
from mhanum.bounds.a_priori.sizes import Operand, Range, literal
from mhanum.bounds.a_priori.softcap import capped
from mhanum.bounds.a_priori.softmax_pv import softmax_pv
from mhanum.bounds.factors import EVALUATION
from mhanum.bounds.forward import ASSUMPTIONS
from mhanum.bounds.projections import linear, linear_overflow
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams
from mhanum.rope import Rope, check_holds, pair_sum, rope_error_linear
from mhanum.units import Online

__all__ = ["attention_bound_a_priori", "mha_bound_a_priori"]

A_PRIORI = (
    "a priori: every input satisfies the stated size bounds (row norms of q and k, entries of v "
    "or of x); no bias; masks with -inf (at least min_keys attended keys per row)"
)


def _check_a_priori_scope(num: Numerics) -> None:
    if num.exp_form != "exp":
        msg = (
            f"numerics.exp_form: the a priori bound (A.4) covers 'exp', got {num.exp_form!r}; "
            "use the a posteriori attention_bound (A.1) for the folded exp2"
        )
        raise InvalidArgument(msg)
    if num.kv_splits is not None:
        msg = (
            f"numerics.kv_splits: the a priori bound (A.4) covers unsplit keys, got "
            f"{num.kv_splits}; use the a posteriori attention_bound (A.6) for split-KV"
        )
        raise InvalidArgument(msg)
    if num.mask_value != -math.inf:
        msg = (
            "numerics.mask_value: the a priori bound (A.4) covers masks applied with -inf, got "
            f"{num.mask_value!r}; use the a posteriori attention_bound for finite constants"
        )
        raise InvalidArgument(msg)
    if isinstance(num.softmax_algorithm, Online) and (
        num.format_of("accum").precision > num.format_of("softmax").precision
    ):
        msg = "numerics.softmax_format: the online softmax needs it at least as precise as accum"
        raise InvalidArgument(msg)
    if num.format_of("score").precision > num.format_of("softmax").precision:
        msg = "numerics.score_format: expected a score format no wider than the softmax format"
        raise InvalidArgument(msg)


def _nonnegative(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
        msg = f"{name}: expected a finite number >= 0, got {x!r}"
        raise InvalidArgument(msg)
    return float(x)


def _total(terms: dict[str, Any], theorem: str, rng: Range, shape: tuple[int, ...]) -> Bound:
    terms = {name: np.asarray(t, np.float64) * (1 + EVALUATION) for name, t in terms.items()}
    terms = {name: np.broadcast_to(t, shape).copy() for name, t in terms.items()}
    terms.update(rng.terms(shape))
    total = sum(terms.values()) if terms else np.zeros(shape)
    return Bound(
        total,
        terms,
        theorem,
        (*ASSUMPTIONS, A_PRIORI),
        "blanchard2021",
        reasons=rng.reasons,
    )


def attention_bound_a_priori(
    q_len: int,
    kv_len: int,
    d_k: int,
    d_v: int | None = None,
    *,
    q_norm: float,
    k_norm: float,
    v_max: float,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    min_keys: int | None = None,
    softcap: float | None = None,
    rope: Any = None,
    positions: Any = None,
) -> Bound:
    """Theorem A.4: an a priori componentwise bound on the error of ``mhanum.attention``.

    For every input ``q`` (``q_len × d_k``), ``k`` (``kv_len × d_k``), ``v`` (``kv_len × d_v``)
    with ``‖q_i‖₂ <= q_norm``, ``‖k_j‖₂ <= k_norm``, ``|v_jl| <= v_max``, given as float64
    numbers (their rounding into ``numerics.input`` is included) and any mask applied with
    ``-inf`` that leaves at least ``min_keys`` keys per row,

    .. math::

        |\\hat o_{il} - o_{il}| \\le \\text{total}\\quad\\text{for every } i, l,

    where ``total`` is Theorem A.1 evaluated at its worst over those inputs: every logit error by
    ``Δ = c(G_{d_k}(1+θ)+θ)·q_norm·k_norm + ... + ε64`` (A.1 step 3 with Cauchy–Schwarz, and
    step 0's ``ε64 = 2^-52 (d_k+2) c·q_norm·k_norm``, the float64 logits' own error, whose
    effect on the target is the term ``evaluation``), the logit range by
    ``2c·q_norm·k_norm + 2Δ``, ``Σ_j p̃_j <= e^{2Δ}``, ``Σ_j p_j|v_jl| <= v_max``
    (papers/attention.md, Theorem A.4). So on any admissible input it is at least A.1. The bound
    does not depend on ``q_len``; on ``kv_len`` through the summation factors and underflow
    terms.

    *No overflow* is proved from the norms, stage by stage as A.1 does from the values
    (papers/attention.md, R): the stored operands, their reads into the scale, operand and
    accumulation formats, ``Q Kᵀ`` and the scores, the naive softmax's exponentials, row sum
    and reciprocal, the online running sum and accumulator, ``P V`` and the output. Where a
    stage may overflow, every entry is ``inf`` (term ``overflow``; ``vacuous`` where the
    softmax cannot be bounded: the naive softmax's overflow or flushed reciprocal, or a row sum
    that may be off by 100%), and ``Bound.reasons`` says which stage, format and value.

    With the safe softmax, step W's ``|ô| + |o|`` (the computed weights sum to a little over 1
    whatever the logits, papers/attention.md) replaces the terms where it is smaller and where
    the softmax could not be bounded (term ``magnitudes``): large norms give a finite bound, of
    about twice ``v_max``, wherever no stage may overflow.

    Assumptions: those of Theorem A.1, no bias, masks with ``-inf`` (a finite masking constant is
    refused: its leakage depends on the logits, use :func:`~mhanum.bounds.attention_bound`).

    Args:
        q_len, kv_len, d_k, d_v: the shapes (``d_v`` defaults to ``d_k``).
        q_norm, k_norm: bounds on the Euclidean norms of the query and key rows.
        v_max: a bound on the magnitude of every value entry.
        numerics: a :class:`~mhanum.Numerics` or preset name.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        min_keys: the fewest keys a row attends (only the naive softmax uses it); default
            ``kv_len``.
        softcap: the logit soft-cap ``c`` (``c·tanh(s/c)`` on the scaled scores), or ``None``:
            A.4 then reads the capped logits, ``|a| <= c·tanh(c_s·q_norm·k_norm/c)`` within the
            error of Theorem B.9 (a) (papers/backward.md), so the logit range is at most ``2c``
            however large the norms.
        rope: a :class:`mhanum.rope.Rope` the kernel rotates ``q`` and ``k`` with (held in the
            input format, which ``rope.rotation_format`` must hold), as for
            :func:`~mhanum.bounds.attention_bound`; the exact attention is then that of the
            exactly rotated inputs. Corollary P.7 (papers/rope.md): the exact rotation's rows
            have norms at most ``max(k, 1)`` times the inputs' (``k`` YaRN's table factor), and
            the computed ones are within ``ρ(|x_j| + |x_j'|) + ε`` of them, Theorem P.1 as a
            linear bound (:func:`mhanum.rope.rope_error_linear`) with the inputs' rounding.
        positions: with ``rope``, the queries' and keys' positions (see
            :meth:`mhanum.rope.Rope.positions_for`).

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_v,)`` (the same bound for
        every row); ``terms`` as for :func:`~mhanum.bounds.attention_bound`. ``total`` is
        ``inf`` (terms ``overflow``, ``vacuous``) exactly when ``Bound.reasons`` is not empty.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite norms, or numerics
            outside the theorem's scope. A possible overflow is not an error: it is an infinite
            bound with its reason in ``Bound.reasons``.

    References:
        blanchard2021; higham2002 (§3.1); papers/attention.md Theorem A.4.

    Examples:
        >>> b = attention_bound_a_priori(64, 64, 64, q_norm=8.0, k_norm=8.0, v_max=3.0,
        ...                              numerics="fp32")
        >>> bool(b.total.max() < 1e-3), b.reasons
        (True, ())
    """
    num = resolve(numerics)
    _check_a_priori_scope(num)
    V.positive_int(q_len, "q_len")
    n = V.positive_int(kv_len, "kv_len")
    d_k = V.positive_int(d_k, "d_k")
    d_v = d_k if d_v is None else V.positive_int(d_v, "d_v")
    least = n if min_keys is None else V.positive_int(min_keys, "min_keys")
    if least > n:
        msg = f"min_keys: expected at most kv_len = {n}, got {least}"
        raise InvalidArgument(msg)
    qn, kn = _nonnegative(q_norm, "q_norm"), _nonnegative(k_norm, "k_norm")
    vm = _nonnegative(v_max, "v_max")
    cap = V.softcap_value(softcap)
    if cap is not None:
        num.check_softcap()
    fin = num.format_of("input")
    c = V.scale_value(scale, d_k, placement=num.scale)
    rng = Range()
    # |x̃ - x| <= u_in|x| + η_in for unrounded inputs (A.1 step 1)
    qo = Operand(None, qn, fin.u, np.full(d_k, fin.smallest_normal))
    ko = Operand(None, kn, fin.u, np.full(d_k, fin.smallest_normal))
    if rope is not None:
        if not isinstance(rope, Rope):
            msg = f"rope: expected a mhanum.rope.Rope, got {type(rope).__name__}"
            raise InvalidArgument(msg)
        pos = rope.positions_for(positions, d_k=d_k, q_len=q_len, k_len=n)
        check_holds(rope, num.storage_format, "the input format")
        qo, ko = (
            _rotated(norm, at, rope, fin, d_k) for norm, at in zip((qn, kn), pos, strict=True)
        )
    elif positions is not None:
        msg = "positions: expected only with rope= (the positions of a rotary embedding)"
        raise InvalidArgument(msg)
    v_abs = np.full(d_v, vm)
    with np.errstate(over="ignore"):  # bounds beyond float64 are inf, and flagged
        logits = logit_error(qo, ko, d_k, num, c, scale is None, rng)
        if cap is not None:
            logits = capped(logits, cap, num, rng)
        v_bar = read_values(v_abs, fin.u * v_abs + fin.smallest_normal, num, rng)
        terms = softmax_pv(logits, n, least, v_abs, v_bar, 0.0, num, rng)
    return _total(terms, "A.4", rng, (d_v,))


def _rotated(norm: float, positions: np.ndarray, rope: Any, fin: Any, d_k: int) -> Operand:
    """Corollary P.7 (papers/rope.md): the rows of inputs of norm at most ``norm``, rounded into
    the input format and rotated as ``rope`` states. The exact rotation's rows have norm at most
    ``K·norm``, ``K = max(k, 1)``; the computed ``R̂(fl(x))`` is within
    ``ρ(|x_j| + |x_j'|) + ε`` of ``R(x)`` entry by entry, ``ρ = a(1 + u) + K u`` and
    ``ε = 2(a + K)η + e`` (``(a, e)`` Theorem P.1's linear form, ``u``, ``η`` the input
    format's). The partner map is a permutation, so by Cauchy–Schwarz ``Σ_t e_t|b_t| <=
    2ρ‖x‖‖b‖ + ‖ε‖‖b‖``: the norm form with ``rel = 2ρ`` (the entries past ``rope.dim`` only
    round, within ``u|x_j| + η``)."""
    a, e = rope_error_linear(positions, rope)
    big = max(rope.table_scale, 1.0)
    rho = a * (1 + fin.u) + big * fin.u
    err = 2 * (a + big) * fin.smallest_normal + e
    return Operand(None, big * norm, 2 * rho * (1 + 2.0**-50), np.full(d_k, err * (1 + 2.0**-50)))


def _rotated_sizes(o: Operand, rope: Any, positions: np.ndarray) -> Operand:
    """Corollary P.7, entrywise (papers/rope.md): a head's projected operand in A.2 (a)'s
    coordinate bounds ``|y*| <= S``, the computed entry within ``E = err + gerr`` of ``y*``,
    rotated. The stand-in is the exact rotation ``R(y*)``, ``|R(y*)_j| <= K(S_j + S_j')``; the
    kernel's ``R̂(ŷ)`` is within ``a((S + E)_j + (S + E)_j') + e + K(E_j + E_j')`` of it
    (Theorem P.1's linear form at ``|ŷ| <= S + E``, and the exact rotation of ``ŷ - y*``), with
    ``K = max(k, 1)`` (``pair_sum``: ``x_j + x_j'`` on the rotated entries, ``x_j`` past them)."""
    assert o.size is not None
    a, e = rope_error_linear(positions, rope)
    big = max(rope.table_scale, 1.0)
    total = np.asarray(o.err + o.gerr, np.float64)
    size = big * pair_sum(o.size, rope)
    err = (a * pair_sum(o.size + total, rope) + e + big * pair_sum(total, rope)) * (1 + 2.0**-50)
    return Operand(size * (1 + 2.0**-50), 0.0, 0.0, err, 0.0, 0.0)


def mha_bound_a_priori(
    params: MHAParams,
    num_heads: int,
    q_len: int,
    kv_len: int,
    *,
    x_max: float,
    x_kv_max: float | None = None,
    numerics: Numerics | str | None = None,
    scale: float | None = None,
    min_keys: int | None = None,
    num_kv_heads: int | None = None,
    rope: Any = None,
    positions: Any = None,
) -> Bound:
    """Theorem A.4 for multi-head attention: a bound from the weights and ``max |x|`` only.

    For every input with ``|x_q| <= x_max`` and ``|x_kv| <= x_kv_max`` entrywise (float64 values,
    rounded into ``numerics.input``), the error of every output component of
    ``mhanum.multi_head_attention(x_q, x_kv, params, num_heads, mask=..., numerics=...)`` is at
    most ``total[l]``. The projections follow A.2 (a) evaluated at ``|x| = x_max``, ``|w|`` and
    ``|b|`` (every term is nondecreasing in them), which bounds each projected entry, its float64
    stand-in's error and the computed entry's error coordinatewise; each head is then A.4 with
    ``|q_i|·|k_j| <= Σ_t Q_t K_t`` for those coordinate bounds and the term ``evaluation`` of
    A.2 (b), and the output projection is A.2 (c) at ``|o_l| <= max |v_l|``.

    No overflow is proved from the same bounds: the inputs in the input format, every stage of
    the projections (R.7: weights, operands, partial sums, bias, the result in the storage
    format), every stage of each head (as :func:`attention_bound_a_priori`) and the output
    projection (in the output format). Where a stage may overflow, every entry is ``inf``
    (terms ``overflow``, ``vacuous``) and ``Bound.reasons`` says why.

    Args:
        params: the layer's weights.
        num_heads: number of heads.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        q_len, kv_len: sequence lengths.
        x_max: a bound on ``|x_q|`` entries; ``x_kv_max`` on ``|x_kv|`` (default ``x_max``).
        numerics, scale, min_keys: as for :func:`attention_bound_a_priori`.
        rope, positions: every head's projected queries and keys rotated as the
            :class:`mhanum.rope.Rope` states (as :func:`mhanum.multi_head_attention` with
            ``rope=``): Corollary P.7's entrywise form (papers/rope.md) on A.2 (a)'s coordinate
            bounds, the exact rotation of the exact projection as the stand-in.

    Returns:
        A :class:`~mhanum.bounds.Bound` whose ``total`` has shape ``(d_out,)``, ``inf`` exactly
        when ``Bound.reasons`` is not empty.

    Raises:
        InvalidArgument: for non-positive sizes, negative or non-finite bounds, parameters that
            do not fit ``num_heads``, or numerics outside the theorem's scope.

    References:
        papers/attention.md Theorems A.2 and A.4.
    """
    num = resolve(numerics)
    _check_a_priori_scope(num)
    if not isinstance(params, MHAParams):
        msg = f"params: expected an MHAParams, got {type(params).__name__}"
        raise InvalidArgument(msg)
    if num_kv_heads is not None:
        params = params.expand_kv_heads(num_heads, num_kv_heads)
    heads = V.positive_int(num_heads, "num_heads")
    params.validate(heads)
    V.positive_int(q_len, "q_len")
    n = V.positive_int(kv_len, "kv_len")
    least = n if min_keys is None else V.positive_int(min_keys, "min_keys")
    if least > n:
        msg = f"min_keys: expected at most kv_len = {n}, got {least}"
        raise InvalidArgument(msg)
    xq = _nonnegative(x_max, "x_max")
    xkv = xq if x_kv_max is None else _nonnegative(x_kv_max, "x_kv_max")
    turn = None
    if rope is not None:
        if not isinstance(rope, Rope):
            msg = f"rope: expected a mhanum.rope.Rope, got {type(rope).__name__}"
            raise InvalidArgument(msg)
        pos = rope.positions_for(positions, d_k=params.qk_width // heads, q_len=q_len, k_len=n)
        check_holds(rope, num.storage_format, "the projections' storage format")
        turn = (rope, pos)
    elif positions is not None:
        msg = "positions: expected only with rope= (the positions of a rotary embedding)"
        raise InvalidArgument(msg)
    with np.errstate(over="ignore"):  # bounds beyond float64 are inf, and flagged
        return _mha(params, heads, n, least, (xq, xkv), num, scale, turn)


def _mha(
    params: MHAParams,
    heads: int,
    n: int,
    least: int,
    x_max: tuple[float, float],
    num: Numerics,
    scale: float | None,
    turn: tuple[Any, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Bound:
    """:func:`mha_bound_a_priori` after its arguments are checked (``x_max``: the bounds on
    ``|x_q|`` and ``|x_kv|``; ``turn``: the rope and the queries' and keys' positions)."""
    xq, xkv = x_max
    fin, storage, out_fmt = num.format_of("input"), num.storage_format, num.format_of("output")
    w: dict[str, Any] = {
        f.name: None if getattr(params, f.name) is None else np.abs(getattr(params, f.name))
        for f in dataclasses.fields(params)
    }
    w = {k: None if a is None else np.asarray(a, np.float64) for k, a in w.items()}
    shape = (params.d_out,)
    rng = Range()
    bounds = {}
    for name, xname, x, width in (
        ("q", "x_q", xq, params.d_q),
        ("k", "x_kv", xkv, params.d_kv),
        ("v", "x_kv", xkv, params.d_kv),
    ):
        x64 = np.full((1, width), x)
        e_in = fin.u * x64 + fin.smallest_normal
        rng.check(x64 + e_in, fin, f"{xname} in the input format")
        wn, bn = f"w{name}", f"b{name}"
        lin = linear(x64, np.zeros_like(x64), w[wn], w[bn], num, storage)
        _, why = linear_overflow(lin, x64, e_in, w[wn], w[bn], num, storage, f"{name} projection")
        for reason in why:
            rng.flag(literal(reason))
        given = lin.given[0]
        # |y*| <= lin.y + given at x_max; the stand-in of an admissible input is within given
        # of its y*; the computed entry within used + given of the stand-in (A.2 (b))
        bounds[name] = (lin.y[0] + 2 * given, lin.error(e_in)[0] + given, given)
    if not all(np.isfinite(np.concatenate(b)).all() for b in bounds.values()):
        rng.flag("the projections' bounds are not finite in float64")
        return _total({}, "A.4", rng, shape)
    d_k, d_v = params.qk_width // heads, params.v_width // heads
    c = V.scale_value(scale, d_k, placement=num.scale)
    per_head = []
    for h in range(heads):
        qs, ks, vs = (slice(h * d, (h + 1) * d) for d in (d_k, d_k, d_v))
        (q_size, e_q, g_q), (k_size, e_k, g_k) = (
            tuple(a[s] for a in bounds[name]) for name, s in (("q", qs), ("k", ks))
        )
        qo = Operand(q_size, 0.0, 0.0, e_q, 0.0, g_q)
        ko = Operand(k_size, 0.0, 0.0, e_k, 0.0, g_k)
        if turn is not None:
            qo, ko = (
                _rotated_sizes(o, turn[0], at) for o, at in zip((qo, ko), turn[1], strict=True)
            )
        logits = logit_error(qo, ko, d_k, num, c, scale is None, rng)
        v_abs, e_v, g_v = (a[vs] for a in bounds["v"])
        v_bar = read_values(v_abs, e_v, num, rng)
        per_head.append(softmax_pv(logits, n, least, v_abs, v_bar, g_v, num, rng))
    names = sorted({name for t in per_head for name in t})
    merged = {
        name: np.concatenate([np.broadcast_to(t.get(name, 0.0), (d_v,)) for t in per_head])
        for name in names
    }
    merged = {name: t * (1 + EVALUATION) for name, t in merged.items()}
    # A.2 (c): the heads' outputs within |v| of zero, their stand-ins within the evaluation
    # error of the exact ones, and the computed ones within the heads' totals
    o_abs = bounds["v"][0][None, :]
    o_given = EVALUATION * o_abs + merged.get("evaluation", np.zeros(params.v_width))[None, :]
    out = linear(o_abs, o_given, w["wo"], w["bo"], num, out_fmt)
    o_err = sum(merged.values(), np.zeros(params.v_width))[None, :]
    _, why = linear_overflow(out, o_abs, o_err, w["wo"], w["bo"], num, out_fmt, "output projection")
    for reason in why:
        rng.flag(literal(reason))
    terms = {f"attention.{name}": out.kappa * (t @ out.slope) for name, t in merged.items()}
    terms["output_projection"] = out.fixed[0]
    return _total(terms, "A.4", rng, shape)
