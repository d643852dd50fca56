"""Certified arbitrary-precision reference of attention and multi-head attention.

The reference computes what attention *should* return for the given binary floating-point inputs:
the exact real-number result, correctly rounded to float64, and (on request) as mpmath numbers
certified to a requested number of significant digits. Everything else in mhanum is measured
against it, so it depends on no other part of mhanum that computes attention.

**Exact where it can be.** Every input (float16/32/64, bfloat16, float8, ...) converts to float64
exactly and is then a dyadic rational ``m * 2**e``. Sums and products of dyadic rationals are dyadic
rationals, so the projections ``x @ w + b``, the scores ``q @ k.T``, the bias, the logit
differences ``s_ij - s_im`` and (for MHA) the products ``v_h @ wo_h`` are computed with no rounding
at all, once, independently of any working precision. Only the irrational numbers are computed at
a working precision ``p``, with a local ``mpmath.MPContext`` (never the global ``mpmath.mp``): the
default scale ``1/sqrt(d_k)`` (exact when ``d_k`` is a power of 4), ``exp``, the softmax sums and
quotients. The output ``sum_j p_ij v_j`` (for MHA ``sum_h sum_j p_hij (v_h wo_h)_j + bo``) is then
formed exactly from the rounded probabilities and rounded once.

**Certified by doubling the precision.** The whole computation runs at ``p`` and at ``2p`` bits,
starting from ``p = ceil(digits * log2(10)) + 32``, and is accepted only if every output component
agrees: ``|r_p - r_2p| <= 10**-digits * |r_2p|``, or its exact value is proved 0 (see **Zeros**
below; it is then exactly 0). Two zeros do not agree by themselves, since probabilities that
differ by less than ``2**-2p`` round alike and their cancelling outputs are 0 at both ``p`` and
``2p``; an unproved zero keeps doubling (the value ``-4.7e-569`` is found at 3168 bits).
Otherwise both precisions are doubled, while ``p <= max_prec``; then
:class:`~mhanum.CertificationError` says how many digits were reached and where. This is the
classical precision-doubling check, not an interval enclosure: it is sound when the error at
``2p`` is much smaller than the error at ``p``. That holds here because nothing exact is rounded
before the end. Rounding an exact number is what fools the check: the logit ``-1e60 - 1``
rounded to 100 or to 200 bits loses the ``- 1`` both times, and the two runs agree on a wrong
``exp``. The rounded numbers are approximations of irrational
numbers, whose errors shrink by about ``2**-p`` when ``p`` doubles, and mpmath exponents are
unbounded, so nothing underflows. Terms are dropped from a sum only where a bound proves them
below ``2**-p`` of the result; otherwise the sum is exact.

**Backends.** ``backend="mpmath"`` is the naive algorithm, written to be obviously right:
loops over exact dot products and mpmath numbers, ``exp``, ``fsum``, and every output element as
one exact sum; it costs ``O(L**2 d)`` Python operations (``O(L**2 d**2)`` for MHA).
``backend="exact"`` does all linear algebra on integers with Ozaki-style splitting into float64
digit matrices (see :mod:`mhanum.reference._exact`) and multiplies the probabilities in fixed point
per row; only ``exp`` and the softmax run element by element. Both are certified by doubling the
precision (above); they share the input checks and the certification, not the arithmetic.

``backend="dd"`` certifies differently, with no mpmath in the loop: vectorised double-double ball
arithmetic in numpy (:mod:`mhanum.reference._dd`, :mod:`mhanum.reference._fastref`) carries a proven
componentwise error bound with every value, from Ozaki-split products of the floats through a
table-driven ``exp`` to the outputs (``papers/reference.md``, Theorem 1), and a component is
certified when its bound is below ``10**-digits`` of its value. It certifies at most 26 digits
(:func:`max_digits`) and raises :class:`~mhanum.CertificationError` where it cannot certify.
``backend="auto"`` (default) runs ``"dd"`` and recomputes just the rows it did not certify, with
``"arb"`` where python-flint is installed (faster) and ``"exact"`` otherwise; when ``digits > 26``
it runs ``"exact"`` on everything. For multi-head attention with python-flint, such rows are first
*refined*: only their probabilities are recomputed, as Arb balls, and the output is formed exactly
from them with a rigorous radius (``papers/reference.md``, Theorem 2), which costs a fraction of the
layer instead of all key projections; the rows that still do not certify go to ``"arb"``. It always
certifies ``digits``. ``backend="arb"`` uses python-flint's rigorous balls (the optional extra
``arb``) with precision doubling until the radii certify.

**Zeros.** No relative accuracy can be certified at an exact 0, nor from an enclosure that
contains 0, however small. An output is therefore certified when (``papers/reference.md``, §6)

1. its relative error is at most ``10**-digits`` (above), or
2. its exact value is *proved* to be 0, by exact rational arithmetic on the given floats: it is
   then returned as exactly ``0`` (float64 and mpf), by every backend of :func:`attention` and
   :func:`multi_head_attention`. A row's output is ``sum_g e**(l_g) W_g / Z`` over the groups
   ``g`` of keys with equal logits, ``W_g`` the sum of their values; without a soft-cap the
   logits are algebraic, and by the Lindemann-Weierstrass theorem the ``e**(l_g)`` of distinct
   ones are linearly independent over the algebraic numbers, so the output is 0 if and only if
   every ``W_g`` is 0: for attention without a soft-cap the test is complete (with one, keys
   are grouped by equal score and bias, and the test is sufficient). For multi-head attention
   it is sufficient only: a head whose ``W_g`` are proportional to its group sizes is a
   rational constant, and heads whose logits agree up to a shift are merged; the exact zeros
   it misses are certified by 3 where that applies; or
3. (the Arb balls: ``backend="arb"``, the rows ``"auto"`` refines or recomputes with Arb, and
   the gradients :func:`attention_grad`, :func:`mha_grad`, which have no proof of 2 and rely on
   3) its rigorous enclosure lies within ``[-2**-1075, 2**-1075]``, half the smallest
   subnormal: every real number there rounds to a float64 zero, so ``0.0`` is the correctly
   rounded exact value, whatever it is. The output is returned as 0 (the mpf too,
   within ``2**-1075`` of the exact value; the sign of the zero is not certified). The radii
   shrink like ``2**-p`` times the size of the terms, so an exact zero is certified by 3 once
   ``p`` exceeds about ``1075 + log2`` of that size (1584 bits for terms near 1, well within
   the default ``max_prec``). The doubling backends (``"mpmath"``, ``"exact"``) have no
   enclosure, and ``"dd"`` adds an underflow term of ``2**-1060`` to its radii: they use 1 and 2
   only.

No other absolute tolerance is used: an output that is small next to the values it cancels,
but not provably 0 and not below ``2**-1075``, is certified to ``digits`` digits relative to
itself, at the precision that takes. So the float64 results below stay correctly rounded,
and a downstream test of ``|kernel - reference|`` against a tolerance sees at most the error
of the rounding to float64.

Sums that can cancel are never left to ``mpmath.fsum``/``fdot``: those drop a term more than
``2*prec`` bits below the running sum even if the sum later cancels (``fsum([1, 2**-1000, -1])``
is 0 at 100 and at 200 bits, a wrong value that doubling the precision would certify).

**Rounding to float64.** The returned float64 array is the higher-precision value ``r_2p`` rounded
to nearest (ties to even, subnormals rounded once, magnitudes past the float64 range become
``±inf``). It is the correctly rounded exact result unless the exact result lies within the
certified tolerance ``10**-digits`` (relative) of a float64 rounding boundary; an output
certified as a zero (**Zeros**, 2 and 3) is ``0.0``, its correctly rounded value.

**Fully-masked rows.** A row whose keys are all excluded (``mask`` False or ``bias`` ``-inf``) has
no softmax: the softmax over the empty set is undefined. ``fully_masked="nan"`` (default) returns
NaN for it, the mathematically faithful answer; ``"zero"`` returns zeros (PyTorch's
``_safe_softmax``); ``"uniform"`` returns the mean of ``v`` over all ``L_k`` keys (what replacing
the masked logits by one finite constant gives).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.gradients import Gradients, MHAGradients
from mhanum.params import MHAParams
from mhanum.problem import AttentionProblem, MHAProblem
from mhanum.reference import _exact, _fastref
from mhanum.reference._backends import (
    bind_naive_attention,
    bind_naive_mha,
    exact_attention,
    exact_mha,
    floating_outputs,
)
from mhanum.reference._certify import (
    arb_backend,
    batch_element,
    certified,
    certify,
    check_softcap_backend,
    exact_product,
    fast_certified,
    fast_path_applies,
    has_flint,
    head_rotation,
    max_digits,
    nearest_float64,
    rotation,
    sub_spec,
)
from mhanum.reference._spec import (
    BACKENDS,
    ScoreSpec,
    check_options,
    check_scale,
    params_float64,
    score_spec,
    sink_row,
)
from mhanum.reference._zeros import attention_zeros, mha_value_zeros, mha_zeros, value_zeros

if TYPE_CHECKING:
    from mhanum._types import ArrayLike
__all__ = [
    "BACKENDS",
    "Gradients",
    "attention",
    "attention_grad",
    "max_digits",
    "mha_grad",
    "multi_head_attention",
    "nearest_float64",
]


@one_blas_thread
def attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: masks.Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    digits: int = 20,
    fully_masked: str = "nan",
    max_prec: int = 8192,
    backend: str = "auto",
    return_mpf: bool = False,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    descale: tuple[float, float, float] | None = None,
    rope: Any = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact attention ``softmax(scale * q @ k.T + bias) @ v`` of the given floats, certified.

    Scores ``s_ij = scale * sum_t q_it k_jt + bias_ij`` are formed exactly; keys excluded by
    ``mask`` or by a ``-inf`` bias get weight exactly zero; the softmax over the remaining keys and
    the output ``o_i = sum_j p_ij v_j`` are certified to ``digits`` significant digits (see the
    module docstring).

    Args:
        q: queries ``(..., Lq, d_k)``, any real floating-point array (numpy, ml_dtypes, JAX).
        k: keys ``(..., Lk, d_k)``.
        v: values ``(..., Lk, d_v)``; the leading dimensions of ``q``, ``k``, ``v`` broadcast.
        mask: boolean array broadcastable to ``(..., Lq, Lk)``; True means attend, False excludes
            the key exactly; or a :class:`mhanum.masks.Band` (its array for these lengths).
        bias: float array broadcastable to ``(..., Lq, Lk)`` added exactly to the scaled scores;
            finite or ``-inf`` (``-inf`` excludes the key).
        scale: the score scale, used exactly; ``None`` means exactly ``1/sqrt(d_k)``.
        digits: significant digits to certify, an integer in ``[1, 2000]``.
        fully_masked: result for a row with every key excluded: ``"nan"`` (the softmax over an
            empty set is undefined), ``"zero"`` or ``"uniform"`` (mean of ``v`` over all keys).
        max_prec: largest working precision in bits, an integer ``>= 64`` and at least the
            starting precision ``ceil(digits * log2(10)) + 32``; the check runs at ``p`` and
            ``2p`` for ``p`` up to ``max_prec``.
        backend: ``"auto"`` (double-double enclosure; the rows it does not certify recomputed
            by ``"arb"`` if python-flint is installed, else by ``"exact"``), ``"dd"`` (the
            enclosure alone), ``"exact"`` (integer linear algebra), ``"mpmath"`` (naive loops)
            or ``"arb"`` (python-flint ball arithmetic); see
            :func:`max_digits`.
        return_mpf: also return the certified mpmath values.
        sink: optional attention-sink logits, one per batch element or head (broadcast
            against the batch dimensions): ``e^σ`` joins every row's normaliser, as one more
            key with value 0 that no mask excludes (:func:`mhanum.masks.with_sink`).
        softcap: optional logit soft-cap ``c > 0``: the scaled scores become ``c·tanh(s/c)``
            before the bias. ``tanh`` is irrational, so the logits are computed at the working
            precision (their differences from the row's largest, plus the exact bias
            differences); ``"auto"`` then runs ``"exact"`` on every row, and ``"dd"`` refuses.
        descale: fp8 descale factors ``(d_q, d_k, d_v)`` (float32 numbers > 0): the attention of
            ``d_q q``, ``d_k k``, ``d_v v``, whose products must be exact in float64 (they are
            for inputs of at most 29 significant bits, fp8 and float16 among them).
        rope: a :class:`mhanum.rope.Rope`: the attention of the *exactly* rotated ``q`` and
            ``k`` (papers/rope.md, P.4): the exact ``ω`` of its scaling's formula, the exact
            angles ``θ = p·ω``, their exact ``cos`` and ``sin`` (times YaRN's table factor), the
            exact rotation of the given floats; none of ``rope``'s formats round anything
            here. The rotated entries are irrational, so they are computed as Arb balls
            (:func:`mhanum.reference._rope.arb_rotation`) at the working precision, which doubles until
            the outputs certify: ``backend`` ``"auto"`` or ``"arb"`` (the others refuse). An
            output is proved 0 only when its column of ``v`` is 0 over the row's keys (or by
            its enclosure, **Zeros** 3).
        positions: with ``rope``, the queries' and keys' positions, as
            :meth:`mhanum.rope.Rope.positions_for` reads them (a pair; one array for both when
            ``Lq = Lk``; by default the keys ``0..Lk-1`` and the queries the last ``Lq``).

    Returns:
        float64 array ``(..., Lq, d_v)``, the certified values rounded to nearest; with
        ``return_mpf=True`` the pair ``(floats, mpf_values)``, ``mpf_values`` an object array of
        ``mpf`` of a private context at the certifying precision (convert with ``mpmath.mpf``).

    Raises:
        InvalidArgument: for a non-float, non-finite or misshapen array, a non-boolean mask, a NaN
            or ``+inf`` bias, or an out-of-range option; the message names the argument.
        CertificationError: if ``digits`` digits are not reached by ``max_prec`` bits; with
            ``backend="dd"``, if ``digits > max_digits("dd")`` or a component is not certified.
        ImportError: for ``backend="arb"`` without python-flint (a dependency of mhanum: ``pip install python-flint``).

    Examples:
        Equal scores average the values:

        >>> import numpy as np
        >>> from mhanum import reference
        >>> v = np.array([[1.0], [2.0], [4.0]])
        >>> reference.attention(np.zeros((1, 2)), np.ones((3, 2)), v)
        array([[2.33333333]])
        >>> import mpmath
        >>> out, exact = reference.attention(
        ...     np.zeros((1, 2)), np.ones((3, 2)), v, digits=30, return_mpf=True)
        >>> mpmath.nstr(exact[0, 0], 30)
        '2.33333333333333333333333333333'
    """
    options = check_options(digits, max_prec, fully_masked, backend, return_mpf)
    p = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, descale=descale,
        rope=rope, positions=positions,
    )  # fmt: skip
    q64, k64, v64 = (np.asarray(x).astype(np.float64) for x in (p.q, p.k, p.v))
    if p.descale is not None:
        q64, k64, v64 = (
            exact_product(x, d, n)
            for x, d, n in zip((q64, k64, v64), p.descale, "qkv", strict=True)
        )
    mask, bias, shape = p.mask, p.bias, p.scores
    key_positions = None if p.positions is None else p.positions[1]
    if p.sink is not None:
        b64 = None if bias is None else np.asarray(bias).astype(np.float64)
        k64, v64, mask, bias = masks.with_sink(q64, k64, v64, mask, b64, p.sink)
        shape = (*k64.shape[:-2], q64.shape[-2], k64.shape[-2])
        if key_positions is not None:  # the sink's key is 0: any position rotates it to 0
            key_positions = np.append(key_positions, 0)
    batch = shape[:-2]
    spec = score_spec(
        mask, bias, check_scale(scale), shape, q64.shape[-1], options.fully_masked, p.softcap
    )
    check_softcap_backend(spec, options)
    if p.rope is not None:
        assert p.positions is not None
        assert key_positions is not None
        rotate = rotation(p.rope, (q64, p.positions[0]), (k64, key_positions), options)
        return arb_backend().attention(q64, k64, v64, spec, options, value_zeros(v64, spec), rotate)
    zeros = attention_zeros(q64, k64, v64, spec)
    if options.backend == "arb":
        return arb_backend().attention(q64, k64, v64, spec, options, zeros)
    if options.backend == "mpmath":
        floating = _exact.Floating.from_float64
        compute = bind_naive_attention(floating(q64), floating(k64), floating(v64), spec)
        return certified(compute, options, zeros)

    def exact_rows(index: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        """Some rows of one batch element, certified by ``"arb"`` if installed, else ``"exact"``."""
        q_b, k_b, v_b = (batch_element(x, batch, index) for x in (q64, k64, v64))
        sub = sub_spec(spec, (*index, rows))
        sub_zeros = attention_zeros(q_b[rows], k_b, v_b, sub)
        if has_flint():
            with_mpf = dataclasses.replace(options, return_mpf=True)
            return arb_backend().attention(q_b[rows], k_b, v_b, sub, with_mpf, sub_zeros)[1]
        dyadic = _exact.Dyadic.from_float64
        core = exact_attention(dyadic(q_b[rows]), dyadic(k_b), dyadic(v_b), sub)
        return certify(floating_outputs(core), options, sub_zeros)

    if options.backend == "exact" or spec.softcap is not None or not fast_path_applies(options):
        dyadic = _exact.Dyadic.from_float64
        core = exact_attention(dyadic(q64), dyadic(k64), dyadic(v64), spec)
        return certified(floating_outputs(core), options, zeros)
    with np.errstate(all="ignore"):
        out, undefined = _fastref.attention(
            q64,
            k64,
            v64,
            spec.excluded,
            spec.bias,
            _fastref.scale_ball(spec.scale, spec.d_k),
            spec.fully_masked,
        )
    return fast_certified(out, undefined, batch, exact_rows, options, zeros)


@one_blas_thread
def attention_grad(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    d_out: ArrayLike,
    *,
    mask: masks.Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    digits: int = 20,
    max_prec: int = 8192,
    softcap: float | None = None,
    sink: ArrayLike | None = None,
) -> Gradients:
    """Certified gradients of attention: the exact backward pass of the given floats.

    With ``S = scale·q kᵀ + bias``, ``P = softmax(S)`` (exactly 0 at masked keys) and
    ``O = P v``, the gradients of ``<d_out, O>`` are ``dv = Pᵀ d_out``,
    ``dS = P ∘ (d_out vᵀ - rowsum(P ∘ d_out vᵀ))``, ``dq = scale·dS k``, ``dk = scale·dSᵀ q`` and
    ``dbias = dS``. Without a soft-cap or a sink, and for ``digits`` up to 26, they are first
    enclosed in double-double balls (:mod:`mhanum.reference._fastref`, Theorem 1 of
    papers/reference.md carried through the backward pass: no python-flint needed) and
    returned when every entry is certified, i.e. its ball's radius is at most
    ``2**-ceil(digits log2 10) / 2`` of its center. Otherwise (and for every entry of such a
    call) they are computed in python-flint's Arb balls (every input float exact, ``exp`` and
    the sums rigorous) and certified by the same test, or when the ball lies within
    ``[-2**-1075, 2**-1075]`` (an exact zero, say: the entry is then ``0.0``, its correctly
    rounded value; see **Zeros** in the module docstring), doubling the precision up to
    ``max_prec`` (the forward reference's ``backend="arb"``): backward kernels are measured
    against it.

    Args:
        q, k, v: as for :func:`attention` (batch dimensions broadcast).
        d_out: the output's cotangent ``(..., Lq, d_v)``.
        mask, bias, scale: as for :func:`attention`; a row must attend some key (the softmax of
            an empty row has no gradient).
        softcap, sink: as for :func:`attention`: the cap's slope enters ``dq`` and ``dk``; the
            sink is one more key (zero key and value, bias ``σ``) whose gradient is ``dsink``.
        digits, max_prec: as for :func:`attention`.

    Raises:
        InvalidArgument: for bad inputs (named), a ``d_out`` of another shape than the output,
            or a row that attends no key.
        CertificationError: if a gradient is not certified by ``max_prec`` bits (an exact
            zero needs about ``1075 + log2`` of the size of the terms that cancel).

    Examples:
        >>> import numpy as np
        >>> from mhanum import reference
        >>> g = reference.attention_grad(np.zeros((1, 2)), np.ones((3, 2)), np.eye(3), np.ones((1, 3)))
        >>> g.dv
        array([[0.33333333, 0.33333333, 0.33333333],
               [0.33333333, 0.33333333, 0.33333333],
               [0.33333333, 0.33333333, 0.33333333]])
    """
    options = check_options(digits, max_prec, "zero", "arb", False)
    p = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, d_out=d_out
    )
    q64, k64, v64, g64 = (np.asarray(x).astype(np.float64) for x in (p.q, p.k, p.v, p.d_out))
    keys = k64.shape[-2]
    mask, bias, batch = p.mask, p.bias, p.batch
    if p.sink is not None:
        b64 = None if bias is None else np.asarray(bias).astype(np.float64)
        k64, v64, mask, bias = masks.with_sink(q64, k64, v64, mask, b64, p.sink)
        batch = k64.shape[:-2]
    shape = (*batch, q64.shape[-2], k64.shape[-2])
    spec = score_spec(mask, bias, check_scale(scale), shape, q64.shape[-1], "zero", p.softcap)
    if spec.excluded.all(axis=-1).any():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    if p.sink is None and spec.softcap is None and fast_path_applies(options):
        fast = _certified_grads(q64, k64, v64, g64, spec, options.digits)
        if fast is not None:
            return Gradients(*fast)
    grads = arb_backend().attention_grad(
        q64, k64, v64, g64, spec, options, sink_column=sink is not None
    )
    if sink is None:
        return Gradients(*grads)
    # the sink's key and value are constants: drop their rows; its logit's gradient is the
    # sum of its column of dS, certified with the rest
    dq, dk, dv, dbias, dsink = grads
    return Gradients(dq, dk[..., :keys, :], dv[..., :keys, :], dbias[..., :keys], dsink[..., 0, 0])


def _certified_grads(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, spec: ScoreSpec, digits: int
) -> tuple[np.ndarray, ...] | None:
    """``(dq, dk, dv, dbias)`` from their double-double enclosures
    (:func:`mhanum.reference._fastref.attention_grad`) where every entry is certified to
    ``digits`` (the center, rounded to float64); ``None`` where one is not (Arb then)."""
    with np.errstate(all="ignore"):
        balls = _fastref.attention_grad(
            q, k, v, g, spec.excluded, spec.bias, _fastref.scale_ball(spec.scale, spec.d_k)
        )
    if not all(_fastref.certified(b, digits).all() for b in balls):
        return None
    return tuple(b.hi + b.lo for b in balls)


@one_blas_thread
def mha_grad(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    params: MHAParams,
    num_heads: int,
    d_out: ArrayLike,
    *,
    mask: masks.Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    digits: int = 20,
    max_prec: int = 8192,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    num_kv_heads: int | None = None,
) -> MHAGradients:
    """Certified gradients of multi-head attention: the exact backward pass of the given floats.

    The forward is :func:`multi_head_attention`'s (projections ``y = x w + b`` exactly, head
    ``h`` on its columns, the heads concatenated and projected by ``wo``), with the logit scale
    ``scale`` (default exactly ``1/sqrt(d_k)``). With ``G = d_out``: ``dO = G woᵀ``, every head's
    ``(dq_h, dk_h, dv_h, dS_h)`` as :func:`attention_grad` computes them from its projections and
    ``dO_h``, then ``dx_q = dQ wqᵀ``, ``dx_kv = dK wkᵀ + dV wvᵀ``, ``dwq = Σ x_qᵀ dQ`` (every
    weight likewise, ``dwo = Σ Oᵀ G``; summed over the batch) and ``dbq = Σ dQ`` over every row
    (``dbk`` is exactly 0: each row of ``dS`` sums to 0). All of it runs in python-flint's Arb
    balls, certified as :func:`attention_grad` is.

    Args:
        x_q, x_kv, params, num_heads, mask, bias: as for :func:`multi_head_attention`; every row
            must attend some key in every head.
        d_out: the output's cotangent ``(..., Lq, d_out)``.
        scale: the logit scale; default ``1/sqrt(d_k)``.
        digits, max_prec: as for :func:`attention`.
        sink: attention sinks, one logit per head, as for :func:`multi_head_attention`: each
            head's sink is one more key (zero key and value, bias ``σ``) whose gradient is
            ``dsink`` ``(..., H)``, the sum of its column of ``dS``.
        softcap: the logit soft-cap of every head, as for :func:`attention_grad`.
        num_kv_heads: grouped-query attention, as for :func:`multi_head_attention`: head ``h``
            reads key/value head ``h // (H / H_kv)``, whose ``dK`` and ``dV`` are the exact sums
            of its group's; ``dx_kv`` and the gradients of ``wk``, ``wv``, ``bk``, ``bv`` are
            those of the grouped weights.

    Returns:
        :class:`mhanum.gradients.MHAGradients` ``(dx_q, dx_kv, params, dbias[, dsink])`` in
        float64, the inputs' gradients broadcast to the batch, ``params`` shaped like the given
        weights.

    Raises:
        InvalidArgument: for bad inputs (named) or a row that attends no key.
        CertificationError: if a gradient is not certified by ``max_prec`` bits.

    Examples:
        >>> import numpy as np
        >>> from mhanum import MHAParams, reference
        >>> params = MHAParams.random(4, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((3, 4))
        >>> g = reference.mha_grad(x, x, params, 2, np.ones((3, 4)))
        >>> g.dx_q.shape, float(np.abs(g.params.bk).max())
        ((3, 4), 0.0)
    """
    options = check_options(digits, max_prec, "zero", "arb", False)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads, d_out=d_out,
    )  # fmt: skip
    heads = p.num_heads
    group = 1 if p.num_kv_heads is None else heads // p.num_kv_heads
    xq64, xkv64, g64 = (np.asarray(x).astype(np.float64) for x in (p.x_q, p.x_kv, p.d_out))
    mask, bias, shape = p.mask, p.bias, p.scores
    if p.sink is not None:
        mask, bias, shape = masks.head_sinks(mask, bias, p.sink, shape)
    spec = score_spec(mask, bias, check_scale(scale), shape, p.d_k, "zero", p.softcap)
    if spec.excluded.all(axis=-1).any():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    params64 = params_float64(params)
    dx_q, dx_kv, dbias, grads, dsink = arb_backend().mha_grad(
        xq64, xkv64, g64, params64, heads, spec, options, sink=sink is not None, group=group
    )
    names = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
    return MHAGradients(dx_q, dx_kv, MHAParams(**{n: grads.get(n) for n in names}), dbias, dsink)


@one_blas_thread
def multi_head_attention(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    params: MHAParams,
    num_heads: int,
    *,
    mask: masks.Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    digits: int = 20,
    fully_masked: str = "nan",
    max_prec: int = 8192,
    backend: str = "auto",
    return_mpf: bool = False,
    num_kv_heads: int | None = None,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    rope: Any = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    scale: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact multi-head attention ``concat_h(attention_h) @ wo + bo`` of the given floats, certified.

    ``q = x_q @ wq + bq``, ``k = x_kv @ wk + bk``, ``v = x_kv @ wv + bv`` exactly (a ``None`` bias
    is no bias); head ``h`` takes columns ``[h*d_k, (h+1)*d_k)`` of ``q`` and ``k`` (``d_k =
    wq.shape[1] // num_heads``) and ``[h*d_v, (h+1)*d_v)`` of ``v``; each head is
    :func:`attention` with scale ``scale`` (default exactly ``1/sqrt(d_k)``); the heads are
    concatenated in head order
    and projected, ``y = o @ wo + bo``. A row is NaN (with ``fully_masked="nan"``) if it is fully
    masked in any head.

    Args:
        x_q: query input ``(..., Lq, d_q)``, any real floating-point array.
        x_kv: key/value input ``(..., Lk, d_kv)``; leading dimensions broadcast with ``x_q``'s.
        params: the weights, ``y = x @ w + b`` convention.
        num_heads: number of heads ``H``, dividing ``wq.shape[1]`` and ``wv.shape[1]``.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        sink: attention sinks, one per head, as in :func:`mhanum.multi_head_attention`.
        softcap: the logit soft-cap of every head, as in :func:`attention`.
        scale: the score scale of every head, used exactly; ``None`` means exactly
            ``1/sqrt(d_k)``.
        rope, positions: every head's projected queries and keys rotated exactly, as in
            :func:`attention` (Arb balls: ``backend`` ``"auto"`` or ``"arb"``; an output is
            proved 0 only when its column of ``wo`` and its ``bo`` are 0, or by its enclosure).
        mask: boolean array broadcastable to ``(..., H, Lq, Lk)`` (so an ``(Lq, Lk)`` mask applies
            to every head); True means attend; or a :class:`mhanum.masks.Band`.
        bias: float array broadcastable to ``(..., H, Lq, Lk)``, finite or ``-inf``.
        digits: significant digits to certify, an integer in ``[1, 2000]``.
        fully_masked: ``"nan"``, ``"zero"`` or ``"uniform"``, as in :func:`attention` (per head).
        max_prec: largest working precision in bits, as in :func:`attention`.
        backend: as in :func:`attention`.
        return_mpf: also return the certified mpmath values.

    Returns:
        float64 array ``(..., Lq, d_out)``, the certified values rounded to nearest (``±inf``
        where they are past the float64 range, which attention alone, a convex combination of
        ``v``, never is); with ``return_mpf=True`` the pair ``(floats, mpf_values)``.

    Raises:
        InvalidArgument: for invalid ``params`` or ``num_heads``, a non-float, non-finite or
            misshapen input, a bad mask or bias, or an out-of-range option.
        CertificationError: if ``digits`` digits are not reached by ``max_prec`` bits; with
            ``backend="dd"``, as in :func:`attention`.
        ImportError: for ``backend="arb"`` without python-flint.

    Examples:
        >>> import numpy as np
        >>> from mhanum import MHAParams, reference
        >>> params = MHAParams.random(8, seed=0)
        >>> x = np.random.default_rng(0).standard_normal((5, 8))
        >>> reference.multi_head_attention(x, x, params, 2).shape
        (5, 8)
    """
    options = check_options(digits, max_prec, fully_masked, backend, return_mpf)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, sink=sink, softcap=softcap,
        num_kv_heads=num_kv_heads, rope=rope, positions=positions, scale=scale,
    )  # fmt: skip
    params, num_heads = p.params, p.num_heads
    xq64, xkv64 = (np.asarray(x).astype(np.float64) for x in (p.x_q, p.x_kv))
    mask, bias, shape, batch = p.mask, p.bias, p.scores, p.batch
    key_positions = None if p.positions is None else p.positions[1]
    if p.sink is not None:
        mask, bias, shape = masks.head_sinks(mask, bias, p.sink, shape)
        xkv64, params = sink_row(xkv64, params_float64(params))
        batch = shape[:-3]
        if key_positions is not None:  # the sink's key projects to 0: any position keeps it 0
            key_positions = np.append(key_positions, 0)
    spec = score_spec(mask, bias, check_scale(scale), shape, p.d_k, options.fully_masked, p.softcap)
    check_softcap_backend(spec, options)
    params64 = params_float64(params)
    if p.rope is not None:
        assert p.positions is not None
        assert key_positions is not None
        turn = head_rotation(p.rope, {"q": p.positions[0], "k": key_positions}, options)
        return arb_backend().multi_head_attention(
            xq64, xkv64, params64, num_heads, spec, options, mha_value_zeros(params64), turn
        )
    zeros = mha_zeros(xq64, xkv64, params64, num_heads, spec)
    if options.backend == "arb":
        arb = arb_backend()
        return arb.multi_head_attention(xq64, xkv64, params64, num_heads, spec, options, zeros)
    if options.backend == "mpmath":
        compute = bind_naive_mha(xq64, xkv64, params64, num_heads, spec)
        return certified(compute, options, zeros)

    def exact_rows(index: tuple[int, ...], rows: np.ndarray) -> np.ndarray:
        """Some rows of one batch element: refined (Theorem 2) or recomputed by ``"arb"`` if
        python-flint is installed, else recomputed by ``"exact"``."""
        xq_b, xkv_b = (batch_element(x, batch, index) for x in (xq64, xkv64))
        # the batch element first, then its rows: an integer and an array split by a slice
        # would move the rows' axis in front of the heads' (numpy's advanced indexing)
        sub = sub_spec(sub_spec(spec, index), (slice(None), rows))
        sub_zeros = mha_zeros(xq_b[rows], xkv_b, params64, num_heads, sub)
        if has_flint():
            arb = arb_backend()
            refined = arb.refine_mha_rows(
                xq_b[rows], xkv_b, params64, num_heads, sub, options, sub_zeros
            )
            if refined is not None:
                return refined
            with_mpf = dataclasses.replace(options, return_mpf=True)
            return arb.multi_head_attention(
                xq_b[rows], xkv_b, params64, num_heads, sub, with_mpf, sub_zeros
            )[1]
        core = exact_mha(xq_b[rows], xkv_b, params64, num_heads, sub)
        return certify(floating_outputs(core), options, sub_zeros)

    if options.backend == "exact" or spec.softcap is not None or not fast_path_applies(options):
        compute = floating_outputs(exact_mha(xq64, xkv64, params64, num_heads, spec))
        return certified(compute, options, zeros)
    weights = {f.name: getattr(params64, f.name) for f in dataclasses.fields(params64)}
    with np.errstate(all="ignore"):
        out, undefined = _fastref.multi_head_attention(
            xq64, xkv64, weights, num_heads, spec.excluded, spec.bias, spec.fully_masked,
            spec.scale,
        )  # fmt: skip
    return fast_certified(out, undefined, batch, exact_rows, options, zeros)
