"""The kernels' constants: rounded on the host, read by the compiled emulation as operands.

A new scale or soft-cap is new data for the program compiled for its structure; each constant is
the one rounding of its float64 value into the format that multiplies by it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import mhanum as mn
from mhanum import round_to
from mhanum.emulate import attention as emulate_attention
from mhanum.emulate import backward as emulate_backward
from mhanum.emulate.constants import LOG2E, Const, Constants
from mhanum.formats import get_format
from mhanum.numerics import Backward, Numerics, resolve

# over the exponent range: subnormal in float32 and the half formats, above their largest finite
SCALES = (0.125, 0.3, 1 / math.sqrt(96), 2.0**-140, 3e-39, 0.7 * 2.0**-60, 7e4, 1e30)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float64"])
def test_each_constant_is_one_rounding_of_its_float64_value(scale, fmt):
    f = get_format(fmt)
    num = Numerics(input=fmt, accum="float64" if fmt == "float64" else "float32")
    consts = Constants.of(num, scale, 5.5, f)
    exact = {
        Const.SCALE: scale,
        Const.SQRT_SCALE: math.sqrt(scale),
        Const.SCALE_LOG2E: scale * LOG2E,
        Const.SCALE_LOG2E_FACTORS: float(round_to(scale, f)) * float(round_to(LOG2E, f)),
        Const.CAP: 5.5,
        Const.INV_CAP: 1 / 5.5,
    }
    carrier = np.float64 if fmt == "float64" else np.float32
    for name, value in exact.items():
        got = np.asarray(consts.value(name, f))
        want = round_to(value, f).astype(carrier)
        assert got.dtype == carrier
        np.testing.assert_array_equal(got.tobytes(), want.tobytes(), err_msg=str(name))


def test_a_negative_scale_has_no_square_root():
    consts = Constants.of(resolve("fp32"), -0.5)
    assert math.isnan(float(consts.value(Const.SQRT_SCALE, get_format("float32"))))
    assert float(consts.value(Const.SCALE, get_format("float32"))) == -0.5
    assert not consts.capped


def _inputs(lq=3, lk=5, d=4):
    rng = np.random.default_rng(7)
    return tuple(rng.standard_normal(shape) for shape in ((lq, d), (lk, d), (lk, d), (lq, d)))


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
@pytest.mark.parametrize("placement", ["scores", "q", "qk"])
def test_a_new_scale_or_cap_does_not_compile_a_new_program(preset, placement):
    q, k, v, g = _inputs()
    num = resolve(preset).replace(scale=placement, softmax="online(2)")
    jitted = (emulate_attention._attention_jit, emulate_backward._grad_jit)
    mn.attention(q, k, v, scale=0.3, softcap=4.0, numerics=num)
    emulate_backward.attention_grad(q, k, v, g, scale=0.3, softcap=4.0, numerics=num)
    before = [f._cache_size() for f in jitted]
    outs = []
    for scale, cap in ((0.7, 4.0), (2.0**-20, 9.5), (3.0, 0.5)):
        outs.append(mn.attention(q, k, v, scale=scale, softcap=cap, numerics=num))
        emulate_backward.attention_grad(q, k, v, g, scale=scale, softcap=cap, numerics=num)
    assert [f._cache_size() for f in jitted] == before
    # and the constants do reach the program: each scale gives its own output
    assert len({np.asarray(o).tobytes() for o in outs}) == len(outs)


def test_the_structure_still_compiles_apart():
    """A cap or none, another placement, another backward: other programs."""
    q, k, v, g = _inputs(lq=2, lk=3, d=2)
    num = resolve("fp32").replace(softmax="online(2)")
    size = emulate_attention._attention_jit._cache_size
    mn.attention(q, k, v, scale=0.5, numerics=num)
    n = size()
    mn.attention(q, k, v, scale=0.5, softcap=3.0, numerics=num)
    mn.attention(q, k, v, scale=0.5, numerics=num.replace(scale="q"))
    assert size() == n + 2
    grad = emulate_backward._grad_jit._cache_size
    emulate_backward.attention_grad(q, k, v, g, scale=0.5, numerics=num)
    m = grad()
    emulate_backward.attention_grad(
        q, k, v, g, scale=0.5, numerics=num, backward=Backward("flash2", block_q=2, block_k=2)
    )
    assert grad() == m + 1
