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
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import mpmath
import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import CertificationError, InvalidArgument
from mhanum._threads import one_blas_thread
from mhanum.gradients import Gradients, MHAGradients
from mhanum.params import MHAParams
from mhanum.problem import AttentionProblem, MHAProblem
from mhanum.reference import _dd, _exact, _fastref
from mhanum.reference._dd import Ball

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

_FULLY_MASKED = ("nan", "zero", "uniform")
BACKENDS = ("auto", "dd", "exact", "mpmath", "arb")
"""The backends, fastest first: see :func:`max_digits` and ``docs/performance.md``."""
_MAX_DIGITS = 2000
_MIN_MAX_PREC = 64
# Bits beyond ceil(digits * log2(10)) at the starting working precision.
_GUARD_BITS = 32
# Bits beyond the working precision of the dyadic approximation of an irrational scale.
_SCALE_GUARD_BITS = 64
# Bits of the scale approximation used only to choose each row's largest score.
_ARGMAX_SCALE_BITS = 64

# A backend's computation at one working precision: mpf outputs (zeros in undefined rows) and a
# boolean array marking the rows (all axes but the last) that are undefined.
_Compute = Callable[[mpmath.MPContext], tuple[np.ndarray, np.ndarray]]
# Whether the exact output at an index (of a defined row) is provably 0.
_ExactZero = Callable[[tuple[int, ...]], bool]


@dataclasses.dataclass(frozen=True)
class _Options:
    """Validated keyword options shared by both public functions."""

    digits: int
    max_prec: int
    fully_masked: str
    backend: str
    return_mpf: bool


@dataclasses.dataclass(frozen=True)
class _ScoreSpec:
    """How scores become probabilities; the arrays have the full scores shape ``(..., Lq, Lk)``.

    Attributes:
        excluded: True where a key is excluded (``mask`` False or ``bias`` ``-inf``).
        bias: float64 bias with ``-inf`` replaced by 0, or ``None``.
        scale: the exact scale as ``(man, exp)``, or ``None`` for ``1/sqrt(d_k)``.
        d_k: the length of the score dot products.
        fully_masked: the fully-masked-row policy.
        softcap: the logit soft-cap ``c`` (``c·tanh(s/c)`` before the bias), or ``None``.
    """

    excluded: np.ndarray
    bias: np.ndarray | None
    scale: tuple[int, int] | None
    d_k: int
    fully_masked: str
    softcap: float | None = None


@one_blas_thread
def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    digits: int = 20,
    fully_masked: str = "nan",
    max_prec: int = 8192,
    backend: str = "auto",
    return_mpf: bool = False,
    sink: Any = None,
    softcap: float | None = None,
    descale: Any = None,
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
    options = _check_options(digits, max_prec, fully_masked, backend, return_mpf)
    p = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, descale=descale
    )
    q64, k64, v64 = (np.asarray(x).astype(np.float64) for x in (p.q, p.k, p.v))
    if p.descale is not None:
        q64, k64, v64 = (
            _exact_product(x, d, n)
            for x, d, n in zip((q64, k64, v64), p.descale, "qkv", strict=True)
        )
    mask, bias, shape = p.mask, p.bias, p.scores
    if p.sink is not None:
        b64 = None if bias is None else np.asarray(bias).astype(np.float64)
        k64, v64, mask, bias = masks.with_sink(q64, k64, v64, mask, b64, p.sink)
        shape = (*k64.shape[:-2], q64.shape[-2], k64.shape[-2])
    batch = shape[:-2]
    spec = _score_spec(
        mask, bias, _check_scale(scale), shape, q64.shape[-1], options.fully_masked, p.softcap
    )
    _check_softcap_backend(spec, options)
    zeros = _attention_zeros(q64, k64, v64, spec)
    if options.backend == "arb":
        return _arb_backend().attention(q64, k64, v64, spec, options, zeros)
    if options.backend == "mpmath":
        floating = _exact.Floating.from_float64
        compute = _bind_naive_attention(floating(q64), floating(k64), floating(v64), spec)
        return _certified(compute, options, zeros)

    def exact_rows(index: tuple[int, ...], rows: Any) -> np.ndarray:
        """Some rows of one batch element, certified by ``"arb"`` if installed, else ``"exact"``."""
        q_b, k_b, v_b = (_batch_element(x, batch, index) for x in (q64, k64, v64))
        sub = _sub_spec(spec, (*index, rows))
        sub_zeros = _attention_zeros(q_b[rows], k_b, v_b, sub)
        if _has_flint():
            with_mpf = dataclasses.replace(options, return_mpf=True)
            return _arb_backend().attention(q_b[rows], k_b, v_b, sub, with_mpf, sub_zeros)[1]
        dyadic = _exact.Dyadic.from_float64
        core = _exact_attention(dyadic(q_b[rows]), dyadic(k_b), dyadic(v_b), sub)
        return _certify(_floating_outputs(core), options, sub_zeros)

    if options.backend == "exact" or spec.softcap is not None or not _fast_path_applies(options):
        dyadic = _exact.Dyadic.from_float64
        core = _exact_attention(dyadic(q64), dyadic(k64), dyadic(v64), spec)
        return _certified(_floating_outputs(core), options, zeros)
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
    return _fast_certified(out, undefined, batch, exact_rows, options, zeros)


@one_blas_thread
def attention_grad(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    digits: int = 20,
    max_prec: int = 8192,
    softcap: float | None = None,
    sink: Any = None,
) -> Gradients:
    """Certified gradients of attention: the exact backward pass of the given floats.

    With ``S = scale·q kᵀ + bias``, ``P = softmax(S)`` (exactly 0 at masked keys) and
    ``O = P v``, the gradients of ``<d_out, O>`` are ``dv = Pᵀ d_out``,
    ``dS = P ∘ (d_out vᵀ - rowsum(P ∘ d_out vᵀ))``, ``dq = scale·dS k``, ``dk = scale·dSᵀ q`` and
    ``dbias = dS``. They are computed in python-flint's Arb balls (every input float exact,
    ``exp`` and the sums rigorous) and certified when every ball's radius is at most
    ``2**-ceil(digits log2 10) / 2`` of its midpoint, or the ball lies within
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
    options = _check_options(digits, max_prec, "zero", "arb", False)
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
    spec = _score_spec(mask, bias, _check_scale(scale), shape, q64.shape[-1], "zero", p.softcap)
    if spec.excluded.all(axis=-1).any():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    grads = _arb_backend().attention_grad(
        q64, k64, v64, g64, spec, options, sink_column=sink is not None
    )
    if sink is None:
        return Gradients(*grads)
    # the sink's key and value are constants: drop their rows; its logit's gradient is the
    # sum of its column of dS, certified with the rest
    dq, dk, dv, dbias, dsink = grads
    return Gradients(dq, dk[..., :keys, :], dv[..., :keys, :], dbias[..., :keys], dsink[..., 0, 0])


@one_blas_thread
def mha_grad(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    num_heads: int,
    d_out: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    digits: int = 20,
    max_prec: int = 8192,
    sink: Any = None,
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
    options = _check_options(digits, max_prec, "zero", "arb", False)
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
    spec = _score_spec(mask, bias, _check_scale(scale), shape, p.d_k, "zero", p.softcap)
    if spec.excluded.all(axis=-1).any():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    params64 = _params_float64(params)
    dx_q, dx_kv, dbias, grads, dsink = _arb_backend().mha_grad(
        xq64, xkv64, g64, params64, heads, spec, options, sink=sink is not None, group=group
    )
    names = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
    return MHAGradients(dx_q, dx_kv, MHAParams(**{n: grads.get(n) for n in names}), dbias, dsink)


@one_blas_thread
def multi_head_attention(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    num_heads: int,
    *,
    mask: Any = None,
    bias: Any = None,
    digits: int = 20,
    fully_masked: str = "nan",
    max_prec: int = 8192,
    backend: str = "auto",
    return_mpf: bool = False,
    num_kv_heads: int | None = None,
    sink: Any = None,
    softcap: float | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Exact multi-head attention ``concat_h(attention_h) @ wo + bo`` of the given floats, certified.

    ``q = x_q @ wq + bq``, ``k = x_kv @ wk + bk``, ``v = x_kv @ wv + bv`` exactly (a ``None`` bias
    is no bias); head ``h`` takes columns ``[h*d_k, (h+1)*d_k)`` of ``q`` and ``k`` (``d_k =
    wq.shape[1] // num_heads``) and ``[h*d_v, (h+1)*d_v)`` of ``v``; each head is
    :func:`attention` with scale exactly ``1/sqrt(d_k)``; the heads are concatenated in head order
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
    options = _check_options(digits, max_prec, fully_masked, backend, return_mpf)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, sink=sink, softcap=softcap,
        num_kv_heads=num_kv_heads,
    )  # fmt: skip
    params, num_heads = p.params, p.num_heads
    xq64, xkv64 = (np.asarray(x).astype(np.float64) for x in (p.x_q, p.x_kv))
    mask, bias, shape, batch = p.mask, p.bias, p.scores, p.batch
    if p.sink is not None:
        mask, bias, shape = masks.head_sinks(mask, bias, p.sink, shape)
        xkv64, params = _sink_row(xkv64, _params_float64(params))
        batch = shape[:-3]
    spec = _score_spec(mask, bias, None, shape, p.d_k, options.fully_masked, p.softcap)
    _check_softcap_backend(spec, options)
    params64 = _params_float64(params)
    zeros = _mha_zeros(xq64, xkv64, params64, num_heads, spec)
    if options.backend == "arb":
        arb = _arb_backend()
        return arb.multi_head_attention(xq64, xkv64, params64, num_heads, spec, options, zeros)
    if options.backend == "mpmath":
        compute = _bind_naive_mha(xq64, xkv64, params64, num_heads, spec)
        return _certified(compute, options, zeros)

    def exact_rows(index: tuple[int, ...], rows: Any) -> np.ndarray:
        """Some rows of one batch element: refined (Theorem 2) or recomputed by ``"arb"`` if
        python-flint is installed, else recomputed by ``"exact"``."""
        xq_b, xkv_b = (_batch_element(x, batch, index) for x in (xq64, xkv64))
        # the batch element first, then its rows: an integer and an array split by a slice
        # would move the rows' axis in front of the heads' (numpy's advanced indexing)
        sub = _sub_spec(_sub_spec(spec, index), (slice(None), rows))
        sub_zeros = _mha_zeros(xq_b[rows], xkv_b, params64, num_heads, sub)
        if _has_flint():
            arb = _arb_backend()
            refined = arb.refine_mha_rows(
                xq_b[rows], xkv_b, params64, num_heads, sub, options, sub_zeros
            )
            if refined is not None:
                return refined
            with_mpf = dataclasses.replace(options, return_mpf=True)
            return arb.multi_head_attention(
                xq_b[rows], xkv_b, params64, num_heads, sub, with_mpf, sub_zeros
            )[1]
        core = _exact_mha(xq_b[rows], xkv_b, params64, num_heads, sub)
        return _certify(_floating_outputs(core), options, sub_zeros)

    if options.backend == "exact" or spec.softcap is not None or not _fast_path_applies(options):
        compute = _floating_outputs(_exact_mha(xq64, xkv64, params64, num_heads, spec))
        return _certified(compute, options, zeros)
    weights = {f.name: getattr(params64, f.name) for f in dataclasses.fields(params64)}
    with np.errstate(all="ignore"):
        out, undefined = _fastref.multi_head_attention(
            xq64, xkv64, weights, num_heads, spec.excluded, spec.bias, spec.fully_masked
        )
    return _fast_certified(out, undefined, batch, exact_rows, options, zeros)


# --- validation --------------------------------------------------------------------------------


def _check_options(
    digits: Any, max_prec: Any, fully_masked: Any, backend: Any, return_mpf: Any
) -> _Options:
    if not _is_int(digits) or not 1 <= digits <= _MAX_DIGITS:
        msg = f"digits: expected an integer in [1, {_MAX_DIGITS}], got {digits!r}"
        raise InvalidArgument(msg)
    if not _is_int(max_prec) or max_prec < _MIN_MAX_PREC:
        msg = f"max_prec: expected an integer >= {_MIN_MAX_PREC}, got {max_prec!r}"
        raise InvalidArgument(msg)
    if max_prec < _start_prec(int(digits)):
        msg = (
            f"max_prec: expected at least {_start_prec(int(digits))} bits for digits={digits}, "
            f"got {max_prec}"
        )
        raise InvalidArgument(msg)
    if fully_masked not in _FULLY_MASKED:
        msg = f"fully_masked: expected one of 'nan', 'zero', 'uniform', got {fully_masked!r}"
        raise InvalidArgument(msg)
    if backend not in BACKENDS:
        msg = f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        raise InvalidArgument(msg)
    if not isinstance(return_mpf, (bool, np.bool_)):
        msg = f"return_mpf: expected a bool, got {return_mpf!r}"
        raise InvalidArgument(msg)
    return _Options(int(digits), int(max_prec), fully_masked, backend, bool(return_mpf))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _start_prec(digits: int) -> int:
    """Starting working precision in bits for ``digits`` significant digits."""
    return math.ceil(digits * math.log2(10)) + _GUARD_BITS


def _float_array(x: Any, name: str, min_ndim: int) -> np.ndarray:
    """``x`` converted exactly to float64, after checking its dtype and rank."""
    return np.asarray(V.float_array(x, name, min_ndim=min_ndim)).astype(np.float64)


def _broadcast_to(x: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        return np.broadcast_to(x, shape)
    except ValueError:
        msg = f"{name}: expected a shape broadcastable to {shape}, got {x.shape}"
        raise InvalidArgument(msg) from None


def _check_scale(scale: Any) -> tuple[int, int] | None:
    """The scale as an exact ``(man, exp)`` pair, or ``None`` for ``1/sqrt(d_k)``."""
    if scale is None:
        return None
    arr = np.asarray(scale)
    numeric = arr.dtype.kind in "iu" or V.is_exact_float_dtype(arr.dtype)
    if arr.ndim != 0 or not numeric or isinstance(scale, (bool, np.bool_)):
        msg = f"scale: expected None or a finite real number, got {scale!r}"
        raise InvalidArgument(msg)
    value = float(arr.astype(np.float64))
    if not math.isfinite(value) or (arr.dtype.kind in "iu" and int(arr) != value):
        msg = f"scale: expected None or a finite real number exact in float64, got {scale!r}"
        raise InvalidArgument(msg)
    return _float_pair(value)


def _score_spec(
    mask: Any,
    bias: Any,
    scale: tuple[int, int] | None,
    shape: tuple[int, ...],
    d_k: int,
    fully_masked: str,
    softcap: Any = None,
) -> _ScoreSpec:
    """Check ``mask``, ``bias`` and ``softcap`` against the scores ``shape`` and combine them."""
    excluded = ~np.asarray(masks.dense(masks.normalise(mask, shape), shape))
    bias64 = None
    if bias is not None:
        bias_arr = _float_array(bias, "bias", 0)
        V.check_finite(bias_arr, "bias", allow_neg_inf=True)
        bias_arr = _broadcast_to(bias_arr, "bias", shape)
        excluded = excluded | np.isneginf(bias_arr)
        bias64 = np.where(np.isneginf(bias_arr), 0.0, bias_arr)
    return _ScoreSpec(excluded, bias64, scale, d_k, fully_masked, V.softcap_value(softcap))


def _sink_row(x_kv: np.ndarray, params: MHAParams) -> tuple[np.ndarray, MHAParams]:
    """The sink's key and value, exactly zero after the projections, as one more row of x_kv:
    a new input column (0 for the real rows, 1 for the sink's) whose weight row is ``-b_k``
    (``-b_v``), so the sink projects to ``1·(-b) + b = 0`` and the real rows to what they did
    (exact arithmetic: the reference computes the projections exactly)."""
    lead = x_kv.shape[:-2]
    real = np.concatenate([x_kv, np.zeros((*lead, x_kv.shape[-2], 1))], axis=-1)
    row = np.zeros((*lead, 1, x_kv.shape[-1] + 1))
    row[..., -1] = 1.0
    extra = {}
    for w, b in (("wk", "bk"), ("wv", "bv")):
        bias = getattr(params, b)
        width = np.shape(getattr(params, w))[1]
        minus = np.zeros(width) if bias is None else -np.asarray(bias, np.float64)
        extra[w] = np.vstack([np.asarray(getattr(params, w), np.float64), minus[None]])
    return np.concatenate([real, row], axis=-2), dataclasses.replace(params, **extra)


def _params_float64(params: MHAParams) -> MHAParams:
    """The parameters with every array converted (exactly) to a numpy float64 array."""
    converted = {
        f.name: np.asarray(value).astype(np.float64)
        for f in dataclasses.fields(params)
        if (value := getattr(params, f.name)) is not None
    }
    return dataclasses.replace(params, **converted)


# --- the fast path ------------------------------------------------------------------------------

# The certified mpf values of some rows (an index array of the query axis) of one batch element.
_ExactRows = Callable[[tuple[int, ...], Any], np.ndarray]


def nearest_float64(x: Any) -> float:
    """A finite mpf correctly rounded to float64 (nearest, ties to even; ``inf`` past the range).

    ``float(mpf)`` rounds to 53 bits first and so rounds twice in the subnormal range; this rounds
    once, subnormals included.

    >>> import mpmath
    >>> nearest_float64(mpmath.mpf(2) ** -1074 * mpmath.mpf("1.5"))
    1e-323
    """
    return _exact.to_float64(*_exact.mpf_pair(x))


def max_digits(backend: str) -> int:
    """The most significant digits ``backend`` certifies; asking for more raises or falls back.

    ``"auto"``, ``"exact"``, ``"mpmath"`` and ``"arb"`` certify any number of digits up to 2000
    (given ``max_prec``). ``"dd"``, the double-double enclosure alone, certifies at most 26: its
    error bounds are near ``2**-95`` of the values (``papers/reference.md``, Theorem 1); with
    more digits ``backend="dd"`` raises :class:`~mhanum.CertificationError` and ``"auto"`` runs
    the exact backend on every row.

    Raises:
        InvalidArgument: for an unknown backend.

    Examples:
        >>> from mhanum import reference
        >>> reference.max_digits("dd"), reference.max_digits("auto")
        (26, 2000)
    """
    if backend not in BACKENDS:
        msg = f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        raise InvalidArgument(msg)
    return _fastref.MAX_DIGITS if backend == "dd" else _MAX_DIGITS


def _exact_product(x: np.ndarray, factor: float, name: str) -> np.ndarray:
    """``x·factor`` in float64, refused unless every product is exact (their significant bits
    fit 53 and no product leaves float64's normal range)."""
    product = x * factor

    def bits(a: np.ndarray) -> np.ndarray:
        m, _ = np.frexp(np.abs(a))
        ints = (m * 2.0**53).astype(np.uint64)
        low = ints & (~ints + np.uint64(1))  # the lowest set bit
        return 53 - np.log2(np.maximum(low, 1).astype(np.float64)).astype(np.int64)

    with np.errstate(over="ignore", under="ignore"):
        ok = (x == 0) | (
            (bits(x) + int(bits(np.asarray(factor))) <= 53)
            & (np.abs(product) >= np.finfo(np.float64).tiny)
            & np.isfinite(product)
        )
    if not np.all(ok):
        msg = (
            f"descale: expected {name}·d_{name} exact in float64 (inputs of at most 29 "
            f"significant bits with a float32 factor), got inexact products"
        )
        raise InvalidArgument(msg)
    return product


def _check_softcap_backend(spec: _ScoreSpec, options: _Options) -> None:
    """The double-double enclosure has no ``tanh``: ``"dd"`` refuses a soft-cap."""
    if spec.softcap is not None and options.backend == "dd":
        msg = "backend 'dd' does not take softcap (it has no tanh); use backend='auto' or 'exact'"
        raise CertificationError(msg)


def _fast_path_applies(options: _Options) -> bool:
    """Whether to try the double-double enclosure (``"dd"`` refuses what it cannot certify).

    Its bounds assume gradual underflow, which a library loaded into the process can switch off.
    """
    if not _dd.gradual_underflow():
        if options.backend == "dd":
            msg = "backend 'dd' needs gradual underflow, but float64 subnormals are flushed"
            raise CertificationError(msg)
        return False
    if options.digits <= _fastref.MAX_DIGITS:
        return True
    if options.backend == "dd":
        msg = (
            f"backend 'dd' certifies at most {_fastref.MAX_DIGITS} digits, got digits="
            f"{options.digits}; use backend='auto' or 'exact'"
        )
        raise CertificationError(msg)
    return False


def _batch_element(x: np.ndarray, batch: tuple[int, ...], index: tuple[int, ...]) -> np.ndarray:
    """Batch element ``index`` of ``x`` broadcast to the batch shape ``batch``."""
    return np.broadcast_to(x, batch + x.shape[-2:])[index]


def _sub_spec(spec: _ScoreSpec, index: tuple[Any, ...]) -> _ScoreSpec:
    """The score spec restricted by ``index`` (a batch element and some query rows)."""
    bias = None if spec.bias is None else spec.bias[index]
    return dataclasses.replace(spec, excluded=spec.excluded[index], bias=bias)


def _fast_certified(
    out: Ball,
    undefined: np.ndarray,
    batch: tuple[int, ...],
    exact_rows: _ExactRows,
    options: _Options,
    exact_zero: _ExactZero,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The enclosed outputs where they certify ``digits``; elsewhere the exact rows (or raise).

    An undefined row is NaN. A component whose enclosure contains 0 without certifying it is
    exactly 0 where ``exact_zero`` proves it. A row with a component still not certified is
    recomputed by ``exact_rows`` (``"auto"``: refined or recomputed with ``"arb"`` where
    python-flint is installed, else recomputed with ``"exact"``); with ``"dd"`` that raises
    :class:`~mhanum.CertificationError`.
    """
    good = _fastref.certified(out, options.digits) | undefined[..., None]
    out, good = _proved_zeros(out, good, exact_zero)
    floats = np.where(undefined[..., None], np.nan, out.hi)
    values = _dd_to_mpf(out.hi, out.lo, undefined) if options.return_mpf else None
    failed = ~np.asarray(good.all(axis=-1))
    if failed.any() and options.backend == "dd":
        first = tuple(int(i) for i in np.argwhere(~good)[0])
        msg = (
            f"backend 'dd' could not certify {options.digits} digits for {int((~good).sum())} "
            f"of {good.size} components (first at index {first}); use backend='auto'"
        )
        raise CertificationError(msg)
    for index in np.ndindex(batch):
        rows = np.flatnonzero(failed[index])
        if rows.size:
            exact = exact_rows(index, rows)
            floats[(*index, rows)] = _to_float64(exact)
            if values is not None:
                values[(*index, rows)] = exact
    return (floats, values) if values is not None else floats


def _proved_zeros(out: Ball, good: np.ndarray, exact_zero: _ExactZero) -> tuple[Ball, np.ndarray]:
    """``out`` set to exactly 0 where a component not ``good`` is proved 0, and the new ``good``.

    An exact 0 lies in its enclosure, so only the enclosures that may contain 0 are looked up:
    ``|hi + lo| <= rad`` implies ``|hi| <= 2 rad`` (``|lo| <= u |hi|``).
    """
    rad = np.zeros_like(out.hi) if out.rad is None else out.rad
    with np.errstate(invalid="ignore", over="ignore"):
        candidates = ~good & (np.abs(out.hi) <= 2 * rad)
    zero = np.zeros(good.shape, dtype=bool)
    for index in np.argwhere(candidates):
        zero[tuple(index)] = exact_zero(tuple(int(i) for i in index))
    if not zero.any():
        return out, good
    cleared = Ball(
        np.where(zero, 0.0, out.hi), np.where(zero, 0.0, out.lo), np.where(zero, 0.0, rad)
    )
    return cleared, good | zero


def _dd_to_mpf(hi: np.ndarray, lo: np.ndarray, undefined: np.ndarray) -> np.ndarray:
    """``hi + lo`` as exact mpf numbers (NaN in undefined rows)."""
    ctx = _context(_exact._FLOAT64_MANTISSA_BITS)
    values = np.empty(hi.shape, dtype=object)
    for index, h in np.ndenumerate(hi):
        if undefined[index[:-1]]:
            values[index] = ctx.nan
        else:
            values[index] = ctx.fadd(ctx.mpf(float(h)), ctx.mpf(float(lo[index])), exact=True)
    return values


def _has_flint() -> bool:
    """Whether python-flint (a dependency of mhanum) can be imported."""
    try:
        import flint  # noqa: F401
    except ImportError:
        return False
    return True


def _arb_backend() -> Any:
    """The python-flint backend, imported on first use."""
    from mhanum.reference import _arbref

    return _arbref


# --- certification -----------------------------------------------------------------------------


def _context(prec: int) -> mpmath.MPContext:
    """A fresh mpmath context at ``prec`` bits, rounding to nearest."""
    ctx = mpmath.MPContext()
    ctx.prec = prec
    return ctx


def _certified(
    compute: _Compute, options: _Options, exact_zero: _ExactZero
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Run ``compute`` at ``p`` and ``2p`` until they agree; the float64 (and mpf) result."""
    values = _certify(compute, options, exact_zero)
    floats = _to_float64(values)
    return (floats, values) if options.return_mpf else floats


def _certify(compute: _Compute, options: _Options, exact_zero: _ExactZero) -> np.ndarray:
    """Values at ``2p`` that agree with those at ``p``, or exactly 0 where ``exact_zero`` proves it.

    Two zeros do not agree by themselves: probabilities that differ by less than ``2**-2p`` round
    to the same numbers at ``p`` and at ``2p`` bits, and values that cancel then give 0 at both.
    Nor is a proved zero always computed as 0 (equal values weighted by probabilities whose
    rounded sum is not 1), so a component that does not agree is looked up in the proof.
    """
    proved = _memoized(exact_zero)
    prec = _start_prec(options.digits)
    low = _with_nan(compute, _context(prec))
    while True:
        ctx = _context(2 * prec)
        high = _with_nan(compute, ctx)
        unproved = {}
        for index, error in _disagreements(ctx, low, high, options.digits).items():
            if proved(index):
                high[index] = ctx.zero
            else:
                unproved[index] = error
        if not unproved:
            return high
        if 2 * prec > options.max_prec:
            index = max(unproved, key=unproved.__getitem__)
            error = unproved[index]
            agreed = max(0.0, -float(ctx.log10(error))) if error != ctx.inf else 0.0
            msg = (
                f"could not certify {options.digits} digits within max_prec={options.max_prec} "
                f"bits: at {prec} and {2 * prec} bits the worst component, at index {index}, "
                f"agrees to {agreed:.1f} digits (value {ctx.nstr(high[index], 10)})"
            )
            raise CertificationError(msg)
        low, prec = high, 2 * prec


def _memoized(exact_zero: _ExactZero) -> _ExactZero:
    """``exact_zero`` computed once per index (a component may be looked up at every doubling)."""
    known: dict[tuple[int, ...], bool] = {}

    def proved(index: tuple[int, ...]) -> bool:
        if index not in known:
            known[index] = exact_zero(index)
        return known[index]

    return proved


def _with_nan(compute: _Compute, ctx: mpmath.MPContext) -> np.ndarray:
    """The outputs of ``compute`` with its undefined rows set to NaN."""
    values, undefined = compute(ctx)
    values[undefined] = ctx.nan
    return values


def _disagreements(
    ctx: mpmath.MPContext, low: np.ndarray, high: np.ndarray, digits: int
) -> dict[tuple[int, ...], Any]:
    """The components that do not agree to ``digits`` digits, with their relative disagreement
    (``inf`` where the value at ``2p`` is 0, two zeros included)."""
    tolerance = ctx.mpf(10) ** -digits
    found = {}
    for index, hi in np.ndenumerate(high):
        if ctx.isnan(hi) or (hi and abs(low[index] - hi) <= tolerance * abs(hi)):
            continue
        found[tuple(int(i) for i in index)] = abs(low[index] - hi) / abs(hi) if hi else ctx.inf
    return found


def _to_float64(values: np.ndarray) -> np.ndarray:
    """mpf values correctly rounded to float64 (NaN kept)."""
    out = np.empty(values.shape, dtype=np.float64)
    for index, value in np.ndenumerate(values):
        out[index] = math.nan if mpmath.isnan(value) else _exact.to_float64(*_exact.mpf_pair(value))
    return out


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


def _rational_scale(spec: _ScoreSpec) -> Fraction | None:
    """The scale as a Fraction where it is rational (given, or ``1/sqrt(d_k)`` of a square)."""
    if spec.scale is not None:
        man, exp = spec.scale
        return man * Fraction(2) ** exp
    root = math.isqrt(spec.d_k)
    return Fraction(1, root) if root * root == spec.d_k else None


def _logit_key(
    dot: Fraction, bias: Fraction, scale: Fraction | None, spec: _ScoreSpec
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


def _attention_zeros(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: _ScoreSpec) -> _ExactZero:
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


def _logit_groups(
    q_row: np.ndarray, keys: np.ndarray, spec: _ScoreSpec, row: tuple[int, ...]
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


def _mha_zeros(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: _ScoreSpec
) -> _ExactZero:
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

    def projections(b: tuple[int, ...]) -> Any:
        if b not in cache:
            q, k, v = (
                _fraction_matrix(_exact_affine(x, w, bias))
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


# --- the scale ---------------------------------------------------------------------------------


def _scale_dyadic(spec: _ScoreSpec, bits: int) -> tuple[int, int]:
    """The scale as ``(man, exp)``, exact or truncated to ``bits`` fraction bits.

    A given scale is exact, and so is ``1/sqrt(d_k)`` when ``d_k`` is a power of 4; otherwise
    ``isqrt(4**bits // d_k) * 2**-bits`` is below ``1/sqrt(d_k)`` by less than ``2**-bits``.
    """
    if spec.scale is not None:
        return spec.scale
    return math.isqrt((1 << (2 * bits)) // spec.d_k), -bits


# --- exact backend -----------------------------------------------------------------------------

# An exact-backend stage at one working precision: exact values (probabilities, or outputs before
# their final rounding) and the undefined rows.
_Stage = Callable[[mpmath.MPContext], tuple[_exact.Floating, np.ndarray]]


def _exact_attention(
    q: _exact.Dyadic, k: _exact.Dyadic, v: _exact.Dyadic, spec: _ScoreSpec
) -> _Stage:
    """The computation of ``o = P @ v`` at a working precision (scores computed once, here)."""
    probabilities = _exact_probabilities(q, k, spec)

    def outputs(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        probs, undefined = probabilities(ctx)
        return _exact.rows_matmul(probs, v, prec=ctx.prec), undefined

    return outputs


def _exact_mha(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: _ScoreSpec
) -> _Stage:
    """The computation of ``y`` at a working precision (everything exact computed once, here).

    ``y = sum_h P_h @ (v_h @ wo_h) + bo``: the products ``v_h @ wo_h`` are exact and independent
    of the precision, so the probabilities, which are rounded, are multiplied once, and no
    rounded intermediate (such as a head output) can lose bits that a later cancellation needs.
    """
    q, k, v = (
        _exact_affine(x, w, b).map(lambda a: _split_heads(a, num_heads))
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


def _exact_affine(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> _exact.Dyadic:
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


def _exact_probabilities(q: _exact.Dyadic, k: _exact.Dyadic, spec: _ScoreSpec) -> _Stage:
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
        logits = _scaled(delta_scores, _scale_dyadic(spec, ctx.prec + _SCALE_GUARD_BITS))
        if delta_bias is not None:
            logits = _exact.add(logits, delta_bias)
        return _exact_softmax(ctx, _dyadic_logits(ctx, logits), spec)

    def capped(ctx: mpmath.MPContext) -> tuple[_exact.Floating, np.ndarray]:
        scaled = _scaled(scores, _scale_dyadic(spec, ctx.prec + _SCALE_GUARD_BITS))
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
    ctx: mpmath.MPContext, x: Any, delta: _exact.Dyadic | None, index: tuple[int, ...]
) -> Any:
    """``x`` plus the exact dyadic ``delta[index]``, added exactly (no rounding)."""
    if delta is None:
        return x
    return ctx.fadd(x, ctx.ldexp(int(delta.ints[index]), delta.exp), exact=True)


def _scaled(x: _exact.Dyadic, scale: tuple[int, int]) -> _exact.Dyadic:
    man, exp = scale
    return _exact.Dyadic(x.exp + exp, ints=x.ints * man)


def _row_argmax(scores: _exact.Dyadic, bias: _exact.Dyadic | None, spec: _ScoreSpec) -> np.ndarray:
    """Index ``(..., Lq, 1)`` of (approximately) the largest included score of each row."""
    logits = _scaled(scores, _scale_dyadic(spec, _ARGMAX_SCALE_BITS))
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
    ctx: mpmath.MPContext, row_logits: _RowLogits, spec: _ScoreSpec
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


def _floating_outputs(core: _Stage) -> _Compute:
    """Round a core's exact outputs to the working precision (the last rounding)."""

    def compute(ctx: mpmath.MPContext) -> tuple[np.ndarray, np.ndarray]:
        out, undefined = core(ctx)
        values = np.empty(out.man.shape, dtype=object)
        for index, man in np.ndenumerate(out.man):
            values[index] = ctx.mpf((man, out.exp[index]))
        return values, np.broadcast_to(undefined[..., None], values.shape)

    return compute


# --- mpmath (naive) backend --------------------------------------------------------------------


def _bind_naive_attention(
    q: _exact.Floating, k: _exact.Floating, v: _exact.Floating, spec: _ScoreSpec
) -> _Compute:
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


def _bind_naive_mha(
    x_q: np.ndarray, x_kv: np.ndarray, params: MHAParams, num_heads: int, spec: _ScoreSpec
) -> _Compute:
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
    ctx: mpmath.MPContext, q: _exact.Floating, k: _exact.Floating, spec: _ScoreSpec
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


def _naive_bias(spec: _ScoreSpec, row: tuple[int, ...], j: int) -> tuple[int, int]:
    return (0, 0) if spec.bias is None else _float_pair(spec.bias[(*row, j)])


def _minus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """``a - b`` exactly, for pairs."""
    return _exact.sum_exact([a, (-b[0], b[1])])


def _naive_logit(
    ctx: mpmath.MPContext, scale: Any, dot: tuple[int, int], bias: tuple[int, int]
) -> Any:
    """``scale * dot + bias`` as an mpf: exact for a dyadic scale, else one rounding (the product)."""
    if isinstance(scale, tuple):
        product = _product(scale, dot)
    else:
        product = _exact.mpf_pair(scale * ctx.ldexp(*dot))
    return ctx.ldexp(*_exact.sum_exact([product, bias]))


def _float_pair(x: float) -> tuple[int, int]:
    """A float64 as an exact ``(man, exp)`` pair."""
    mant, exp = math.frexp(float(x))
    return int(math.ldexp(mant, 53)), exp - 53


def _times(p: Any, man: int, exp: int) -> tuple[int, int]:
    """The exact product of an mpf and ``man * 2**exp`` as a pair."""
    return _product(_exact.mpf_pair(p), (man, exp))


def _product(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The exact product of two pairs."""
    return a[0] * b[0], a[1] + b[1]
