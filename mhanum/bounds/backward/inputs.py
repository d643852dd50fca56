"""The inputs of Theorems B.1/B.2, and the context every step of their proof reads
(papers/backward.md, step 1)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum.bounds.enclosure import GRADIENTS, U64, Dot, Ranges, read_error
from mhanum.bounds.factors import LOG2E, compound, operand_bits, rounding_error
from mhanum.bounds.scale import OperandScale, is_power_of_four, operand_scale, scale_rounding
from mhanum.formats import Format
from mhanum.numerics import Backward, Numerics
from mhanum.problem import AttentionProblem

__all__ = [
    "Context", "Folded", "Inputs", "Operands", "ScaledOperands", "inputs", "operands_step",
]  # fmt: skip


class Inputs(NamedTuple):
    """The float64 inputs of Theorem B.1: the stand-ins ``q, k, v, g`` (``g`` is ``d_out``),
    the attended keys ``keep``, the bias, the scale ``c64`` with its float64 rounding ``u64``;
    with multi-head attention (B.6), how far the stand-ins are from the exact operands."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    keep: np.ndarray
    bias: np.ndarray | None
    c64: float
    u64: float
    sink: bool = False
    # multi-head attention's heads (Theorem B.6): the float64 q, k, v, d_out are stand-ins off
    # the exact ones by ``given``; the computed ones, before they are read into the input
    # format, are off the exact ones by ``errors`` and stored in the formats ``sources``
    given: tuple[np.ndarray, ...] | None = None
    errors: tuple[np.ndarray, ...] | None = None
    sources: tuple[Format, ...] | None = None
    # |Ô - O|, its reasons, and (or None) A.1g's bound along g per row
    forward: tuple[np.ndarray, tuple[str, ...], np.ndarray | None] | None = None
    cap: float | None = None  # the logit soft-cap
    scale: float | None = None  # the scale as given (None: 1/sqrt(d_k), rounded in float64)
    # step 2': the scale (or its square root) on q (and k); then the logits are unscaled
    # (c64 = 1) and dq, dk are multiplied by ``factors`` (None: by c64)
    scaled: ScaledOperands | None = None
    factors: tuple[tuple[float, float] | None, tuple[float, float] | None] | None = None


class ScaledOperands(NamedTuple):
    """Step 2' of B.1 (papers/backward.md): the factor ``f`` (the scale on ``q``, or its square
    root on ``q`` and ``k``) with its roundings, the operands before it (``q``, ``k``: what the
    forward bound reads), and for each scaled operand ``|x̂_s - f·x| <= errors`` of the
    computed one and ``|x̃_s - f·x| <= radii`` of the float64 stand-in ``x̃_s = fl64(f64·x)``."""

    q: np.ndarray
    k: np.ndarray
    scale: OperandScale
    errors: dict[str, np.ndarray]
    radii: dict[str, np.ndarray]


def inputs(p: AttentionProblem, num: Numerics) -> Inputs:
    """The float64 inputs of Theorem B.1 for the backward problem ``p`` (``p.d_out`` given),
    broadcast to its batch, with the attended keys and the sink's key and value appended."""
    num.check_problem(p)
    batch, target, cap = p.batch, p.scores, p.softcap
    q, k, v, g = (
        np.broadcast_to(np.asarray(x, np.float64), (*batch, *x.shape[-2:]))
        for x in (p.q, p.k, p.v, p.d_out)
    )
    keep = masks.dense(p.mask, target)
    if p.mask is not None and not math.isinf(num.mask_constant()):
        msg = (
            "numerics.mask_value: the backward bound (Theorem B.1) needs -inf masking, got "
            f"{num.mask_value!r}"
        )
        raise InvalidArgument(msg)
    b = None
    if p.bias is not None:
        b = np.broadcast_to(np.asarray(p.bias, np.float64), target)
        keep = keep & np.isfinite(b)
        b = np.where(keep, b, 0.0)
    if p.sink is not None:  # one more key: k = v = 0, bias σ, never masked
        k, v, keep2, b = masks.with_sink(q, k, v, keep, b, p.sink)
        keep = np.ones(b.shape, bool) if keep2 is None else np.asarray(keep2, bool)
        q, g = (np.broadcast_to(x, (*b.shape[:-2], *x.shape[-2:])) for x in (q, g))
    if not keep.any(axis=-1).all():
        msg = "mask: expected every row to attend some key (an empty softmax has no gradient)"
        raise InvalidArgument(msg)
    c64 = p.scale_value(num.scale)
    u64 = 0.0
    if p.scale is None and not is_power_of_four(q.shape[-1]):
        u64 = compound(U64, over=(U64,))  # 1/sqrt(d): two float64 roundings
    x = Inputs(q, k, v, g, keep, b, c64, u64, p.sink is not None, cap=cap, scale=p.scale)
    return x if num.scale == "scores" else scaled_step(x, num)


def scaled_step(x: Inputs, num: Numerics) -> Inputs:
    """Step 2' (papers/backward.md): with the scale on ``q`` (or ``sqrt(c)`` on ``q`` and
    ``k``), B.1 on the scaled operands with the scale 1, ``dq`` (and ``dk``) multiplied by the
    factor again: ``c·q kᵀ = (f q)(f k)ᵀ``, so ``dq = f·(dS (f k))`` and ``dk = f·(dSᵀ (f q))``
    (on ``q`` only: ``dq = c·(dS k)``, ``dk = dSᵀ (c q)``). The scaled operands are the
    forward's (papers/attention.md, step 2'), read by the dots from the scale format."""
    sc = operand_scale(x.c64, x.q.shape[-1], x.scale is None, num)
    fin = num.format_of("input")
    names = ("q", "k") if num.scale == "qk" else ("q",)
    arrays = {"q": x.q, "k": x.k}
    errors, radii = {}, {}
    for name in names:
        a = arrays[name]
        arrays[name], e_s, g_s = sc.applied(a, rounding_error(a, fin), 0.0)
        errors[name], radii[name] = e_s + g_s, g_s
    factor = (sc.f64, sc.u64)
    return x._replace(
        q=arrays["q"], k=arrays["k"], c64=1.0, u64=0.0,
        scaled=ScaledOperands(x.q, x.k, sc, errors, radii),
        factors=(factor, factor if num.scale == "qk" else None),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Context:
    """What every step of B.1/B.2 reads: the inputs, the numerics, the backward algorithm,
    ``λ`` (B.5, or ``None``), the ranges every step records into, B.0's dot and whether B.2
    may read the forward through A.1's known roundings (``known``)."""

    x: Inputs
    num: Numerics
    bw: Backward
    lam: float | None
    rng: Ranges
    dot: Dot
    known: bool = False

    @classmethod
    def of(
        cls, x: Inputs, num: Numerics, bw: Backward, lam: float | None, *, known: bool = False
    ) -> Context:
        """A fresh context: no stage checked yet."""
        return cls(x, num, bw, lam, Ranges(), Dot(num), known)

    @property
    def flash(self) -> bool:
        """FlashAttention-2 (Theorem B.2), or the textbook backward (B.1)."""
        return self.bw.algorithm == "flash2"

    @property
    def grad(self) -> Format:
        """The gradient format."""
        return self.bw.formats(self.num)[0]

    @property
    def dsf(self) -> Format:
        """The format ``dS`` is rounded to for the last dots."""
        return self.bw.formats(self.num)[1]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(L_q, n, d_k, d_v)``, ``n`` the keys (a sink's included)."""
        return self.x.q.shape[-2], self.x.k.shape[-2], self.x.q.shape[-1], self.x.v.shape[-1]

    def fmt(self, role: str) -> Format:
        """The numerics' format of ``role`` (``"input"``, ``"accum"``, ``"score"`` ...)."""
        return self.num.format_of(role)

    def folded(self) -> Folded | None:
        """B.2 with ``exp_form="exp2-folded"`` (step 2''): the constants' roundings, or
        ``None`` for the exp form."""
        if not self.num.folds_scale:
            return None
        sm, c64 = self.fmt("softmax"), self.x.c64
        c2_hat, u_c2, _ = scale_rounding(c64 * LOG2E, sm)
        _, u_c, _ = scale_rounding(c64, sm)
        _, u_l, _ = scale_rounding(LOG2E, sm)
        # c64 within u64 of c; log2(e) and the product in float64: two roundings more; and the
        # scale rounded into the softmax format first, as FlashAttention-2 forms c2 from its
        # float32 softmax_scale (flash_api.cpp): either construction is covered
        return Folded(
            c2_hat,
            compound(self.x.u64, U64, U64, u_c, u_c2),
            compound(self.x.u64, u_c),
            compound(U64, u_l),
        )


class Folded(NamedTuple):
    """The constants of FlashAttention-2's exp2 (papers/backward.md, step 2''):
    ``c2 = fl_m(c64·log2 e) = c·log2(e)·(1 + δ_c)``, ``ĉ = fl_m(c64) = c(1 + θ_c)`` (the
    forward's log-sum-exp factor) and ``L̂ = fl_m(log2 e) = log2(e)(1 + θ_L)`` (the
    recomputation's), with ``|δ_c| <= delta_c``, ``|θ_c| <= theta_c``, ``|θ_L| <= theta_l``."""

    c2_hat: float
    delta_c: float
    theta_c: float
    theta_l: float


@dataclasses.dataclass(frozen=True)
class Operands:
    """Step 1's enclosures of ``q``, ``k``, ``v`` and ``d_out`` (keyed by those names):
    ``err >= |x̂ - x|`` of the operand in the input format, ``rad >= |x̃ - x|`` of the float64
    stand-in (``None``: exact), ``mag = |x̃|`` and ``up >= |x|``."""

    err: dict[str, np.ndarray]
    rad: dict[str, np.ndarray | None]
    mag: dict[str, np.ndarray]
    up: dict[str, np.ndarray]
    bits: dict[str, int]


def operands_step(ctx: Context) -> Operands:
    """Step 1 (papers/backward.md): the inputs rounded into the input format; step 2': the
    scaled operands, as the dots read them from the scale format; B.6: computed operands, off
    the exact ones by ``errors``, read into it from their storage formats."""
    x, fin, rng = ctx.x, ctx.fmt("input"), ctx.rng
    e: dict[str, np.ndarray] = {}
    rad: dict[str, np.ndarray | None] = {}
    bits = dict.fromkeys(("q", "k", "v", "d_out"), operand_bits(ctx.num, fin))
    arrays = (("q", x.q), ("k", x.k), ("v", x.v), ("d_out", x.g))
    for i, (name, arr) in enumerate(arrays):
        if x.scaled is not None and name in x.scaled.errors:
            scaled_ranges(ctx, name)
            rad[name], e[name] = x.scaled.radii[name], x.scaled.errors[name]
            bits[name] = operand_bits(ctx.num, x.scaled.scale.fmt)
        elif x.errors is None or x.given is None or x.sources is None:
            rad[name] = None
            rng.check(np.abs(arr), fin, f"{name} rounded to the input format", GRADIENTS)
            e[name] = rounding_error(arr, fin)
        else:  # B.6: a computed operand, off the exact one by errors[i], read into fin
            rad[name] = x.given[i]
            used = np.abs(arr) + x.given[i] + x.errors[i]
            rng.check(used, fin, f"{name} read into the input format", GRADIENTS)
            e[name] = x.errors[i] + read_error(used, x.sources[i], fin)
    mag = {name: np.abs(arr) for name, arr in arrays}
    up = {name: m if rad[name] is None else m + rad[name] for name, m in mag.items()}
    return Operands(e, rad, mag, up, bits)


def scaled_ranges(ctx: Context, name: str) -> None:
    """Step 2''s ranges: the operand ``name`` in the input format, read into the scale format
    and multiplied by ``f̂`` there (as the forward's step 2' checks them)."""
    assert ctx.x.scaled is not None
    sc, fin = ctx.x.scaled.scale, ctx.fmt("input")
    a = ctx.x.scaled.q if name == "q" else ctx.x.scaled.k
    ctx.rng.check(np.abs(a), fin, f"{name} rounded to the input format", GRADIENTS)
    stored = np.abs(a) + rounding_error(a, fin)
    ctx.rng.check(stored, sc.fmt, f"{name} read into the scale format", GRADIENTS)
    product = abs(sc.f_hat) * stored * (1 + sc.u_t) + sc.fmt.smallest_normal
    ctx.rng.check(product, sc.fmt, f"{name} times the scale factor {sc.f_hat:.4g}", GRADIENTS)
