"""Certified tolerances for other people's attention kernels: "is this difference a bug, or rounding?"

:func:`attention_tolerance` gives, element by element, how far a kernel's output may lie from the
exact attention of its inputs: the bound of Theorem A.1 under every candidate numerics of the
kernel's descriptor (:mod:`mhanum.testing.kernels`), the largest of them, plus the float64 rounding
of the certified reference. :func:`assert_attention_close` checks a kernel's output against it and,
when it fails, says how many elements fail, the worst one (index, actual, exact, tolerance and
their ratio) and which term of the bound governs it. The ``mha`` variants do the same for a whole
multi-head attention layer (Theorem A.2). ``confidence=P`` (never the default) gives the
probabilistic tolerance of Theorem A.3 instead, which holds with probability at least ``P`` under
a model of independent rounding errors (:class:`ProbabilisticOracle`).

A kernel that meets its tolerance is within rounding of the exact answer *as its numerics model
says it rounds*; one that does not computes something else (a wrong scale, a dropped block, a
stale maximum), or rounds differently from its descriptor, which is a finding too.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((4, 16)).astype(np.float32) for _ in range(3))
>>> import jax
>>> out = np.asarray(jax.nn.dot_product_attention(q[:, None], k[:, None], v[:, None]))[:, 0]
>>> assert_attention_close(out, q, k, v, kernel="jax-xla")
>>> wrong = out.copy(); wrong[2, 5] += 1e-3
>>> assert_attention_close(wrong, q, k, v, kernel="jax-xla")  # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
mhanum.testing.oracle.AttentionMismatch: 1 of 64 elements outside the certified tolerance of kernel 'jax-xla'...
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.testing.backward_kernels import (
    BACKWARD_KERNELS,
    BACKWARD_NOT_MODELLED,
    BackwardKernel,
    get_backward_kernel,
)
from mhanum.testing.grad import (
    GradientMismatch,
    GradientOracle,
    assert_attention_grad_close,
    assert_mha_grad_close,
    attention_grad_oracle,
    attention_grad_tolerance,
    mha_grad_oracle,
    mha_grad_tolerance,
)
from mhanum.testing.kernels import FULLY_MASKED, KERNELS, NOT_MODELLED, Kernel, get_kernel
from mhanum.testing.kvcache_kernels import (
    KV_CACHE_KERNELS,
    KV_CACHE_NOT_MODELLED,
    KVCacheKernel,
    get_kv_cache,
)
from mhanum.testing.oracle import (
    AttentionMismatch,
    Oracle,
    PredictedOverflow,
    as_float64,
    assert_close,
    fold_candidates,
    keyword_defaults,
    keywords_over,
)

if TYPE_CHECKING:
    from mhanum._types import ArrayLike
    from mhanum.kvcache import KVQuant
    from mhanum.numerics import Numerics
    from mhanum.params import MHAParams
    from mhanum.rope import Rope

__all__ = [
    "BACKWARD_KERNELS",
    "BACKWARD_NOT_MODELLED",
    "FULLY_MASKED",
    "KERNELS",
    "KV_CACHE_KERNELS",
    "KV_CACHE_NOT_MODELLED",
    "NOT_MODELLED",
    "PROBABILISTIC_MODEL",
    "AttentionMismatch",
    "BackwardKernel",
    "GradientMismatch",
    "GradientOracle",
    "KVCacheKernel",
    "Kernel",
    "Oracle",
    "PredictedOverflow",
    "ProbabilisticOracle",
    "assert_attention_close",
    "assert_attention_grad_close",
    "assert_mha_close",
    "assert_mha_grad_close",
    "attention_grad_oracle",
    "attention_grad_tolerance",
    "attention_inputs",
    "attention_oracle",
    "attention_tolerance",
    "get_backward_kernel",
    "get_kernel",
    "get_kv_cache",
    "mha_grad_oracle",
    "mha_grad_tolerance",
    "mha_oracle",
    "mha_tolerance",
]

_LAYOUTS = ("bhld", "blhd")
_F64_ROUNDING = 2.0**-52  # the certified reference's float64 rounding, relative (with margin)
_FORMATS = {"float64": "float32", "float32": "float32", "bfloat16": "bfloat16",
            "float16": "float16"}  # fmt: skip


PROBABILISTIC_MODEL = (
    "independent, mean-zero rounding errors in every sum and dot (Higham & Mary 2019; "
    "Theorem A.3, papers/attention.md)"
)


@dataclasses.dataclass(frozen=True)
class ProbabilisticOracle(Oracle):
    """An :class:`Oracle` whose tolerance is Theorem A.3's (A.2's probabilistic form for a
    layer): it holds with probability at least :attr:`probability` under :attr:`model`, not
    for every rounding.

    The event is joint: with that probability *every* element of the output lies within its
    tolerance at once (the union bound of Theorem A.3 over all the rounding chains of the
    call), so each element does too. The model is that of Higham & Mary (2019): the rounding
    errors of the additions and products inside every sum and dot are independent random
    variables of mean zero. It is exact for stochastic rounding; for round to nearest it is a
    model, and inputs whose roundings all go one way (sums of equal values just above half
    an ulp, constant channels, values on a coarse grid) break it: there a correct kernel may
    exceed this tolerance while staying within the certified one (docs/testing.md, "A
    probabilistic tolerance"). The exponentials, divisions and single roundings keep their
    deterministic bounds, and so does the float64 rounding of the reference.

    Attributes:
        confidence: the probability asked for (``confidence=`` of :func:`attention_oracle`).
        probability: the probability the candidates' bounds state, the least of them: at
            least ``confidence`` (``λ`` is solved from the union bound, then raised by float64
            spacings until the stated probability reaches it).
        model: the model of the rounding errors under which the probability holds, in words.
    """

    confidence: float
    probability: float
    model: str

    def message(self, actual: Any) -> str | None:
        """:meth:`Oracle.message`, saying that the tolerance is probabilistic, with its
        probability and its model."""
        text = super().message(actual)
        if text is None:
            return None
        text = text.replace(
            "outside the certified tolerance", "outside the probabilistic tolerance", 1
        )
        chance = self.probability
        stated = f"{chance:.6g}" if 1 - chance >= 1e-5 else f"1 - {1 - chance:.3g}"
        return (
            f"{text}. The tolerance is probabilistic: all elements lie within it together with "
            f"probability >= {stated} (confidence={self.confidence!r}) under the model of "
            f"{self.model}. On inputs whose roundings all go one way a kernel that rounds as "
            "modelled may exceed it: the certified tolerance (confidence=None) tells whether "
            "it is a bug"
        )


def _confidence(confidence: Any) -> float | None:
    """``confidence`` checked: None, or a number strictly between 0 and 1."""
    if confidence is None:
        return None
    number = isinstance(confidence, (int, float, np.floating)) and not isinstance(
        confidence, (bool, np.bool_)
    )
    if not number or not 0.0 < float(confidence) < 1.0:
        msg = f"confidence: expected None or a float strictly between 0 and 1, got {confidence!r}"
        raise InvalidArgument(msg)
    return float(confidence)


def _format_of(x: Any, dtype: str | None) -> str:
    if dtype is not None:
        if dtype not in _FORMATS:
            msg = f"dtype: expected one of {tuple(_FORMATS)}, got {dtype!r}"
            raise InvalidArgument(msg)
        return _FORMATS[dtype]
    name = str(getattr(x, "dtype", "float64")).removeprefix("torch.")
    if name not in _FORMATS:
        msg = f"q: expected a float16, bfloat16, float32 or float64 array, got dtype {name}"
        raise InvalidArgument(msg)
    return _FORMATS[name]


def _causal(lq: int, lk: int) -> np.ndarray:
    """The causal mask of ``torch``'s and ``jax.nn``'s ``is_causal``: query i attends keys
    ``j <= i`` (aligned at the upper left)."""
    return np.asarray(masks.causal().array(lq, lk))


def _mask(mask: Any, is_causal: bool, target: tuple[int, ...]) -> np.ndarray | None:
    """The kernel's mask for scores shaped ``target`` (``is_causal`` joined), read once."""
    if hasattr(mask, "detach"):  # a torch tensor
        mask = mask.detach().cpu().numpy()
    mask = masks.normalise(mask, target)
    if mask is None and not is_causal:
        return None
    m = np.asarray(masks.dense(mask, target))
    return m & _causal(*target[-2:]) if is_causal else m


def _fold(
    exact: np.ndarray,
    bounds: Sequence[Any],
    dead: np.ndarray | None,
    kernel: Kernel,
    fmt: str,
    confidence: float | None = None,
) -> Oracle:
    """The tolerance from the candidates' bounds: the largest, per element, with its term; with
    ``confidence``, a :class:`ProbabilisticOracle` stating the least of their probabilities."""
    shape = np.shape(bounds[0].total)
    tol, names, reason = fold_candidates([(b.total, b.terms, b.reasons) for b in bounds], shape)
    with np.errstate(invalid="ignore"):
        tol = tol + _F64_ROUNDING * np.where(np.isfinite(exact), np.abs(exact), 0.0)
    if dead is not None and dead.any() and kernel.fully_masked in ("nan", "zero"):
        rows = np.broadcast_to(dead[..., None], tol.shape)
        tol = np.where(rows, 0.0, tol)
        names = np.where(rows, "fully_masked (the convention's exact answer)", names)
        reason = np.where(rows, "", reason)
    if confidence is None:
        return Oracle(exact, tol, names, reason, kernel, fmt)
    probability = min(float(b.probability) for b in bounds)
    return ProbabilisticOracle(
        exact, tol, names, reason, kernel, fmt, confidence, probability, PROBABILISTIC_MODEL
    )


def attention_oracle(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    bias: Any = None,
    scale: float | None = None,
    is_causal: bool = False,
    kernel: Kernel | str = "jax-xla",
    dtype: str | None = None,
    layout: str = "bhld",
    enable_gqa: bool = False,
    softcap: float | None = None,
    sink: Any = None,
    confidence: float | None = None,
    rope: Rope | None = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
    kv_cache: KVQuant | tuple[KVQuant, KVQuant] | str | None = None,
) -> Oracle:
    """The certified reference of ``attention(q, k, v)`` and the kernel's tolerance around it.

    Args:
        q, k, v: ``(..., Lq, d)``, ``(..., Lk, d)``, ``(..., Lk, dv)``, the kernel's inputs as
            it received them (any array type; their values are used exactly).
        mask: boolean, **True = attend**, broadcastable to ``(..., Lq, Lk)``, or a
            :class:`mhanum.masks.Band` (causal or sliding window, any alignment).
        bias: an additive float mask (``-inf`` excludes a key), broadcastable likewise.
        scale: the logit scale (default ``1/sqrt(d)``). A negative one with candidates that
            split it over q and k (``Numerics(scale="qk")``, PyTorch's math backend) is
            modelled as that backend applies it: ``-sqrt(|scale|)`` on q, ``sqrt(|scale|)`` on k.
        is_causal: query ``i`` attends keys ``j <= i`` (torch's and jax.nn's ``is_causal``).
        kernel: a name in :data:`KERNELS` or a :class:`Kernel`.
        dtype: the input format (default: ``q``'s dtype).
        layout: ``"bhld"`` (``(..., L, d)``: torch's SDPA, mhanum) or ``"blhd"`` (``(B, L, H, d)``:
            ``jax.nn.dot_product_attention``, FlashAttention): the layout of q, k, v and of
            the output (``exact`` and ``tolerance`` come back in it); masks and biases are
            ``(..., H, Lq, Lk)`` in both.
        enable_gqa: grouped-query attention (torch's ``enable_gqa``): k and v carry ``H_kv``
            heads, a divisor of q's ``H``; query head ``h`` reads key head ``h // (H / H_kv)``
            (k and v repeated head by head, as ``repeat_interleave`` does).
        softcap: the logit soft-cap ``c`` of a kernel that computes ``c·tanh(s/c)`` in its
            score format before the bias (step 3c of the bounds; the cap's reciprocal may be
            folded or the scores divided by it). The kernel's ``tanh`` must be within the
            candidates' ``Numerics.tanh_ulps``.
        sink: attention-sink logits, one per head (``(H,)``, broadcast against the batch
            dimensions of the ``bhld`` layout), as in :func:`mhanum.attention`.
        confidence: ``None`` (the default): the certified tolerance, Theorem A.1, which holds
            for every rounding the candidates allow. A float strictly between 0 and 1: the
            probabilistic tolerance of Theorem A.3 instead, which holds for all elements at
            once with probability at least ``confidence`` under the model of independent
            mean-zero rounding errors in every sum and dot (Higham & Mary 2019), and is never
            above the certified one. Inputs whose roundings all go one way break the model
            (see :class:`ProbabilisticOracle`); it is never the default.
        rope: a :class:`mhanum.rope.Rope`: the kernel takes the unrotated ``q`` and ``k`` (values
            of ``rope.rotation_format``) and rotates them itself as the ``Rope`` states. The
            exact answer is the attention of the exactly rotated inputs (exact ``ω``, ``θ``,
            ``cos`` and ``sin``), and the tolerance the candidates' bounds with Theorem P.1's
            rotated entries (``attention_bound(..., rope=)``). The certified reference is that
            of the float64 rotations (:func:`mhanum.rope.reference_rope`), whose distance ``g``
            to the exact ones (Lemma P.3) is charged explicitly: it moves each logit by at most
            ``Δ = |scale|·Σ_t (g_q|k| + |q|g_k + g_q·g_k)_t``, so the softmax weights by a
            factor within ``e^{±2Δ}`` and each output by at most ``(e^{2Δ} - 1)·max_j |v_j|``,
            which the tolerance adds (a soft-cap is 1-Lipschitz and a sink's logit is fixed).
        positions: with ``rope``, the queries' and keys' positions: a pair, one array for both
            (``Lq = Lk``), or by default the keys ``0..Lk-1`` with the queries the last ``Lq``
            of them (a decoding step), as :meth:`mhanum.rope.Rope.positions_for` reads them.
        kv_cache: a :class:`mhanum.kvcache.KVQuant` (or the pair of K's and V's), or the name
            of a convention in :data:`KV_CACHE_KERNELS` (:func:`get_kv_cache`; for K and V
            scales of a deployment, pass ``get_kv_cache(name, scale=k_scale,
            v_scale=v_scale)``): the kernel stores ``k`` and ``v`` in
            that cache and attends the values it reads back (the operand placement). The exact
            answer is the attention of the unquantized ``k`` and ``v``, and the tolerance the
            candidates' bounds with Theorem K.1's entries as the operands' errors
            (``attention_bound(..., kv_cache=)``). With ``rope``, the kernel caches its
            rotated keys (Corollary K.3), whose cache must have given scales.

    Returns:
        An :class:`Oracle`; with ``confidence``, a :class:`ProbabilisticOracle`, which carries
        the probability and the model, and whose failure message says the tolerance is
        probabilistic.

    Raises:
        InvalidArgument: for an unknown kernel, a format it does not take, bad inputs, a
            ``confidence`` that is not a number strictly between 0 and 1, a ``rope``,
            ``positions`` or ``kv_cache`` that ``attention_bound`` refuses (by name), or a
            ``rope.rotation_format`` that does not hold ``q`` and ``k`` exactly.
    """
    keywords = {name: value for name, value in locals().items() if name not in ("q", "k", "v")}
    return _attention_oracle(q, k, v, keywords, certified=True)


def _attention_oracle(
    q: object, k: object, v: object, keywords: dict[str, Any], *, certified: bool
) -> Oracle:
    """:func:`attention_oracle` for its ``keywords``; with ``certified=False``, its tolerance
    alone, without the certified reference: the ``2^-52·|exact|`` of the reference's rounding
    is charged with ``max_j |v_j|`` for ``|exact|`` (:func:`_exact_magnitude`), and
    ``Oracle.exact`` holds that magnitude."""
    from mhanum import reference
    from mhanum.bounds import attention_bound
    from mhanum.rope import reference_rope

    (mask, bias, scale, is_causal, kernel, dtype, layout, enable_gqa, softcap, sink, confidence,
     rope, positions, kv_cache) = (keywords[n] for n in _ORACLE_DEFAULTS)  # fmt: skip
    confidence = _confidence(confidence)
    kern = get_kernel(kernel)
    fmt = _format_of(q, dtype)
    candidates = kern.candidates(fmt)
    if layout not in _LAYOUTS:
        msg = f"layout: expected one of {_LAYOUTS}, got {layout!r}"
        raise InvalidArgument(msg)
    q64, k64, v64 = (as_float64(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    if layout == "blhd":
        if min(q64.ndim, k64.ndim, v64.ndim) < 3:
            msg = f"q: expected (B, L, H, d) arrays with layout='blhd', got {q64.shape}"
            raise InvalidArgument(msg)
        q64, k64, v64 = (np.swapaxes(a, -3, -2) for a in (q64, k64, v64))
    b64 = None if bias is None else as_float64(bias, "bias")
    if q64.ndim < 2 or k64.ndim < 2 or v64.ndim < 2:
        msg = f"q: expected arrays of at least 2 dimensions, got {q64.shape}"
        raise InvalidArgument(msg)
    if enable_gqa:
        k64, v64 = _grouped(q64, k64, v64)
    kern.check_head_dims(q64.shape[-1], v64.shape[-1])
    batch = V.broadcast({"q": q64.shape[:-2], "k": k64.shape[:-2], "v": v64.shape[:-2]})
    cache = None if kv_cache is None else get_kv_cache(kv_cache)
    pos = _decoder_positions(q64, k64, v64, rope, positions, cache)
    m = _mask(mask, is_causal, (*batch, q64.shape[-2], k64.shape[-2]))
    policy, dead = kern.fully_masked, None
    ref_mask = m
    if m is not None:
        lead = np.broadcast_shapes(q64.shape[:-2], k64.shape[:-2], np.shape(m)[:-2])
        full = np.broadcast_to(m, (*lead, q64.shape[-2], k64.shape[-2]))
        dead = np.asarray(~full.any(axis=-1), bool)
        if policy == "unmasked" and dead.any():
            ref_mask = np.where(dead[..., None], True, full)
    q_ref, k_ref, given = q64, k64, None
    if rope is not None:
        assert pos is not None  # AttentionProblem gives a rope its positions
        (q_ref, g_q), (k_ref, g_k) = (
            reference_rope(q64, pos[0], rope),
            reference_rope(k64, pos[1], rope),
        )
        given = (g_q, g_k)
    kw: dict[str, Any] = {"bias": b64, "softcap": softcap, "sink": sink, "probability": confidence,
                          "rope": rope, "positions": pos, "kv_cache": cache}  # fmt: skip
    bounds = []
    for n in candidates:
        q_n, scale_n = _signed_scale(q64, scale, n)
        bounds.append(
            attention_bound(
                q_n, k64, v64, m, numerics=n, scale=scale_n, known_rounding=kern.known_rounding,
                **kw,
            )
        )  # fmt: skip
    if certified:
        exact = np.asarray(
            reference.attention(
                q_ref, k_ref, v64, mask=ref_mask, bias=b64, scale=scale,
                fully_masked="nan" if policy == "unmasked" else policy, softcap=softcap, sink=sink,
            ),
            np.float64,
        )  # fmt: skip
    else:
        exact = _exact_magnitude(v64, np.shape(bounds[0].total))
    oracle = _fold(exact, bounds, dead, kern, fmt, confidence)
    if given is not None:
        oracle = _charged(oracle, _rotation_charge(q_ref, k_ref, v64, given, scale), dead)
    if kern.mask_add is not None and m is not None:
        q_abs, k_abs = _magnitudes(q64, k64, (rope, pos, cache), candidates[0])
        oracle = _added_mask(oracle, q_abs, k_abs, m, scale, candidates[0])
    if layout == "bhld":
        return oracle
    exact, tol, term, reason = (
        np.swapaxes(a, -3, -2) for a in (oracle.exact, oracle.tolerance, oracle.term, oracle.reason)
    )
    return dataclasses.replace(oracle, exact=exact, tolerance=tol, term=term, reason=reason)


def _exact_magnitude(v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An upper bound of ``|exact|`` for every output entry: ``max_j |v_jc|`` over the row's
    keys. The exact output row is ``Σ_j p_j v_j`` with ``p_j >= 0`` and ``Σ_j p_j <= 1`` (a
    sink's weight attends no value; a fully masked row under the ``uniform`` or ``unmasked``
    convention averages or attends its keys), whatever the mask, bias, scale, soft-cap or
    rotation of q and k, so ``|exact_c| <= max_j |v_jc|``; its rounding to float64 keeps that
    (rounding is monotone, and the bound is a float64)."""
    return np.broadcast_to(np.abs(v).max(axis=-2, keepdims=True), shape)


_LEAK_ARGUMENT = 151.0  # fl(x_j - M) <= -151: exp2 below 2^-146 within 8 ulps of float32


_ORACLE_DEFAULTS = keyword_defaults(attention_oracle)


def _added_mask(
    oracle: Oracle, q: np.ndarray, k: np.ndarray, mask: np.ndarray, scale: float | None,
    num: Any,
) -> Oracle:  # fmt: skip
    """A kernel that masks by adding ``C = kernel.mask_add`` to its base-2 scaled scores
    ``x_j = fl(t_j·c2)`` (papers/attention.md, "A finite mask added in base 2").

    With ``T`` an upper bound of the row's ``|x_j|`` (from ``Σ|q||k|``), a masked key's
    argument is ``fl(fl(x_j + C) - M) <= 2T + u(|C| + T) - |C|`` (the row maximum ``M`` is at
    least a live key's ``-T``). Where that is at most ``-151`` the masked exponential is below
    ``2^-146`` (any ``exp2`` within ``exp_ulps <= 8`` ulps, subnormals counted), rounds to 0 in
    a probability format whose smallest subnormal exceeds ``2^-145`` (float16: ``2^-24``;
    another is not proved), so that ``P V`` never sees it, and adds at most ``n·2^-146`` to a
    row sum of at least 1/2: the output moves by a relative ``n·2^-145`` at most, which the
    tolerance adds. A row where that is not proved, or that
    attends no key, gets an infinite tolerance and says why.
    """
    from mhanum.formats import round_to

    const = float(oracle.kernel.mask_add)  # type: ignore[arg-type]
    fm = num.format_of("softmax")
    d = q.shape[-1]
    c = 1.0 / math.sqrt(d) if scale is None else float(scale)
    c2 = abs(float(round_to(float(round_to(c, fm)) * float(round_to(math.log2(math.e), fm)), fm)))
    top = (np.abs(q) @ np.swapaxes(np.abs(k), -1, -2)).max(axis=-1)
    t_row = top * c2 * (1 + (d + 4) * 2.0**-23)
    u = fm.u
    ok = t_row * (2 + u) <= abs(const) * (1 - u) - _LEAK_ARGUMENT
    lead = oracle.exact.shape[:-1]
    full = np.broadcast_to(mask, (*lead[:-1], lead[-1], k.shape[-2]))
    masked_keys = (~full).sum(axis=-1)
    live = full.any(axis=-1)
    ok = np.broadcast_to(ok, lead)
    prob = num.format_of("prob")
    if prob.smallest_subnormal / 2 <= 2.0**-146:
        ok = np.zeros(lead, bool)  # a probability format that could hold the leak
    bad = (masked_keys > 0) & ~(ok & live)
    leak = masked_keys * 2.0**-145
    tol = oracle.tolerance
    with np.errstate(invalid="ignore"):
        size = np.where(np.isfinite(oracle.exact), np.abs(oracle.exact), 0.0) + tol
        tol = np.where(bad[..., None], np.inf, tol + leak[..., None] * size)
    why = (
        f"mask_add: a masked key's exponential (scores + {const:g} in base 2) is not proved "
        "to vanish, or the row attends no key"
    )
    term = np.where(bad[..., None], why, oracle.term)
    reason = np.where(bad[..., None], why, oracle.reason)
    return dataclasses.replace(oracle, tolerance=tol, term=term, reason=reason)


def _signed_scale(q: np.ndarray, scale: Any, num: Any) -> tuple[np.ndarray, Any]:
    """The operands of the bound of candidate ``num`` for a negative ``scale``.

    A scale split over q and k (``num.scale == "qk"``) needs its square root; PyTorch's math
    backend (attention.cpp, ``_scaled_dot_product_attention_math``) takes that of ``|scale|``
    and multiplies q by ``-sqrt(|scale|)``, k by ``sqrt(|scale|)``. Rounding to nearest is
    symmetric (``fl(-x) = -fl(x)``, in every product and sum), so the kernel rounds exactly as
    the model does on ``-q`` with ``|scale|``, and its exact attention is the same: the bound
    on those operands is the tolerance. Other placements take a negative scale as it is.
    """
    signed = isinstance(scale, (int, float, np.floating)) and not isinstance(scale, bool)
    if num.scale != "qk" or not signed or not (math.isfinite(scale) and scale < 0):
        return q, scale
    return -q, -float(scale)


def _grouped(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k and v repeated head by head to q's number of heads (grouped-query attention)."""
    if min(q.ndim, k.ndim, v.ndim) < 3:
        msg = f"k: expected (..., H_kv, L, d) arrays with enable_gqa=True, got {k.shape}"
        raise InvalidArgument(msg)
    h, h_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != h_kv or h_kv == 0 or h % h_kv:
        msg = (
            f"k: expected a number of key/value heads dividing q's {h}, the same for k and v, "
            f"got {h_kv} and {v.shape[-3]}"
        )
        raise InvalidArgument(msg)
    group = h // h_kv
    return np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)


def _decoder_positions(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    rope: Rope | None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None,
    cache: KVQuant | tuple[KVQuant, KVQuant] | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``rope``, ``positions`` and ``kv_cache`` checked together, as ``attention_bound`` checks
    them (:class:`mhanum.problem.AttentionProblem`), and ``q`` and ``k`` held exactly in
    ``rope.rotation_format``; the queries' and keys' positions with ``rope``."""
    from mhanum.formats import round_to
    from mhanum.problem import AttentionProblem

    if rope is None and positions is None and cache is None:
        return None
    # one array for both queries and keys is read too (Rope.positions_for)
    pair = cast("tuple[ArrayLike, ArrayLike] | None", positions)
    problem = AttentionProblem.of(q, k, v, rope=rope, positions=pair, kv_cache=cache)
    if rope is not None:
        fmt = rope.format("rotation")
        for x, name in ((q, "q"), (k, "k")):
            if not np.array_equal(round_to(x, fmt), x):
                msg = (
                    f"rope.rotation_format: expected a format that holds {name} exactly (the "
                    f"kernel rotates its inputs as it holds them), got {fmt.name}"
                )
                raise InvalidArgument(msg)
    return problem.positions


def _rotation_charge(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    given: tuple[np.ndarray, np.ndarray],
    scale: float | None,
) -> np.ndarray:
    """A bound on ``|attention(q, k, v) - attention(q*, k*, v)|`` per output entry, for
    ``|q - q*| <= g_q`` and ``|k - k*| <= g_k`` entrywise (``given``; Lemma P.3's for the float64
    rotations ``q``, ``k`` of the exact ``q*``, ``k*``).

    Each logit moves by at most ``|c|·Σ_t (g_q|k| + |q|g_k + g_q·g_k)_t``, at most ``Δ`` per
    row with the keys' largest ``|k_t|`` and ``g_k,t``; a soft-cap ``c·tanh(s/c)`` is 1-Lipschitz,
    a bias, a mask and a sink's logit are the same in both. So ``p*_j/p_j`` lies in
    ``[e^{-2Δ}, e^{2Δ}]`` and ``|Σ_j (p_j - p*_j) v_j| <= (e^{2Δ} - 1)·Σ_j p_j|v_j| <=
    (e^{2Δ} - 1)·max_j |v_j|``. The float64 evaluation: the sum of ``d`` non-negative terms and
    two products, rounded up by ``1 + (d + 4)·2^-52``; ``expm1`` and the last product by
    ``1 + 2^-50``.
    """
    g_q, g_k = given
    d = q.shape[-1]
    c = abs(1.0 / math.sqrt(d) if scale is None else float(scale))
    k_top = np.abs(k).max(axis=-2, keepdims=True)
    g_top = g_k.max(axis=-2, keepdims=True)
    moved = (g_q * (k_top + g_top) + np.abs(q) * g_top).sum(axis=-1, keepdims=True)
    delta = c * moved * (1 + (d + 4) * 2.0**-52)
    return np.expm1(2 * delta) * np.abs(v).max(axis=-2, keepdims=True) * (1 + 2.0**-50)


def _charged(oracle: Oracle, extra: np.ndarray, dead: np.ndarray | None) -> Oracle:
    """``oracle`` with ``extra`` added to its tolerance, but on the rows whose answer the
    kernel's convention fixes exactly (tolerance 0 in :func:`_fold`)."""
    extra = np.broadcast_to(extra, oracle.tolerance.shape)
    if dead is not None and oracle.kernel.fully_masked in ("nan", "zero"):
        extra = np.where(np.broadcast_to(dead[..., None], extra.shape), 0.0, extra)
    return dataclasses.replace(oracle, tolerance=oracle.tolerance + extra)


def _magnitudes(
    q: np.ndarray,
    k: np.ndarray,
    stages: tuple[
        Rope | None, tuple[np.ndarray, np.ndarray] | None, KVQuant | tuple[KVQuant, KVQuant] | None
    ],
    num: Numerics,
) -> tuple[np.ndarray, np.ndarray]:
    """Upper bounds of ``|q|`` and ``|k|`` as the kernel's dot reads them after its decoder
    stages ``(rope, positions, cache)``: Theorem P.1's and Lemma P.3's errors around the
    float64 rotations, K.1's around the cached keys, then a rounding into the input format."""
    from mhanum.rope import reference_rope, rope_error

    rope, pos, cache = stages
    if rope is None and cache is None:
        return q, k
    fin = num.format_of("input")
    q_top, k_top = np.abs(q), np.abs(k)
    if rope is not None and pos is not None:
        tops = []
        for x, at in ((q, pos[0]), (k, pos[1])):
            x64, g = reference_rope(x, at, rope)
            tops.append(np.abs(x64) + g + rope_error(x, at, rope))
        q_top, k_top = tops
    k_cache = cache[0] if isinstance(cache, tuple) else cache
    if k_cache is not None:  # K.1 grows with |x| (given scales with rope, Corollary K.3)
        k_top = k_top + k_cache.read(k_top)[1]
    return q_top * (1 + fin.u) + fin.smallest_normal, k_top * (1 + fin.u) + fin.smallest_normal


def attention_tolerance(q: Any, k: Any, v: Any, **kwargs: Any) -> np.ndarray:
    """The per-element certified tolerance of ``kernel`` on these inputs (see
    :func:`attention_oracle` for the arguments): ``|actual - exact| <= tolerance`` whenever the
    kernel computes as one of its candidate numerics. With ``confidence=P``, the probabilistic
    tolerance: all elements within it together with probability at least ``P`` under the model
    of independent mean-zero rounding errors (Theorem A.3). With ``rope=`` (and ``positions=``)
    or ``kv_cache=``, that of a kernel that rotates q and k itself or reads k and v back from a
    quantized cache, around the exact attention of the exactly rotated, unquantized inputs.

    It computes no reference: where :func:`attention_oracle`'s tolerance charges the float64
    rounding of its reference as ``2^-52·|exact|``, this one charges ``2^-52·max_j |v_j|``, a
    bound of ``|exact|`` (the output is a convex combination of the value rows). So it is at
    least ``attention_oracle(...).tolerance``, and exceeds it by at most ``2^-51·max_j |v_j|``
    per element (``2^-52`` of it, and a kernel's added masking constant's ``n·2^-145`` of it),
    at about a third of its cost."""
    keywords = keywords_over(_ORACLE_DEFAULTS, kwargs, "attention_tolerance")
    return _attention_oracle(q, k, v, keywords, certified=False).tolerance


def assert_attention_close(actual: Any, q: Any, k: Any, v: Any, **kwargs: Any) -> None:
    """Assert that a kernel's output lies within its certified tolerance of the exact attention.

    Takes the arguments of :func:`attention_oracle` after ``actual``. The contract, element by
    element (:class:`Oracle`): where the tolerance is finite, ``|actual - exact| <= tolerance``,
    and an inf or NaN where the exact value is finite fails (the model predicts no overflow
    there: a bug, or a descriptor to correct). Where the tolerance is infinite, the model
    bounds nothing (a stage may overflow its format, a masking constant is not proved to
    vanish, a row attends no key) and any value passes, inf and NaN included; an overflow
    there is warned as :class:`PredictedOverflow`, with the bound's term and reason, so that a
    predicted overflow is told apart from a bug without failing a kernel that computes as
    modelled.

    With ``confidence=P`` the tolerance is Theorem A.3's (see :func:`attention_oracle`): it
    holds for all elements together with probability at least ``P`` under the model of
    independent mean-zero rounding errors, and the failure message says so, with the
    probability and the model.

    A decoder kernel passes the unrotated, unquantized inputs with ``rope=`` (and
    ``positions=``) or ``kv_cache=`` (see :func:`attention_oracle`); one that rotates at the
    wrong positions or in the wrong layout, or forgets a cache's ``k_scale`` or ``v_scale``,
    fails wherever its error exceeds the tolerance, with the worst element named.

    Raises:
        AttentionMismatch: naming how many elements fail, the worst one (index, actual, exact,
            tolerance, ratio; or that the kernel overflowed where the model predicts no
            overflow) and the bound term that governs its tolerance.

    Warns:
        PredictedOverflow: when every bounded element passes and the kernel returned inf or
            NaN where the exact value is finite at an unbounded one: how many, the first, the
            bound's term and its reason.
    """
    assert_close(attention_oracle(q, k, v, **kwargs), actual, stacklevel=3)


def mha_oracle(
    x_q: Any,
    x_kv: Any,
    params: Any,
    num_heads: int,
    *,
    mask: Any = None,
    kernel: Kernel | str = "jax-xla",
    dtype: str | None = None,
    num_kv_heads: int | None = None,
    softcap: float | None = None,
    confidence: float | None = None,
) -> Oracle:
    """:func:`attention_oracle` for a multi-head attention layer (Theorem A.2).

    Args:
        x_q, x_kv: ``(..., Lq, d_model)``, ``(..., Lk, d_model)``.
        params: a :class:`mhanum.MHAParams` (``y = x W + b``).
        num_heads: the number of heads.
        mask: boolean, True = attend, broadcastable to ``(..., heads, Lq, Lk)``.
        kernel, dtype: as in :func:`attention_oracle`.
        num_kv_heads: grouped-query attention, as in :func:`mhanum.multi_head_attention`.
        softcap: the logit soft-cap of every head, as in :func:`attention_oracle`.
        confidence: ``None`` for the certified tolerance (Theorem A.2), or a float strictly
            between 0 and 1 for A.2's probabilistic form (Theorem A.3; the projections' chains
            are counted in its union bound): a :class:`ProbabilisticOracle`, as in
            :func:`attention_oracle`.

    An output row whose every head attends no key under ``-inf`` masking is the convention's
    exact answer (the output bias when heads return 0, NaN): tolerance 0 there. A row where only
    some heads attend no key has no finite bound yet (tolerance ``inf``, term ``fully_masked``).
    """
    keywords = {n: value for n, value in locals().items() if n not in _MHA_POSITIONAL}
    return _mha_oracle(x_q, x_kv, params, num_heads, keywords, certified=True)


_MHA_POSITIONAL = ("x_q", "x_kv", "params", "num_heads")


def _mha_oracle(
    x_q: object,
    x_kv: object,
    params: MHAParams,
    num_heads: int,
    keywords: dict[str, Any],
    *,
    certified: bool,
) -> Oracle:
    """:func:`mha_oracle` for its ``keywords``; with ``certified=False``, its tolerance alone,
    the reference's rounding charged on :func:`_mha_exact_magnitude` (as in
    :func:`_attention_oracle`)."""
    from mhanum import reference
    from mhanum.bounds import mha_bound

    mask, kernel, dtype, num_kv_heads, softcap, confidence = (keywords[n] for n in _MHA_DEFAULTS)
    confidence = _confidence(confidence)
    kern = get_kernel(kernel)
    fmt = _format_of(x_q, dtype)
    if kern.mask_add is not None and mask is not None:
        msg = (
            f"mask: expected None for kernel {kern.name!r} in mha_oracle (it masks by adding "
            f"{kern.mask_add:g} to its base-2 scores, which attention_oracle checks per head)"
        )
        raise InvalidArgument(msg)
    xq, xkv = as_float64(x_q, "x_q"), as_float64(x_kv, "x_kv")
    num_heads = V.positive_int(num_heads, "num_heads")
    if xq.shape[-1] % num_heads == 0:
        kern.check_head_dims(xq.shape[-1] // num_heads)
    batch = V.broadcast({"x_q": xq.shape[:-2], "x_kv": xkv.shape[:-2]})
    m = _mask(mask, False, (*batch, num_heads, xq.shape[-2], xkv.shape[-2]))
    policy, dead = kern.fully_masked, None
    if m is not None:
        m4 = m if m.ndim >= 3 else m[None]  # (..., heads or 1, Lq, Lk)
        dead = np.asarray(~m4.any(axis=-1), bool).all(axis=-2)  # every head's row is masked
    kw: dict[str, Any] = {
        "mask": m, "num_kv_heads": num_kv_heads, "softcap": softcap, "probability": confidence,
    }  # fmt: skip
    bounds = [
        mha_bound(xq, xkv, params, num_heads, numerics=n, known_rounding=kern.known_rounding, **kw)
        for n in kern.candidates(fmt)
    ]
    if certified:
        exact = np.asarray(
            reference.multi_head_attention(
                xq, xkv, params, num_heads, mask=m, num_kv_heads=num_kv_heads,
                fully_masked="nan" if policy == "unmasked" else policy, softcap=softcap,
            ),
            np.float64,
        )  # fmt: skip
    else:
        exact = _mha_exact_magnitude(xkv, params, num_kv_heads or num_heads, num_heads)
        exact = np.broadcast_to(exact[..., None, :], np.shape(bounds[0].total))
    if dead is not None:
        dead = np.broadcast_to(dead, exact.shape[:-1])
    return _fold(exact, bounds, dead, kern, fmt, confidence)


_MHA_DEFAULTS = keyword_defaults(mha_oracle)


def _mha_exact_magnitude(
    x_kv: np.ndarray, params: MHAParams, num_kv_heads: int, num_heads: int
) -> np.ndarray:
    """An upper bound of ``|exact|`` for every output column of the layer, per batch entry.

    Head ``h``'s output row is ``Σ_j p_j v_j`` with ``p_j >= 0``, ``Σ_j p_j <= 1``
    (:func:`_exact_magnitude`) and ``v_j = x_j W_v + b_v`` of its key/value head, so its
    entry ``e`` is at most ``A_e = max_{kv head, j} Σ_t |x_jt||W_v,te| + |b_v,e|`` (the largest
    over the key/value heads, whichever head reads which), and output column ``c`` at most
    ``B_c = Σ_{h,e} A_e |W_o,(h,e)c| + |b_o,c|``. The float64 evaluation sums ``n_1 = d_kv + 1``
    and then ``n_2 = H·d_v + 1`` non-negative terms (any order, contracted or not): relative
    errors ``γ_n1``, ``γ_n2`` (``γ_n = n·2^-53/(1 - n·2^-53)``) and, below the normal range, an
    absolute ``2^-1075`` a product. So ``B <= B̂·(1 + (n_1 + n_2 + 4)·2^-52) + (n_1 + n_2)·
    2^-1074·(1 + max_c Σ|W_o,c|)``, which the last two operations keep (their roundings are in
    the factor's margin)."""
    wv, wo = (np.abs(np.asarray(w, np.float64)) for w in (params.wv, params.wo))
    bv, bo = (
        0.0 if b is None else np.abs(np.asarray(b, np.float64)) for b in (params.bv, params.bo)
    )
    values = (np.abs(x_kv) @ wv + bv).max(axis=-2)  # (..., kv heads · d_v)
    per_entry = values.reshape(*values.shape[:-1], num_kv_heads, -1).max(axis=-2)
    top = np.tile(per_entry, num_heads) @ wo + bo
    n = wv.shape[0] + wo.shape[0] + 2
    slack = n * 2.0**-1074 * (1 + float(wo.sum(axis=0).max(initial=0.0)))
    return top * (1 + (n + 4) * 2.0**-52) + slack


def mha_tolerance(x_q: Any, x_kv: Any, params: Any, num_heads: int, **kwargs: Any) -> np.ndarray:
    """The per-element certified tolerance of a multi-head attention layer (see :func:`mha_oracle`;
    ``confidence=P``: the probabilistic one, as in :func:`attention_tolerance`).

    It computes no reference, as :func:`attention_tolerance`: the reference's float64 rounding
    is charged on a bound of ``|exact|`` (``Σ_{h,e} max|v_e|·|W_o| + |b_o|``, with
    ``max|v_e|`` bounded through ``|x_kv||W_v| + |b_v|``), so it is at least
    ``mha_oracle(...).tolerance``, at a fraction of its cost (the reference is most of the
    oracle's: about a sixth at ``L = 1024``, ``d_model = 512``, 8 heads)."""
    keywords = keywords_over(_MHA_DEFAULTS, kwargs, "mha_tolerance")
    return _mha_oracle(x_q, x_kv, params, num_heads, keywords, certified=False).tolerance


def assert_mha_close(
    actual: Any, x_q: Any, x_kv: Any, params: Any, num_heads: int, **kwargs: Any
) -> None:
    """:func:`assert_attention_close` for a multi-head attention layer (see :func:`mha_oracle`;
    ``confidence=P``: against the probabilistic tolerance, as in :func:`assert_attention_close`)."""
    assert_close(mha_oracle(x_q, x_kv, params, num_heads, **kwargs), actual, stacklevel=3)


def attention_inputs(
    *,
    dtype: str = "float32",
    lengths: Sequence[int] = (1, 7, 16, 64),
    head_dims: Sequence[int] = (8, 64),
    masks: bool = True,
) -> Any:
    """A Hypothesis strategy of ``dict(q=..., k=..., v=..., mask=...)`` for a kernel's property
    test: numpy arrays of ``dtype`` (``"float32"``, ``"bfloat16"`` or ``"float16"``), lengths and
    head dimensions drawn from small fixed sets (so compiled kernels are reused), entries of
    both signs across a wide range, and (``masks=True``) boolean masks, True = attend, that keep
    at least one key per row.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=3, derandomize=True)
    ... @given(attention_inputs(dtype="bfloat16", lengths=(3,), head_dims=(8,)))
    ... def test(case):
    ...     assert case["q"].dtype.name == "bfloat16" and case["q"].shape == (3, 8)
    >>> test()
    """
    import ml_dtypes
    from hypothesis import strategies as st
    from hypothesis.extra.numpy import arrays

    if dtype not in ("float32", "bfloat16", "float16"):
        msg = f"dtype: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}"
        raise InvalidArgument(msg)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    elements = st.floats(-8.0, 8.0, width=32, allow_subnormal=False)

    @st.composite
    def cases(draw: Any) -> dict[str, Any]:
        lq, lk = draw(st.sampled_from(lengths)), draw(st.sampled_from(lengths))
        d, dv = draw(st.sampled_from(head_dims)), draw(st.sampled_from(head_dims))
        out = {
            name: draw(arrays(np.float32, shape, elements=elements)).astype(np_dtype)
            for name, shape in (("q", (lq, d)), ("k", (lk, d)), ("v", (lk, dv)))
        }
        mask = None
        if masks and draw(st.booleans()):
            mask = draw(arrays(np.bool_, (lq, lk)))
            mask[np.arange(lq), draw(st.integers(0, lk - 1))] = True
        out["mask"] = mask
        return out

    return cases()
