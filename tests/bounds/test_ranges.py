"""Theorem A.1 at the edges of the formats' ranges, on drawn inputs (property tests).

The inputs come from :data:`mhanum.strategies.RANGE_STRUCTURES`: values near each format's
largest finite value and its square root, near the smallest normal number and subnormal, scales
and biases across the whole exponent range, and rows whose sums of exponentials approach the
softmax format's overflow threshold; the numerics are every preset and custom numerics in the
theorem's scope (narrower formats after wider ones, fp8 and tf32 stages, every scale placement,
masks with infinite and finite constants). The assertion is the theorem itself: where the bound is
finite the emulated output is finite and within it of the certified reference; where it is
infinite, ``Bound.reasons`` says why. Shapes are drawn from a few fixed ones, so that the jitted
attention is compiled once per numerics and shape.

A configuration the theorem refuses (``InvalidArgument``: a bias that overflows the score
format) or an input the reference cannot certify is skipped. A fully-masked row under ``-inf`` has
no exact attention: its bound must be infinite, with a reason. The inputs on which the theorem was
once found to fail are pinned at the end.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import CertificationError, InvalidArgument, Numerics, reference
from mhanum import strategies as mst
from mhanum.bounds import attention_bound

SHAPES = ((1, 1, 1, 1), (2, 4, 4, 2), (3, 16, 8, 3))
"""``(q_len, kv_len, d_k, d_v)`` of the quick tests."""

LONG_SHAPES = ((4, 64, 16, 4), (2, 256, 4, 2))
"""Longer rows, for the slow tests."""

# the ci profile's settings, and assume() may reject many drawn configurations
RANGE_SETTINGS = settings(
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

NARROW_AFTER_WIDE = {
    "float16 scores after float32 accumulation": Numerics(
        input="float32", accum="float32", score_format="float16", softmax_format="float32"
    ),
    "bfloat16 scale format, float32 inputs, scale on q": Numerics(
        scale="q", scale_format="bfloat16"
    ),
    "bfloat16 scale format, float32 inputs, scale on q and k": Numerics(
        scale="qk", scale_format="bfloat16"
    ),
    "bfloat16 inputs accumulated in float16": Numerics(input="bfloat16", accum="float16"),
    "fp8 e4m3 scores and output": Numerics(
        input="float16",
        accum="float32",
        score_format="float8_e4m3fn",
        output_format="float8_e4m3fn",
        mask_value="finfo.min",  # e4m3 has no infinity
    ),
    "fp8 e5m2 scores, probabilities and output": Numerics(
        input="bfloat16",
        accum="float32",
        score_format="float8_e5m2",
        prob_format="float8_e5m2",
        output_format="float8_e5m2",
    ),
    "tf32 operands, float16 scores, online softmax": Numerics(
        operand_format="tf32", score_format="float16", softmax="online(4)"
    ),
    "float16 everything, naive softmax": Numerics.preset("fp16").replace(softmax="naive"),
    "bfloat16 scores, float16 softmax, finite fill constant": Numerics(
        input="float16",
        accum="float16",
        score_format="bfloat16",
        mask_value="0.7*finfo.min",
    ),
}


def _reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    num: Numerics,
    mask: np.ndarray | None,
    bias: np.ndarray | None,
    scale: float | None,
    softcap: float | None = None,
) -> np.ndarray:
    """The exact attention the bound compares with (a fully-masked row under a finite constant:
    the leaky problem's own value, uniform for ``fill``, the unmasked attention for ``add``;
    under ``-inf``: NaN, where the bound is infinite)."""
    kw = {"bias": bias, "scale": scale, "softcap": softcap}
    if mask is None:
        return reference.attention(q, k, v, **kw)
    empty = ~np.asarray(mask).any(axis=-1, keepdims=True)
    if not empty.any() or not math.isfinite(num.mask_constant()):
        return reference.attention(q, k, v, mask=mask, **kw)
    if num.mask_mode == "fill":
        return reference.attention(q, k, v, mask=mask, fully_masked="uniform", **kw)
    masked = reference.attention(q, k, v, mask=mask, fully_masked="zero", **kw)
    return np.where(empty, reference.attention(q, k, v, **kw), masked)


def _theorem(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    num: Numerics,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    scale: float | None = None,
    *,
    skip: bool = True,
    softcap: float | None = None,
) -> None:
    """Theorem A.1 on one input: finite bound => finite output within it; inf => reasons.

    With ``skip``, an input the theorem refuses or the reference cannot certify is rejected
    (``assume``); without, those errors propagate.
    """
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
            bound = attention_bound(
                q, k, v, mask, bias=bias, numerics=num, scale=scale, softcap=softcap
            )
        ref = _reference(q, k, v, num, mask, bias, scale, softcap)
    except (InvalidArgument, CertificationError):
        if not skip:
            raise
        assume(False)
        raise  # unreachable: assume(False) raises
    out = mn.attention(q, k, v, mask, bias=bias, numerics=num, scale=scale, softcap=softcap)
    out = np.asarray(out, np.float64)
    total = np.asarray(bound.total, np.float64)
    finite = np.isfinite(total)
    where = f"{num.describe()}, scale {scale!r}, softcap {softcap!r}"
    assert np.isfinite(out[finite]).all(), (
        f"{where}: output {out[finite & ~np.isfinite(out)]} under the finite bound "
        f"{total[finite & ~np.isfinite(out)]}"
    )
    assert np.isfinite(ref[finite]).all(), f"{where}: a finite bound where no exact value exists"
    # out and ref of opposite signs near the largest finite number differ by more than it: the
    # difference is inf there, a violation where the bound is finite, and no error where it is not
    with np.errstate(over="ignore", invalid="ignore"):
        err = np.abs(out - ref)
    over = finite & ~(err <= total)
    assert not over.any(), (
        f"{where}: error {err[over]} above the bound {total[over]} (output {out[over]}, "
        f"reference {ref[over]})"
    )
    if not finite.all():
        assert bound.reasons, f"{where}: an infinite bound without a reason"


def _mask(data: st.DataObject, num: Numerics, q_len: int, kv_len: int) -> np.ndarray | None:
    """No mask, or one of every kind, sometimes with a fully-masked row."""
    if not data.draw(st.booleans(), label="masked"):
        return None
    empty = data.draw(st.booleans(), label="fully-masked row")
    return data.draw(mst.masks(q_len=q_len, kv_len=kv_len, fully_masked_rows=empty))


def _check_drawn(
    data: st.DataObject,
    num: Numerics,
    shapes: tuple[tuple[int, int, int, int], ...] = SHAPES,
    structure: object = "range",
    softcap: float | None = None,
) -> None:
    q_len, kv_len, d_k, d_v = data.draw(st.sampled_from(shapes), label="shape")
    x = data.draw(
        mst.attention_inputs(
            q_len=q_len, kv_len=kv_len, d_k=d_k, d_v=d_v, structure=structure, numerics=num
        )
    )
    mask = _mask(data, num, q_len, kv_len)
    _theorem(x.q, x.k, x.v, num, mask, x.bias, x.scale, softcap=softcap)


def _masked_logits_may_leave_the_softmax_range(num: Numerics, mask: np.ndarray | None) -> bool:
    """Whether the input falls in the class pinned below: a fully-masked row under a finite
    masking constant, with a score format whose range exceeds the softmax format's."""
    if mask is None or mask.any(axis=-1).all() or not math.isfinite(num.mask_constant()):
        return False
    return num.format_of("score").max_finite > num.format_of("softmax").max_finite


@pytest.mark.parametrize("preset", Numerics.presets())
@RANGE_SETTINGS
@given(data=st.data())
def test_every_preset_at_the_range_edges(preset, data):
    _check_drawn(data, Numerics.preset(preset))


@RANGE_SETTINGS
@given(data=st.data())
def test_custom_numerics_at_the_range_edges(data):
    num = data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True))
    _check_drawn(data, num)


@pytest.mark.parametrize("name", list(NARROW_AFTER_WIDE))
@RANGE_SETTINGS
@given(data=st.data())
def test_narrower_formats_after_wider_ones(name, data):
    _check_drawn(data, NARROW_AFTER_WIDE[name])


SCALE_FORMATS = {
    "scores": (
        Numerics.preset("fp16"),
        Numerics(score_format="bfloat16", softmax_format="float32"),
        Numerics(input="bfloat16", accum="float32", score_format="float8_e5m2"),
    ),
    "q": (
        Numerics(scale="q", scale_format="bfloat16"),
        Numerics(input="float16", accum="float32", scale="q"),
        Numerics(input="bfloat16", accum="float32", scale="q", scale_format="float8_e4m3fn"),
    ),
    "qk": (
        Numerics(scale="qk", scale_format="bfloat16"),
        Numerics(input="float16", accum="float16", scale="qk", softmax="online(4)"),
        Numerics(input="float32", accum="float32", scale="qk", scale_format="float16"),
    ),
}


@pytest.mark.parametrize("placement", list(SCALE_FORMATS))
@RANGE_SETTINGS
@given(data=st.data())
def test_scales_across_the_exponent_range_in_every_placement(placement, data):
    num = data.draw(st.sampled_from(SCALE_FORMATS[placement]))
    structure = data.draw(st.sampled_from([("scale_range",), ("scale_range", "near_max"),
                                           ("scale_range", "near_sqrt_max")]))  # fmt: skip
    _check_drawn(data, num, structure=structure)


SOFTMAX_SUMS = {
    "float16": Numerics(
        input="float16",
        accum="float32",
        softmax="naive",
        softmax_format="float16",
        score_format="float16",
    ),
    "bfloat16": Numerics(
        input="bfloat16", accum="float32", softmax="naive", softmax_format="bfloat16"
    ),
    "float32": Numerics(input="float16", accum="float32", softmax="naive", score_format="float16"),
}


@pytest.mark.parametrize("softmax_format", list(SOFTMAX_SUMS))
@RANGE_SETTINGS
@given(data=st.data())
def test_naive_row_sums_near_the_softmax_overflow_threshold(softmax_format, data):
    _check_drawn(data, SOFTMAX_SUMS[softmax_format], structure="softmax_sum")


@RANGE_SETTINGS
@given(data=st.data())
def test_biases_across_the_score_formats_range(data):
    num = data.draw(mst.numerics(presets=True, free=False, custom=True, bounded=True))
    structure = data.draw(st.sampled_from([("bias_range",), ("bias_range", "softmax_sum")]))
    _check_drawn(data, num, structure=structure)


EXP2_FORMS = st.sampled_from(("exp2-folded", "exp2-scaled", "exp2"))
WITHOUT_BIAS = tuple((s,) for s in mst.RANGE_STRUCTURES if s not in ("bias_range", "softmax_sum"))


@RANGE_SETTINGS
@given(data=st.data())
def test_folded_exp2_at_the_range_edges(data):
    # exp2 of fl(fl(t·c2) - fl(m·c2)): the argument's error grows with the row maximum; the
    # scaled form rescales by the difference of the scaled maxima
    num = data.draw(
        mst.numerics(presets=False, free=False, custom=True, bounded=True, exp_form=EXP2_FORMS)
    )
    structure = data.draw(st.sampled_from((*WITHOUT_BIAS, None)))
    _check_drawn(data, num, structure=structure)


@RANGE_SETTINGS
@given(data=st.data())
def test_base2_logits_with_biases_and_soft_caps_at_the_range_edges(data):
    # exp_form="exp2": the logits formed as under exp (biases across the exponent range, a
    # soft-cap), then one more product by fl(log2 e) before exp2
    num = data.draw(
        mst.numerics(presets=False, free=False, custom=True, bounded=True, exp_form="exp2")
    )
    cap = data.draw(st.sampled_from([None, 0.5, 30.0]), label="softcap")
    _check_drawn(data, num, structure=data.draw(st.sampled_from((*mst.RANGE_STRUCTURES, None))),
                 softcap=cap)  # fmt: skip


@RANGE_SETTINGS
@given(data=st.data())
def test_running_online_sums_at_the_range_edges(data):
    # FlashAttention's carried sums: one chain over every key, with or without the folded exp2
    form = data.draw(st.sampled_from(("exp", "exp2-folded", "exp2-scaled", "exp2")))
    num = data.draw(
        mst.numerics(
            presets=False,
            free=False,
            custom=True,
            bounded=True,
            exp_form=form,
            online_sums="running",
        )
    )
    structure = data.draw(st.sampled_from((*WITHOUT_BIAS, None)))
    _check_drawn(data, num, shapes=(*SHAPES, (2, 40, 8, 2)), structure=structure)


SPLITS = st.integers(1, 5)


@RANGE_SETTINGS
@given(data=st.data())
def test_split_kv_at_the_range_edges(data):
    # Theorem A.6: every split's log-sum-exp and the merge, presets and custom numerics
    num = data.draw(
        mst.numerics(presets=True, free=False, custom=True, bounded=True, kv_splits=SPLITS)
    )
    _check_drawn(data, num, shapes=(*SHAPES, (2, 40, 8, 2)))


@RANGE_SETTINGS
@given(data=st.data())
def test_lifted_probabilities_at_the_range_edges(data):
    # FlashAttention-3's Max_offset: exponentials in [0, 2^k], fp8 probabilities among others
    num = data.draw(
        mst.numerics(presets=False, free=False, custom=True, bounded=True, exp_form="exp2-folded")
    )
    assume(num.softmax_kind == "online")
    offset = data.draw(st.integers(0, 10), label="prob_offset")
    prob = data.draw(
        st.sampled_from([None, "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16"]),
        label="prob_format",
    )
    num = num.replace(prob_offset=offset, prob_format=prob)
    structure = data.draw(st.sampled_from((*WITHOUT_BIAS, None)))
    _check_drawn(data, num, shapes=(*SHAPES, (2, 40, 8, 2)), structure=structure)


# Gemma 2's caps, and caps across the exponent range (their reciprocals subnormal or past the
# largest finite value of narrow score formats)
CAPS = st.one_of(
    st.sampled_from([50.0, 30.0, 1.0]),
    st.builds(lambda e, m: m * 2.0**e, st.integers(-140, 140), st.floats(1.0, 2.0)),
)


@RANGE_SETTINGS
@given(data=st.data())
def test_soft_capped_logits_at_the_range_edges(data):
    # step 3c: c·tanh(s/c) in the score format, then the bias and the mask
    num = data.draw(mst.numerics(presets=True, free=False, custom=True, bounded=True))
    assume(num.exp_form == "exp")
    _check_drawn(data, num, softcap=data.draw(CAPS, label="softcap"))


@pytest.mark.slow
@RANGE_SETTINGS
@given(data=st.data())
def test_soft_capped_logits_at_the_range_edges_on_long_rows(data):
    num = data.draw(mst.numerics(presets=True, free=False, custom=True, bounded=True))
    assume(num.exp_form == "exp")
    _check_drawn(data, num, shapes=LONG_SHAPES, softcap=data.draw(CAPS, label="softcap"))


@RANGE_SETTINGS
@given(data=st.data())
def test_folded_split_kv_at_the_range_edges(data):
    # FlashAttention's split kernels: the folded exp2, a lift, lse = fl(m·ĉ) + log(ℓ·2^-k)
    num = data.draw(
        mst.numerics(
            presets=False,
            free=False,
            custom=True,
            bounded=True,
            exp_form="exp2-folded",
            kv_splits=SPLITS,
        )
    )
    if num.softmax_kind == "online":
        num = num.replace(prob_offset=data.draw(st.sampled_from([0, 0, 4, 8]), label="lift"))
    structure = data.draw(st.sampled_from((*WITHOUT_BIAS, None)))
    _check_drawn(data, num, shapes=(*SHAPES, (2, 40, 8, 2)), structure=structure)


@pytest.mark.slow
@RANGE_SETTINGS
@given(data=st.data())
def test_split_kv_at_the_range_edges_on_long_rows(data):
    num = data.draw(
        mst.numerics(presets=True, free=False, custom=True, bounded=True, kv_splits=SPLITS)
    )
    _check_drawn(data, num, shapes=LONG_SHAPES)


@pytest.mark.slow
@RANGE_SETTINGS
@given(data=st.data())
def test_custom_numerics_on_the_default_structures(data):
    num = data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True))
    _check_drawn(data, num, structure=None)


@pytest.mark.slow
@pytest.mark.parametrize("preset", Numerics.presets())
@RANGE_SETTINGS
@given(data=st.data())
def test_every_preset_at_the_range_edges_on_long_rows(preset, data):
    _check_drawn(data, Numerics.preset(preset), shapes=LONG_SHAPES)


@pytest.mark.slow
@RANGE_SETTINGS
@given(data=st.data())
def test_custom_numerics_at_the_range_edges_on_long_rows(data):
    num = data.draw(mst.numerics(presets=False, free=False, custom=True, bounded=True))
    _check_drawn(data, num, shapes=LONG_SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("softmax_format", list(SOFTMAX_SUMS))
@RANGE_SETTINGS
@given(data=st.data())
def test_naive_row_sums_near_the_threshold_on_long_rows(softmax_format, data):
    _check_drawn(data, SOFTMAX_SUMS[softmax_format], shapes=LONG_SHAPES, structure="softmax_sum")


# Pinned inputs on which Theorem A.1 once failed ----------------------------------------------

# A fully-masked row under a finite masking constant whose masked logits (fill: the constant M;
# add: s + M) the score format (bfloat16, tf32) holds but the float16 softmax format does not:
# every logit is read as -inf and the output is NaN (-inf - -inf in the safe softmax's shift, 0/0
# in the online one). The bound compared with the leaky problem's value and was finite; the
# read of the masked logits into the softmax format is now range-checked (papers/attention.md,
# R.4'): such rows are infinite, with the reason, and in rows that attend some key the masked
# keys whose logits are certainly read as -inf drop out.


@pytest.mark.parametrize("score_format", ["bfloat16", "tf32"])
@pytest.mark.parametrize("softmax", ["safe", "online(1)"])
@pytest.mark.parametrize("mask_value", ["finfo.min", -1e5])
def test_fully_masked_row_whose_fill_constant_overflows_the_softmax_format(
    score_format, softmax, mask_value
):
    # one query, one key, masked: the target is the leaky problem's uniform row, the mean of v;
    # the bound is 5.5e-4 (safe) or 6.1e-4 (online), the output NaN
    q = np.array([[0.0]])
    k = np.array([[0.0]])
    v = np.array([[1.0]])
    mask = np.array([[False]])
    num = Numerics(input="float16", accum="float16", score_format=score_format,
                   softmax=softmax, mask_value=mask_value)  # fmt: skip
    assert num.format_of("softmax").name == "float16"
    assert -np.inf < num.mask_constant() < -65504
    assert _masked_logits_may_leave_the_softmax_range(num, mask)
    _theorem(q, k, v, num, mask, skip=False)


@pytest.mark.parametrize("score_format", ["bfloat16", "tf32"])
@pytest.mark.parametrize("softmax", ["safe", "online(1)"])
def test_fully_masked_row_whose_added_constant_overflows_the_softmax_format(score_format, softmax):
    # the constant -6e4 is finite in float16 too, but the masked logit s + M = -1e4 - 6e4 is not;
    # the target is the unmasked attention, v = 1; the bound is 5.5e-4 (safe) or 6.1e-4
    # (online), the output NaN
    q = np.array([[100.0]])
    k = np.array([[-100.0]])
    v = np.array([[1.0]])
    mask = np.array([[False]])
    num = Numerics(input="float16", accum="float16", score_format=score_format,
                   softmax=softmax, mask_mode="add", mask_value=-6e4)  # fmt: skip
    assert -65504 < num.mask_constant() < 0
    assert _masked_logits_may_leave_the_softmax_range(num, mask)
    _theorem(q, k, v, num, mask, scale=1.0, skip=False)


def test_fully_masked_row_under_jaxs_constant_with_bfloat16_inputs_accumulated_in_float16():
    # the same class in a plain configuration: bfloat16 scores (the inputs' format), the softmax
    # in the float16 accumulation format, jax's masking constant 0.7·finfo.min of bfloat16
    q = np.array([[0.5, -1.0]])
    k = np.array([[1.0, 2.0], [-0.25, 0.75]])
    v = np.array([[1.0], [3.0]])
    mask = np.array([[False, False]])
    num = Numerics(input="bfloat16", accum="float16", mask_value="0.7*finfo.min")
    assert (num.format_of("score").name, num.format_of("softmax").name) == ("bfloat16", "float16")
    assert _masked_logits_may_leave_the_softmax_range(num, mask)
    _theorem(q, k, v, num, mask, skip=False)


@pytest.mark.parametrize("softmax", ["safe", "online(1)", "online(2)", "naive"])
@pytest.mark.parametrize(("mode", "value"), [("fill", "finfo.min"), ("add", "finfo.min")])
def test_masked_logits_read_as_minus_inf_drop_their_keys_in_rows_that_attend_some(
    softmax, mode, value
):
    # bfloat16 scores, float16 softmax: bfloat16's finfo.min (and s + it) is -inf in float16, so
    # the masked keys drop out exactly as under -inf masking; the first key is masked in every
    # row, so the online softmax starts from a block whose logits are all -inf. Rows that attend
    # some key keep a finite bound that holds; the fully-masked row is infinite, with the reason.
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 2))
    mask = rng.random((3, 6)) < 0.5
    mask[:, 0], mask[:, 3], mask[2] = False, True, False
    num = Numerics(input="float16", accum="float16", score_format="bfloat16",
                   softmax=softmax, mask_mode=mode, mask_value=value)  # fmt: skip
    bound = attention_bound(q, k, v, mask, numerics=num)
    assert np.isfinite(bound.total[:2]).all()
    assert np.isinf(bound.total[2]).all()
    assert any("read as -inf" in r for r in bound.reasons)
    _theorem(q, k, v, num, mask, skip=False)


@pytest.mark.slow
@RANGE_SETTINGS
@given(data=st.data())
def test_folded_exp2_at_the_range_edges_on_long_rows(data):
    num = data.draw(
        mst.numerics(presets=False, free=False, custom=True, bounded=True, exp_form=EXP2_FORMS)
    )
    structure = data.draw(st.sampled_from((*WITHOUT_BIAS, None)))
    _check_drawn(data, num, shapes=LONG_SHAPES, structure=structure)


def test_outputs_of_opposite_signs_near_the_largest_float64_under_an_infinite_bound():
    # found by the full profile (seed 303): a bias of the largest float64 on every logit and
    # values of ±max; the computed and exact outputs lie near ±9e307 and ±1.6e308 with opposite
    # signs, so their difference overflows. The bound is inf with its reasons, and the check
    # reads the infinite difference as no violation there (it once raised on the overflow)
    big = np.finfo(np.float64).max
    q = np.array([[2.04091912, -2.55566503, 0.41809885, -0.56776961],
                  [-0.45264929, -0.21559716, -2.01998613, -0.23193238]])  # fmt: skip
    k = np.array([[-1.73042615, 6.64599903, 0.45157323, -0.70526159],
                  [-0.56257484, -1.33609269, -2.1103011, -0.78160195],
                  [0.96389078, -0.47710721, 1.91551741, -0.39960426],
                  [0.04851913, 3.0916417, 1.09021105, -1.01045747]])  # fmt: skip
    v = np.array([[-big, big], [big, -big], [-big, big], [-big, -big]])
    bias = np.full((2, 4), big)
    num = Numerics.preset("fp64")
    with np.errstate(over="ignore", invalid="ignore"):
        bound = attention_bound(q, k, v, bias=bias, numerics=num)
    assert not np.isfinite(bound.total).any()
    assert bound.reasons
    out = np.asarray(mn.attention(q, k, v, bias=bias, numerics=num), np.float64)
    ref = _reference(q, k, v, num, None, bias, None, None)
    with np.errstate(over="ignore"):
        assert np.isinf(out - ref).any()
    _theorem(q, k, v, num, bias=bias, skip=False)


def test_an_added_mask_that_overflows_float8_e4m3fn_is_nan_not_minus_inf():
    # found by the full profile (seed 303): s + finfo.min = -100.6 - 448 overflows e4m3fn,
    # which has no infinity, so the masked logit is NaN and the naive softmax's row with it
    q = np.array([[43.19565729, -45.38571833, 220.02249806, 36.03930281],
                  [-184.03364331, 124.22897162, 448.0, 325.37749754]])  # fmt: skip
    k = np.array([[-0.70373524, -1.26542147, -0.62327446, 0.04132598],
                  [-2.32503077, -0.21879166, -1.24591095, -0.73226735],
                  [-0.54425898, -0.31630016, 0.41163054, 1.04251337],
                  [-0.12853466, 1.36646347, -0.66519467, 0.35151007]])  # fmt: skip
    v = np.array([[0.90347018, 0.0940123], [-0.74349925, -0.92172538],
                  [-0.45772583, 0.22019512], [-1.00961818, -0.20917557]])  # fmt: skip
    mask = np.array([[True, True, True, False], [True, True, True, True]])
    num = Numerics(input="float64", accum="float64", softmax="naive",
                   score_format="float8_e4m3fn", mask_mode="add", mask_value="finfo.min")  # fmt: skip
    _theorem(q, k, v, num, mask, skip=False)


def test_lifted_exponentials_past_2_to_the_k_where_the_shift_rounds():
    # found by the dev profile: logits near 2.7e8 in float32 (an ulp of 16) with prob_offset 8,
    # so fl(fl(m·c2) - 8) rounds by 16 and the largest weight is 2^16, past float8_e5m2's
    # largest finite value: inf, rescaled by 0 in the next block, is NaN
    q = np.array([[5529.04394531, -5809.37207031, 28162.88085938, 4613.03076172],
                  [-23556.30664062, 15901.30957031, 57344.0, 41648.3203125]])  # fmt: skip
    k = np.array([[-17356.75585938, -31210.05078125, -15372.29101562, 1019.25396729],
                  [-57344.0, -5396.22509766, -30728.84960938, -18060.46679688],
                  [-13423.47363281, -7801.15087891, 10152.35644531, 25712.29882812],
                  [-3170.14794922, 33702.125, -16406.20117188, 8669.55957031]])  # fmt: skip
    v = np.array([[0.90347016, 0.0940123], [-0.74349928, -0.92172539],
                  [-0.45772582, 0.22019513], [-1.00961816, -0.20917557]])  # fmt: skip
    num = Numerics(input="float32", accum="float32", softmax="online(1)", dot="bf16x1",
                   exp_form="exp2-folded", exp_ulps=2.0, div_ulps=1.0, prob_offset=8,
                   prob_format="float8_e5m2")  # fmt: skip
    _theorem(q, k, v, num, skip=False)


@pytest.mark.parametrize("form", ["exp2-folded", "exp2-scaled"])
def test_folded_scores_that_overflow_the_softmax_format_unscaled(form):
    # found by the full profile (seed 1111): the folded forms read the *unscaled* scores into
    # the softmax format; with c2 = scale·log2 e < 1 a score of 75,000 overflows float16 there
    # (inf - inf: NaN) while its product by c2, 54,000, fits. The range check took the scaled
    # scores and the bound was finite (0.21) on a NaN row
    num = Numerics(
        input="float32", accum="float32", score_format="tf32", softmax_format="float16",
        exp_form=form,
    )  # fmt: skip
    q = np.array([[300.0, 0, 0, 0], [1.0, 0, 0, 0]])
    k = np.array([[250.0, 0, 0, 0], [1.0, 0, 0, 0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0]])
    out = np.asarray(mn.attention(q, k, v, numerics=num), np.float64)
    assert np.isnan(out[0]).all()
    bound = attention_bound(q, k, v, numerics=num)
    assert np.isinf(bound.total[0]).all()
    assert any("the scores read into the softmax format" in r for r in bound.reasons)
    _theorem(q, k, v, num, skip=False)  # the second row: finite and within its bound
