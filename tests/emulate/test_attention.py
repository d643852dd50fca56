"""mhanum.attention: accuracy against the certified reference, masks, plumbing and bad inputs.

Tolerances are the rigorous bound of ``mhanum.bounds.attention_bound`` (papers/attention.md,
Theorem A.1), never a chosen constant.
"""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, Numerics, metrics, reference, round_to
from mhanum.bounds import attention_bound
from mhanum.numerics import PRESETS
from tests._grid import covering_grid
from tests._numerics import configured

ORDERS = ["native", "sequential", "pairwise", "blocked(5)", "kahan"]
SOFTMAXES = ["naive", "safe", "online(7)"]


def _inputs(seed: int, fmt, lq=6, lk=19, dk=16, dv=5):
    rng = np.random.default_rng(seed)
    return tuple(
        round_to(rng.standard_normal(shape), fmt) for shape in ((lq, dk), (lk, dk), (lk, dv))
    )


def _check_within_bound(q, k, v, num, mask=None):
    ref = reference.attention(q, k, v, mask=mask)
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    err = np.abs(out - ref)
    bound = attention_bound(q, k, v, mask, numerics=num).total
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g} for {num.describe()}"
    return err


# 210 cells, each compiling its own program (about 0.5 s with an empty cache): the fast run takes
# 15, in which every preset and every pair of order and softmax appears
@pytest.mark.parametrize(
    ("softmax", "order", "preset"),
    covering_grid([(s, o) for s in SOFTMAXES for o in ORDERS], list(PRESETS)),
)
def test_error_is_within_the_derived_bound_and_nonzero(preset, order, softmax):
    num = configured(preset, summation=order, softmax=softmax)
    q, k, v = _inputs(hash((preset, order, softmax)) % 2**32, num.format_of("input"))
    err = _check_within_bound(q, k, v, num)
    assert err.max() > 0  # every preset rounds somewhere on these inputs


@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**32 - 1),
    lk=st.sampled_from((1, 2, 3, 7, 8, 9, 16, 17, 32, 33, 40)),  # bucketed: compiles reused
    scale=st.sampled_from([0.25, 1, 2]),
    preset=st.sampled_from(list(PRESETS)),
    order=st.sampled_from(ORDERS),
    softmax=st.sampled_from([*SOFTMAXES, "online(1)", "online(64)"]),
)
def test_error_is_within_the_derived_bound_on_generated_inputs(
    seed, lk, scale, preset, order, softmax
):
    num = configured(preset, summation=order, softmax=softmax)
    rng = np.random.default_rng(seed)
    fmt = num.format_of("input")
    q = round_to(scale * rng.standard_normal((4, 16)), fmt)
    k = round_to(scale * rng.standard_normal((lk, 16)), fmt)
    v = round_to(rng.standard_normal((lk, 3)) * np.exp(rng.uniform(-3, 3, (lk, 1))), fmt)
    assume(np.isfinite(attention_bound(q, k, v, numerics=num).total).all())  # else vacuous
    _check_within_bound(q, k, v, num)


def test_fp64_is_within_a_few_ulps_of_the_reference():
    q, k, v = _inputs(3, "float64", lq=8, lk=32, dk=64, dv=8)
    num = Numerics.preset("fp64")
    err = _check_within_bound(q, k, v, num)
    ref, ref_mpf = reference.attention(q, k, v, return_mpf=True)
    out = mn.attention(q, k, v, numerics=num)
    measured = metrics.errors(out, ref_mpf)
    bound_ulps = np.max(
        attention_bound(q, k, v, numerics=num).total / mn.formats.ulp(ref, "float64")
    )
    assert measured.max_ulps <= bound_ulps
    assert err.max() > 0


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_masked_keys_get_no_weight(order, softmax):
    num = Numerics.preset("fp32").replace(summation=order, softmax=softmax)
    q, k, v = _inputs(7, "float32")
    mask = np.random.default_rng(7).random((q.shape[0], k.shape[0])) < 0.6
    mask[:, 0] = True
    _check_within_bound(q, k, v, num, mask)
    # Changing the values of masked keys changes nothing, bit for bit.
    v2 = np.where(mask.any(axis=0)[:, None], v, 1e6)
    cols = ~mask.any(axis=0)
    if cols.any():
        np.testing.assert_array_equal(
            mn.attention(q, k, v, mask, numerics=num), mn.attention(q, k, v2, mask, numerics=num)
        )


def test_mask_broadcasts_over_batch_dimensions():
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal((2, 3, 4, 16)),
        rng.standard_normal((2, 1, 5, 16)),
        rng.standard_normal((1, 3, 5, 2)),
    )
    mask = rng.random((4, 5)) < 0.7
    mask[:, 0] = True
    num = Numerics.preset("fp64").replace(summation="sequential")  # XLA's order may change
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num))
    assert out.shape == (2, 3, 4, 2)
    for b in range(2):
        for h in range(3):
            expected = mn.attention(q[b, h], k[b, 0], v[0, h], mask, numerics=num)
            np.testing.assert_array_equal(out[b, h], expected)


def test_minus_1e9_on_every_float32_logit_makes_the_softmax_exactly_uniform():
    # ulp(1e9) = 64 in float32: s + (-1e9) rounds to -1e9 whenever |s| < 32, for every key.
    q, k, v = _inputs(11, "float32", lq=8, lk=16, dk=16)
    bias = np.full((8, 16), -1e9)
    out = mn.attention(q, k, v, bias=bias, numerics="fp32")
    uniform = mn.attention(np.zeros_like(q), k, v, numerics="fp32")  # equal logits
    np.testing.assert_array_equal(out, uniform)
    ref = reference.attention(q, k, v, bias=bias)  # exact: a constant shift changes nothing
    assert metrics.errors(out, ref).normwise_max >= 0.5


@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_fully_masked_row_under_each_convention(softmax):
    q, k, v = _inputs(5, "float32", lq=3, lk=6)
    mask = np.ones((3, 6), bool)
    mask[1] = False
    base = Numerics.preset("fp32").replace(softmax=softmax)
    # -inf: the softmax of an empty set is undefined; the output says so.
    out = np.asarray(mn.attention(q, k, v, mask, numerics=base))
    assert np.isnan(out[1]).all()
    assert np.isfinite(out[[0, 2]]).all()
    ref_nan = reference.attention(q, k, v, mask=mask)
    e = metrics.errors(out, ref_nan)
    assert e.n_undefined == v.shape[1]
    assert e.n_nonfinite == 0
    # finfo.min replaces every logit of the row by the same value: exactly uniform once shifted;
    # without the shift (naive) every exp underflows to 0 and the row is 0/0.
    out = np.asarray(mn.attention(q, k, v, mask, numerics=base.replace(mask_value="finfo.min")))
    added = base.replace(mask_mode="add", mask_value=-1e9)  # every |s| < 32: the same -1e9 row
    out_added = np.asarray(mn.attention(q, k, v, mask, numerics=added))
    if softmax == "naive":
        assert np.isnan(out[1]).all()
        assert np.isnan(out_added[1]).all()
    else:
        uniform = np.asarray(mn.attention(np.zeros_like(q), k, v, numerics=base))
        np.testing.assert_array_equal(out[1], uniform[1])
        np.testing.assert_array_equal(out_added[1], uniform[1])


def test_minus_1e9_overflows_in_float16_and_poisons_a_fully_masked_row():
    q, k, v = _inputs(5, "float16", lq=2, lk=4)
    mask = np.array([[True, True, False, False], [False, False, False, False]])
    num = Numerics.preset("fp16").replace(mask_value=-1e9)
    assert num.mask_constant() == -math.inf
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    assert np.isnan(out[1]).all()
    assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("placement", ["q", "qk"])
def test_scale_placement_is_exact_for_powers_of_four(placement):
    # d_k = 16: 1/4 on the scores, 1/4 on q, and 1/2 on each of q and k are all exact.
    q, k, v = _inputs(2, "float32")
    num = Numerics.preset("fp32").replace(summation="sequential")
    np.testing.assert_array_equal(
        mn.attention(q, k, v, numerics=num),
        mn.attention(q, k, v, numerics=num.replace(scale=placement)),
    )


def test_scale_placement_differs_when_the_scale_is_inexact():
    rng = np.random.default_rng(0)
    q, k, v = (round_to(rng.standard_normal((8, 12)), "bfloat16") for _ in range(3))
    num = Numerics.preset("bf16-fp32acc")
    a = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    b = np.asarray(mn.attention(q, k, v, numerics=num.replace(scale="q")), np.float64)
    assert np.any(a != b)  # 1/sqrt(12) rounded to bf16 on q vs float32 on the scores


def test_jit_with_static_numerics_matches_eager():
    q, k, v = _inputs(4, "bfloat16")
    num = Numerics.preset("bf16-fp32acc").replace(summation="pairwise", softmax="online(4)")
    f = jax.jit(mn.attention, static_argnames="numerics")
    np.testing.assert_array_equal(
        f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), numerics=num),
        mn.attention(q, k, v, numerics=num),
    )


def test_jax_float64_inputs_round_once_like_numpy_inputs():
    x = 1 + 2.0**-8 + 2.0**-30  # rounds up to bfloat16, but to 1 via float32
    q = np.full((1, 4), x)
    num = Numerics.preset("bf16").replace(
        score_format="float32", prob_format="float32", output_format="float32", accum="float32"
    )
    eager = mn.attention(q, q, q, numerics=num)
    traced = jax.jit(mn.attention, static_argnames="numerics")(
        jnp.asarray(q), jnp.asarray(q), jnp.asarray(q), numerics=num
    )
    np.testing.assert_array_equal(eager, traced)
    assert float(np.asarray(eager)[0, 0]) == 1 + 2.0**-7


def test_output_dtype_is_the_output_format_storage():
    q, k, v = _inputs(0, "bfloat16")
    assert mn.attention(q, k, v, numerics="bf16-fp32acc").dtype == jnp.bfloat16
    assert mn.attention(q, k, v, numerics="tf32").dtype == jnp.float32
    assert mn.attention(q, k, v, numerics="fp16").dtype == jnp.float16


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
def test_mha_is_projection_heads_attention_concat_projection(preset):
    num = configured(preset, summation="blocked(3)")
    rng = np.random.default_rng(1)
    params = mn.MHAParams.random(16, seed=1)
    fmt = num.format_of("input")
    x_q, x_kv = (
        round_to(rng.standard_normal((5, 16)), fmt),
        round_to(rng.standard_normal((7, 16)), fmt),
    )
    p = {
        name: round_to(getattr(params, name), fmt)
        for name in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")
    }
    acc, store = num.accum, num.storage_format

    def project(x, w, b, out_fmt):
        y = np.asarray(mn.summation.matmul(x, w, order=num.summation, accum=acc), np.float64)
        return round_to(round_to(y + b, acc), out_fmt)

    q, k, v = (
        project(x, p[w], p[b], store)
        for x, w, b in ((x_q, "wq", "bq"), (x_kv, "wk", "bk"), (x_kv, "wv", "bv"))
    )
    heads = [
        np.asarray(
            mn.attention(
                q[:, h * 4 : (h + 1) * 4],
                k[:, h * 4 : (h + 1) * 4],
                v[:, h * 4 : (h + 1) * 4],
                numerics=num,
            ),
            np.float64,
        )
        for h in range(4)
    ]
    expected = project(np.concatenate(heads, axis=-1), p["wo"], p["bo"], num.format_of("output"))
    got = np.asarray(mn.multi_head_attention(x_q, x_kv, params, 4, numerics=num), np.float64)
    np.testing.assert_array_equal(got, expected)


def test_import_without_x64_refuses_float64_numerics_but_runs_float32():
    code = (
        "import numpy as np, mhanum as mn\n"
        "q = np.eye(4)\n"
        "print(mn.attention(q, q, q, numerics='fp32').dtype)\n"
        "try:\n    mn.attention(q, q, q, numerics='fp64')\n"
        "except mn.InvalidArgument as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "float32" in out.stdout
    assert "refused: numerics: uses float64" in out.stdout


P = mn.MHAParams.random(8, seed=0)
Q = np.zeros((3, 4))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: mn.attention(Q, np.zeros((3, 5)), np.zeros((3, 2))),
            r"k: expected last dimension",
        ),
        (lambda: mn.attention(Q, Q, np.zeros((2, 2))), r"v: expected 3 keys"),
        (
            lambda: mn.attention(np.zeros((2, 3, 4)), np.zeros((3, 3, 4)), np.zeros((3, 3, 4))),
            "q, k, v: expected broadcastable batch dimensions",
        ),
        (lambda: mn.attention(np.array([[np.nan, 0, 0, 0]]), Q, Q), r"q: expected finite values"),
        (lambda: mn.attention(Q, Q, np.full((3, 4), np.inf)), r"v: expected finite values"),
        (lambda: mn.attention(Q, Q, Q, np.ones((2, 3), bool)), "mask: expected a shape broadcast"),
        (lambda: mn.attention(Q, Q, Q, np.ones((3, 3))), "mask: expected a boolean array"),
        (lambda: mn.attention(Q, Q, Q, bias=np.full((3, 3), np.nan)), "bias: expected finite"),
        (lambda: mn.attention(Q, Q, Q, numerics="fp8"), "name: expected one of"),
        (lambda: mn.attention(Q, Q, Q, numerics=Numerics(input="fp12")), "numerics.input"),
        (lambda: mn.attention(Q, Q, Q, numerics=3), "numerics: expected a Numerics"),
        (
            lambda: mn.attention(Q, Q, Q, scale=math.inf),
            "scale: expected None or a finite real number",
        ),
        (
            lambda: mn.attention(Q, Q, Q, scale=-1.0, numerics=mn.Numerics(scale="qk")),
            "scale: expected a scale >= 0",
        ),
        (lambda: mn.attention(np.zeros((3, 4), int), Q, Q), "q: expected a floating-point array"),
        (lambda: mn.attention(np.zeros(4), Q, Q), "q: expected an array with at least 2"),
        (
            lambda: mn.multi_head_attention(np.zeros((3, 8)), np.zeros((3, 8)), P, 3),
            "num_heads: expected a divisor of",
        ),
        (
            lambda: mn.multi_head_attention(np.zeros((3, 8)), np.zeros((3, 8)), P, 0),
            "num_heads: expected a positive integer",
        ),
        (
            lambda: mn.multi_head_attention(np.zeros((3, 6)), np.zeros((3, 8)), P, 2),
            r"x_q: expected last dimension 8",
        ),
        (
            lambda: mn.multi_head_attention(
                np.zeros((3, 8)), np.zeros((3, 8)), mn.MHAParams(P.wq, P.wk, P.wv, P.wo[:4]), 2
            ),
            r"params.wo: expected shape",
        ),
        (
            lambda: mn.multi_head_attention(np.zeros((3, 8)), np.zeros((3, 8)), {"wq": 1}, 2),
            "params: expected an MHAParams",
        ),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()
