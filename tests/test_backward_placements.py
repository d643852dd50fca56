"""The scale on q, or its square root on q and k, in the backward pass (papers/backward.md, step
2'): the emulation reads the scaled operands in the dots of dq and dk and multiplies those
gradients by the factor again (as autograd through PyTorch's math path does), and Theorems
B.1/B.2 bound every gradient against :func:`mhanum.reference.attention_grad`, whose exact
gradients do not depend on where the scale sits.

Every tolerance is the bound; the reference is certified to 17 digits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mhanum import InvalidArgument, reference
from mhanum.bounds.backward import (
    attention_grad_bound,
    attention_grad_bound_a_priori,
    dq_order_difference,
    mha_grad_bound,
)
from mhanum.emulate.backward import attention_grad
from mhanum.numerics import Backward, resolve
from mhanum.params import MHAParams

L, D = 12, 4  # one shape for every example (the default scale 1/2 has the root 2^-1/2)
FLASH = Backward("flash2", block_q=4, block_k=4)
PLACEMENTS = ("q", "qk")


def _violations(q, k, v, g, mask, scale, num, backward, softcap=None, sink=None):
    """The gradients whose error leaves the bound (none may), with the worst ratio."""
    grads = attention_grad(
        q, k, v, g, mask, scale=scale, numerics=num, backward=backward, softcap=softcap, sink=sink
    )
    exact = reference.attention_grad(
        q, k, v, g, mask=mask, scale=scale, digits=17, softcap=softcap, sink=sink
    )
    bounds = attention_grad_bound(
        q, k, v, g, mask, scale=scale, numerics=num, backward=backward, softcap=softcap, sink=sink
    )
    bad = {}
    for name, got, want, b in zip(("dq", "dk", "dv", "dbias"), grads, exact, bounds, strict=False):
        got = np.asarray(got, np.float64)
        if not np.isfinite(b.total).all():
            assert b.reasons, f"{name}: an infinite bound must say why"
        over = ~(np.abs(np.where(np.isfinite(got), got, np.inf) - want) <= b.total)
        if over.any():
            bad[name] = float(np.max(np.abs(got - want)[over] / b.total[over]))
    return bad


@st.composite
def _problem(draw, span=8):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((L, D)) * 2.0 ** draw(st.integers(-span, 4)) for _ in "qkvg")
    mask = np.tril(np.ones((L, L), bool)) if draw(st.booleans()) else None
    # a few scales (each compiles the emulation once): the default, irrational roots, large
    scale = draw(st.sampled_from([None, 0.3, 0.0123, 2.5]))
    return q, k, v, g, mask, scale


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    "preset",
    [
        "fp32",
        "bf16-fp32acc",
        "fp16",
        pytest.param("tf32", marks=pytest.mark.slow),
        pytest.param("tensor-core-bf16", marks=pytest.mark.slow),
    ],
)
@settings(max_examples=12)
@given(problem=_problem())
def test_every_gradient_is_within_its_bound_wherever_the_scale_sits(
    preset, placement, backward, problem
):
    q, k, v, g, mask, scale = problem
    num = resolve(preset).replace(scale=placement)
    assert not _violations(q, k, v, g, mask, scale, num, backward)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
@settings(max_examples=8)
@given(e=st.integers(-140, 120), scale_exp=st.integers(-60, 3), tiny=st.booleans())
@example(e=120, scale_exp=3, tiny=True)
@example(e=-140, scale_exp=-60, tiny=True)
def test_bound_holds_across_the_exponent_range(preset, placement, e, scale_exp, tiny):
    """Inputs and scales (times 0.7: no power of two, nor its root) over the whole exponent
    range, subnormal entries: within the bound, or infinite with the reason."""
    rng = np.random.default_rng((e + 200) * 1000 + scale_exp + 100)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    q = q * 2.0 ** (e // 3)
    v = v * 2.0**e
    g = g * 2.0 ** (-e // 2)
    if tiny:
        q[0, 0] = k[1, 1] = 2.0**-130  # subnormal in float32, 0 in the half formats
    num = resolve(preset).replace(scale=placement)
    assert not _violations(q, k, v, g, None, 0.7 * 2.0**scale_exp, num, FLASH)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_soft_caps_and_sinks_take_the_scaled_operands(placement):
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((L, D)) * 3 for _ in range(4))
    num = resolve("bf16-fp32acc").replace(scale=placement)
    for backward in ("textbook", FLASH):
        assert not _violations(q, k, v, g, None, 0.3, num, backward, softcap=2.0)
        assert not _violations(q, k, v, g, None, 0.3, num, backward, sink=0.5)


def test_the_placements_differ_as_the_model_says():
    """The same inputs, three placements: the gradients differ (the roundings of the scaled
    operands and of the factor are real), and the placements whose factor is a power of two
    (scale 1/4 on q, on q and k: 1/2) agree with the scale on the scores bit for bit."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    runs = {
        (p, s): attention_grad(q, k, v, g, scale=s, numerics=resolve("bf16").replace(scale=p))
        for p in ("scores", "q", "qk")
        for s in (0.25, 0.3)
    }
    for p in ("q", "qk"):
        for name in ("dq", "dk", "dv"):
            a, b = getattr(runs[(p, 0.25)], name), getattr(runs[("scores", 0.25)], name)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(
            np.asarray(runs[(p, 0.3)].dq), np.asarray(runs[("scores", 0.3)].dq)
        )


def test_the_order_difference_takes_the_factor_of_dq():
    """Theorem B.3 with sqrt(c) on q and k: two atomic-add orders of dq differ within it."""
    rng = np.random.default_rng(7)
    q, k, v, g = (rng.standard_normal((16, D)) for _ in range(4))
    num = resolve("fp32").replace(scale="qk")
    a = Backward("flash2", block_q=4, block_k=4)
    b = Backward("flash2", block_q=4, block_k=4, dq_order=(3, 1, 0, 2))
    ga, gb = (attention_grad(q, k, v, g, scale=0.3, numerics=num, backward=x) for x in (a, b))
    bound = dq_order_difference(q, k, v, g, scale=0.3, numerics=num, backward=a)
    diff = np.abs(np.asarray(ga.dq, np.float64) - np.asarray(gb.dq, np.float64))
    assert diff.max() > 0
    assert (diff <= bound.total).all()


def test_theorems_of_the_scores_placement_only_refuse_the_others_by_name():
    num = resolve("fp32").replace(scale="qk")
    with pytest.raises(
        InvalidArgument, match=r"numerics\.scale: expected 'scores' for Theorem B\.4"
    ):
        attention_grad_bound_a_priori(8, 8, 4, q_norm=1.0, k_norm=1.0, v_max=1.0,
                                      d_out_max=1.0, numerics=num)  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8))
    params = MHAParams(*(rng.standard_normal((8, 8)) for _ in range(4)))
    with pytest.raises(
        InvalidArgument, match=r"numerics\.scale: expected 'scores' for Theorem B\.6"
    ):
        mha_grad_bound(x, x, params, 2, x, numerics=num)


def test_a_negative_scale_split_over_q_and_k_is_refused_by_name():
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    num = resolve("fp32").replace(scale="qk")
    with pytest.raises(InvalidArgument, match="scale"):
        attention_grad_bound(q, k, v, g, scale=-0.5, numerics=num)
    assert math.isfinite(float(np.max(attention_grad_bound(q, k, v, g, numerics=num).dq.total)))


# The scale on the scores, multiplying dS before the dots (Backward.scale_at="ds", jax.nn's
# autodiff): steps 6s and 8s of papers/backward.md.

DS = {"textbook": Backward("textbook", scale_at="ds"),
      "flash2": Backward("flash2", block_q=4, block_k=4, scale_at="ds")}  # fmt: skip


@pytest.mark.parametrize("algorithm", list(DS))
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "bf16", "tf32"])
@settings(max_examples=12)
@given(problem=_problem())
def test_every_gradient_is_within_its_bound_with_the_scale_on_ds(preset, algorithm, problem):
    q, k, v, g, mask, scale = problem
    assert not _violations(q, k, v, g, mask, scale, resolve(preset), DS[algorithm])


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
@settings(max_examples=8)
@given(e=st.integers(-140, 120), scale_exp=st.integers(-140, 3), tiny=st.booleans())
@example(e=0, scale_exp=-140, tiny=True)  # a scale subnormal in float32: read as zero, or not
@example(e=120, scale_exp=3, tiny=False)
def test_bound_with_the_scale_on_ds_holds_across_the_exponent_range(preset, e, scale_exp, tiny):
    rng = np.random.default_rng((e + 200) * 1000 + scale_exp + 200)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    v = v * 2.0**e
    g = g * 2.0 ** (-e // 2)
    if tiny:
        q[0, 0] = k[1, 1] = 2.0**-130
    scale = 0.7 * 2.0**scale_exp
    assert not _violations(q, k, v, g, None, scale, resolve(preset), DS["flash2"])


def test_the_scale_on_ds_agrees_with_the_scale_after_the_dots_for_a_power_of_two():
    """A power of two times dS is exact (outside the subnormal range), so both placements
    compute the same bits; 0.3 does not."""
    rng = np.random.default_rng(9)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    num = resolve("bf16")
    for scale, same in ((0.25, True), (0.3, False)):
        a = attention_grad(q, k, v, g, scale=scale, numerics=num)
        b = attention_grad(q, k, v, g, scale=scale, numerics=num, backward=DS["textbook"])
        assert np.array_equal(np.asarray(a.dq), np.asarray(b.dq)) is same


def test_the_scale_on_ds_is_refused_where_it_is_not_modelled():
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    with pytest.raises(InvalidArgument, match=r"backward\.scale_at: expected 'output' with the"):
        attention_grad_bound(q, k, v, g, numerics=resolve("fp32").replace(scale="qk"),
                             backward=DS["textbook"])  # fmt: skip
    with pytest.raises(
        InvalidArgument, match=r"backward\.scale_at: expected 'output' with a tensor-core"
    ):
        attention_grad_bound(q, k, v, g, numerics="tensor-core-bf16", backward=DS["textbook"])
    with pytest.raises(
        InvalidArgument, match=r"backward\.scale_at: expected 'output' for Theorem B\.3"
    ):
        dq_order_difference(q, k, v, g, numerics="fp32", backward=DS["flash2"])
    with pytest.raises(InvalidArgument, match=r"backward\.scale_at: expected one of"):
        Backward(scale_at="dq")


# dP rounded as its dot's result (Backward.dp_format, jax.nn's half-precision backward): step 4r.


@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
@pytest.mark.parametrize(
    ("preset", "dp_format"),
    [("bf16-fp32acc", "bfloat16"), ("fp16-fp32acc", "float16"), ("fp32", "bfloat16")],
)
@settings(max_examples=12)
@given(problem=_problem())
def test_every_gradient_is_within_its_bound_with_dp_rounded(preset, dp_format, algorithm, problem):
    q, k, v, g, mask, scale = problem
    bw = Backward(algorithm, block_q=4, block_k=4, dp_format=dp_format, scale_at="ds")
    assert not _violations(q, k, v, g, mask, scale, resolve(preset), bw)


@settings(max_examples=8)
@given(e=st.integers(-60, 40), tiny=st.booleans())
def test_dp_rounded_to_float16_overflows_or_flushes_with_its_reason(e, tiny):
    """v and d_out scaled over float16's range: dP rounded to float16 overflows (every gradient
    it feeds inf, with the reason) or flushes (charged), never silently."""
    rng = np.random.default_rng(e + 100)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    v, g = v * 2.0 ** (e // 2), g * 2.0 ** (e - e // 2)
    if tiny:
        g[0] = 2.0**-30
    bw = Backward("textbook", dp_format="float16")
    assert not _violations(q, k, v, g, None, None, resolve("fp16-fp32acc"), bw)
    bound = attention_grad_bound(q, k, v, g, numerics="fp16-fp32acc", backward=bw)
    if not np.isfinite(bound.dq.total).all():
        assert any("dP rounded to float16" in r for r in bound.dq.reasons)


def test_dp_format_is_refused_where_it_is_not_modelled():
    with pytest.raises(
        InvalidArgument, match=r"backward\.dp_format: expected None for Theorem B\.4"
    ):
        attention_grad_bound_a_priori(8, 8, 4, q_norm=1.0, k_norm=1.0, v_max=1.0, d_out_max=1.0,
                                      backward=Backward(dp_format="bfloat16"))  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"backward\.dp_format: expected one of bfloat16"):
        Backward(dp_format="float7")


# Each block's partial times the scale before it is added (Backward.scale_at="partials", a
# GEMM's alpha in PyTorch's CPU flash backward): step 8p.


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
@settings(max_examples=12)
@given(problem=_problem())
def test_every_gradient_is_within_its_bound_with_scaled_partials(preset, problem):
    q, k, v, g, mask, scale = problem
    bw = Backward("flash2", block_q=4, block_k=4, scale_at="partials")
    assert not _violations(q, k, v, g, mask, scale, resolve(preset), bw)


@settings(max_examples=8)
@given(e=st.integers(-140, 120), scale_exp=st.integers(-60, 8))
def test_scaled_partials_hold_across_the_exponent_range(e, scale_exp):
    rng = np.random.default_rng((e + 200) * 1000 + scale_exp + 100)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    v, g = v * 2.0**e, g * 2.0 ** (-e // 2)
    bw = Backward("flash2", block_q=4, block_k=4, scale_at="partials")
    assert not _violations(q, k, v, g, None, 0.7 * 2.0**scale_exp, resolve("fp32"), bw)


def test_scaled_partials_differ_from_one_product_and_agree_for_a_power_of_two():
    rng = np.random.default_rng(13)
    q, k, v, g = (rng.standard_normal((16, D)) for _ in range(4))
    num = resolve("fp32")
    for scale, same in ((0.25, True), (0.3, False)):
        a = attention_grad(q, k, v, g, scale=scale, numerics=num, backward=FLASH)
        b = attention_grad(q, k, v, g, scale=scale, numerics=num,
                           backward=Backward("flash2", block_q=4, block_k=4, scale_at="partials"))  # fmt: skip
        assert np.array_equal(np.asarray(a.dq), np.asarray(b.dq)) is same
