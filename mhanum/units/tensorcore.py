"""Bit-exact models of NVIDIA tensor-core inner products (pure Python: the model, not its emulation).

The JAX emulation is :func:`mhanum.emulate.tensorcore.matmul`, the error factor of Theorem T.2
:func:`mhanum.bounds.factors.tensor_core_factor`, and the probes that chose the models
:mod:`mhanum.devices.probes`.

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
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from mhanum._errors import InvalidArgument
from mhanum.formats import Format, get_format, representable

if TYPE_CHECKING:
    from mhanum._types import ArrayLike

__all__ = ["F32_EMAX", "F32_EMIN", "F32_FRAC", "MODELS", "TensorCoreModel", "get_model"]

F32_EMIN = -126
F32_EMAX = 127
F32_FRAC = 23  # stored fraction bits of float32
_NORMALISATIONS = ("toward_zero", "nearest")


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
    def format(self) -> Format:
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
        return float(window + Fraction(2) ** (F32_EMIN - self.output_precision + 1))

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
            mc, ec = _decompose(c, 24, F32_EMIN)
            terms.append((c < 0, mc, ec - F32_FRAC, ec))
        if not terms:
            return 0.0
        quantum = max(t[3] for t in terms) - F32_FRAC - self.extra_bits
        total = 0
        for negative, m, lsb, _ in terms:
            shift = lsb - quantum
            aligned = m << shift if shift >= 0 else m >> -shift
            total += -aligned if negative else aligned
        return _round_scaled(total, quantum, self.output_precision, self.normalisation)


def _check_values(values: ArrayLike, fmt: str, name: str) -> list[float]:
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
    keep = max(quantum + mag.bit_length() - precision, F32_EMIN - precision + 1)
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
    if kept and keep + kept.bit_length() - 1 > F32_EMAX:
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
