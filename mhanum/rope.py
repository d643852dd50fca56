"""Rotary position embeddings (RoPE) as a numerical stage: the value, its emulation, its exact
reference and the bound on the rotated entries (papers/rope.md, Theorem P.1).

A :class:`Rope` states what a kernel computes and where it rounds: the inverse frequencies
``ω_i`` (``base^(-2i/d)``, scaled as ``linear``, ``dynamic`` NTK, ``yarn`` or ``llama3`` scale
them, in the format ``inv_freq_format``), the positions (``position_format``), the angles
``θ = p·ω`` (``product_format``), the tables ``cos θ`` and ``sin θ`` (computed in
``trig_format``, stored in ``table_format``) and the rotation ``x_a·cos θ ∓ x_b·sin θ``
(``rotation_format``), in the half-split layout (GPT-NeoX, Llama in ``transformers``: ``x_j`` with
``x_{j + d/2}``) or the interleaved one (GPT-J, Meta's reference Llama: ``x_{2i}`` with
``x_{2i+1}``). The formulas are those of ``transformers``' ``modeling_rope_utils``.

* :func:`apply_rope` rotates as the kernel does (every rounding exact, ``pow``, ``cos`` and
  ``sin`` correctly rounded in their formats).
* :func:`reference_rope` is the exact rotation (exact ``ω``, ``θ``, ``cos`` and ``sin``) in
  float64, with a certified bound on its own distance to the exact values.
* :func:`rope_error` bounds ``|rotated - exact|`` entry by entry for every kernel that computes
  as the :class:`Rope` states (``pow``, ``cos`` and ``sin`` within their ulps): Theorem P.1.

Examples:
    >>> import numpy as np
    >>> rope = Rope(dim=32, inv_freq_format="float16", position_format="float16",
    ...             product_format="float16")
    >>> float(angles(rope, np.array([1857]))[0, 1])  # gpt-neox#1003: 1044.27 exactly
    1045.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Literal

import mpmath
import numpy as np

from mhanum import _validate as V
from mhanum._errors import InvalidArgument
from mhanum.formats import Format, get_format, round_to

if TYPE_CHECKING:
    from collections.abc import Callable

    from mhanum._types import ArrayLike

__all__ = [
    "SCALINGS",
    "Rope",
    "angles",
    "apply_rope",
    "check_holds",
    "check_positions",
    "exact_inv_freq",
    "inv_freq_enclosure",
    "pair_sum",
    "reference_rope",
    "rope_error",
    "rope_error_linear",
    "rotation_spread",
]

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")
Layout = Literal["half", "interleaved"]
_U64 = 2.0**-53
_FORMAT_FIELDS = (
    "inv_freq_format",
    "position_format",
    "product_format",
    "trig_format",
    "table_format",
    "rotation_format",
)


@dataclasses.dataclass(frozen=True)
class Rope:
    """What a RoPE kernel computes, and in which formats it rounds (papers/rope.md, P.0).

    Attributes:
        dim: the rotary dimension ``d`` (even; the leading ``d`` entries of each head rotate,
            the rest pass unchanged, as ``partial_rotary_factor`` does).
        base: ``rope_theta``, the base of the frequencies ``ω_i = base^(-2i/d)``.
        layout: ``"half"`` (``x_j`` pairs with ``x_{j+d/2}``, ``rotate_half``) or
            ``"interleaved"`` (``x_{2i}`` with ``x_{2i+1}``).
        scaling: one of :data:`SCALINGS`, as ``transformers`` computes it: ``linear`` divides
            ``ω`` by ``factor``; ``dynamic`` (NTK) raises the base to
            ``base·(factor·S/M - factor + 1)^(d/(d-2))`` for ``S = max(positions) + 1`` beyond
            ``M = original_max_position``; ``yarn`` blends ``ω`` and ``ω/factor`` over the
            correction range of ``beta_fast``, ``beta_slow`` and scales the tables by
            ``attention_factor`` (default ``0.1 ln(factor) + 1``); ``llama3`` divides the low
            frequencies by ``factor`` and smooths between ``low_freq_factor`` and
            ``high_freq_factor``.
        factor: the scaling factor ``f``.
        original_max_position: the pretraining context ``M`` (``dynamic``, ``yarn``, ``llama3``).
        low_freq_factor: ``llama3``'s low-frequency factor.
        high_freq_factor: ``llama3``'s high-frequency factor.
        beta_fast: ``yarn``'s fast correction (rotations).
        beta_slow: ``yarn``'s slow correction (rotations).
        attention_factor: ``yarn``'s table factor (default ``0.1 ln(factor) + 1``).
        truncate: ``yarn``'s truncation of its correction range to integers.
        inv_freq_format: the format ``ω`` is computed and stored in (``transformers``: float32;
            a kernel that casts it to bfloat16, NVIDIA/Megatron-LM#744: bfloat16).
        position_format: the format of the positions (they must be exact in it).
        product_format: the format of ``θ = p·ω`` (gpt-neox#1003: float16).
        trig_format: the format ``cos`` and ``sin`` are computed in.
        table_format: the format of the stored tables (``transformers``: the model's dtype).
        rotation_format: the format of the rotation's products and sums, and of its result
            (the dtype of q and k).
        pow_ulps: the accuracy of ``pow`` in ``inv_freq_format``, in ulps.
        trig_ulps: the accuracy of ``cos`` and ``sin`` in ``trig_format``, in ulps.
    """

    dim: int
    base: float = 10000.0
    layout: Layout = "half"
    scaling: str = "none"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True
    inv_freq_format: Format | str = "float32"
    position_format: Format | str = "float32"
    product_format: Format | str = "float32"
    trig_format: Format | str = "float32"
    table_format: Format | str = "float32"
    rotation_format: Format | str = "float32"
    pow_ulps: float = 1.0
    trig_ulps: float = 2.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        dim = V.positive_int(self.dim, "rope.dim")
        if dim % 2:
            msg = f"rope.dim: expected an even rotary dimension, got {dim}"
            raise InvalidArgument(msg)
        set_(self, "dim", dim)
        for name in ("base", "factor", "low_freq_factor", "high_freq_factor", "beta_fast"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                msg = f"rope.{name}: expected a finite positive number, got {value!r}"
                raise InvalidArgument(msg)
            set_(self, name, float(value))
        if self.base <= 1:
            msg = f"rope.base: expected a base above 1, got {self.base!r}"
            raise InvalidArgument(msg)
        if self.scaling not in SCALINGS:
            msg = f"rope.scaling: expected one of {', '.join(SCALINGS)}, got {self.scaling!r}"
            raise InvalidArgument(msg)
        if self.layout not in ("half", "interleaved"):
            msg = f"rope.layout: expected 'half' or 'interleaved', got {self.layout!r}"
            raise InvalidArgument(msg)
        if self.scaling == "dynamic" and dim < 4:
            msg = (
                f"rope.dim: expected at least 4 with scaling 'dynamic' (its base's exponent "
                f"d/(d-2)), got {dim}"
            )
            raise InvalidArgument(msg)
        if self.scaling in ("dynamic", "yarn", "llama3") and self.original_max_position is None:
            msg = f"rope.original_max_position: expected an int for scaling {self.scaling!r}"
            raise InvalidArgument(msg)
        if self.original_max_position is not None:
            set_(
                self,
                "original_max_position",
                V.positive_int(self.original_max_position, "rope.original_max_position"),
            )
        if self.scaling == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            msg = (
                "rope.high_freq_factor: expected more than low_freq_factor "
                f"({self.low_freq_factor}), got {self.high_freq_factor}"
            )
            raise InvalidArgument(msg)
        for name in _FORMAT_FIELDS:
            set_(self, name, get_format(getattr(self, name), argname=f"rope.{name}"))
        for name in ("pow_ulps", "trig_ulps"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 <= value < 2**20:
                msg = f"rope.{name}: expected a number of ulps in [0, 2^20), got {value!r}"
                raise InvalidArgument(msg)

    def format(self, name: str) -> Format:
        """The :class:`~mhanum.formats.Format` of a stage (``"product"``, ``"table"``, ...)."""
        fmt = getattr(self, f"{name}_format")
        assert isinstance(fmt, Format)
        return fmt

    def positions_for(
        self,
        positions: ArrayLike | tuple[ArrayLike, ArrayLike] | None,
        *,
        d_k: int,
        q_len: int,
        k_len: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The queries' and the keys' positions for an attention problem: given as a pair, as
        one array for both (``Lq = Lk``), or by default the keys ``0..Lk-1`` and the queries the
        last ``Lq`` of them (a decoding step); each exact in ``position_format``.

        Raises:
            InvalidArgument: for a rotary dimension wider than ``d_k``, or positions that do
                not fit (naming ``rope`` or ``positions``).
        """
        if self.dim > d_k:
            msg = f"rope: expected a rotary dimension of at most d_k = {d_k}, got {self.dim}"
            raise InvalidArgument(msg)
        if positions is None:
            if q_len > k_len:
                msg = (
                    f"positions: expected them given when there are more queries ({q_len}) "
                    f"than keys ({k_len})"
                )
                raise InvalidArgument(msg)
            keys = np.arange(k_len)
            pair: tuple[ArrayLike, ArrayLike] = (keys[k_len - q_len :], keys)
        elif isinstance(positions, tuple) and len(positions) == 2:
            pair = positions
        elif q_len == k_len:
            pair = (positions, positions)
        else:
            msg = f"positions: expected a pair (queries', keys') for Lq = {q_len} != Lk = {k_len}"
            raise InvalidArgument(msg)
        q_pos, k_pos = (check_positions(x, self) for x in pair)
        for got, want, name in ((q_pos, q_len, "queries"), (k_pos, k_len, "keys")):
            if got.shape != (want,):
                msg = f"positions: expected {want} positions of the {name}, got {got.shape[0]}"
                raise InvalidArgument(msg)
        return q_pos, k_pos

    @property
    def table_scale(self) -> float:
        """The factor of the tables: YaRN's ``attention_factor`` (``0.1 ln(factor) + 1``), else 1."""
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def to_dict(self) -> dict[str, object]:
        """Every field by name, JSON-ready (formats by name); :meth:`from_dict` reads it back.

        Examples:
            >>> rope = Rope(dim=8, base=500000.0, table_format="bfloat16")
            >>> rope.to_dict()["table_format"]
            'bfloat16'
            >>> Rope.from_dict(rope.to_dict()) == rope
            True
        """
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.name if isinstance(value, Format) else value
        return out

    @classmethod
    def from_dict(cls, mapping: object) -> Rope:
        """The :class:`Rope` whose fields ``mapping`` (a mapping of field names) holds, as
        :meth:`to_dict` writes them; a field left out takes its default.

        Raises:
            InvalidArgument: for a value that is not a mapping, an unknown key, or a field the
                :class:`Rope` refuses (naming it).
        """
        from collections.abc import Mapping

        if not isinstance(mapping, Mapping):
            msg = f"rope: expected a mapping of Rope fields, got {type(mapping).__name__}"
            raise InvalidArgument(msg)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(key) for key in mapping if key not in names)
        if unknown:
            msg = f"rope: expected keys from {names}, got {unknown}"
            raise InvalidArgument(msg)
        return cls(**mapping)


def check_positions(positions: ArrayLike, rope: Rope) -> np.ndarray:
    """``positions`` as a 1-D int64 array, each exact in ``rope.position_format``."""
    p = np.asarray(positions)
    if p.ndim != 1 or p.size == 0:
        msg = f"positions: expected a non-empty 1-D array, got shape {p.shape}"
        raise InvalidArgument(msg)
    if not (np.issubdtype(p.dtype, np.integer) or np.issubdtype(p.dtype, np.floating)):
        msg = f"positions: expected integers, got dtype {p.dtype}"
        raise InvalidArgument(msg)
    if np.issubdtype(p.dtype, np.floating) and not np.all(np.isfinite(p) & (p == np.round(p))):
        msg = "positions: expected integers, got a non-integer or non-finite value"
        raise InvalidArgument(msg)
    # the range is checked in the given dtype: int64 would wrap a uint64 past 2^63, or a float
    # past int64's range, into a value the caller never gave
    if np.any(p < 0):
        msg = f"positions: expected non-negative positions, got {int(p.min())}"
        raise InvalidArgument(msg)
    fmt = rope.format("position")
    exact = min(2.0**fmt.precision, fmt.max_finite)
    if p.max() > exact:
        msg = (
            f"positions: expected positions up to {exact:g}, which {fmt.name} represents "
            f"exactly (rope.position_format), got {int(p.max())}"
        )
        raise InvalidArgument(msg)
    return p.astype(np.int64)


def _dynamic_base(rope: Rope, seq_len: int) -> float:
    """``transformers``' dynamic NTK base (float64, as Python computes it)."""
    m = rope.original_max_position
    assert m is not None
    s = max(seq_len, m)
    d = rope.dim
    return rope.base * ((rope.factor * s / m) - (rope.factor - 1)) ** (d / (d - 2))


def _yarn_range(rope: Rope) -> tuple[float, float]:
    """The correction range ``[low, high]`` of YaRN, in float64 as ``transformers`` computes it."""
    d, m = rope.dim, rope.original_max_position
    assert m is not None

    def dim_of(rotations: float) -> float:
        return (d * math.log(m / (rotations * 2 * math.pi))) / (2 * math.log(rope.base))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    return float(low), float(high)


def exact_inv_freq(rope: Rope, seq_len: int = 1, prec: int = 160) -> list[Any]:
    """The exact ``ω_i`` (mpmath numbers of ``prec`` bits) of the scaling's formula."""
    ctx = mpmath.MPContext()
    ctx.prec = prec
    d = rope.dim
    base = ctx.mpf(_dynamic_base(rope, seq_len) if rope.scaling == "dynamic" else rope.base)
    # the formula's constants as the configuration holds them (float64 values)
    f = ctx.mpf(rope.factor)
    omega = [base ** (-ctx.mpf(2 * i) / d) for i in range(d // 2)]
    if rope.scaling == "linear":
        return [w / f for w in omega]
    if rope.scaling == "yarn":
        low, high = _yarn_range(rope)
        out = []
        for i, w in enumerate(omega):
            ramp = min(max((ctx.mpf(i) - low) / (ctx.mpf(high) - low), 0), 1)
            ef = 1 - ramp
            out.append(w / f * (1 - ef) + w * ef)
        return out
    if rope.scaling == "llama3":
        m = ctx.mpf(rope.original_max_position)
        lf, hf = ctx.mpf(rope.low_freq_factor), ctx.mpf(rope.high_freq_factor)
        out = []
        for w in omega:
            wavelen = 2 * ctx.pi / w
            if wavelen < m / hf:
                out.append(w)
            elif wavelen > m / lf:
                out.append(w / f)
            else:
                s = (m / wavelen - lf) / (hf - lf)
                out.append((1 - s) * w / f + s * w)
        return out
    return omega


# -- the kernel's inverse frequencies: nominal (correctly rounded pow) and enclosed ------------


class _Box:
    """Interval evaluation of a pipeline of roundings into one format (papers/rope.md, P.2).

    Each value is ``[lo, hi]`` (float64 arrays); an operation's exact range over the box is
    enclosed in float64 with one ulp outward, then rounded to nearest into the format: round
    to nearest is monotone, so every value the kernel computes lies in the result.
    """

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt

    def round(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lo = round_to(np.nextafter(lo, -np.inf), self.fmt)
        hi = round_to(np.nextafter(hi, np.inf), self.fmt)
        return lo, hi

    def op(
        self, f: np.ufunc, a: tuple[Any, Any], b: tuple[Any, Any]
    ) -> tuple[np.ndarray, np.ndarray]:
        with np.errstate(divide="ignore", invalid="ignore"):
            corners = [f(x, y) for x in a for y in b]
        lo = np.minimum.reduce([np.broadcast_to(c, np.shape(corners[0])) for c in corners])
        hi = np.maximum.reduce([np.broadcast_to(c, np.shape(corners[0])) for c in corners])
        return self.round(np.asarray(lo, np.float64), np.asarray(hi, np.float64))


def _pipeline(rope: Rope, seq_len: int, box: _Box | None) -> tuple[np.ndarray, np.ndarray]:
    """``transformers``' float32 computation of ``ω`` (in ``inv_freq_format``), nominal
    (``box=None``: every operation correctly rounded, ``pow`` included) or enclosed."""
    fmt = rope.format("inv_freq")
    b = box or _Box(fmt)
    exact = box is None

    def pt(x: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(x, np.float64)
        return x, x

    def rnd(x: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
        if exact:
            y = round_to(np.asarray(x[0], np.float64), fmt)
            return y, y
        return b.round(np.asarray(x[0], np.float64), np.asarray(x[1], np.float64))

    def op(f: np.ufunc, x: tuple[Any, Any], y: tuple[Any, Any]) -> tuple[np.ndarray, np.ndarray]:
        if exact:
            with np.errstate(divide="ignore", invalid="ignore"):
                return rnd((f(x[0], y[0]), None))
        return b.op(f, x, y)

    d = rope.dim
    base = _dynamic_base(rope, seq_len) if rope.scaling == "dynamic" else rope.base
    base_f = float(round_to(np.float64(base), fmt))
    exps = op(np.divide, pt(np.arange(0, d, 2, dtype=np.float64)), pt(float(d)))
    # pow(base, t), within pow_ulps ulps in the format (correctly rounded when nominal)
    p0, p1 = np.power(base_f, exps[0]), np.power(base_f, exps[1])
    if exact:
        pos = rnd((p0, p0))
    else:
        spread = 2 * rope.pow_ulps * fmt.u
        pos = (
            np.nextafter(np.minimum(p0, p1) * (1 - spread), -np.inf),
            np.nextafter(np.maximum(p0, p1) * (1 + spread), np.inf),
        )
    one = pt(1.0)
    inv = op(np.divide, one, pos)
    f = pt(float(round_to(np.float64(rope.factor), fmt)))
    if rope.scaling == "linear":
        inv = op(np.divide, inv, f)
    elif rope.scaling == "yarn":
        low, high = _yarn_range(rope)
        interp = op(np.divide, one, op(np.multiply, f, pos))
        ramp = op(np.divide, op(np.subtract, pt(np.arange(d // 2)), pt(low)), pt(high - low))
        ramp = (np.clip(ramp[0], 0, 1), np.clip(ramp[1], 0, 1))
        ef = op(np.subtract, one, ramp)
        inv = op(
            np.add,
            op(np.multiply, interp, op(np.subtract, one, ef)),
            op(np.multiply, inv, ef),
        )
    elif rope.scaling == "llama3":
        inv = _llama3(rope, inv, f, op, pt, one)
    return inv


def _llama3(
    rope: Rope,
    inv: tuple[np.ndarray, np.ndarray],
    f: tuple[np.ndarray, np.ndarray],
    op: Callable[..., tuple[np.ndarray, np.ndarray]],
    pt: Callable[[ArrayLike], tuple[np.ndarray, np.ndarray]],
    one: tuple[np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """``transformers``' ``_compute_llama3_parameters`` on ``inv`` (nominal or enclosed): a
    branch whose condition the enclosure cannot decide takes the union of both."""
    m = float(rope.original_max_position or 0)
    lf, hf = rope.low_freq_factor, rope.high_freq_factor
    wavelen = op(np.divide, pt(2 * math.pi), inv)
    low_wl, high_wl = m / lf, m / hf
    scaled = op(np.divide, inv, f)
    smooth = op(np.divide, op(np.subtract, op(np.divide, pt(m), wavelen), pt(lf)), pt(hf - lf))
    llama = (
        np.where(wavelen[0] > low_wl, scaled[0], inv[0]),
        np.where(wavelen[1] > low_wl, scaled[1], inv[1]),
    )
    # (the branch of wavelen > low_wl undecided: both candidates)
    unsure_low = (wavelen[0] <= low_wl) & (wavelen[1] > low_wl)
    llama = (
        np.where(unsure_low, np.minimum(scaled[0], inv[0]), llama[0]),
        np.where(unsure_low, np.maximum(scaled[1], inv[1]), llama[1]),
    )
    smoothed = op(
        np.add,
        op(np.divide, op(np.multiply, op(np.subtract, one, smooth), llama), f),
        op(np.multiply, smooth, llama),
    )
    medium_lo = ~(wavelen[0] < high_wl) & ~(wavelen[0] > low_wl)
    medium_hi = ~(wavelen[1] < high_wl) & ~(wavelen[1] > low_wl)
    lo = np.where(medium_lo & medium_hi, smoothed[0], llama[0])
    hi = np.where(medium_lo & medium_hi, smoothed[1], llama[1])
    unsure = medium_lo != medium_hi
    lo = np.where(unsure, np.minimum(smoothed[0], llama[0]), lo)
    hi = np.where(unsure, np.maximum(smoothed[1], llama[1]), hi)
    return lo, hi


def inv_freq_enclosure(rope: Rope, seq_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``[lo, hi]`` per frequency, containing every ``ω̂_i`` a kernel computing as ``rope``
    states can produce (``pow`` within ``pow_ulps``; Lemma P.2)."""
    return _pipeline(rope, seq_len, _Box(rope.format("inv_freq")))


def angles(rope: Rope, positions: ArrayLike) -> np.ndarray:
    """The kernel's angles ``θ̂ = fl(p·ω̂)`` (``len(positions) × dim/2``, float64 carrier),
    with ``ω̂`` the nominal inverse frequencies (``pow`` correctly rounded)."""
    p = check_positions(positions, rope)
    omega = _pipeline(rope, int(p.max()) + 1, None)[0]
    return round_to(p[:, None].astype(np.float64) * omega[None, :], rope.format("product"))


def _tables(rope: Rope, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cos θ̂`` and ``sin θ̂`` correctly rounded into ``trig_format``, scaled, then stored."""
    trig, table = rope.format("trig"), rope.format("table")
    c, s = round_to(np.cos(theta), trig), round_to(np.sin(theta), trig)
    if rope.table_scale != 1.0:
        k = float(round_to(np.float64(rope.table_scale), trig))
        c, s = round_to(c * k, trig), round_to(s * k, trig)
    return round_to(c, table), round_to(s, table)


def _pairs(rope: Rope) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each rotated entry ``j``: its partner, the sign of the sine term and its frequency."""
    d = rope.dim
    j = np.arange(d)
    if rope.layout == "half":
        half = d // 2
        partner = np.where(j < half, j + half, j - half)
        sign = np.where(j < half, -1.0, 1.0)
        freq = j % half
    else:
        partner = j ^ 1
        sign = np.where(j % 2 == 0, -1.0, 1.0)
        freq = j // 2
    return partner, sign, freq


def _check_x(x: ArrayLike, rope: Rope, positions: np.ndarray, *, held: bool = True) -> np.ndarray:
    """``x`` as float64 values, shaped ``(..., L, d_head)``; ``held``: exact in
    ``rotation_format`` (the kernel's inputs as it holds them)."""
    arr = V.float_array(x, "x", min_ndim=2)
    V.check_finite(arr, "x")
    values = np.asarray(arr, np.float64)
    if values.shape[-2] != positions.shape[0] or values.shape[-1] < rope.dim:
        msg = (
            f"x: expected shape (..., {positions.shape[0]}, d) with d >= rope.dim = "
            f"{rope.dim}, got {values.shape}"
        )
        raise InvalidArgument(msg)
    fmt = rope.format("rotation")
    if held and not np.array_equal(round_to(values, fmt), values):
        msg = (
            f"x: expected values of rope.rotation_format ({fmt.name}), the kernel's inputs as it "
            "holds them; round them first (mhanum.formats.round_to)"
        )
        raise InvalidArgument(msg)
    return values


def apply_rope(x: ArrayLike, positions: ArrayLike, rope: Rope) -> np.ndarray:
    """Rotate ``x`` (``(..., L, d_head)``) as the kernel ``rope`` describes: every rounding of
    the stated formats exact, ``pow``, ``cos`` and ``sin`` correctly rounded.

    ``x`` holds the kernel's inputs, values of ``rotation_format``.
    """
    p = check_positions(positions, rope)
    x = _check_x(x, rope, p)
    fmt = rope.format("rotation")
    c, s = _tables(rope, angles(rope, p))
    partner, sign, freq = _pairs(rope)
    xa, xb = x[..., : rope.dim], x[..., partner]
    first = round_to(xa * c[:, freq], fmt)
    second = round_to(xb * s[:, freq], fmt)
    out = x.copy()
    out[..., : rope.dim] = round_to(first + sign * second, fmt)
    return out


def reference_rope(x: ArrayLike, positions: ArrayLike, rope: Rope) -> tuple[np.ndarray, np.ndarray]:
    """The exact rotation of ``x`` in float64, and a bound on its distance to the exact values.

    ``ω`` is the scaling's exact value rounded once to float64, ``θ = fl(p·ω)``, ``cos`` and
    ``sin`` numpy's (within one float64 ulp), the rotation in float64: Lemma P.3 bounds the
    result's distance to the exact rotation of the exact angles, entry by entry.
    """
    p = check_positions(positions, rope)
    x = _check_x(x, rope, p, held=False)
    omega = np.array([float(w) for w in exact_inv_freq(rope, int(p.max()) + 1)])
    theta = p[:, None].astype(np.float64) * omega[None, :]
    k = rope.table_scale
    c, s = np.cos(theta) * k, np.sin(theta) * k
    partner, sign, freq = _pairs(rope)
    xa, xb = x[..., : rope.dim], x[..., partner]
    out = x.copy()
    out[..., : rope.dim] = xa * c[:, freq] + sign * (xb * s[:, freq])
    # |θ64 - θ| <= 2.01u·θ; cos and sin within an ulp (2u) of those of θ64; k within u
    d_trig = k * (2.01 * _U64 * theta + 2 * _U64) + _U64 * k
    err = np.zeros_like(x)
    with np.errstate(over="ignore"):
        err[..., : rope.dim] = (
            (np.abs(xa) + np.abs(xb)) * d_trig[:, freq]
            + 3 * _U64 * (np.abs(xa * c[:, freq]) + np.abs(xb * s[:, freq]))
        ) * (1 + 4 * _U64) + 2.0**-1074 * 4
    return out, err


def rope_error(x: ArrayLike, positions: ArrayLike, rope: Rope, *, held: bool = True) -> np.ndarray:
    """Theorem P.1: a bound on ``|x̂_rot - x_rot|`` entry by entry, ``x_rot`` the exact rotation
    of ``x`` by the exact angles, ``x̂_rot`` any kernel's that computes as ``rope`` states.

    The inverse frequencies' error is enclosed on the configuration itself (Lemma P.2), the
    angles' by their product's rounding, the tables' by the angles' (``|cos a - cos b| <=
    |a - b|``), ``cos``'s and ``sin``'s ulps and their roundings, and the rotation's by its two
    products and one sum in ``rotation_format``. Where the rotated value may overflow
    ``rotation_format`` (range, R), the bound is ``inf``.

    ``held=False``: ``x`` bounds the magnitudes of the kernel's inputs instead of being them
    (values of ``rotation_format`` none of whose magnitudes exceed ``|x|``): the bound is
    nondecreasing in every ``|x_j|``, so its value at ``|x|`` bounds each of theirs.

    Examples:
        >>> import numpy as np
        >>> rope = Rope(dim=8, table_format="bfloat16", rotation_format="bfloat16")
        >>> x = np.ones((3, 8))
        >>> bool(np.all(rope_error(x, np.arange(3), rope) < 0.05))
        True
    """
    p = check_positions(positions, rope)
    x = _check_x(x, rope, p, held=held)
    fr = rope.format("rotation")
    seq_len = int(p.max()) + 1
    lo, hi = inv_freq_enclosure(rope, seq_len)
    omega = np.array([float(w) for w in exact_inv_freq(rope, seq_len)])
    # |ω̂ - ω| for every ω̂ in [lo, hi] (ω itself is within 2^-53 of the float64 value)
    d_omega = np.maximum(np.abs(hi - omega), np.abs(omega - lo)) + _U64 * omega
    fp = rope.format("product")
    pf = p.astype(np.float64)[:, None]
    theta = pf * omega[None, :]
    prod_hi = pf * hi[None, :]
    # P.1 (a): the angle, fl(p·ω̂) in the product format
    d_theta = pf * d_omega[None, :] + fp.u * prod_hi + fp.smallest_normal
    d_theta = d_theta + 2 * _U64 * theta  # θ in float64 (the bound's own evaluation)
    # P.1 (b): the tables: cos of the computed angle in trig_format (trig_ulps, relative),
    # times the table scale, then stored in table_format
    ft, fs = rope.format("trig"), rope.format("table")
    k = rope.table_scale
    k_err = 0.0 if k == 1.0 else ft.u * k + 2 * ft.u * k  # the constant's and the product's
    eps_t = 2 * rope.trig_ulps * ft.u
    tables = {}
    for name, f in (("cos", np.cos), ("sin", np.sin)):
        exact = np.abs(f(theta)) + 2 * _U64 + 2.01 * _U64 * theta  # numpy's, of θ in float64
        computed = np.minimum(exact + d_theta, 1.0)  # |cos θ̂| <= |cos θ| + |θ̂ - θ|
        trig_err = d_theta + eps_t * computed + ft.smallest_normal
        stored = k * (computed + eps_t * computed + ft.smallest_normal) + k_err * computed
        err = k * trig_err + k_err * computed
        tables[name] = (err + fs.u * stored + fs.smallest_normal, stored)
    partner, _, freq = _pairs(rope)
    xa, xb = np.abs(x[..., : rope.dim]), np.abs(x[..., partner])
    (e_c, c_hat), (e_s, s_hat) = tables["cos"], tables["sin"]
    first = xa * c_hat[:, freq]
    second = xb * s_hat[:, freq]
    # P.1 (c): the rotation fl(fl(x_a ĉ) ∓ fl(x_b ŝ)) in rotation_format: γ_2 of its magnitudes
    u = fr.u
    gamma2 = 2 * u / (1 - 2 * u)
    out = np.zeros_like(x)
    with np.errstate(over="ignore"):
        out[..., : rope.dim] = (
            xa * e_c[:, freq] + xb * e_s[:, freq] + gamma2 * (first + second)
            + 3 * fr.smallest_normal
        ) * (1 + 8 * _U64)  # fmt: skip
        # R: the products and the sum are held in rotation_format; where the rotated value may
        # pass its largest finite number, P.1 says nothing: the bound is inf there
        reach = (first + second) * (1 + gamma2) + 3 * fr.smallest_normal
        out[..., : rope.dim] = np.where(reach <= fr.max_finite, out[..., : rope.dim], np.inf)
    return out


def rope_error_linear(positions: ArrayLike, rope: Rope) -> tuple[float, float]:
    """Theorem P.1 as a linear bound in the magnitudes (for the a priori Theorem A.4): ``(a, e)``
    with ``|x̂_rot - x_rot|_j <= a·(|x_j| + |x_j'|) + e`` for every input ``x`` held in
    ``rotation_format`` at these positions (``j'`` the partner of ``j``).

    P.1's bound is, entry by entry, nonnegative multiples of ``|x_j|`` and ``|x_j'|`` plus a
    constant: its value at ``x = 0`` is the constant, at ``|x| = 1`` the constant plus the
    multiples' coefficients, so their largest difference (rounded up) bounds every coefficient.

    Examples:
        >>> a, e = rope_error_linear([0, 1, 4095], Rope(dim=8, table_format="bfloat16"))
        >>> bool(2.0**-9 < a < 2.0**-5), bool(e < 1e-37)  # the constant: 3 float32 underflows
        (True, True)
    """
    p = check_positions(positions, rope)
    shape = (p.shape[0], rope.dim)
    zero = rope_error(np.zeros(shape), p, rope)
    one = rope_error(np.ones(shape), p, rope)
    return float(np.max(one - zero)) * (1 + 2.0**-50), float(np.max(zero))


def pair_sum(x: ArrayLike, rope: Rope) -> np.ndarray:
    """``x_j + x_j'`` for each rotated entry ``j`` and its partner ``j'``, ``x_j`` past
    ``rope.dim`` (``(..., d_head)``): the bound of a rotated entry from bounds on both of its
    pair's inputs.

    Examples:
        >>> pair_sum(np.array([1.0, 2.0, 4.0]), Rope(dim=2)).tolist()
        [3.0, 3.0, 4.0]
    """
    x = np.asarray(x, np.float64)
    partner, _, _ = _pairs(rope)
    out = x.copy()
    out[..., : rope.dim] = x[..., : rope.dim] + x[..., partner]
    return out


def rotation_spread(e: ArrayLike, rope: Rope) -> np.ndarray:
    """A bound on ``|R(x') - R(x)|`` entry by entry for the exact rotation ``R`` and any ``x'``
    within ``e`` of ``x`` (``(..., L, d_head)``): ``k (e_a + e_b)`` for a rotated entry, ``k``
    the table factor (``|cos θ|, |sin θ| <= 1``), ``e`` for the rest; rounded up.

    Examples:
        >>> import numpy as np
        >>> rotation_spread(np.array([[1.0, 2.0, 4.0]]), Rope(dim=2)).tolist()
        [[3.0000000000000013, 3.0000000000000013, 4.0]]
    """
    e = np.asarray(e, np.float64)
    partner, _, _ = _pairs(rope)
    out = e.copy()
    with np.errstate(over="ignore"):
        out[..., : rope.dim] = (
            rope.table_scale * (e[..., : rope.dim] + e[..., partner]) * (1 + 4 * _U64)
        )
    return out


def check_holds(rope: Rope, fmt: Format, what: str) -> None:
    """A kernel rotates the values it holds: ``rope.rotation_format`` must hold ``fmt``
    (``what``'s format) exactly, its precision and exponent range at least ``fmt``'s.

    Raises:
        InvalidArgument: naming ``rope.rotation_format``.
    """
    rot = rope.format("rotation")
    if rot.precision < fmt.precision or rot.emin > fmt.emin or rot.emax < fmt.emax:
        msg = (
            f"rope.rotation_format: expected a format that holds {what} ({fmt.name}) exactly "
            f"(the kernel rotates the values it holds), got {rot.name}"
        )
        raise InvalidArgument(msg)
