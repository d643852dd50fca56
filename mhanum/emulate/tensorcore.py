"""JAX emulation of the tensor-core models of :mod:`mhanum.units.tensorcore`, bit for bit.

Integer arithmetic on the bits of float32 carriers: each fused step aligns, truncates, adds and
normalises exactly as :meth:`mhanum.units.tensorcore.TensorCoreModel.dot` does on Python floats.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from mhanum._errors import InvalidArgument
from mhanum.units.tensorcore import F32_EMAX, F32_EMIN, F32_FRAC, TensorCoreModel, get_model

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["matmul"]


def _u32(x: int | jax.Array) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.uint32)


def _decode_f32(bits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sign, exponent ``e`` (subnormals at -126) and 24-bit significand of float32 bits."""
    field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = bits & 0x7FFFFF
    sig = frac | jnp.where(field != 0, _u32(1 << 23), _u32(0))
    exp = jnp.where(field == 0, F32_EMIN, field - 127)
    return (bits >> 31) == 1, exp, sig


def _shift(m: jax.Array, s: jax.Array) -> jax.Array:
    """``m * 2**s`` truncated, for uint32 ``m`` and int32 ``s`` (0 when shifted out)."""
    left = m << jnp.clip(s, 0, 31).astype(jnp.uint32)
    right = m >> jnp.clip(-s, 0, 31).astype(jnp.uint32)
    return jnp.where(s >= 0, left, jnp.where(s < -31, _u32(0), right))


def _clz(x: jax.Array) -> jax.Array:
    return lax.clz(x).astype(jnp.int32)


def _step_bits(
    model: TensorCoreModel,
    a: tuple[jax.Array, ...],
    b: tuple[jax.Array, ...],
    c_bits: jax.Array,
) -> jax.Array:
    """One fused step on decoded operands; ``a``, ``b`` broadcast to ``(..., M, N, group)``."""
    fmt = model.format
    sa, ea, ma, a_nan, a_inf = a
    sb, eb, mb, b_nan, b_inf = b
    p_sig = ma * mb
    p_sign = sa != sb
    p_nz = p_sig != 0
    p_align = ea + eb
    p_lsb = p_align - 2 * (fmt.precision - 1)

    sc, ec, mc = _decode_f32(c_bits)
    c_field = (c_bits >> 23) & 0xFF
    c_nan = (c_field == 0xFF) & ((c_bits & 0x7FFFFF) != 0)
    c_inf = (c_field == 0xFF) & ~c_nan
    c_nz = (mc != 0) & ~c_inf & ~c_nan

    low = jnp.int32(-(2**20))
    big = jnp.max(jnp.where(p_nz, p_align, low), axis=-1)
    big = jnp.maximum(big, jnp.where(c_nz, ec, low))
    quantum = big - F32_FRAC - model.extra_bits

    p_aligned = jnp.where(p_nz, _shift(p_sig, p_lsb - quantum[..., None]), _u32(0))
    c_aligned = jnp.where(c_nz, _shift(mc, ec - F32_FRAC - quantum), _u32(0))
    pos = jnp.sum(jnp.where(p_sign, _u32(0), p_aligned), axis=-1, dtype=jnp.uint32)
    neg = jnp.sum(jnp.where(p_sign, p_aligned, _u32(0)), axis=-1, dtype=jnp.uint32)
    pos = pos + jnp.where(sc, _u32(0), c_aligned)
    neg = neg + jnp.where(sc, c_aligned, _u32(0))
    negative = neg > pos
    mag = jnp.where(negative, neg - pos, pos - neg)
    finite_bits = _round_bits(mag, quantum, negative, model)

    p_nan = a_nan | b_nan | (a_inf & (mb == 0) & ~b_inf) | (b_inf & (ma == 0) & ~a_inf)
    p_inf = (a_inf | b_inf) & ~p_nan
    pos_inf = jnp.any(p_inf & ~p_sign, axis=-1) | (c_inf & ~sc)
    neg_inf = jnp.any(p_inf & p_sign, axis=-1) | (c_inf & sc)
    nan = jnp.any(p_nan, axis=-1) | c_nan | (pos_inf & neg_inf)
    out = jnp.where(pos_inf, _u32(0x7F800000), finite_bits)
    out = jnp.where(neg_inf, _u32(0xFF800000), out)
    return jnp.where(nan, _u32(0x7FC00000), out)


def _round_bits(
    mag: jax.Array, quantum: jax.Array, negative: jax.Array, model: TensorCoreModel
) -> jax.Array:
    """float32 bits of ``±mag * 2**quantum`` rounded as :func:`_round_scaled` does."""
    prec = model.output_precision
    nbits = 32 - _clz(mag)
    keep = jnp.maximum(quantum + nbits - prec, F32_EMIN - prec + 1)
    drop = keep - quantum
    kept = _shift(mag, -drop)
    if model.normalisation == "nearest":
        d = jnp.clip(drop, 1, 32).astype(jnp.uint32)
        rem = jnp.where(drop >= 32, mag, mag & ((_u32(1) << jnp.minimum(d, 31)) - 1))
        rem = jnp.where(drop <= 0, _u32(0), rem)
        half = jnp.where(drop >= 33, _u32(0xFFFFFFFF), _u32(1) << jnp.minimum(d - 1, 31))
        up = (drop > 0) & ((rem > half) | ((rem == half) & ((kept & 1) == 1)))
        kept = kept + up.astype(jnp.uint32)
    carry = kept >= _u32(1 << prec)
    kept = jnp.where(carry, kept >> 1, kept)
    keep = jnp.where(carry, keep + 1, keep)
    normal = kept >= _u32(1 << (prec - 1))
    field = (keep + prec - 1 + 127).astype(jnp.uint32)
    body = kept << (24 - prec)
    bits = jnp.where(normal, (field << 23) | (body & 0x7FFFFF), body)
    bits = jnp.where(normal & (keep + prec - 1 > F32_EMAX), _u32(0x7F800000), bits)
    bits = jnp.where(mag == 0, _u32(0), bits)
    return jnp.where(negative & (mag != 0), bits | _u32(0x80000000), bits)


def _decode_input(x: jax.Array, model: TensorCoreModel) -> tuple[jax.Array, ...]:
    """Sign, exponent (at least ``emin``), integer significand, NaN and inf flags of values of
    the input format carried in float32."""
    fmt = model.format
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign, e32, sig = _decode_f32(bits)
    field = (bits >> 23) & 0xFF
    nan = (field == 0xFF) & ((bits & 0x7FFFFF) != 0)
    inf = (field == 0xFF) & ~nan
    exp = jnp.maximum(e32, fmt.emin)
    m = _shift(sig, -((exp - e32) + (24 - fmt.precision)))
    m = jnp.where(nan | inf, _u32(0), m)
    return sign, exp, m, nan, inf


@partial(jax.jit, static_argnames="model")
def _matmul(
    a: jax.Array, b: jax.Array, model: TensorCoreModel, c: jax.Array | None = None
) -> jax.Array:
    k = a.shape[-1]
    g = model.group
    groups = max(-(-k // g), 1)
    pad = groups * g - k
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, n = a.shape[-2], b.shape[-1]
    a = jnp.pad(jnp.broadcast_to(a, (*batch, m, k)), [(0, 0)] * (len(batch) + 1) + [(0, pad)])
    b = jnp.pad(jnp.broadcast_to(b, (*batch, k, n)), [(0, 0)] * len(batch) + [(0, pad), (0, 0)])
    # (groups, ..., M, 1, g) and (groups, ..., 1, N, g)
    a_g = jnp.moveaxis(a.reshape(*a.shape[:-1], groups, g), -2, 0)[..., :, None, :]
    b_t = jnp.swapaxes(b, -1, -2)
    b_g = jnp.moveaxis(b_t.reshape(*b_t.shape[:-1], groups, g), -2, 0)[..., None, :, :]

    def body(c_bits: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        xa, xb = xs
        return _step_bits(model, _decode_input(xa, model), _decode_input(xb, model), c_bits), None

    if c is None:
        c0 = jnp.zeros((*batch, m, n), dtype=jnp.uint32)
    else:  # an initial accumulator (float32), fed to the first step as C
        c0 = lax.bitcast_convert_type(
            jnp.broadcast_to(c.astype(jnp.float32), (*batch, m, n)), jnp.uint32
        )
    out, _ = lax.scan(body, c0, (a_g, b_g))
    return lax.bitcast_convert_type(out, jnp.float32)


def matmul(
    a: ArrayLike, b: ArrayLike, model: TensorCoreModel | str, *, c: ArrayLike | None = None
) -> jax.Array:
    """``c + a @ b`` as the modelled tensor core computes it, bit for bit equal to ``model.dot``.

    Args:
        a: ``(..., M, K)`` float32 array whose values are values of ``model.input_format``.
        b: ``(..., K, N)`` float32 array, likewise; batch dimensions broadcast.
        model: a :class:`TensorCoreModel` or its name.
        c: an optional float32 accumulator ``(..., M, N)`` the first step adds (as an MMA
            accumulates into its C operand); default zero.

    Returns:
        ``(..., M, N)`` float32 array: entry ``(i, j)`` is ``model.dot(a[i, :], b[:, j])``.
        Values outside the input format give unspecified results.

    Raises:
        InvalidArgument: for an unknown model, non-float32 arrays, or mismatched shapes.

    Examples:
        >>> import numpy as np
        >>> a = np.array([[1, 1, 1, 1]], np.float32)
        >>> b = np.array([[2], [2**-23 + 2**-24], [0], [0]], np.float32)
        >>> float(matmul(a, b, "v100-fp16")[0, 0])
        2.0
    """
    mdl = get_model(model)
    arrs = []
    for name, x in (("a", a), ("b", b)):
        arr = jnp.asarray(x)
        if arr.dtype != jnp.float32:
            msg = f"{name}: expected a float32 array, got dtype {arr.dtype}"
            raise InvalidArgument(msg)
        if arr.ndim < 2:
            msg = f"{name}: expected at least 2 dimensions, got shape {arr.shape}"
            raise InvalidArgument(msg)
        arrs.append(arr)
    if arrs[0].shape[-1] != arrs[1].shape[-2]:
        msg = f"b: expected {arrs[0].shape[-1]} rows (a's columns), got shape {arrs[1].shape}"
        raise InvalidArgument(msg)
    try:
        jnp.broadcast_shapes(arrs[0].shape[:-2], arrs[1].shape[:-2])
    except ValueError as err:
        msg = f"b: expected batch dimensions broadcastable with a's {arrs[0].shape[:-2]}, got {arrs[1].shape[:-2]}"
        raise InvalidArgument(msg) from err
    init = None if c is None else jnp.asarray(c, jnp.float32)
    return _matmul(arrs[0], arrs[1], mdl, init)


# --------------------------------------------------------------------------------------------
# Probes (papers/tensorcore.md, §4).
