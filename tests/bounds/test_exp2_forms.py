"""The base-2 softmaxes beyond FlashAttention's folded one (step 3'').

``exp_form="exp2-scaled"`` (the Triton tutorial kernel) forms ``c2 = fl(fl(scale)·fl(log2 e))``
itself, takes the maximum ``M`` of the scaled scores ``x = fl(t·c2)``, and rescales by
``exp2(fl(M - M'))``, the difference of two scaled maxima, where FlashAttention-2 scales the
difference of the unscaled ones. Its exponentials are those of ``"exp2-folded"``; Theorem A.1
charges it as the folded form. ``exp_form="exp2"`` (xFormers' memory-efficient kernel,
flex_attention) forms the logits as ``"exp"`` does (scale, bias, soft-cap) and takes them into
base 2 by one more product, ``fl(s·fl(log2 e))``. The softmax alone (``softmax_bound``) charges
every form.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics
from mhanum.bounds import attention_bound
from mhanum.bounds.softmax import softmax_bound
from mhanum.emulate._arith import runtime_zero
from mhanum.emulate.attention import Stages
from mhanum.emulate.constants import Constants

LOG2E = math.log2(math.e)
ZERO = runtime_zero(jnp.zeros((1,), jnp.float32))


def _scaled(**kw: object) -> Numerics:
    return Numerics(exp_form="exp2-scaled", **kw)


def test_the_constant_is_the_kernels_own_product():
    # a scale whose c2 differs between one rounding of scale·log2(e) and the kernel's three
    f32 = np.float32
    scale = next(
        s
        for s in (1 / math.sqrt(d) for d in range(2, 400))
        if f32(f32(s) * f32(LOG2E)) != f32(s * LOG2E)
    )
    num = _scaled(softmax="online(4)")
    st = Stages(num, ZERO, Constants.of(num, scale))
    assert float(st.c2) == float(f32(f32(scale) * f32(LOG2E)))
    num = Numerics(exp_form="exp2-folded")
    folded = Stages(num, ZERO, Constants.of(num, scale))
    assert float(folded.c2) == float(f32(scale * LOG2E)) != float(st.c2)


def test_the_rescaling_is_exp2_of_the_difference_of_the_scaled_maxima():
    num = _scaled(softmax="online(4)")
    st = Stages(num, ZERO, Constants.of(num, 0.125))
    c2 = np.float32(st.c2)
    # maxima far from zero and close together: fl(m·c2) - fl(m'·c2) and fl(m - m')·c2 differ
    m = np.asarray([[-np.inf], [1000.3], [77.77], [3.0e4]], np.float32)
    m2 = np.asarray([[5.0], [1000.9], [80.01], [3.00007e4]], np.float32)
    got = np.asarray(st.rescale(jnp.asarray(m), jnp.asarray(m2)))
    arg = np.float32(m * c2) - np.float32(m2 * c2)
    want = np.array(st.soft.exp2(jnp.asarray(arg)))
    want[0] = 0.0  # a row that has seen no finite score is not rescaled
    np.testing.assert_array_equal(got, want)
    folded = np.asarray(st.soft.exp2(jnp.asarray(np.float32(np.float32(m - m2) * c2))))
    assert np.any(got[1:] != folded[1:])


def test_the_safe_softmax_equals_the_folded_form_under_a_shared_constant():
    # one block: no rescaling, and with scale 1/2 both forms take the same c2
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((12, 8)) * 4 for _ in range(3))
    a = mn.attention(q, k, v, numerics=_scaled(softmax="safe"), scale=0.5)
    b = mn.attention(q, k, v, numerics=Numerics(exp_form="exp2-folded"), scale=0.5)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"scale": "q"}, r"^numerics.scale: expected 'scores' with exp_form='exp2-scaled'"),
        ({"softmax": "naive"}, r"^numerics.softmax: expected 'safe' or 'online\(B\)'"),
        ({"mask_value": -1e9}, r"^numerics.mask_value: expected -inf with exp_form='exp2-scaled'"),
        ({"kv_splits": 2, "softmax": "online(4)"}, r"^numerics.kv_splits: expected None with"),
        ({"prob_offset": 8, "softmax": "online(4)"}, r"^numerics.prob_offset: expected 0 unless"),
    ],
)
def test_bad_combinations_raise_naming_the_field(kw, match):
    with pytest.raises(InvalidArgument, match=match):
        _scaled(**kw)


CASES = [
    (fmt, softmax)
    for fmt in ("float32", "bfloat16", "float16")
    for softmax in ("safe", "online(4)", "online(3)")
]


@pytest.mark.parametrize(("fmt", "softmax"), CASES)
def test_growing_maxima_and_large_logits_are_covered(fmt, softmax):
    # logits that grow along the keys (every block raises the maximum: a rescaling per block)
    # on top of a large offset (the roundings of t·c2 and of the maxima about u·A)
    rng = np.random.default_rng(len(fmt) * 7 + len(softmax))
    num = _scaled(input=fmt, accum="float32", softmax=softmax, prob_format=fmt, output_format=fmt)
    ratios = []
    for offset in (0.0, 1e2, 3e4):
        a = float(mn.round_to(offset, fmt))
        q = np.zeros((10, 4))
        q[:, 0], q[:, 1] = a, np.asarray(mn.round_to(rng.uniform(0.5, 2, 10), fmt))
        k = np.zeros((24, 4))
        k[:, 0] = 1.0
        k[:, 1] = np.asarray(mn.round_to(np.linspace(0, 6, 24) + rng.uniform(0, 0.3, 24), fmt))
        v = np.asarray(mn.round_to(rng.standard_normal((24, 4)), fmt), np.float64)
        mask = rng.random((10, 24)) < 0.85
        mask[:, -1] = True
        bound = attention_bound(q, k, v, mask, numerics=num, scale=0.7)
        out = np.asarray(mn.attention(q, k, v, mask, numerics=num, scale=0.7), np.float64)
        exact = np.asarray(mn.reference.attention(q, k, v, mask=mask, scale=0.7), np.float64)
        assert np.all(np.isfinite(bound.total))
        ratios.append(float(np.max(np.abs(out - exact) / bound.total)))
    assert max(ratios) <= 1, ratios


def test_tiny_factors_of_the_constant_are_infinite_with_the_reason():
    q, k, v = (np.ones((2, 4)) for _ in range(3))
    # fl(scale) subnormal in float32 while the product c2 is normal: a kernel that flushes the
    # factor reads c2 as zero, and a masked key's -inf·0 is NaN
    bound = attention_bound(q, k, v, numerics=_scaled(softmax="online(2)"), scale=1.0e-38)
    assert np.all(np.isinf(bound.total))
    assert any("fl(scale) is subnormal or zero" in r for r in bound.reasons)


def _base2(**kw: object) -> Numerics:
    return Numerics(exp_form="exp2", **kw)


def test_the_three_base2_forms_agree_where_they_should():
    # the softmax alone has scale 1: every form's constant is fl(log2 e) and its exponentials
    # exp2(fl(fl(x·c2) - fl(m·c2))) are the same numbers; one block rescales nothing, so the
    # safe softmaxes agree bit for bit, and online the scaled and the base-2 forms still do
    rng = np.random.default_rng(2)
    x = np.asarray(mn.round_to(rng.standard_normal((5, 12)) * 30 + 100, "float32"), np.float64)
    for softmax in ("safe", "online(4)"):
        out = {f: np.asarray(mn.softmax(x, numerics=Numerics(exp_form=f, softmax=softmax)))
               for f in ("exp2-folded", "exp2-scaled", "exp2")}  # fmt: skip
        np.testing.assert_array_equal(out["exp2-scaled"], out["exp2"])
        if softmax == "safe":
            np.testing.assert_array_equal(out["exp2-folded"], out["exp2"])
    num = _base2(softmax="safe")  # the scale is on the scores: c2 is fl(log2 e) whatever it is
    st = Stages(num, ZERO, Constants.of(num, 0.125))
    assert float(st.c2) == float(np.float32(LOG2E))


@pytest.mark.parametrize(("fmt", "softmax"), CASES)
def test_the_base2_form_with_a_bias_and_large_logits_is_covered(fmt, softmax):
    rng = np.random.default_rng(len(fmt) * 3 + len(softmax))
    num = _base2(input=fmt, accum="float32", softmax=softmax, prob_format=fmt, output_format=fmt)
    for offset in (0.0, 1e2, 3e4):
        q = np.asarray(mn.round_to(rng.standard_normal((10, 8)), fmt), np.float64)
        k = np.asarray(mn.round_to(rng.standard_normal((24, 8)), fmt), np.float64)
        v = np.asarray(mn.round_to(rng.standard_normal((24, 4)), fmt), np.float64)
        # a large common bias per row: logits near the offset with a spread of a few units
        bias = offset + np.sort(rng.uniform(0, 4, (10, 24)), axis=-1)
        bias = np.asarray(mn.round_to(bias, fmt), np.float64)
        bias[:, 5] = -np.inf
        bound = attention_bound(q, k, v, bias=bias, numerics=num)
        out = np.asarray(mn.attention(q, k, v, bias=bias, numerics=num), np.float64)
        exact = np.asarray(mn.reference.attention(q, k, v, bias=bias), np.float64)
        assert np.all(np.isfinite(bound.total))
        assert np.all(np.abs(out - exact) <= bound.total), offset
    assert "exp_fold" in bound.parts["logits"]


def test_the_base2_form_refuses_what_it_does_not_model():
    with pytest.raises(InvalidArgument, match=r"^numerics.mask_value: expected -inf with exp_fo"):
        _base2(mask_value=-1e9)
    with pytest.raises(InvalidArgument, match=r"^numerics.kv_splits: expected None with exp_fo"):
        _base2(softmax="online(4)", kv_splits=2)
    q = np.ones((2, 4))
    with pytest.raises(InvalidArgument, match=r"^sink: expected None with numerics.exp_form"):
        mn.attention(q, q, q, sink=0.0, numerics=_base2())


FORMS = ("exp2-folded", "exp2-scaled", "exp2")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("softmax", ["safe", "online(4)", "online(1)"])
def test_the_softmax_alone_charges_every_base2_form(form, softmax):
    # logits near 3e4 with a spread of 4: the conversion into base 2 and the shifts' roundings
    # (about u·3e4 = 2e-3) dwarf the spread's; without their charge the bound is exceeded
    rng = np.random.default_rng(5)
    x = np.asarray(mn.round_to(3e4 + rng.uniform(0, 4, (6, 16)), "float32"), np.float64)
    x[:, 3] = -np.inf
    num = Numerics(exp_form=form, softmax=softmax)
    got = np.asarray(mn.softmax(x, numerics=num), np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    exact = e / e.sum(axis=-1, keepdims=True)
    bound = softmax_bound(x, num)
    assert np.all(np.abs(got - exact) <= bound.total)
    assert np.max(np.abs(got - exact) / bound.total) > 0.01  # and not vacuous
