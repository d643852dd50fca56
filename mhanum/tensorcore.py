"""Bit-exact models of NVIDIA tensor-core inner products, their JAX emulation and error bound.

A tensor core computes ``D = C + A B`` by *fused steps*: a step takes ``group`` exact products
``a_i b_i`` and the float32 accumulator ``c``, aligns all of them to the largest exponent in a
fixed-point window, truncating what falls below it, adds them exactly, and normalises the sum
once into float32, rounding toward zero (Fasi et al. 2021, §§4-6; Khattak & Mikaitis 2025). An
inner product of length ``n`` is ``ceil(n / group)`` such steps in order, the output of one being
the ``c`` of the next.

The model of one step (papers/tensorcore.md, §1), for inputs of precision ``p`` and
``E_x = max(floor(log2|x|), emin)`` the exponent a value is stored with:

1. every nonzero product ``a_i b_i`` is exact; its *alignment exponent* is ``E_a + E_b`` (the
   exponent of the product of the two significands in ``[1, 4)``, before normalisation); ``c``'s
   is ``E_c`` (float32, ``emin = -126``);
2. ``E`` is the largest alignment exponent of a nonzero term; every term is truncated toward zero
   to a multiple of ``2**(E - 23 - extra_bits)`` (no guard, round or sticky bits);
3. the truncated terms are added exactly (enough carry bits: the sources' models keep the sum
   exactly);
4. the sum is normalised and rounded (``normalisation``: toward zero in every model here) to
   ``output_precision`` bits with float32's exponent range, subnormals included; an exponent
   above 127 gives infinity (as the sources' model does).

NaN and infinities follow the sources' model: a NaN product (``NaN`` or ``inf * 0``) or ``c``, or
infinities of both signs, give NaN; otherwise an infinity gives that infinity.

This is the parameterised model ``Generic_BFMA_TC`` of the MATLAB toolbox that accompanies
Khattak & Mikaitis (2025), restated: its rule "one more alignment bit when the largest product's
significand is at least 2 and its exponent at least ``c``'s" is step 2's anchoring of the window
at ``E_a + E_b`` rather than at the normalised product exponent (papers/tensorcore.md, §1.2).

References:
    Fasi, Higham, Mikaitis & Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ Comput.
    Sci. 7:e330 (2021), and its test suite, github.com/north-numerical-computing/
    tensor-cores-numerical-behavior (``tc_test_numerics-V100.cu``,
    ``tc_test_numerics-T4-A100-binary16.cu``, ``-A100-bf16.cu``, ``-A100-tf32.cu``).
    Khattak & Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv:2512.07004 (2025), and its
    models, github.com/north-numerical-computing/MATLAB-tensor-core (``models/V100TC.m``,
    ``A100TC.m``, ``H100TC.m``, ``tools/Generic_BFMA_TC.m``, ``tools/GEMM.m``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum._errors import InvalidArgument
from mhanum.formats import FORMATS, get_format, representable, round_to

__all__ = [
    "MODELS",
    "PROBES",
    "Probe",
    "TensorCoreModel",
    "dot_error_eta",
    "dot_error_factor",
    "get_model",
    "matching_models",
    "matmul",
    "run_probes",
]

_F32_EMIN = -126
_F32_EMAX = 127
_F32_FRAC = 23  # stored fraction bits of float32
_NORMALISATIONS = ("toward_zero", "nearest")
_ORDERS = ("sequential", "native")


@dataclasses.dataclass(frozen=True)
class TensorCoreModel:
    """A model of one GPU's tensor-core inner product with float32 accumulation.

    Attributes:
        name: ``"<gpu>-<input>"``, e.g. ``"v100-fp16"``.
        input_format: mhanum format name of ``A`` and ``B``.
        group: number of products fused with the accumulator in one step (the sources' "FMA
            size").
        extra_bits: alignment bits kept below float32's 23 fraction bits, relative to the
            largest alignment exponent (the sources' ``neab``); negative for fp8 on H100.
        normalisation: rounding of the normalised sum, ``"toward_zero"`` or ``"nearest"``.
        output_precision: significand bits of each step's output (24, float32, except fp8 on
            H100, whose model keeps ``24 + extra_bits``).
        carry_bits: carry bits the sources report above the leading bit (informative: the model
            adds exactly, which equals the hardware whenever the sum fits them).
        source: where the parameters come from.
    """

    name: str
    input_format: str
    group: int
    extra_bits: int
    normalisation: Literal["toward_zero", "nearest"] = "toward_zero"
    output_precision: int = 24
    carry_bits: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        get_format(self.input_format, argname="input_format")
        if self.normalisation not in _NORMALISATIONS:
            msg = f"normalisation: expected one of {_NORMALISATIONS}, got {self.normalisation!r}"
            raise InvalidArgument(msg)
        if not 1 <= self.group <= 64:
            msg = f"group: expected an integer in [1, 64], got {self.group!r}"
            raise InvalidArgument(msg)
        if not 2 <= self.output_precision <= 24:
            msg = f"output_precision: expected an integer in [2, 24], got {self.output_precision}"
            raise InvalidArgument(msg)
        # The JAX emulation adds the aligned magnitudes of each sign in uint32: every product is
        # below 4 * 2**(23 + extra_bits) units and c below 2 * 2**(23 + extra_bits).
        if (4 * self.group + 2) << max(23 + self.extra_bits, 0) > 2**32:
            msg = f"extra_bits: expected group and extra_bits whose sums fit 32 bits, got {self}"
            raise InvalidArgument(msg)

    @property
    def format(self) -> Any:
        """The :class:`mhanum.formats.Format` of the inputs."""
        return get_format(self.input_format)

    @property
    def node_delta(self) -> float:
        r"""Relative error bound of one fused step (papers/tensorcore.md, Theorem T.1).

        If no nonzero input is subnormal in ``input_format`` and no overflow occurs,

        .. math::
            |\mathrm{step}(a, b, c) - (c + \textstyle\sum_i a_i b_i)|
            \le \delta\,(|c| + \textstyle\sum_i |a_i b_i|) + \eta,

        with :math:`\delta = \epsilon + m\,u'(1+\epsilon)`, :math:`\epsilon = 2^{1-P}` (``P`` the
        output precision), :math:`u' = 2^{-23-\text{extra\_bits}}`, and ``m = group`` (``group +
        1`` when ``extra_bits < 0``, where the anchor term itself may be truncated).
        """
        eps = Fraction(1, 2 ** (self.output_precision - 1))
        u_align = Fraction(2) ** (-23 - self.extra_bits)
        return float(eps + self._inexact_terms * u_align * (1 + eps))

    @property
    def node_eta(self) -> float:
        r"""Absolute underflow term of one fused step (Theorem T.1).

        :math:`\eta = (1+\epsilon)\,m\,2^{-149-\text{extra\_bits}} + 2^{-126-P+1}`: the window
        anchored at a float32-subnormal ``c``, and the rounding of a sum in float32's subnormal
        range.
        """
        eps = Fraction(1, 2 ** (self.output_precision - 1))
        window = (1 + eps) * self._inexact_terms * Fraction(2) ** (-149 - self.extra_bits)
        return float(window + Fraction(2) ** (_F32_EMIN - self.output_precision + 1))

    @property
    def _inexact_terms(self) -> int:
        return self.group + (1 if self.extra_bits < 0 else 0)

    def dot(self, a: Sequence[float], b: Sequence[float], c: float = 0.0) -> float:
        """``c + sum(a_i * b_i)`` as the modelled tensor core computes it, in exact arithmetic.

        Consecutive groups of :attr:`group` products are fused with the running accumulator, in
        order; the last group is padded with zero products.

        Args:
            a: values of :attr:`input_format`.
            b: values of :attr:`input_format`, as many as ``a``.
            c: the initial accumulator, a float32 value.

        Returns:
            The float32 result, as a Python float.

        Raises:
            InvalidArgument: if the lengths differ or a value is not in its format.

        Examples:
            >>> MODELS["v100-fp16"].dot([1, 1, 1, 1], [2, 2**-23 + 2**-24, 0, 0])
            2.0
            >>> MODELS["a100-fp16"].dot([1.0], [1.0], -(1 - 2**-24)) == 2**-24
            True
        """
        a_vals = _check_values(a, self.input_format, "a")
        b_vals = _check_values(b, self.input_format, "b")
        if len(a_vals) != len(b_vals):
            msg = f"b: expected {len(a_vals)} values (as many as a), got {len(b_vals)}"
            raise InvalidArgument(msg)
        acc = _check_values([c], "float32", "c")[0]
        for start in range(0, max(len(a_vals), 1), self.group):
            acc = self._step(
                a_vals[start : start + self.group], b_vals[start : start + self.group], acc
            )
        return acc

    def _step(self, a: Sequence[float], b: Sequence[float], c: float) -> float:
        """One fused step: the model of the module docstring, on Python floats."""
        products = [x * y for x, y in zip(a, b, strict=True)]  # only for the NaN/inf rule
        special = _special_result([*products, c])
        if special is not None:
            return special
        fmt = self.format
        terms: list[tuple[bool, int, int, int]] = []  # (sign, significand, lsb exponent, align)
        for x, y in zip(a, b, strict=True):
            if x == 0 or y == 0:
                continue
            mx, ex = _decompose(x, fmt.precision, fmt.emin)
            my, ey = _decompose(y, fmt.precision, fmt.emin)
            sign = (x < 0) != (y < 0)
            terms.append((sign, mx * my, ex + ey - 2 * (fmt.precision - 1), ex + ey))
        if c != 0:
            mc, ec = _decompose(c, 24, _F32_EMIN)
            terms.append((c < 0, mc, ec - _F32_FRAC, ec))
        if not terms:
            return 0.0
        quantum = max(t[3] for t in terms) - _F32_FRAC - self.extra_bits
        total = 0
        for negative, m, lsb, _ in terms:
            shift = lsb - quantum
            aligned = m << shift if shift >= 0 else m >> -shift
            total += -aligned if negative else aligned
        return _round_scaled(total, quantum, self.output_precision, self.normalisation)


def _check_values(values: Any, fmt: str, name: str) -> list[float]:
    try:
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as err:
        msg = f"{name}: expected a sequence of real numbers, got {values!r}"
        raise InvalidArgument(msg) from err
    finite = np.isfinite(arr)
    bad = finite & ~representable(np.where(finite, arr, 0.0), fmt)
    if bad.any():
        msg = f"{name}: expected values of {fmt}, got {arr[bad][0]!r}"
        raise InvalidArgument(msg)
    return [float(v) for v in arr]


def _decompose(x: float, precision: int, emin: int) -> tuple[int, int]:
    """``(m, e)`` with ``|x| = m * 2**(e - precision + 1)``, ``e = max(floor(log2|x|), emin)``."""
    e = max(math.frexp(x)[1] - 1, emin)
    m = Fraction(abs(x)) * Fraction(2) ** (precision - 1 - e)
    if m.denominator != 1:
        msg = f"x: expected a value of precision {precision}, got {x!r}"
        raise InvalidArgument(msg)
    return int(m), e


def _special_result(values: Sequence[float]) -> float | None:
    if any(math.isnan(v) for v in values):
        return math.nan
    pos = any(v == math.inf for v in values)
    neg = any(v == -math.inf for v in values)
    if pos and neg:
        return math.nan
    if pos:
        return math.inf
    if neg:
        return -math.inf
    return None


def _round_scaled(total: int, quantum: int, precision: int, mode: str) -> float:
    """``total * 2**quantum`` rounded to ``precision`` bits with float32's exponent range."""
    if total == 0:
        return 0.0
    mag = abs(total)
    keep = max(quantum + mag.bit_length() - precision, _F32_EMIN - precision + 1)
    drop = keep - quantum
    if drop <= 0:
        kept = mag << -drop
    else:
        kept, rem = mag >> drop, mag & ((1 << drop) - 1)
        half = 1 << (drop - 1)
        if mode == "nearest" and (rem > half or (rem == half and kept & 1)):
            kept += 1
    if kept >= 1 << precision:
        kept, keep = kept >> 1, keep + 1
    if kept and keep + kept.bit_length() - 1 > _F32_EMAX:
        return math.copysign(math.inf, total)
    return math.copysign(math.ldexp(kept, keep), total)


def _model(
    name: str, fmt: str, group: int, extra_bits: int, source: str, **kw: Any
) -> TensorCoreModel:
    return TensorCoreModel(name, fmt, group, extra_bits, source=source, **kw)


_KM = "Khattak & Mikaitis (2025), MATLAB-tensor-core"
MODELS: Mapping[str, TensorCoreModel] = {
    m.name: m
    for m in (
        _model(
            "v100-fp16", "float16", 4, 0, carry_bits=3,
            source="Fasi et al. (2021) §4 (Volta: 4 products + c, no extra alignment bits, "
            "truncation, 3 carry bits); models/V100TC.m: fma=4, neab=0, frmode='rz'",
        ),
        _model(
            "a100-fp16", "float16", 8, 1, carry_bits=3,
            source=f"Fasi et al. (2021) §6 (Ampere); {_KM} models/A100TC.m: fma=8, neab=1, 'rz'",
        ),
        _model(
            "a100-bf16", "bfloat16", 8, 1, carry_bits=3,
            source=f"Fasi et al. (2021) §6; {_KM} models/A100TC.m: fma=8, neab=1, 'rz'",
        ),
        _model(
            "a100-tf32", "tf32", 4, 1, carry_bits=3,
            source=f"Fasi et al. (2021) §6; {_KM} models/A100TC.m: tf32 fma=4, neab=1, 'rz'",
        ),
        _model(
            "h100-fp16", "float16", 16, 2,
            source=f"{_KM} models/H100TC.m: fma=16, neab=2, frmode='rz'",
        ),
        _model(
            "h100-bf16", "bfloat16", 16, 2,
            source=f"{_KM} models/H100TC.m: fma=16, neab=2, frmode='rz'",
        ),
        _model(
            "h100-tf32", "tf32", 8, 2,
            source=f"{_KM} models/H100TC.m: tf32 fma=8, neab=2, frmode='rz'",
        ),
        _model(
            "h100-fp8-e4m3", "float8_e4m3fn", 32, -10, output_precision=14,
            source=f"{_KM} models/H100TC.m: fp8 fma=32, neab=-10 (tools/GEMM.m: output "
            "fraction bits 23 + neab = 13), 'rz'",
        ),
        _model(
            "h100-fp8-e5m2", "float8_e5m2", 32, -10, output_precision=14,
            source=f"{_KM} models/H100TC.m: fp8 fma=32, neab=-10 (tools/GEMM.m: output "
            "fraction bits 23 + neab = 13), 'rz'",
        ),
    )
}  # fmt: skip
"""The models, by name. Per-GPU sources: papers/tensorcore.md, Table 1."""


def get_model(model: TensorCoreModel | str, *, argname: str = "model") -> TensorCoreModel:
    """Look a tensor-core model up by name.

    Raises:
        InvalidArgument: for an unknown name, naming ``argname``.

    Examples:
        >>> get_model("h100-bf16").group
        16
    """
    if isinstance(model, TensorCoreModel):
        return model
    if isinstance(model, str) and model.lower() in MODELS:
        return MODELS[model.lower()]
    msg = f"{argname}: expected one of {', '.join(MODELS)}, got {model!r}"
    raise InvalidArgument(msg)


def _height(model: TensorCoreModel, n: int, order: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        msg = f"n: expected a non-negative integer, got {n!r}"
        raise InvalidArgument(msg)
    if order not in _ORDERS:
        msg = f"order: expected one of {_ORDERS}, got {order!r}"
        raise InvalidArgument(msg)
    if order == "sequential":
        return -(-n // model.group)
    return n


def _round_up(x: float) -> float:
    return math.nextafter(math.nextafter(x, math.inf), math.inf)


def dot_error_factor(model: TensorCoreModel | str, n: int, *, order: str = "sequential") -> float:
    r"""The factor :math:`(1+\delta)^h - 1` of the dot-product bound (Theorem T.2).

    For ``n`` products with no nonzero input subnormal in the input format and no overflow,

    .. math::
        |\hat d - (c + \textstyle\sum_i a_i b_i)| \le ((1+\delta)^h - 1)
        (|c| + \textstyle\sum_i |a_i b_i|) + \eta_h,

    with :math:`\delta` = ``model.node_delta``, :math:`\eta_h` = :func:`dot_error_eta`, and ``h``
    the height: ``ceil(n / group)`` for ``"sequential"`` (``model.dot`` and :func:`matmul`), and
    ``n`` for ``"native"``: any tree whose nodes are fused steps of this model or float32
    additions, grouped as a library chooses (split-K included), in which a node that rounds has
    at least two nonzero operands.

    Returns:
        The factor, rounded upward.

    Raises:
        InvalidArgument: for an unknown model or order, or a negative ``n``.

    Examples:
        >>> dot_error_factor("v100-fp16", 4) >= MODELS["v100-fp16"].node_delta  # one step
        True
    """
    m = get_model(model)
    h = _height(m, n, order)
    return _round_up(math.expm1(h * math.log1p(m.node_delta))) if h else 0.0


def dot_error_eta(model: TensorCoreModel | str, n: int, *, order: str = "sequential") -> float:
    r"""The underflow term :math:`\eta_h` of Theorem T.2: :math:`\eta \cdot N (1+\delta)^{h-1}`.

    ``N`` is the number of steps: ``h`` (sequential) or at most ``n`` (native).
    """
    m = get_model(model)
    h = _height(m, n, order)
    if h == 0:
        return 0.0
    return _round_up(m.node_eta * h * math.exp((h - 1) * math.log1p(m.node_delta)))


# --------------------------------------------------------------------------------------------
# JAX emulation: integer arithmetic on the bits of float32 carriers.


def _u32(x: Any) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.uint32)


def _decode_f32(bits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sign, exponent ``e`` (subnormals at -126) and 24-bit significand of float32 bits."""
    field = ((bits >> 23) & 0xFF).astype(jnp.int32)
    frac = bits & 0x7FFFFF
    sig = frac | jnp.where(field != 0, _u32(1 << 23), _u32(0))
    exp = jnp.where(field == 0, _F32_EMIN, field - 127)
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
    quantum = big - _F32_FRAC - model.extra_bits

    p_aligned = jnp.where(p_nz, _shift(p_sig, p_lsb - quantum[..., None]), _u32(0))
    c_aligned = jnp.where(c_nz, _shift(mc, ec - _F32_FRAC - quantum), _u32(0))
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
    keep = jnp.maximum(quantum + nbits - prec, _F32_EMIN - prec + 1)
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
    bits = jnp.where(normal & (keep + prec - 1 > _F32_EMAX), _u32(0x7F800000), bits)
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
def _matmul(a: jax.Array, b: jax.Array, model: TensorCoreModel) -> jax.Array:
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

    c0 = jnp.zeros((*batch, m, n), dtype=jnp.uint32)
    out, _ = lax.scan(body, c0, (a_g, b_g))
    return lax.bitcast_convert_type(out, jnp.float32)


def matmul(a: Any, b: Any, model: TensorCoreModel | str) -> jax.Array:
    """``a @ b`` as the modelled tensor core computes it, bit for bit equal to ``model.dot``.

    Args:
        a: ``(..., M, K)`` float32 array whose values are values of ``model.input_format``.
        b: ``(..., K, N)`` float32 array, likewise; batch dimensions broadcast.
        model: a :class:`TensorCoreModel` or its name.

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
    return _matmul(arrs[0], arrs[1], mdl)


# --------------------------------------------------------------------------------------------
# Probes (papers/tensorcore.md, §4).


@dataclasses.dataclass(frozen=True)
class Probe:
    """A probe of Fasi et al. (2021): ``c + sum(a_i b_i)`` with inputs in ``input_format``.

    Attributes:
        name: short name; the test-suite item it comes from is in ``source``.
        input_format: mhanum format name of ``a`` and ``b``.
        a, b: the inputs (the suite's first entries of row 0 of A and column 0 of B).
        c: the accumulator ``C[0, 0]``.
        reported: expected output per model name, where the suite's PASS condition is an
            equality on that GPU (the paper reports PASS for it).
        source: file and test item of the suite.
    """

    name: str
    input_format: str
    a: tuple[float, ...]
    b: tuple[float, ...]
    c: float
    reported: Mapping[str, float]
    source: str

    def rn_float32(self) -> float:
        """IEEE float32 round-to-nearest sequential ``((c + a_0 b_0) + a_1 b_1) + ...``."""
        acc = np.float32(self.c)
        for x, y in zip(self.a, self.b, strict=True):
            acc = np.float32(acc + np.float32(np.float64(x) * np.float64(y)))
        return float(acc)


_SUITE = "north-numerical-computing/tensor-cores-numerical-behavior"
_V100 = f"{_SUITE}/tc_test_numerics-V100.cu"
_A100H = f"{_SUITE}/tc_test_numerics-T4-A100-binary16.cu"
_A100B = f"{_SUITE}/tc_test_numerics-A100-bf16.cu"
_A100T = f"{_SUITE}/tc_test_numerics-A100-tf32.cu"
_ALL_A100 = ("a100-fp16", "a100-bf16", "a100-tf32")
_X = math.ldexp


def _probes() -> list[Probe]:
    probes: list[Probe] = []

    def add(name: str, fmt: str, a: Sequence[float], b: Sequence[float], c: float,
            reported: Mapping[str, float], source: str) -> None:  # fmt: skip
        probes.append(Probe(name, fmt, tuple(map(float, a)), tuple(map(float, b)), float(c),
                            dict(reported), source))  # fmt: skip

    fmts = {"a100-fp16": "float16", "a100-bf16": "bfloat16", "a100-tf32": "tf32"}
    srcs = {"a100-fp16": _A100H, "a100-bf16": _A100B, "a100-tf32": _A100T}
    below_one = {"float16": 1 - _X(1, -11), "bfloat16": 1 - _X(1, -8), "tf32": 1 - _X(1, -11)}
    for model, fmt in [("v100-fp16", "float16"), *fmts.items()]:
        src = _V100 if model == "v100-fp16" else srcs[model]
        tag = fmt if model != "v100-fp16" else "float16-v100"
        v100 = model == "v100-fp16"
        w = below_one[fmt]
        exact = 1 - 2 * (1 - w) + (1 - w) ** 2
        add(
            f"products_exact/{tag}",
            fmt,
            [w],
            [w],
            0,
            {model: exact},
            f"{src}: B 'Products are computed exactly' (tf32: the suite's 1 - 2**-24, which the "
            "hardware truncates to tf32, given here as its tf32 value)",
        )
        add(
            f"products_exact_4/{tag}",
            fmt,
            [w] * 4,
            [w] * 4,
            0,
            {model: 4 * exact},
            f"{src}: B 'Products are computed exactly', second part",
        )
        half = 1.0 if v100 else 0.5
        add(
            f"accumulated_in_binary32/{tag}",
            fmt,
            [half] * 4,
            [_X(1, -24)] * 4,
            1.0,
            {model: 1.0},
            f"{src}: B 'Products are accumulated in binary32'",
        )
        for j in range(4):
            a = [1.0] * 4 if v100 else [0.5] * 4
            bb = [_X(1, -24)] * 4
            a[j], bb[j] = 1.0, 1.0
            add(
                f"largest_first_{j}/{tag}",
                fmt,
                a,
                bb,
                _X(1, -24),
                {model: 1.0},
                f"{src}: B 'Sum starts from largest element', j={j}",
            )
        small = _X(1, -23) + _X(1, -24)
        add(
            f"round_down_positive/{tag}",
            fmt,
            [1] * 4,
            [2, small, 0, 0],
            0,
            {model: 2.0},
            f"{src}: C 'Round-down for positive values'",
        )
        add(
            f"round_up_negative/{tag}",
            fmt,
            [1] * 4,
            [-2, -small, 0, 0],
            0,
            {model: -2.0},
            f"{src}: C 'Round-up for negative values'",
        )
        add(
            f"extra_alignment_bits/{tag}",
            fmt,
            [1],
            [1],
            -(1 - _X(1, -24)),
            {model: _X(1, -23) if v100 else _X(1, -24)},
            f"{src}: D1 'Extra bits in the significand alignment'",
        )
        add(
            f"normalisation_in_addition/{tag}",
            fmt,
            [1] * 4,
            [_X(1, -24)] * 4,
            1 - _X(1, -24),
            {model: 1 + _X(1, -23)},
            f"{src}: D2 'Normalization in addition'",
        )
        add(
            f"normalisation_in_subtraction/{tag}",
            fmt,
            [1, 1],
            [1, -_X(1, -24)],
            -1 + _X(1, -24),
            {model: _X(1, -23) if v100 else 0.0},
            f"{src}: D3 'Normalization in subtraction'",
        )
        carry_c = 1 + _X(1, -22) + _X(1, -23)
        for i in range(4):
            bb = [1.0] * 4
            bb[i] = _X(1, -23)
            add(
                f"carry_out_{i}/{tag}",
                fmt,
                [1] * 4,
                bb,
                carry_c,
                {model: 4 + _X(1, -21)},
                f"{src}: D4 'Extra bits for carry out', i={i}",
            )
        add(
            f"carry_out_third_bit/{tag}",
            fmt,
            [1] * 4,
            [1, 1.5, 1.75, 1.875],
            1.875,
            {model: 8.0},
            f"{src}: D4, test for the third bit",
        )
        add(
            f"carry_round_down/{tag}",
            fmt,
            [1] * 4,
            [1] * 4,
            carry_c,
            {model: 5.0},
            f"{src}: D4, round-down in normalisation of positive values",
        )
        add(
            f"carry_round_up_negative/{tag}",
            fmt,
            [1] * 4,
            [-1] * 4,
            -carry_c,
            {model: -5.0},
            f"{src}: D4, round-up in normalisation of negative values",
        )
        if not v100:
            mono_b = [_X(1, -24)] * 3 + [_X(1, -23) + _X(1, -24)]
            for c in (1 - _X(1, -24), 1.0):
                add(
                    f"monotonicity_c={c!r}/{tag}",
                    fmt,
                    [0.5] * 4,
                    mono_b,
                    c,
                    {},
                    f"{src}: D5 'Monotonicity of dot product' (the suite asserts only an order "
                    "between the two outputs; no output is reported)",
                )
    add(
        "subnormal_input/float16",
        "float16",
        [_X(1, -24)],
        [4],
        0,
        {"v100-fp16": _X(1, -22), "a100-fp16": _X(1, -22)},
        f"{_V100} and {_A100H}: A 'Binary16 subnormals in input (binary32 mode)'",
    )
    add(
        "subnormal_input/bfloat16",
        "bfloat16",
        [_X(1, -133)],
        [_X(1, 7)],
        0,
        {"a100-bf16": _X(1, -126)},
        f"{_A100B}: A 'Bfloat16 subnormals in input'",
    )
    add(
        "subnormal_input/tf32",
        "tf32",
        [_X(1, -136)],
        [_X(1, 10)],
        0,
        {"a100-tf32": _X(1, -126)},
        f"{_A100T}: A 'TF32 subnormals in input'",
    )
    for fmt, model, src in (("bfloat16", "a100-bf16", _A100B), ("tf32", "a100-tf32", _A100T)):
        add(
            f"subnormal_output/{fmt}",
            fmt,
            [_X(1, -126)],
            [0.5],
            0,
            {model: _X(1, -127)},
            f"{src}: A 'subnormals in output (binary32 mode)', first part",
        )
        add(
            f"subnormal_output_c/{fmt}",
            fmt,
            [_X(1, -126)],
            [1],
            -_X(1, -127),
            {model: _X(1, -127)},
            f"{src}: A 'subnormals in output (binary32 mode)', second",
        )
    for fmt in ("float16", "bfloat16", "tf32"):
        rep = {m: _X(1, -149) for m in ("v100-fp16", *_ALL_A100) if MODELS[m].input_format == fmt}
        add(
            f"binary32_subnormal_c/{fmt}",
            fmt,
            [0],
            [0],
            _X(1, -149),
            rep,
            f"{_V100}, {_A100H}, {_A100B}, {_A100T}: A 'Binary32 subnormals in input'",
        )
    return probes


PROBES: tuple[Probe, ...] = tuple(_probes())
"""The probes of Fasi et al. (2021) whose output is a float32 number (binary16-output items are
left out: mhanum models float32 accumulation only)."""

_OFFSET = 32  # probe products start here: a multiple of every model's group


def _split_c(c: float, fmt: str) -> list[float] | None:
    """``c`` as a sum of at most 3 values of ``fmt`` (each ``x * 1``), or None if impossible."""
    parts: list[float] = []
    rest = c
    while rest != 0 and len(parts) < 3:
        part = float(round_to(rest, fmt, mode="toward_zero"))
        if part == 0:
            return None
        parts.append(part)
        rest -= part  # exact: part is rest's leading bits
    return parts if rest == 0 else None


def probe_vectors(probe: Probe) -> tuple[list[float], list[float]] | None:
    """The length-64 row and column that run ``probe`` as a matmul with ``C = 0``.

    ``c`` enters the accumulator as the exact output of an earlier step: its leading bits, split
    into at most 3 values of the input format, are products ``x * 1`` at positions 0-2, and the
    probe's products start at position 32, a multiple of every model's group. Under every model
    here, the first step adds the parts exactly (they lie in one binade and the window keeps 23
    fraction bits below it), steps of zero products pass the accumulator on unchanged, and the
    probe's step then sees ``c`` as its accumulator (``tests/test_tensorcore.py`` checks this
    with ``model.dot``). Returns None when ``c`` is not such a sum (a float32 subnormal ``c``
    below the input format's range).
    """
    parts = _split_c(probe.c, probe.input_format) if probe.c != 0 else []
    if parts is None:
        return None
    a = [0.0] * 64
    b = [0.0] * 64
    for i, part in enumerate(parts):
        a[i], b[i] = part, 1.0
    for i, (x, y) in enumerate(zip(probe.a, probe.b, strict=True)):
        a[_OFFSET + i], b[_OFFSET + i] = x, y
    return a, b


def _float_hex(x: float) -> str:
    return f"{np.float32(x).view(np.uint32):08x}"


def run_probes(backend: str | None = None) -> list[dict[str, Any]]:
    """Run every probe as a real 64x64x64 matmul on a JAX backend and compare with the models.

    fp16 and bf16 probes multiply arrays of that dtype with ``preferred_element_type=float32``;
    tf32 probes multiply float32 arrays with ``precision=lax.Precision.DEFAULT`` (tensor cores
    use tf32 for it on Ampere and later). The probe sits in row 0 of ``A`` and column 0 of ``B``
    as :func:`probe_vectors` places it, with ``c`` as an earlier step's output.

    Args:
        backend: a JAX backend name (``"cpu"``, ``"gpu"``), or None for the default.

    Returns:
        One dict per probe: ``name``, ``input_format``, ``a``, ``b``, ``c`` (floats),
        ``c_hex``, ``observed`` (float, or None when the probe cannot run as a matmul),
        ``observed_hex``, ``reported`` (the suite's expected outputs per model), ``predicted``
        (each model's ``dot`` on the probe), ``rn_float32``, ``matches`` (models whose
        prediction equals the observed bits), ``device``.
    """
    device = jax.devices(backend)[0]
    results = []
    for probe in PROBES:
        models = [m for m in MODELS.values() if m.input_format == probe.input_format]
        predicted = {m.name: m.dot(probe.a, probe.b, probe.c) for m in models}
        vectors = probe_vectors(probe)
        observed = None if vectors is None else _run_on(vectors, probe.input_format, device)
        matches = [
            name
            for name, value in predicted.items()
            if observed is not None and _float_hex(value) == _float_hex(observed)
        ]
        results.append(
            {
                "name": probe.name,
                "input_format": probe.input_format,
                "a": list(probe.a),
                "b": list(probe.b),
                "c": probe.c,
                "c_hex": _float_hex(probe.c),
                "observed": observed,
                "observed_hex": None if observed is None else _float_hex(observed),
                "reported": dict(probe.reported),
                "predicted": predicted,
                "rn_float32": probe.rn_float32(),
                "matches": matches,
                "device": str(device),
            }
        )
    return results


def _run_on(vectors: tuple[list[float], list[float]], fmt: str, device: Any) -> float:
    a = np.zeros((64, 64), np.float32)
    b = np.zeros((64, 64), np.float32)
    a[0, :] = vectors[0]
    b[:, 0] = vectors[1]
    if fmt == "tf32":
        dtype, precision = jnp.float32, lax.Precision.DEFAULT
    else:
        dtype, precision = FORMATS[fmt].jax_dtype, None
    a_dev = jax.device_put(jnp.asarray(a, dtype=dtype), device)
    b_dev = jax.device_put(jnp.asarray(b, dtype=dtype), device)
    out = jnp.matmul(a_dev, b_dev, precision=precision, preferred_element_type=jnp.float32)
    return float(np.asarray(out)[0, 0])


def matching_models(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Models whose prediction matches the observed output of every probe of their format that
    ran (and that had at least one such probe).

    Examples:
        >>> matching_models([{"input_format": "float16", "observed": 2.0,
        ...                   "matches": ["v100-fp16", "h100-fp16"]}])
        ['v100-fp16', 'h100-fp16']
    """
    out = []
    for model in MODELS.values():
        ran = [
            r
            for r in results
            if r["input_format"] == model.input_format and r["observed"] is not None
        ]
        if ran and all(model.name in r["matches"] for r in ran):
            out.append(model.name)
    return out
