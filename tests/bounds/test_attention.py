"""mhanum.bounds.attention_bound (Theorem A.1): soundness beyond pre-rounded inputs, terms, scope."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound, mha_bound
from mhanum.numerics import PRESETS
from tests._numerics import configured


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    d_k=st.sampled_from([3, 12, 16, 20, 64]),
    preset=st.sampled_from(list(PRESETS)),
    order=st.sampled_from(["native", "sequential", "pairwise", "blocked(3)", "kahan"]),
    softmax=st.sampled_from(["naive", "safe", "online(5)"]),
    masked=st.booleans(),
)
def test_sound_on_unrounded_inputs_and_inexact_scales(seed, d_k, preset, order, softmax, masked):
    # float64 inputs that are not values of the input format, and 1/sqrt(d_k) irrational for
    # d_k not a power of 4: both roundings are terms of A.1.
    num = configured(preset, summation=order, softmax=softmax)
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((5, d_k)),
        rng.standard_normal((11, d_k)),
        rng.standard_normal((11, 3)),
    )
    mask = (rng.random((5, 11)) < 0.7) | (np.arange(11) == 0) if masked else None
    bound = attention_bound(q, k, v, mask, numerics=num)
    assume(np.isfinite(bound.total).all())
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v, mask=mask))
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"


def test_terms_add_up_and_name_the_dominant_source():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 16)) for _ in range(3))
    b = attention_bound(q, k, v, numerics="bf16-fp32acc", known_rounding=False)
    np.testing.assert_array_equal(b.total, sum(b.terms.values()))
    assert b.theorem == "A.1"
    # Unrounded float64 inputs into bfloat16 (u = 2^-8): rounding q and k moves the logits far
    # more than float32 accumulation does.
    assert b.dominant() == "logits"
    rounded = [mn.round_to(x, "bfloat16") for x in (q, k, v)]
    exact_inputs = attention_bound(*rounded, numerics="bf16-fp32acc", known_rounding=False)
    assert exact_inputs.terms["operands"].max() == 0.0
    # Bound.parts splits the logits term into the sources of the logit errors; they add up to
    # it. Rounding q and k into bfloat16 dominates it; with bfloat16 inputs that source is 0.
    parts = b.parts["logits"]
    np.testing.assert_allclose(sum(parts.values()), b.terms["logits"], rtol=1e-12)
    assert max(parts, key=lambda name: parts[name].max()) == "operands"
    assert exact_inputs.parts["logits"]["operands"].max() == 0.0
    assert exact_inputs.parts["logits"]["scale"].max() > 0  # the bfloat16 score rounding


def test_batched_bound_equals_per_slice_bounds():
    rng = np.random.default_rng(1)
    q, k, v = (
        rng.standard_normal((2, 3, 16)),
        rng.standard_normal((2, 5, 16)),
        rng.standard_normal((1, 5, 2)),
    )
    b = attention_bound(q, k, v, numerics="fp32").total
    for i in range(2):
        np.testing.assert_array_equal(
            b[i], attention_bound(q[i], k[i], v[0], numerics="fp32").total
        )


Q = np.zeros((2, 4))


def test_added_masked_logits_that_may_overflow_the_score_format_make_their_row_infinite():
    # s + M = -16 - 65504 = -65520 is float16's rounding boundary to -inf: the row that masks
    # the key may hold the leaky logit or drop it; it is infinite with the reason, the other
    # row is bounded (and, without masked keys, unaffected by the constant)
    num = Numerics(input="float16", mask_mode="add", mask_value=-65504.0)
    mask = np.array([[True, False], [True, True]])
    bias = np.array([[0.0, -16.0]])
    k, v = np.zeros((2, 4)), np.array([[1.0], [2.0]])
    bound = attention_bound(Q, k, v, mask, bias=bias, numerics=num)
    assert np.isinf(bound.total[0]).all()
    assert np.isfinite(bound.total[1]).all()
    assert any("may or may not overflow float16" in r for r in bound.reasons)
    plain = attention_bound(Q[1:], k, v, bias=bias, numerics=num.replace(mask_value=-np.inf))
    np.testing.assert_array_equal(bound.total[1:], plain.total)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {
                "numerics": Numerics(mask_mode="add", mask_value=-1e9),
                "mask": np.array([[True, False], [True, True]]),
                "bias": np.array([[-np.inf, -np.inf]]),
            },
            "bias: expected at least one key per row",
        ),
        (
            {
                "numerics": Numerics(
                    input="bf16", score_format="float32", softmax_format="bfloat16", accum="float32"
                )
            },
            "numerics.score_format",
        ),
        ({"numerics": Numerics(softmax="online(2)", softmax_format="bfloat16")}, "softmax_format"),
        ({"bias": np.array([[np.nan, 0.0]])}, "bias: expected finite values or -inf"),
        ({"numerics": 3}, "numerics: expected a Numerics"),
    ],
)
def test_outside_the_theorem_raises(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        attention_bound(Q, Q, Q, **kwargs)


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(list(PRESETS)),
    order=st.sampled_from(["native", "sequential", "pairwise", "kahan"]),
    softmax=st.sampled_from(["naive", "safe", "online(2)"]),
    n_keys=st.sampled_from([1, 2, 3, 7]),
    scale=st.sampled_from([None, 0.3, 2.0, 3.7]),
    bias_size=st.sampled_from([0.0, 1.0, 30.0]),
)
def test_sound_with_bias_short_rows_and_any_scale(
    seed, preset, order, softmax, n_keys, scale, bias_size
):
    # Short rows (Kahan's constant exceeds γ_{n-1} for n = 3), scales above one (the underflow of
    # the first score rounding is multiplied by the scale), and an additive bias with -inf entries.
    num = configured(preset, summation=order, softmax=softmax)
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((4, 8)), rng.standard_normal((n_keys, 8))
    v = rng.standard_normal((n_keys, 2))
    bias = bias_size * rng.standard_normal((4, n_keys))
    bias[:, 1:][rng.random((4, n_keys - 1)) < 0.3] = -np.inf
    bound = attention_bound(q, k, v, bias=bias, numerics=num, scale=scale)
    assume(np.isfinite(bound.total).all())
    out = np.asarray(mn.attention(q, k, v, bias=bias, numerics=num, scale=scale), np.float64)
    err = np.abs(out - reference.attention(q, k, v, bias=bias, scale=scale))
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    d_k=st.sampled_from([4, 12, 16, 20]),
    preset=st.sampled_from(list(PRESETS)),
    placement=st.sampled_from(["q", "qk"]),
    scale=st.sampled_from([None, 0.3, 2.0]),
    softmax=st.sampled_from(["naive", "safe", "online(3)"]),
)
def test_sound_with_the_scale_on_q_or_on_q_and_k(seed, d_k, preset, placement, scale, softmax):
    # The scaled operands are rounded in the scale format before the dot (step 2'); sqrt(0.3) and
    # 1/sqrt(d_k)^(1/2) are irrational, sqrt(2.0) too; d_k = 4, 16 make 1/sqrt(d_k) a power of 2.
    num = configured(preset, scale=placement, softmax=softmax)
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((4, d_k)),
        rng.standard_normal((7, d_k)),
        rng.standard_normal((7, 3)),
    )
    bound = attention_bound(q, k, v, numerics=num, scale=scale)
    assume(np.isfinite(bound.total).all())
    out = np.asarray(mn.attention(q, k, v, numerics=num, scale=scale), np.float64)
    err = np.abs(out - reference.attention(q, k, v, scale=scale))
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"


MASK_CONSTANTS = [-1e4, -1e9, -30.0, "finfo.min", "0.7*finfo.min"]


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(list(PRESETS)),
    mode=st.sampled_from(["fill", "add"]),
    value=st.sampled_from(MASK_CONSTANTS),
    softmax=st.sampled_from(["naive", "safe", "online(3)"]),
    order=st.sampled_from(["native", "sequential", "pairwise", "kahan"]),
    fully_masked_row=st.booleans(),
    logit_size=st.sampled_from([1.0, 4.0]),
)
def test_sound_with_finite_masking_constants(
    seed, preset, mode, value, softmax, order, fully_masked_row, logit_size
):
    # Finite constants leak (fill: the masked keys keep the constant; add: s + M, absorbed) and
    # a fully-masked row is the leaky problem itself: uniform (fill) or the unmasked softmax (add).
    num = configured(preset, mask_mode=mode, mask_value=value, softmax=softmax, summation=order)
    rng = np.random.default_rng(seed)
    q, k = logit_size * rng.standard_normal((4, 8)), rng.standard_normal((9, 8))
    v = rng.standard_normal((9, 2))
    mask = rng.random((4, 9)) < 0.6
    mask[:, 0] = True
    if fully_masked_row:
        mask[1] = False
    assume(not (fully_masked_row and num.mask_constant() == -np.inf))  # NaN row: refused
    bound = attention_bound(q, k, v, mask, numerics=num)
    # add-mode logits that may overflow the score format: infinite rows, with the reason
    assert np.isfinite(bound.total).all() or bound.reasons
    assume(np.isfinite(bound.total).all())
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    ref = reference.attention(q, k, v, mask=mask, fully_masked="uniform")
    if fully_masked_row and mode == "add":
        ref[1] = reference.attention(q[1:2], k, v)[0]
    err = np.abs(out - ref)
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"
    if "mask" in bound.terms:
        assert np.all(bound.terms["mask"][1] == 0.0) or not fully_masked_row


def test_the_leakage_of_a_small_fill_constant_is_the_mask_term():
    # Filling masked logits with -1 leaks O(1) probability: the bound must name it, and the
    # measured error must lie below it (and above a tenth of it: the term is tight here).
    rng = np.random.default_rng(3)
    q, k, v = (0.3 * rng.standard_normal((n, 8)) for n in (3, 16, 16))
    mask = np.array([[True] * 8 + [False] * 8] * 3)
    num = Numerics(mask_value=-1.0)
    bound = attention_bound(q, k, v, mask, numerics=num)
    assert bound.dominant() == "mask"
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v, mask=mask))
    assert np.all(err <= bound.total)
    assert np.max(err) > 0.1 * np.max(bound.total)


def test_ones_times_minus_1e9_is_covered_and_not_vacuous():
    # The seed case: an additive -1e9 on every float32 logit (every key "masked" in add mode):
    # the logits are quantised to multiples of 64, the error is O(1), and the bound, finite,
    # covers it (the leaky problem's target is the unmasked softmax).
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 16)) for _ in range(3))
    num = Numerics(mask_mode="add", mask_value=-1e9)
    mask = np.zeros((8, 8), bool)
    bound = attention_bound(q, k, v, mask, numerics=num)
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    err = np.abs(out - reference.attention(q, k, v))
    assert np.isfinite(bound.total).all()
    assert np.max(err) > 0.1
    assert np.all(err <= bound.total)
    assert np.max(err / bound.total) > 0.05


def test_subnormal_inputs_read_as_zero_are_covered():
    # float32 subnormals are values of the format, but XLA's CPU backend may read them as zero.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
    q[0, 0] = 2.0**-140
    k[1, 2] = -(2.0**-130)
    num = Numerics.preset("fp32")
    assert attention_bound(q, k, v, numerics=num).terms["logits"].min() > 0
    err = np.abs(
        np.asarray(mn.attention(q, k, v, numerics=num), np.float64) - reference.attention(q, k, v)
    )
    assert np.all(err <= attention_bound(q, k, v, numerics=num).total)


def test_a_bias_that_overflows_the_score_format_is_refused():
    q = np.zeros((2, 4))
    with pytest.raises(InvalidArgument, match="bias: expected values finite in the score format"):
        attention_bound(q, q, q, bias=np.full((2, 2), -1e9), numerics="fp16")


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    preset=st.sampled_from(list(PRESETS)),
    order=st.sampled_from(["native", "sequential", "pairwise", "blocked(3)", "kahan"]),
    softmax=st.sampled_from(["naive", "safe", "online(3)"]),
    heads=st.sampled_from([1, 2, 4]),
    masked=st.booleans(),
    x_scale=st.sampled_from([0.5, 1.0, 4.0]),
)
def test_mha_bound_is_sound(seed, preset, order, softmax, heads, masked, x_scale):
    # Unrounded float64 inputs and weights, biases in every projection, d_k = 16/heads (the scale
    # is irrational for d_k = 8), cross-attention with Lq != Lk.
    num = configured(preset, summation=order, softmax=softmax)
    rng = np.random.default_rng(seed)
    params = mn.MHAParams.random(16, seed=seed % 1000, d_kv=12, d_out=10)
    x_q = x_scale * rng.standard_normal((2, 5, 16))
    x_kv = x_scale * rng.standard_normal((2, 7, 12))
    mask = None
    if masked:
        mask = rng.random((2, heads, 5, 7)) < 0.6
        mask[..., 0] = True
    bound = mha_bound(x_q, x_kv, params, heads, mask=mask, numerics=num)
    assume(np.isfinite(bound.total).all())
    out = mn.multi_head_attention(x_q, x_kv, params, heads, mask=mask, numerics=num)
    ref = reference.multi_head_attention(x_q, x_kv, params, heads, mask=mask)
    err = np.abs(np.asarray(out, np.float64) - ref)
    assert np.all(err <= bound.total), f"{np.max(err / bound.total):.3g}"


def test_mha_bound_terms_and_one_head_against_attention_bound():
    rng = np.random.default_rng(5)
    params = mn.MHAParams.random(8, seed=2)
    x = rng.standard_normal((6, 8))
    b = mha_bound(x, x, params, 2, numerics="fp32")
    assert b.theorem == "A.2"
    assert b.total.shape == (6, 8)
    np.testing.assert_allclose(b.total, sum(b.terms.values()), rtol=1e-15)
    assert {"attention.logits", "attention.pv", "output_projection"} <= set(b.terms)
    assert all(np.all(t >= 0) for t in b.terms.values())
    # Exactly representable weights and inputs with an identity output projection: A.2 is A.1
    # on the projections plus the projection terms, so it is at least A.1 of the exact q, k, v.
    eye = mn.MHAParams(np.eye(8), np.eye(8), np.eye(8), np.eye(8))
    x32 = mn.round_to(x, "float32")
    a2 = mha_bound(x32, x32, eye, 1, numerics="fp32").total
    a1 = attention_bound(x32, x32, x32, numerics="fp32").total
    assert np.all(a2 >= a1)
    assert np.all(a2 <= 4 * a1)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.zeros((3, 8)), np.zeros((3, 8)), "params", 2), "params: expected an MHAParams"),
        ((np.zeros((3, 7)), np.zeros((3, 8)), None, 2), "x_q: expected last dimension 8"),
        ((np.zeros((3, 8)), np.zeros((3, 8)), None, 3), "num_heads"),
        ((np.full((3, 8), np.nan), np.zeros((3, 8)), None, 2), "x_q: expected finite values"),
        # before the inputs' rounding is taken exactly (A.2 (d)), not an IndexError there
        (
            (np.full(8, 0.1), np.zeros((3, 8)), None, 2),
            "x_q: expected an array with at least 2 dimensions",
        ),
    ],
)
def test_mha_bound_bad_arguments(args, match):
    params = mn.MHAParams.random(8, seed=0)
    args = tuple(params if a is None else a for a in args)
    with pytest.raises(InvalidArgument, match=match):
        mha_bound(*args)


@pytest.mark.parametrize("preset", ["fp32", "bf16", "fp16", "bf16-fp32acc"])
def test_probabilistic_variant_is_smaller_and_holds_on_random_data(preset):
    # λ = 6: each chain fails with probability <= 2e^-18 under the model; the union over the
    # 64·64·(64 + 1 + 64) chains still leaves probability >= 0.98. Round-to-nearest on random
    # data is a deterministic instance of the model, so a failure here is a (rare) model failure
    # with a fixed seed: it is either always there or never.
    rng = np.random.default_rng(11)
    num = configured(preset, summation="sequential")
    q, k, v = (mn.round_to(rng.standard_normal((64, 64)), num.input) for _ in range(3))
    det = attention_bound(q, k, v, numerics=num)
    prob = attention_bound(q, k, v, numerics=num, lam=6.0)
    assert det.probability == 1.0
    assert 0.98 <= prob.probability < 1.0
    assert prob.source == "higham2019"
    # step W's |ô| + |o| is deterministic and caps both; the P·V terms compare where it does not
    assert np.all(prob.total <= det.total)
    free = (det.terms.get("magnitudes", 0.0) == 0) & (prob.terms.get("magnitudes", 0.0) == 0)
    assert np.all(prob.terms["pv"][free] < det.terms["pv"][free])
    err = np.abs(
        np.asarray(mn.attention(q, k, v, numerics=num), np.float64) - reference.attention(q, k, v)
    )
    assert np.all(err <= prob.total)
    mha = mha_bound(q, q, mn.MHAParams.random(64, seed=1), 4, numerics=num, lam=6.0)
    assert 0 < mha.probability < prob.probability


def test_naive_softmax_with_a_huge_row_sum_is_vacuous():
    # The row sum e^87.5 + 1 exceeds 2^126: XLA's reciprocal flushes to zero and the output is 0.
    q, k, v = np.array([[87.5]]), np.array([[1.0], [0.0]]), np.array([[1.0], [2.0]])
    num = Numerics.preset("fp32").replace(softmax="naive")
    out = np.asarray(mn.attention(q, k, v, numerics=num, scale=1.0), np.float64)
    ref = reference.attention(q, k, v, scale=1.0)
    bound = attention_bound(q, k, v, numerics=num, scale=1.0).total
    assert np.all(np.abs(out - ref) <= bound)
    assert np.isinf(bound).all()


def test_probabilistic_bound_fails_where_every_rounding_goes_one_way():
    # Theorem A.3 assumes independent mean-zero rounding errors. Here every addition of the
    # sequential dot adds t = 2^-24 + 2^-34 (just over half an ulp of the running sum near 1)
    # and rounds up: the logit is off by ~1023·u, not ~λ·sqrt(1023)·u. The probabilistic bound
    # at lam = 6 (stated probability 0.9999) is exceeded; the deterministic one holds.
    d = 1024
    q = np.full((1, d), 2.0**-24 + 2.0**-34)
    q[0, 0] = 1.0
    k = np.zeros((2, d))
    k[0, :] = 1.0
    k[1, 0] = 1.0
    v = np.array([[1.0], [-1.0]])
    num = Numerics(summation="sequential")
    out = np.asarray(mn.attention(q, k, v, numerics=num, scale=1.0), np.float64)
    err = np.abs(out - reference.attention(q, k, v, scale=1.0))
    prob = attention_bound(q, k, v, numerics=num, scale=1.0, lam=6.0)
    assert prob.probability > 0.999
    assert np.all(err > prob.total)
    assert np.all(err <= attention_bound(q, k, v, numerics=num, scale=1.0).total)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mask": np.array([[True, True], [False, False]])},
        {"bias": np.array([[0.0, -np.inf], [-np.inf, -np.inf]])},
    ],
)
def test_fully_masked_rows_under_minus_inf_are_bounded_row_by_row(kwargs):
    # The NaN row gets an infinite bound with its reason; the other row is bounded as usual.
    q = k = v = np.random.default_rng(2).standard_normal((2, 2))
    bound = attention_bound(q, k, v, **kwargs)
    assert np.isinf(bound.total[1]).all()
    assert np.isfinite(bound.total[0]).all()
    assert any("fully-masked rows" in r for r in bound.reasons)
    mask = kwargs.get("mask")
    out = np.asarray(mn.attention(q, k, v, mask, bias=kwargs.get("bias")), np.float64)
    ref = reference.attention(q, k, v, mask=mask, bias=kwargs.get("bias"))
    assert np.isnan(out[1]).all()
    assert np.all(np.abs(out[0] - ref[0]) <= bound.total[0])


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "tf32"])
@pytest.mark.parametrize("softmax", ["safe", "online(2)"])
def test_a_row_with_one_key_is_charged_only_the_rounding_of_v_and_the_output(preset, softmax):
    # Its probability is exactly 1 (exp(0) = 1, 1/1 = 1): the output is v_j rounded twice.
    num = configured(preset, softmax=softmax)
    mask = np.eye(4, 5, dtype=bool)
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal((4, 3)) * 4,
        rng.standard_normal((5, 3)) * 4,
        rng.standard_normal((5, 2)),
    )
    bound = attention_bound(q, k, v, mask, numerics=num)
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    fin, fout, op = num.format_of("input"), num.format_of("output"), num.operand_rounding
    u_op = op.u if op is not None else 0.0
    rel = (1 + fin.u) * (1 + u_op) * (1 + fout.u) - 1  # v rounded to the input, operand, output
    step = rel * np.abs(v[:4]) + 2 * fin.smallest_normal + fout.smallest_normal
    assert np.all(np.abs(out - v[:4]) <= bound.total)
    assert bound.terms["logits"].max() == 0.0
    assert bound.terms["softmax"].max() == 0.0
    assert np.all(bound.total <= 1.01 * step + 1e-30)


# (tf32 is left out: its operand rounding is charged u|v| without looking at the values)
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "bf16", "fp16-fp32acc"])
@pytest.mark.parametrize("softmax", ["safe", "online(2)"])
def test_a_one_key_row_whose_values_every_format_holds_is_bounded_by_the_evaluation_only(
    preset, softmax
):
    # v in multiples of 1/8 below 4: a value of every format, so the output v_j is exact; the
    # last rounding is to nearest (step 7'), and what remains is the float64 evaluation's own
    # error (2^-40 relative), far below one unit in the last place of any format
    num = configured(preset, softmax=softmax)
    mask = np.eye(4, 5, dtype=bool)
    rng = np.random.default_rng(5)
    q, k = rng.standard_normal((4, 3)), rng.standard_normal((5, 3))
    v = rng.integers(-32, 32, (5, 2)) / 8
    bound = attention_bound(q, k, v, mask, numerics=num)
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)
    np.testing.assert_array_equal(out, v[:4])
    assert np.all(bound.total <= 2.0**-38 * np.abs(v[:4]).max())


def test_a_negative_scale_is_bounded():
    # PyTorch's SDPA tests use scale = -1e4: logits of 1e4·|q·k|, one key per row dominates.
    x = np.random.default_rng(3).standard_normal((6, 8))
    for scale in (-1e4, -0.125, 0.0):
        bound = attention_bound(x, x, x, scale=scale, numerics="bf16-fp32acc")
        out = np.asarray(mn.attention(x, x, x, scale=scale, numerics="bf16-fp32acc"), np.float64)
        assert np.isfinite(bound.total).all()
        assert np.all(np.abs(out - reference.attention(x, x, x, scale=scale)) <= bound.total)


def test_mha_bound_computes_the_rounding_of_inputs_and_weights():
    # bfloat16 inputs: the float64 weights and inputs round, and A.2 (d) takes that rounding's
    # effect from two certified references instead of bounding it
    rng = np.random.default_rng(21)
    params = mn.MHAParams.random(16, seed=4)
    x = rng.standard_normal((6, 16))
    num = Numerics.preset("bf16-fp32acc")
    exact = mha_bound(x, x, params, 2, numerics=num)
    bounded = mha_bound(x, x, params, 2, numerics=num, input_rounding="bounded")
    out = np.asarray(mn.multi_head_attention(x, x, params, 2, numerics=num), np.float64)
    err = np.abs(out - reference.multi_head_attention(x, x, params, 2))
    assert np.all(err <= exact.total)
    assert np.all(err <= bounded.total)
    assert "input_rounding" not in bounded.terms
    # the term is the references' difference, with their rounding (2^-52 relative) added
    fmt = num.format_of("input")
    xr = np.asarray(mn.round_to(x, fmt), np.float64)
    pr = dataclasses.replace(
        params,
        **{
            f.name: np.asarray(mn.round_to(getattr(params, f.name), fmt), np.float64)
            for f in dataclasses.fields(params)
        },
    )
    r_hat, r = (
        reference.multi_head_attention(xr, xr, pr, 2),
        reference.multi_head_attention(x, x, params, 2),
    )
    diff = np.abs(r_hat - r)
    term = exact.terms["input_rounding"]
    assert np.all(term >= diff)
    assert np.all(term <= (diff + 2.0**-52 * (np.abs(r_hat) + np.abs(r))) * (1 + 2.0**-49))
    # its remaining terms are A.2 of the rounded inputs and weights, which nothing rounds
    inner = mha_bound(xr, xr, pr, 2, numerics=num)
    assert "input_rounding" not in inner.terms
    np.testing.assert_array_equal(exact.total, inner.total + term)
    # inputs that are values of the format: nothing to compute, the same bound either way
    np.testing.assert_array_equal(
        inner.total, mha_bound(xr, xr, pr, 2, numerics=num, input_rounding="exact").total
    )
    with pytest.raises(InvalidArgument, match="input_rounding: expected one of"):
        mha_bound(x, x, params, 2, numerics=num, input_rounding="reference")


def test_mha_logits_term_ignores_what_the_values_share():
    # A.2 (c'): the probabilities' deviations sum to zero, so a value bias common to every key
    # moves no output through the logits; the term must not grow with it (it grew as |v|)
    rng = np.random.default_rng(22)
    base = mn.MHAParams.random(16, seed=5)
    x = rng.standard_normal((8, 16))
    terms = []
    for shift in (0.0, 100.0):
        params = mn.MHAParams(
            base.wq, base.wk, base.wv, base.wo, base.bq, base.bk, base.bv + shift, base.bo
        )
        bound = mha_bound(x, x, params, 2, numerics="fp32")
        out = np.asarray(mn.multi_head_attention(x, x, params, 2, numerics="fp32"), np.float64)
        err = np.abs(out - reference.multi_head_attention(x, x, params, 2))
        assert np.all(err <= bound.total)
        terms.append(np.max(bound.terms["attention.logits"]))
    # what stays: the float64 slack on v·ŵ (2^-40 of |v||ŵ|) and the output rounding's share
    assert terms[1] <= 2 * terms[0]


def test_a_float64_evaluation_that_overflows_gives_its_reason():
    """A one-key float64 row whose logit is -8.99e307 (found at the range edges): the bound's
    own float64 terms overflow; the entry is infinite, and ``Bound.reasons`` says why."""
    from mhanum.bounds.forward.a1 import EVALUATION_OVERFLOW

    q = np.array([[9.249179730657929e153]])
    k = np.array([[-9.718121969797847e153]])
    v = np.array([[8.988465674311579e307]])
    b = attention_bound(q, k, v, numerics="fp64")
    assert not np.all(np.isfinite(b.total))
    assert EVALUATION_OVERFLOW in b.reasons
