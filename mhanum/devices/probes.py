"""The probes that pin the tensor-core models down (papers/tensorcore.md, §4).

Each :class:`Probe` is an item of the test suite of Fasi et al. (2021): ``c + sum(a_i b_i)`` with
inputs chosen so that the models of :mod:`mhanum.units.tensorcore` differ. :func:`run_probes` runs
them as real matmuls on a JAX backend, and :func:`matching_models` says which models every
observed output agrees with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mhanum.formats import FORMATS, round_to
from mhanum.units.tensorcore import MODELS

__all__ = ["PROBES", "Probe", "matching_models", "probe_vectors", "run_probes"]


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


_Add = Callable[[str, str, Sequence[float], Sequence[float], float, Mapping[str, float], str], None]


@dataclasses.dataclass(frozen=True)
class _Setting:
    """One tensor-core mode of the suite: its model, format, probe tag and source."""

    model: str
    fmt: str
    tag: str
    src: str
    v100: bool
    w: float  # the largest number below one in the input format


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
        v100 = model == "v100-fp16"
        setting = _Setting(
            model, fmt, fmt if not v100 else "float16-v100", _V100 if v100 else srcs[model],
            v100, below_one[fmt],
        )  # fmt: skip
        _products_and_accumulation(add, setting)
        _rounding(add, setting)
        _alignment_and_normalisation(add, setting)
    _subnormals(add)
    return probes


def _products_and_accumulation(add: _Add, s: _Setting) -> None:
    """Part B of the suite: exact products, binary32 accumulation, the largest addend first."""
    model, fmt, tag, src, v100, w = s.model, s.fmt, s.tag, s.src, s.v100, s.w
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


def _rounding(add: _Add, s: _Setting) -> None:
    """Part C of the suite: the direction of the final rounding."""
    model, fmt, tag, src = s.model, s.fmt, s.tag, s.src
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


def _alignment_and_normalisation(add: _Add, s: _Setting) -> None:
    """Part D of the suite: alignment bits, normalisation, carry out, monotonicity."""
    model, fmt, tag, src, v100 = s.model, s.fmt, s.tag, s.src, s.v100
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


def _subnormals(add: _Add) -> None:
    """Part A of the suite: subnormal inputs and outputs."""
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


def _run_on(vectors: tuple[list[float], list[float]], fmt: str, device: jax.Device) -> float:
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
