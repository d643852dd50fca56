"""Attention and multi-head attention in JAX whose every rounding is the one ``Numerics`` names.

``attention(q, k, v, mask, numerics=...)`` computes ``softmax(scale · q kᵀ + bias, masked) v`` with
the stages, formats, orders and algorithms of :class:`mhanum.Numerics` (its module docstring lists
the stages). The computation is jit-compiled once per ``Numerics`` and shape; it can itself be
wrapped in ``jax.jit`` with ``numerics`` static.

**Mask convention: True means attend.** This is the convention of ``jax.nn``, Flax, Keras and
``torch.nn.functional.scaled_dot_product_attention``, and the *opposite* of the boolean
``attn_mask`` of ``torch.nn.MultiheadAttention`` (where True means masked out). An additive float
mask is passed as ``bias=``.

A fully-masked row (every key masked) is NaN when the masking constant is ``-inf`` (the softmax of
an empty set is undefined: ``-inf - (-inf)`` in the safe softmax, ``0/0`` in the naive and online
ones). When masked logits are replaced by a finite constant the row is uniform over the keys with
the safe and online softmax; the naive softmax (no shift) underflows every ``exp`` to 0 for a
constant such as ``finfo.min`` or ``-1e9`` and gives ``0/0 = NaN``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum import _validate as V
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.emulate._arith import Arith, runtime_zero, to_format
from mhanum.emulate.constants import LOG2E, Const, Constants
from mhanum.emulate.summation import matmul_with, sum_with
from mhanum.formats import Format, round_to
from mhanum.masks import Band
from mhanum.numerics import Numerics, resolve
from mhanum.params import MHAParams
from mhanum.problem import AttentionProblem, MHAProblem
from mhanum.rope import apply_rope, check_holds

if TYPE_CHECKING:
    from mhanum._types import Array, ArrayLike
    from mhanum.kvcache import KVQuant
    from mhanum.rope import Rope

__all__ = ["attention", "multi_head_attention", "softmax"]

# A Band is part of the compiled computation (its mask is built inside it), not an input.
jax.tree_util.register_static(Band)


def check_x64(num: Numerics) -> None:
    if num.needs_x64 and not jax.config.read("jax_enable_x64"):
        msg = (
            "numerics: uses float64, which needs JAX's 64-bit mode; call "
            "jax.config.update('jax_enable_x64', True) at start-up"
        )
        raise InvalidArgument(msg)


def host_round(x: ArrayLike, fmt: Format) -> Array:
    """Round a concrete numpy input into ``fmt`` once, from float64 (JAX arrays round in the jit)."""
    if isinstance(x, jax.Array):
        return x
    rounded = round_to(x, fmt)
    carrier = np.float64 if fmt.name == "float64" else np.float32
    return jnp.asarray(rounded.astype(carrier))


class Stages:
    """The arithmetic of each stage of one run, sharing one runtime zero, and the run's
    constants (:class:`mhanum.emulate.constants.Constants`)."""

    def __init__(self, num: Numerics, guard: jax.Array, consts: Constants) -> None:
        self.num = num
        self.consts = consts
        self.acc = Arith(num.format_of("accum"), guard)
        self.score = Arith(num.format_of("score"), guard)
        self.soft = Arith(num.format_of("softmax"), guard)
        self.scaled = Arith(num.format_of("scale"), guard)
        self.input = num.format_of("input")
        self.storage = num.storage_format
        self.prob = num.format_of("prob")
        self.output = num.format_of("output")
        self.operand = num.operand_rounding
        self.base2 = num.exp2
        self.folded = num.folds_scale
        self.c2: jax.Array | None = None  # exp2: the base-2 constant
        self.c_lse: jax.Array | None = None  # exp2-folded: fl(scale), a split's lse factor
        self._fold()

    def _fold(self) -> None:
        """Set the folded constant: ``c2 = fl(scale·log2(e))`` (the float64 product, rounded;
        ``exp2-folded``) or ``fl(fl(scale)·fl(log2(e)))`` (the kernel's own product in the
        softmax format; ``exp2-scaled``), or ``fl(log2(e))`` on the scaled scores (``exp2``)."""
        if self.num.exp_form == "exp2":
            self.c2 = format_constant(self.soft, LOG2E)
        elif self.num.exp_form == "exp2-scaled":
            self.c2 = self.constant(self.soft, Const.SCALE_LOG2E_FACTORS)
        elif self.folded:
            self.c2 = self.constant(self.soft, Const.SCALE_LOG2E)
            self.c_lse = self.constant(self.soft, Const.SCALE)

    def constant(self, ar: Arith, c: Const | float) -> jax.Array:
        """The run's constant ``c`` rounded into ``ar``'s format (an operand of the program), or
        a Python float rounded on the host (a literal of the program)."""
        if isinstance(c, Const):
            return jnp.asarray(self.consts.value(c, ar.fmt))
        return format_constant(ar, c)

    def exp_shifted(self, x: jax.Array, shift: jax.Array) -> jax.Array:
        """``exp(x - shift)``, or (folded) ``exp2(fl(fl(x·c2) - fl(shift·c2)))``, with
        ``prob_offset = k``: ``exp2(fl(fl(x·c2) - fl(fl(shift·c2) - k)))``."""
        sm = self.soft
        if not self.base2:
            return sm.exp(sm.sub(x, shift))
        assert self.c2 is not None
        top = sm.mul(shift, self.c2)
        if self.num.prob_offset:
            top = sm.sub(top, jnp.asarray(float(self.num.prob_offset), sm.dtype))
        return sm.exp2(sm.sub(sm.mul(x, self.c2), top))

    def rescale(self, m: jax.Array, shift: jax.Array) -> jax.Array:
        """The online rescaling ``exp(m - m')``, or (``exp2-folded``) ``exp2(fl(fl(m - m')·c2))``,
        or (``exp2-scaled``) ``exp2(fl(fl(m·c2) - fl(m'·c2)))``, the difference of the scaled
        maxima.

        Folded, a row that has seen no finite score yet (``m = -inf``: FlashAttention's first
        block) is not rescaled: its sum and accumulator are 0 and the factor is 0 (``-inf·c2``
        would be NaN for a ``c2`` read as zero).
        """
        sm = self.soft
        if not self.base2:
            return sm.exp(sm.sub(m, shift))
        assert self.c2 is not None
        if self.num.exp_form != "exp2-folded":
            factor = sm.exp2(sm.sub(sm.mul(m, self.c2), sm.mul(shift, self.c2)))
        else:
            factor = sm.exp2(sm.mul(sm.sub(m, shift), self.c2))
        return jnp.where(jnp.isneginf(m), jnp.zeros_like(factor), factor)

    def dot(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return matmul_with(self.acc, a, b, self.num.summation, self.operand, self.num.dot)

    def sum(self, x: jax.Array) -> jax.Array:
        return sum_with(self.soft, x, self.num.summation, keepdims=True)

    def carry_sum(self, d: jax.Array, c: jax.Array, e: jax.Array) -> jax.Array:
        """The online row sum after a block: ``d·c + Σ e`` (``running``: ``d·c`` the first term)."""
        sm = self.soft
        if self.num.online_sums == "running":
            return self.sum(jnp.concatenate([sm.mul(d, c), e], axis=-1))
        return sm.add(sm.mul(d, c), self.sum(e))

    def carry_pv(self, acc: jax.Array, c: jax.Array, p: jax.Array, v: jax.Array) -> jax.Array:
        """The online output after a block: ``acc·c + P V`` (``running``: the dot's accumulator)."""
        ar = self.acc
        scaled = ar.mul(acc, ar.take(c))
        if self.num.online_sums == "running":
            return matmul_with(ar, p, v, self.num.summation, self.operand, self.num.dot, scaled)
        return ar.add(scaled, self.dot(p, v))


def format_constant(ar: Arith, value: float) -> jax.Array:
    """A Python float rounded once into ``ar``'s format (on the host, from its float64 value)."""
    return jnp.asarray(float(round_to(value, ar.fmt)), ar.dtype)


def _scaled(st: Stages, x: jax.Array, factor: Const) -> jax.Array:
    ar = st.scaled
    return ar.mul(ar.take(x), st.constant(ar, factor))


def scaled_operands(st: Stages, q: jax.Array, k: jax.Array) -> tuple[jax.Array, ...]:
    """The operands of the logits' dot: ``q`` times ``fl(scale)`` (placement ``"q"``), or ``q``
    and ``k`` each times ``fl(sqrt(scale))`` (``"qk"``), read into and multiplied in the scale
    format; ``q`` and ``k`` as given when the scale is on the scores."""
    if st.num.scale == "q":
        return _scaled(st, q, Const.SCALE), k
    if st.num.scale == "qk":
        return _scaled(st, q, Const.SQRT_SCALE), _scaled(st, k, Const.SQRT_SCALE)
    return q, k


def softcap_tanh(st: Stages, s: jax.Array) -> jax.Array:
    """``t̂ = fl(tanh(fl(s·r̂)))`` in the score format, ``r̂ = fl(1/c)``: the soft-cap's ``tanh``."""
    sc = st.score
    return sc.tanh(sc.mul(s, st.constant(sc, Const.INV_CAP)))


def _softcap(st: Stages, s: jax.Array) -> jax.Array:
    """``fl(ĉ·t̂)`` in the score format, ``ĉ = fl(c)`` (:func:`softcap_tanh`)."""
    sc = st.score
    return sc.mul(st.constant(sc, Const.CAP), softcap_tanh(st, s))


def stage_logits(
    st: Stages,
    q: jax.Array,
    k: jax.Array,
    mask: Band | jax.Array | None,
    bias: jax.Array | None,
) -> jax.Array:
    """The logits as the kernel forms them: the scaled scores, soft-capped (where the run's
    constants hold a cap), the bias added, the mask applied, in the score format."""
    num = st.num
    q, k = scaled_operands(st, q, k)
    sc = st.score
    s = sc.take(st.dot(q, jnp.swapaxes(k, -1, -2)))
    if num.scale == "scores" and not st.folded:
        s = sc.mul(s, st.constant(sc, Const.SCALE))
    if st.consts.capped:
        s = _softcap(st, s)
    if bias is not None:
        s = sc.add(s, sc.take(bias))
    if mask is not None:
        constant = jnp.asarray(num.mask_constant(), sc.dtype)
        masked = constant if num.mask_mode == "fill" else sc.add(s, constant)
        s = jnp.where(_mask_array(mask, s), s, masked)
    return s


def _mask_array(mask: Band | jax.Array, s: jax.Array) -> jax.Array:
    """A boolean mask as given, or a :class:`Band` formed inside the computation."""
    return mask.array(s.shape[-2], s.shape[-1], xp=jnp) if isinstance(mask, Band) else mask


def _softmax_then_pv(st: Stages, s: jax.Array, v: jax.Array) -> jax.Array:
    return st.dot(to_format(stage_probabilities(st, s), st.prob), v)


def _online_normaliser(st: Stages, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Running maximum and rescaled sum over key blocks (Milakov & Gimelshein 2018, Alg. 3)."""
    sm = st.soft
    block = st.num.softmax_block
    assert block is not None
    n_blocks = -(-s.shape[-1] // block)
    pad = n_blocks * block - s.shape[-1]
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    s_blocks = jnp.moveaxis(s.reshape(*s.shape[:-1], n_blocks, block), -2, 0)

    def step(
        carry: tuple[jax.Array, jax.Array], sb: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        m, d = carry
        m_new = jnp.maximum(m, jnp.max(sb, axis=-1, keepdims=True))
        shift = jnp.where(jnp.isneginf(m_new), jnp.zeros_like(m_new), m_new)
        c = st.rescale(m, shift)
        d = st.carry_sum(d, c, st.exp_shifted(sb, shift))
        return (m_new, d), None

    init = (
        jnp.full((*s.shape[:-1], 1), -jnp.inf, sm.dtype),
        jnp.zeros((*s.shape[:-1], 1), sm.dtype),
    )
    return lax.scan(step, init, s_blocks)[0]


def stage_probabilities(st: Stages, s: jax.Array) -> jax.Array:
    """The softmax of the logits ``s`` in the softmax format, by the numerics' algorithm."""
    sm = st.soft
    x = sm.take(s)
    kind = st.num.softmax_kind
    if kind == "online":
        m, d = _online_normaliser(st, x)
        shift = jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)
        return sm.div(st.exp_shifted(x, shift), d)
    if kind == "safe" and st.base2:
        top = jnp.max(x, axis=-1, keepdims=True)
        e = st.exp_shifted(x, jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top))
        return sm.div(e, st.sum(e))
    if kind == "safe":
        x = sm.sub(x, jnp.max(x, axis=-1, keepdims=True))
    e = sm.exp(x)
    return sm.div(e, st.sum(e))


def _online_state(st: Stages, s: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    """FlashAttention-style streaming over key blocks: running max, rescaled sum and accumulator.

    For each block: ``m' = max(m, max(s_blk))``; ``c = exp(m - m')``; ``e = exp(s_blk - m')``;
    ``d = d·c + Σ e``; ``acc = acc·c + round(e, prob) @ v_blk``; the final ``(m, d, acc)``
    (:func:`_online` divides: ``o = acc / d``).
    While every logit seen is ``-inf`` the shift is 0 (as FlashAttention guards it), so an early
    fully-masked block does not poison the row.
    """
    sm, acc_ar = st.soft, st.acc
    block = st.num.softmax_block
    assert block is not None
    n_keys = s.shape[-1]
    n_blocks = -(-n_keys // block)
    pad = n_blocks * block - n_keys
    s = jnp.pad(sm.take(s), [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, pad), (0, 0)])
    s_blocks = jnp.moveaxis(s.reshape(*s.shape[:-1], n_blocks, block), -2, 0)
    v_blocks = jnp.moveaxis(v.reshape(*v.shape[:-2], n_blocks, block, v.shape[-1]), -3, 0)

    rows = s.shape[:-1]
    batch = jnp.broadcast_shapes(rows[:-1], v.shape[:-2])
    init = (
        jnp.full((*rows, 1), -jnp.inf, sm.dtype),
        jnp.zeros((*rows, 1), sm.dtype),
        jnp.zeros((*batch, rows[-1], v.shape[-1]), acc_ar.dtype),
    )

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array], blk: tuple[jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        m, d, acc = carry
        sb, vb = blk
        m_new = jnp.maximum(m, jnp.max(sb, axis=-1, keepdims=True))
        shift = jnp.where(jnp.isneginf(m_new), jnp.zeros_like(m_new), m_new)
        c = st.rescale(m, shift)
        e = st.exp_shifted(sb, shift)
        d = st.carry_sum(d, c, e)
        acc = st.carry_pv(acc, c, to_format(e, st.prob), vb)
        return (m_new, d, acc), None

    return lax.scan(step, init, (s_blocks, v_blocks))[0]


def _online(st: Stages, s: jax.Array, v: jax.Array) -> jax.Array:
    _, d, acc = _online_state(st, s, v)
    return st.soft.div(st.soft.take(acc), d)


def partial_attention(st: Stages, s: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One split of split-KV: its log-sum-exp ``fl(m + fl(log ℓ))`` in the softmax format
    (``-inf`` for a split with no attended key) and its output in ``accum`` (0 there)."""
    sm = st.soft
    kind = st.num.softmax_kind
    if kind == "online":
        m, d, acc = _online_state(st, s, v)
        o = sm.div(sm.take(acc), d)
        shift = m
    else:
        x = sm.take(s)
        if kind == "safe":
            top = jnp.max(x, axis=-1, keepdims=True)
            shift = jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top)
            e = st.exp_shifted(x, shift)
        else:
            shift = jnp.zeros((*x.shape[:-1], 1), sm.dtype)
            e = sm.exp(x)
        d = st.sum(e)
        o = st.dot(to_format(sm.div(e, d), st.prob), v)
    empty = d == 0
    if st.folded:  # the maximum is of the unscaled scores: m·fl(scale); the lift taken off
        assert st.c_lse is not None
        shift = sm.mul(jnp.where(jnp.isneginf(shift), jnp.zeros_like(shift), shift), st.c_lse)
        d = sm.mul(d, jnp.asarray(2.0**-st.num.prob_offset, sm.dtype))
    lse = jnp.where(empty, -jnp.inf, sm.add(shift, sm.log(d)))
    o = st.acc.take(o)
    return lse, jnp.where(empty, jnp.zeros_like(o), o)


def _split_kv(st: Stages, s: jax.Array, v: jax.Array) -> jax.Array:
    """Split-KV attention (``numerics.kv_splits``): each split attended alone, then the partial
    outputs merged by their log-sum-exps as FlashAttention-2's combine kernel does."""
    sm, ar = st.soft, st.acc
    n_keys = s.shape[-1]
    size = st.num.kv_split_size(n_keys)
    count = -(-n_keys // size)
    pad = count * size - n_keys
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    v = jnp.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, pad), (0, 0)])
    s_splits = jnp.moveaxis(s.reshape(*s.shape[:-1], count, size), -2, 0)
    v_splits = jnp.moveaxis(v.reshape(*v.shape[:-2], count, size, v.shape[-1]), -3, 0)
    lse, outs = jax.vmap(lambda sb, vb: partial_attention(st, sb, vb))(s_splits, v_splits)
    lse_all = jnp.moveaxis(lse[..., 0], 0, -1)  # (..., Lq, splits)
    top = jnp.max(lse_all, axis=-1, keepdims=True)
    top = jnp.where(jnp.isneginf(top), jnp.zeros_like(top), top)
    total = st.sum(sm.exp(sm.sub(lse_all, top)))
    big = jnp.where(total == 0, jnp.inf, sm.add(sm.log(total), top))
    alpha = jnp.moveaxis(sm.exp(sm.sub(lse_all, big)), -1, 0)[..., None]  # (splits, ..., Lq, 1)

    def add(out: jax.Array, part: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        a, o = part  # one split after the other; fl(0 + x) = x starts the sum exactly
        return ar.add(out, ar.mul(ar.take(a), o)), None

    return lax.scan(add, jnp.zeros_like(outs[0]), (alpha, outs))[0]


def attend(
    st: Stages,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Band | jax.Array | None,
    bias: jax.Array | None,
    descale_v: float | None = None,
) -> jax.Array:
    """The attention of every stage as ``st`` rounds it: the logits, the softmax (its
    algorithm), ``P·V``, rounded to the output format."""
    s = stage_logits(st, q, k, mask, bias)
    if st.num.kv_splits is not None:
        y = _split_kv(st, s, v)
    elif st.num.softmax_kind == "online":
        y = _online(st, s, v)
    else:
        y = _softmax_then_pv(st, s, v)
    if descale_v is not None:  # fp8: the output times d_v, in the format y is in
        ar = Arith(st.num.descale_format, st.acc.guard)
        y = ar.mul(ar.take(y), format_constant(ar, descale_v))
    return to_format(y, st.output)


@functools.partial(jax.jit, static_argnames=("numerics", "descale_v"))
def _attention_jit(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    bias: Any,
    consts: Constants,
    *,
    numerics: Numerics,
    descale_v: float | None = None,
) -> jax.Array:
    st = Stages(numerics, runtime_zero(q), consts)
    q, k, v = (to_format(x, st.input) for x in (q, k, v))
    out = attend(st, q, k, v, mask, bias, descale_v)
    return out.astype(st.output.jax_dtype)


def attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    descale: tuple[float, float, float] | None = None,
    rope: Rope | None = None,
    positions: tuple[ArrayLike, ArrayLike] | None = None,
    kv_cache: KVQuant | tuple[KVQuant, KVQuant] | None = None,
) -> jax.Array:
    """Scaled dot-product attention with explicit numerics.

    .. math::

        O = \\mathrm{softmax}\\big(\\mathrm{scale}\\cdot Q K^\\top + B,\\ \\text{masked}\\big)\\, V

    Args:
        q: queries ``(..., Lq, d_k)``.
        k: keys ``(..., Lk, d_k)``.
        v: values ``(..., Lk, d_v)``. The batch dimensions of q, k and v broadcast together.
        mask: optional boolean array broadcastable to ``(..., Lq, Lk)``; **True means attend**.
            A :class:`mhanum.masks.Band` (``masks.causal()``, ``masks.sliding_window(n)``) is
            built inside the computation instead of passed as an array. Masked logits are replaced by (``fill``) or added to (``add``) the masking constant of
            ``numerics``.
        bias: optional additive float array broadcastable to ``(..., Lq, Lk)``, rounded to the score
            format and added to the scaled scores; ``-inf`` entries are allowed.
        scale: the logit scale; default ``1/sqrt(d_k)`` (float64, then rounded into the format of
            the product it enters).
        numerics: a :class:`Numerics` or a preset name (default: float32, XLA's order).
        sink: optional attention-sink logits, one per batch element or head (broadcast
            against the batch dimensions): ``e^σ`` joins every row's normaliser, as one more
            key with value 0 that no mask excludes (:func:`mhanum.masks.with_sink`).
        softcap: optional logit soft-cap ``c > 0`` (Gemma 2: 50): the scaled scores become
            ``c·tanh(s/c)`` before the bias and the mask, computed in the score format as
            ``fl(ĉ·fl(tanh(fl(s·r̂))))`` with ``ĉ = fl(c)`` and ``r̂ = fl(1/c)`` (``tanh`` XLA's,
            within ``numerics.tanh_ulps``).
        descale: fp8 descale factors ``(d_q, d_k, d_v)`` (float32 numbers > 0), as
            FlashAttention-3 applies them to fp8 q, k, v: the attention of ``d_q q``, ``d_k k``,
            ``d_v v``, computed with the scale constant ``fl(scale·d_q·d_k)`` (the float64
            product rounded once) on the given q, k, v, and the output (after the online
            softmax's division, or the P·V dot) times ``d_v`` in its format
            (``Numerics.descale_format``) before its rounding to ``output_format``. Needs the
            scale on the scores.
        rope: a :class:`mhanum.rope.Rope`: ``q`` and ``k`` (the kernel's inputs, values of
            ``rope.rotation_format``, concrete) are rotated as it states
            (:func:`mhanum.rope.apply_rope`) before the attention, whose numerics then read
            them in the input format.
        positions: with ``rope``, the queries' and keys' positions (see
            :class:`mhanum.problem.AttentionProblem`).
        kv_cache: a :class:`mhanum.kvcache.KVQuant`, or the pair ``(k's, v's)``: ``k`` and
            ``v`` (concrete; with ``rope``, the rotated keys) are stored in the quantized cache
            and read back as it states before the attention, whose numerics then read them in
            the input format (operand placement); or the attention reads the codes, K's
            scale joins the scores' constant and V's multiplies the output, rounded into the
            output format again (accumulator placement, one scale per tensor).

    Returns:
        ``(..., Lq, d_v)`` in the dtype that stores ``numerics.output_format``.

    Raises:
        InvalidArgument: for shapes that do not fit, non-float inputs, NaN/Inf in concrete inputs,
            a non-boolean mask, or float64 numerics without JAX's 64-bit mode.

    Examples:
        >>> import numpy as np
        >>> q = k = v = np.eye(2)
        >>> out = attention(q, k, v, numerics="fp32")
        >>> out.shape
        (2, 2)
    """
    num = resolve(numerics)
    check_x64(num)
    p = AttentionProblem.of(
        q, k, v, mask=mask, bias=bias, scale=scale, sink=sink, softcap=softcap, descale=descale,
        rope=rope, positions=positions, kv_cache=kv_cache,
    )  # fmt: skip
    num.check_problem(p)
    q, k, v, mask, bias = p.q, p.k, p.v, p.mask, p.bias
    if p.rope is not None:
        q, k = _rotated(p)
    descale, rescale_output = p.descale, None
    if p.kv_cache is not None:
        if any(V.is_traced(x) for x in (k, v)):
            msg = "kv_cache: the cache is emulated on concrete k and v; call outside jax.jit"
            raise InvalidArgument(msg)
        acc = p.accumulated()
        if acc is None:
            k, v = p.kv_cache[0].read(k)[0], p.kv_cache[1].read(v)[0]
        else:
            # the dots read the codes, k's scale joins the scores' constant, and v's multiplies
            # the output once it is in the output format (FlashInfer: out *= v_scale)
            (k, v), rescale_output = acc.codes, acc.descale[2]
            descale = (1.0, acc.descale[1], 1.0)
    if p.sink is not None:
        xp = jnp if any(isinstance(x, jax.Array) for x in (q, k, v, p.sink)) else np
        k, v, mask, bias = masks.with_sink(q, k, v, mask, bias, p.sink, xp=xp)
    if bias is not None:
        bias = host_round(bias, num.format_of("score"))
    factor = p.scale_value(num.scale)
    if descale is not None:
        factor = factor * descale[0] * descale[1]
    fmt = num.format_of("input")
    q, k, v = (host_round(x, fmt) for x in (q, k, v))
    out = _attention_jit(
        q,
        k,
        v,
        mask,
        bias,
        Constants.of(num, factor, p.softcap),
        numerics=num,
        descale_v=None if p.descale is None else p.descale[2],
    )
    if rescale_output is None:
        return out
    scaled = round_to(np.asarray(out, np.float64) * rescale_output, num.format_of("output"))
    return jnp.asarray(scaled, dtype=out.dtype)


def _rotated(p: AttentionProblem) -> tuple[np.ndarray, np.ndarray]:
    """``q`` and ``k`` rotated as ``p.rope`` states (concrete inputs only)."""
    assert p.rope is not None
    assert p.positions is not None
    if any(V.is_traced(x) for x in (p.q, p.k)):
        msg = "rope: the rotation is emulated on concrete q and k; call attention outside jax.jit"
        raise InvalidArgument(msg)
    return (
        apply_rope(np.asarray(p.q, np.float64), p.positions[0], p.rope),
        apply_rope(np.asarray(p.k, np.float64), p.positions[1], p.rope),
    )


@functools.partial(jax.jit, static_argnames=("numerics",))
def _softmax_jit(x: Any, mask: Any, *, numerics: Numerics) -> jax.Array:
    st = Stages(numerics, runtime_zero(x), Constants.of(numerics, 1.0))
    s = st.score.take(x)
    if mask is not None:
        constant = jnp.asarray(numerics.mask_constant(), st.score.dtype)
        s = jnp.where(
            _mask_array(mask, s),
            s,
            constant if numerics.mask_mode == "fill" else st.score.add(s, constant),
        )
    return stage_probabilities(st, s).astype(st.soft.fmt.jax_dtype)


def softmax(
    x: ArrayLike, mask: Band | ArrayLike | None = None, *, numerics: Numerics | str | None = None
) -> jax.Array:
    """The softmax stage of :func:`attention` alone, over the last axis of the logits ``x``.

    ``x`` is rounded to ``numerics.score_format`` and masked as in :func:`attention` (True means
    keep), then the softmax runs in ``numerics.softmax_format`` by ``numerics.softmax``: ``naive``
    ``exp(x)/Σ exp(x)``; ``safe`` ``exp(x - max)/Σ``; ``online(B)`` the running maximum ``m`` and
    sum ``d`` over blocks of ``B`` (Milakov & Gimelshein 2018), then ``exp(x - m)/d``. Every sum is
    in ``numerics.summation`` order. The result is in the softmax format (not yet rounded to
    ``prob_format``).

    Raises:
        InvalidArgument: for a non-float or non-finite ``x`` (``-inf`` is allowed), or a bad mask.
    """
    num = resolve(numerics)
    check_x64(num)
    x = V.float_array(x, "x", min_ndim=1)
    V.check_finite(x, "x", allow_neg_inf=True)
    mask = masks.normalise(mask, tuple(x.shape))
    return _softmax_jit(host_round(x, num.format_of("score")), mask, numerics=num)


def project(st: Stages, x: jax.Array, w: jax.Array, b: jax.Array | None, fmt: Format) -> jax.Array:
    """``x @ w + b`` accumulated in ``accum`` (bias included), then rounded to ``fmt``."""
    y = st.dot(x, w)
    if b is not None:
        y = st.acc.add(y, st.acc.take(b))
    return to_format(y, fmt)


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    """``(..., L, H·d)`` to ``(..., H, L, d)``: head ``h`` takes columns ``[h·d, (h+1)·d)``."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads), -2, -3)


def head_logit_inputs(
    num: Numerics, p: MHAProblem
) -> tuple[Any, Any, tuple[int, ...], float | None]:
    """The mask, bias, sinks and soft-cap of a multi-head problem's scores, checked against
    ``num``: ``(mask, bias, scores, cap)`` with a sink's column added (the scores' new shape in
    ``scores``) and the bias rounded into the score format.

    Raises:
        InvalidArgument: naming the argument ``num`` does not model.
    """
    num.check_problem(p)
    mask, bias, target = p.mask, p.bias, p.scores
    if p.sink is not None:
        mask, bias, target = masks.head_sinks(mask, bias, p.sink, target)
    if bias is not None:
        bias = host_round(bias, num.format_of("score"))
    return mask, bias, tuple(target), p.softcap


def merge_heads(x: jax.Array) -> jax.Array:
    """``(..., H, L, d)`` to ``(..., L, H·d)``, heads in order (the inverse of
    :func:`split_heads`)."""
    x = jnp.swapaxes(x, -2, -3)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _head_projections(
    st: Stages, x_q: Any, x_kv: Any, p: Any, num_heads: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each head's ``q``, ``k``, ``v``: the projections stored in the storage format."""
    x_q, x_kv = to_format(x_q, st.input), to_format(x_kv, st.input)
    q = split_heads(project(st, x_q, p.wq, p.bq, st.storage), num_heads)
    k = split_heads(project(st, x_kv, p.wk, p.bk, st.storage), num_heads)
    v = split_heads(project(st, x_kv, p.wv, p.bv, st.storage), num_heads)
    return q, k, v


def _heads_output(
    st: Stages, heads: tuple[Any, Any, Any], p: Any, logits: tuple[Any, ...], sink: bool
) -> jax.Array:
    """Every head's attention (``logits``: mask, bias), concatenated and projected by ``wo``,
    ``bo`` into the output format."""
    q, k, v = heads
    if sink:  # the sink's key and value: zeros, the last of every row (masks.with_sink)
        k, v = masks.zero_key(k, xp=jnp), masks.zero_key(v, xp=jnp)
    o = merge_heads(attend(st, q, k, v, *logits))
    return project(st, o, p.wo, p.bo, st.output).astype(st.output.jax_dtype)


def _input_params(st: Stages, params: MHAParams) -> Any:
    """The weights rounded into the input format (jax arrays in ``MHAParams``' fields)."""
    return jax.tree_util.tree_map(lambda w: to_format(w, st.input), params)


@functools.partial(jax.jit, static_argnames=("num_heads", "numerics", "sink"))
def _mha_jit(
    x_q: Any,
    x_kv: Any,
    params: MHAParams,
    mask: Any,
    bias: Any,
    consts: Constants,
    *,
    num_heads: int,
    numerics: Numerics,
    sink: bool = False,
) -> jax.Array:
    st = Stages(numerics, runtime_zero(x_q), consts)
    p = _input_params(st, params)
    heads = _head_projections(st, x_q, x_kv, p, num_heads)
    return _heads_output(st, heads, p, (mask, bias), sink)


@functools.partial(jax.jit, static_argnames=("num_heads", "numerics"))
def _projections_jit(
    x_q: Any, x_kv: Any, params: MHAParams, *, num_heads: int, numerics: Numerics
) -> tuple[jax.Array, jax.Array, jax.Array]:
    st = Stages(numerics, runtime_zero(x_q), Constants.of(numerics, 1.0))
    return _head_projections(st, x_q, x_kv, _input_params(st, params), num_heads)


@functools.partial(jax.jit, static_argnames=("numerics", "sink"))
def _heads_output_jit(
    q: Any,
    k: Any,
    v: Any,
    params: MHAParams,
    mask: Any,
    bias: Any,
    consts: Constants,
    *,
    numerics: Numerics,
    sink: bool = False,
) -> jax.Array:
    st = Stages(numerics, runtime_zero(q), consts)
    return _heads_output(st, (q, k, v), _input_params(st, params), (mask, bias), sink)


def _rotated_heads(
    p: MHAProblem, num: Numerics, heads: tuple[jax.Array, jax.Array, jax.Array]
) -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """Every head's projected ``q`` and ``k`` rotated as ``p.rope`` states
    (:func:`mhanum.rope.apply_rope`, on the host) and stored again in the storage format."""
    assert p.rope is not None
    assert p.positions is not None
    storage = num.storage_format
    q, k, v = heads
    return (
        round_to(apply_rope(np.asarray(q, np.float64), p.positions[0], p.rope), storage),
        round_to(apply_rope(np.asarray(k, np.float64), p.positions[1], p.rope), storage),
        v,
    )


def multi_head_attention(
    x_q: ArrayLike,
    x_kv: ArrayLike,
    params: MHAParams,
    num_heads: int,
    *,
    mask: Band | ArrayLike | None = None,
    bias: ArrayLike | None = None,
    scale: float | None = None,
    numerics: Numerics | str | None = None,
    num_kv_heads: int | None = None,
    sink: ArrayLike | None = None,
    softcap: float | None = None,
    rope: Rope | None = None,
    positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None = None,
) -> jax.Array:
    """Multi-head attention ``concat_h(attention(x_q Wq_h + bq_h, ...)) Wo + bo`` with explicit numerics.

    Head ``h`` uses columns ``[h·d_k, (h+1)·d_k)`` of the projections (see :class:`MHAParams`).
    Projections accumulate in ``numerics.accum`` with the bias added there, and are rounded to the
    storage format; the output projection is rounded to ``numerics.output_format``.

    Args:
        x_q: query input ``(..., Lq, d_q)``.
        x_kv: key/value input ``(..., Lk, d_kv)``.
        params: the weights; rounded into ``numerics.input`` like the inputs.
        num_heads: number of heads ``H``; must divide ``H·d_k`` and ``H·d_v``.
        num_kv_heads: grouped-query attention: ``wk``, ``wv`` (and ``bk``, ``bv``) hold
            ``num_kv_heads`` heads, a divisor of ``num_heads``, each read by ``num_heads /
            num_kv_heads`` query heads (:meth:`MHAParams.expand_kv_heads`); ``1`` is
            multi-query attention. Default: as many as ``num_heads``.
        sink: optional attention-sink logits, one per head (``(H,)``, or broadcast against
            ``(..., H)``): ``e^σ`` joins every row's normaliser in that head, as one more key
            with value 0 that no mask excludes (:func:`mhanum.masks.with_sink`).
        softcap: optional logit soft-cap ``c > 0``, in every head, as in :func:`attention`.
        rope: a :class:`mhanum.rope.Rope`: every head's projected queries and keys (values of
            the storage format, which ``rope.rotation_format`` must hold) are rotated as it
            states (:func:`mhanum.rope.apply_rope`, on the host: concrete inputs only) and
            stored again in the storage format before the heads' attention.
        positions: with ``rope``, the queries' and keys' positions, as for :func:`attention`.
        mask: optional boolean array broadcastable to ``(..., H, Lq, Lk)``, **True means attend**
            (a per-batch mask has shape ``(B, 1, Lq, Lk)``), or a :class:`mhanum.masks.Band`.
        bias: optional additive float array broadcastable to ``(..., H, Lq, Lk)``.
        scale: logit scale; default ``1/sqrt(d_k)``.
        numerics: a :class:`Numerics` or a preset name.

    Returns:
        ``(..., Lq, d_out)`` in the dtype that stores ``numerics.output_format``.

    Raises:
        InvalidArgument: as :func:`attention`, and for parameters that do not fit the inputs or a
            ``num_heads`` that does not divide the projected widths.
    """
    num = resolve(numerics)
    check_x64(num)
    p = MHAProblem.of(
        x_q, x_kv, params, num_heads, mask=mask, bias=bias, scale=scale, sink=sink,
        softcap=softcap, num_kv_heads=num_kv_heads, rope=rope, positions=positions,
    )  # fmt: skip
    mask, bias, _, cap = head_logit_inputs(num, p)
    if p.rope is not None:
        check_holds(p.rope, num.storage_format, "the projections' storage format")
        if any(V.is_traced(x) for x in (p.x_q, p.x_kv)):
            msg = "rope: the rotation is emulated on concrete inputs; call outside jax.jit"
            raise InvalidArgument(msg)
    fmt = num.format_of("input")
    x_q, x_kv = host_round(p.x_q, fmt), host_round(p.x_kv, fmt)
    params = jax.tree_util.tree_map(lambda w: host_round(w, fmt), p.params)
    consts = Constants.of(num, p.scale_value(num.scale), cap)
    if p.rope is not None:
        heads = _projections_jit(x_q, x_kv, params, num_heads=p.num_heads, numerics=num)
        q, k, v = _rotated_heads(p, num, heads)
        return _heads_output_jit(
            jnp.asarray(q, heads[0].dtype), jnp.asarray(k, heads[1].dtype), v, params, mask,
            bias, consts, numerics=num, sink=p.sink is not None,
        )  # fmt: skip
    return _mha_jit(
        x_q, x_kv, params, mask, bias, consts, num_heads=p.num_heads, numerics=num,
        sink=p.sink is not None,
    )  # fmt: skip
