"""Tests for the tensor-core models (mhanum.units.tensorcore, .emulate.tensorcore, .devices.probes): probes of Fasi et al. (2021), JAX emulation, error bound."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mhanum import InvalidArgument
from mhanum.bounds.factors import tensor_core_eta as dot_error_eta
from mhanum.bounds.factors import tensor_core_factor as dot_error_factor
from mhanum.devices.probes import PROBES, matching_models, probe_vectors
from mhanum.emulate.tensorcore import matmul
from mhanum.formats import get_format, round_to
from mhanum.units.tensorcore import MODELS, TensorCoreModel, get_model

REPORTED = [(p, name, value) for p in PROBES for name, value in p.reported.items()]


def _hex(x: float) -> str:
    return f"{np.float32(x).view(np.uint32):08x}"


@pytest.mark.parametrize(
    ("probe", "model", "expected"), REPORTED, ids=[f"{p.name}-{m}" for p, m, _ in REPORTED]
)
def test_models_reproduce_the_reported_probe_outputs(probe, model, expected):
    assert _hex(MODELS[model].dot(probe.a, probe.b, probe.c)) == _hex(expected)


def test_every_gpu_of_fasi_et_al_has_reported_probes():
    assert {m for _, m, _ in REPORTED} == {"v100-fp16", "a100-fp16", "a100-bf16", "a100-tf32"}


def test_seed_probe_is_truncated_on_v100():
    a, b = [1.0, 1.0, 1.0, 1.0], [2.0, 2**-23 + 2**-24, 0.0, 0.0]
    assert MODELS["v100-fp16"].dot(a, b) == 2.0
    rn = np.float32(0)
    for x, y in zip(a, b, strict=True):
        rn = np.float32(rn + np.float32(x * y))
    assert float(rn) == 2 + 2**-22  # what round-to-nearest gives instead


def test_probes_distinguish_v100_from_a100():
    probe = next(p for p in PROBES if p.name == "extra_alignment_bits/float16-v100")
    assert MODELS["v100-fp16"].dot(probe.a, probe.b, probe.c) == 2**-23
    assert MODELS["a100-fp16"].dot(probe.a, probe.b, probe.c) == 2**-24


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
def test_probe_as_matmul_equals_probe_with_c(probe):
    vectors = probe_vectors(probe)
    if vectors is None:
        assert probe.c != 0
        assert float(round_to(probe.c, probe.input_format, mode="toward_zero")) == 0
        return
    for model in MODELS.values():
        if model.input_format == probe.input_format:
            direct = model.dot(probe.a, probe.b, probe.c)
            assert _hex(model.dot(*vectors)) == _hex(direct)


def test_matching_models_needs_every_probe_of_the_format():
    results = [
        {"input_format": "float16", "observed": 1.0, "matches": ["a100-fp16", "h100-fp16"]},
        {"input_format": "float16", "observed": 2.0, "matches": ["h100-fp16"]},
        {"input_format": "float16", "observed": None, "matches": []},
    ]
    assert matching_models(results) == ["h100-fp16"]


# --- matmul equals dot, bit for bit -------------------------------------------------------------

MODEL_NAMES = sorted(MODELS)


@st.composite
def format_values(draw, fmt: str, n: int, *, subnormals: bool = True):
    f = get_format(fmt)
    lo = f.emin - (f.precision - 1 if subnormals else 0)
    hi = min(f.emax, 12)
    values = []
    for _ in range(n):
        kind = draw(st.sampled_from(["normal", "normal", "normal", "zero", "near", "power"]))
        sign = draw(st.sampled_from([1.0, -1.0]))
        if kind == "zero":
            values.append(0.0)
            continue
        e = draw(st.integers(lo, hi))
        if kind == "power":
            x = math.ldexp(1.0, e)
        elif kind == "near":  # 1 - ulp: long runs of ones, the truncation's worst case
            x = math.ldexp(2.0 - f.eps, e)
        else:
            x = math.ldexp(draw(st.floats(1.0, 2.0, exclude_max=True)), e)
        values.append(sign * float(round_to(min(x, f.max_finite), fmt)))
    if not subnormals:
        values = [v if abs(v) >= f.smallest_normal else 0.0 for v in values]
    return values


@st.composite
def matmul_cases(draw):
    model = MODELS[draw(st.sampled_from(MODEL_NAMES))]
    m, n = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    g = model.group  # lengths bucketed around the group size, so compiled matmuls are reused
    k = draw(st.sampled_from(sorted({1, 2, g - 1, g, g + 1, 2 * g, 2 * g + 3} - {0})))
    a = draw(format_values(model.input_format, m * k))
    b = draw(format_values(model.input_format, k * n))
    return model, np.array(a, np.float32).reshape(m, k), np.array(b, np.float32).reshape(k, n)


def _assert_matmul_is_dot(model, a, b):
    out = np.asarray(matmul(a, b, model))
    assert out.dtype == np.float32
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            expected = model.dot(a[i].tolist(), b[:, j].tolist())
            assert _hex(out[i, j]) == _hex(expected), (model.name, i, j)


@given(matmul_cases())
def test_matmul_equals_dot_bit_for_bit(case):
    _assert_matmul_is_dot(*case)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_matmul_equals_dot_on_adversarial_inputs(name):
    model = MODELS[name]
    f = model.format
    big = float(round_to(f.max_finite, f.name))
    tiny = f.smallest_subnormal
    rows = [
        [1.0, 1.0, 1.0, 1.0, -1.0, big, -big, tiny],
        [big] * 8,  # large sums: carries, and overflow to infinity in float32 for some formats
        [2.0 - f.eps, -(2.0 - f.eps), tiny, -tiny, 1.0, 0.0, 0.5, -0.5],
        [math.nan, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ]
    a = np.array(rows, np.float32)
    b = np.array([[1.0, -1.0, 2.0 - f.eps, tiny], *[[1.0, 0.5, -1.0, big]] * 7], np.float32)
    if f.has_inf:
        a[3, 2] = np.inf
        b[2, 1] = -np.inf
        b[2, 2] = 0.0
    _assert_matmul_is_dot(model, a, b)


def test_matmul_broadcasts_batch_dimensions():
    rng = np.random.default_rng(0)
    a = round_to(rng.standard_normal((2, 1, 3, 20)), "bfloat16").astype(np.float32)
    b = round_to(rng.standard_normal((4, 20, 2)), "bfloat16").astype(np.float32)
    out = np.asarray(matmul(a, b, "a100-bf16"))
    assert out.shape == (2, 4, 3, 2)
    model = MODELS["a100-bf16"]
    assert _hex(out[1, 3, 2, 1]) == _hex(model.dot(a[1, 0, 2].tolist(), b[3, :, 1].tolist()))


# --- the error bound ---------------------------------------------------------------------------


@st.composite
def bound_cases(draw):
    model = MODELS[draw(st.sampled_from(MODEL_NAMES))]
    n = draw(st.integers(1, 3 * model.group + 1))
    a = draw(format_values(model.input_format, n, subnormals=False))
    b = draw(format_values(model.input_format, n, subnormals=False))
    if draw(st.booleans()):  # cancellation: the second half undoes the first
        half = n // 2
        a[half : 2 * half] = [-x for x in a[:half]]
        b[half : 2 * half] = b[:half]
    return model, a, b


@given(bound_cases())
@example((MODELS["v100-fp16"], [1.0, 1.0, 1.0, 1.0], [2.0, 2**-23 + 2**-24, 0.0, 0.0]))
@example((MODELS["h100-fp8-e4m3"], [448.0] + [1.0] * 31, [1.0] + [0.875] * 31))
def test_dot_error_is_within_the_bound(case):
    model, a, b = case
    computed = model.dot(a, b)
    exact = sum((Fraction(x) * Fraction(y) for x, y in zip(a, b, strict=True)), Fraction(0))
    mass = sum((abs(Fraction(x) * Fraction(y)) for x, y in zip(a, b, strict=True)), Fraction(0))
    n = len(a)
    for order in ("sequential", "native"):
        bound = Fraction(dot_error_factor(model, n, order=order)) * mass + Fraction(
            dot_error_eta(model, n, order=order)
        )
        assert abs(Fraction(computed) - exact) <= bound, order


def test_bound_is_attained_to_within_a_small_factor():
    # The worst case of one V100 step: c = 1 - 2**-24 loses its last bit, products lose theirs.
    model = MODELS["v100-fp16"]
    a, b, c = [1.0] * 4, [2**-24] * 4, 1.0
    err = abs(Fraction(model.dot(a, b, c)) - (1 + Fraction(4, 2**24)))
    mass = 1 + Fraction(4, 2**24)
    assert err / mass > Fraction(model.node_delta) / 3
    assert err <= Fraction(model.node_delta) * mass


def test_node_delta_values():
    assert MODELS["v100-fp16"].node_delta == 2**-23 + 4 * 2**-23 * (1 + 2**-23)
    assert MODELS["h100-fp16"].node_delta == 2**-23 + 16 * 2**-25 * (1 + 2**-23)
    assert MODELS["h100-fp8-e4m3"].node_delta == 2**-13 + 33 * 2**-13 * (1 + 2**-13)


def test_dot_error_factor_heights():
    model = MODELS["a100-fp16"]
    d = model.node_delta
    assert dot_error_factor(model, 0) == 0.0
    assert dot_error_factor(model, 8) >= d
    assert dot_error_factor(model, 9) >= (1 + d) ** 2 - 1
    assert dot_error_factor(model, 9) < (1 + d) ** 3 - 1
    assert dot_error_factor(model, 9, order="native") >= (1 + d) ** 9 - 1


# --- bad arguments -----------------------------------------------------------------------------

BAD = [
    (lambda: get_model("p100-fp16"), "model"),
    (lambda: get_model(3), "model"),
    (lambda: MODELS["v100-fp16"].dot([1.0], [1.0, 2.0]), "b"),
    (lambda: MODELS["v100-fp16"].dot([1 + 2**-12], [1.0]), "a"),
    (lambda: MODELS["a100-bf16"].dot([1.0], [1 + 2**-9]), "b"),
    (lambda: MODELS["v100-fp16"].dot([1.0], [1.0], 1 + 2**-30), "c"),
    (lambda: MODELS["v100-fp16"].dot(["x"], [1.0]), "a"),
    (lambda: dot_error_factor("v100-fp16", -1), "n"),
    (lambda: dot_error_factor("v100-fp16", 4, order="pairwise"), "order"),
    (lambda: matmul(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32), "v100-fp16"), "b"),
    (lambda: matmul(np.ones((2, 3)), np.ones((3, 2), np.float32), "v100-fp16"), "a"),
    (lambda: matmul(np.ones(3, np.float32), np.ones((3, 2), np.float32), "v100-fp16"), "a"),
    (lambda: matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32), "x"), "model"),
    (lambda: TensorCoreModel("x", "float17", 4, 0), "input_format"),
    (lambda: TensorCoreModel("x", "float16", 4, 0, normalisation="up"), "normalisation"),
    (lambda: TensorCoreModel("x", "float16", 0, 0), "group"),
    (lambda: TensorCoreModel("x", "float16", 64, 8), "extra_bits"),
]


@pytest.mark.parametrize(("call", "argname"), BAD)
def test_bad_arguments_raise_invalid_argument_naming_the_argument(call, argname):
    with pytest.raises(InvalidArgument, match=f"^{argname}:"):
        call()
