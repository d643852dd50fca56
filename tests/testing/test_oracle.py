"""mhanum.testing against real kernels (torch SDPA on the CPU, jax.nn): no false alarms, and a
planted bug that moves the output beyond rounding is caught, with a message that locates it."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from mhanum import InvalidArgument
from mhanum.testing import (
    KERNELS,
    AttentionMismatch,
    PredictedOverflow,
    assert_attention_close,
    attention_oracle,
    attention_tolerance,
    get_kernel,
)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

DTYPES = {"float32": (np.float32, torch.float32), "bfloat16": (ml_dtypes.bfloat16, torch.bfloat16),
          "float16": (np.float16, torch.float16)}  # fmt: skip
SHAPES = [(1, 1, 8), (5, 7, 16), (16, 16, 64)]  # (Lq, Lk, d)


def _inputs(seed, lq, lk, d, dtype, spread=1.0):
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype][0]
    return tuple(
        (spread * rng.standard_normal(s)).astype(np.float32).astype(np_dtype)
        for s in ((lq, d), (lk, d), (lk, d))
    )


def _torch(q, k, v, mask=None, *, backend, is_causal=False, scale=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdtype = DTYPES[str(q.dtype)][1]
    tq, tk, tv = (
        torch.from_numpy(np.asarray(a, np.float32)).to(tdtype)[None, None] for a in (q, k, v)
    )
    tm = None if mask is None else torch.from_numpy(np.asarray(mask))[None, None]
    chosen = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    with torch.no_grad(), sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=tm, is_causal=is_causal, scale=scale
        )
    return out[0, 0]


def _jax(q, k, v, mask=None, *, is_causal=False):
    m = None if mask is None else jnp.asarray(mask)[None, None]
    out = jax.nn.dot_product_attention(
        jnp.asarray(q)[None, :, None], jnp.asarray(k)[None, :, None], jnp.asarray(v)[None, :, None],
        mask=m, is_causal=is_causal,
    )  # fmt: skip
    return np.asarray(out)[0, :, 0]


RUNS = {
    "torch-sdpa-math": lambda *a, **kw: _torch(*a, backend="math", **kw),
    "torch-sdpa-flash-cpu": lambda *a, **kw: _torch(*a, backend="flash", **kw),
    "jax-xla": _jax,
}


@pytest.mark.parametrize("kernel", list(RUNS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_real_kernels_lie_within_their_tolerance(kernel, dtype, shape):
    for seed, spread, causal in ((0, 1.0, False), (1, 4.0, True)):
        q, k, v = _inputs(seed, *shape, dtype, spread)
        causal = causal and shape[0] == shape[1]
        out = RUNS[kernel](q, k, v, is_causal=causal)
        assert_attention_close(out, q, k, v, kernel=kernel, is_causal=causal)


@pytest.mark.parametrize("kernel", list(RUNS))
def test_masked_rows_and_fully_masked_rows_follow_the_convention(kernel):
    q, k, v = _inputs(3, 6, 9, 16, "float32")
    mask = np.random.default_rng(4).random((6, 9)) < 0.5
    mask[2] = False  # a row that attends no key
    mask[4, 0] = True
    out = RUNS[kernel](q, k, v, mask)
    oracle = attention_oracle(q, k, v, mask=mask, kernel=kernel)
    if get_kernel(kernel).fully_masked == "zero":
        assert np.all(oracle.tolerance[2] == 0)  # the convention fixes the answer: exactly 0
        assert np.all(oracle.exact[2] == 0)
    oracle.assert_close(out)


# -- planted bugs -----------------------------------------------------------------------------


def _reference_kernel(q, k, v, mask=None, *, bug=None):
    """A small float32 safe-softmax kernel (the jax-xla model), with optional planted bugs."""
    q32, k32, v32 = (np.asarray(a, np.float32) for a in (q, k, v))
    scale = np.float32(1 / math.sqrt(q32.shape[-1]))
    if bug == "scale":
        scale = np.float32(scale * 1.01)
    s = (q32 @ k32.T) * scale
    if bug == "causal-off-by-one":
        mask = np.tril(np.ones(s.shape, bool), k=1)
    if mask is not None:
        s = np.where(mask, s, np.float32(-0.7 * np.finfo(np.float32).max))
    if bug == "drop-block":
        s[:, :4] = np.float32(-0.7 * np.finfo(np.float32).max)
    m = s.max(axis=-1, keepdims=True)
    if bug == "stale-max":  # two key blocks; the first is not rescaled when the maximum grows
        m1 = s[:, :6].max(axis=-1, keepdims=True)
        e1, e2 = np.exp(s[:, :6] - m1), np.exp(s[:, 6:] - m)
        return (e1 @ v32[:6] + e2 @ v32[6:]) / (
            e1.sum(-1, keepdims=True) + e2.sum(-1, keepdims=True)
        )
    e = np.exp(s - m)
    p = e / e.sum(axis=-1, keepdims=True)
    if bug == "bf16-probs":
        p = p.astype(ml_dtypes.bfloat16).astype(np.float32)
    out = p @ v32
    if bug == "missing-rescale":
        out = e @ v32
    return out


@pytest.mark.parametrize(
    "bug", ["scale", "drop-block", "stale-max", "bf16-probs", "missing-rescale",
            "causal-off-by-one"],
)  # fmt: skip
def test_planted_bugs_are_caught_with_a_message_that_locates_them(bug):
    q, k, v = _inputs(7, 12, 12, 32, "float32", spread=2.0)
    causal = bug == "causal-off-by-one"
    mask = np.tril(np.ones((12, 12), bool)) if causal else None
    assert_attention_close(_reference_kernel(q, k, v, mask), q, k, v, mask=mask, kernel="jax-xla")
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(
            _reference_kernel(q, k, v, mask, bug=bug), q, k, v, mask=mask, kernel="jax-xla"
        )
    text = str(info.value)
    assert "elements outside the certified tolerance of kernel 'jax-xla'" in text
    assert "worst at index (" in text
    assert "governed by the bound's" in text


def test_a_nan_where_a_number_is_due_fails():
    q, k, v = _inputs(8, 4, 4, 8, "float32")
    out = np.array(_jax(q, k, v))
    out[1, 1] = np.nan
    with pytest.raises(AttentionMismatch, match=r"1 of 32 elements .* index \(1, 1\)"):
        assert_attention_close(out, q, k, v, kernel="jax-xla")


def test_unpinned_4d_inputs_run_the_cpu_flash_kernel_which_the_math_descriptor_does_not_describe():
    # docs/testing.md: SDPA chooses its backend from the inputs; pin the one the marker names
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(17)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 32, 16), np.float32)).to(torch.bfloat16)
               for _ in range(3))  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        chosen = sdpa(q, k, v)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            flash = sdpa(q, k, v)
        with sdpa_kernel([SDPBackend.MATH]):
            math_backend = sdpa(q, k, v)
        assert torch.equal(chosen, flash)
        assert torch.equal(sdpa(q[0, 0], k[0, 0], v[0, 0]), math_backend[0, 0])  # 2-D: math
        narrow = v[..., :8].contiguous()  # v with another head dimension: math
        chosen_narrow = sdpa(q, k, narrow)
        with sdpa_kernel([SDPBackend.MATH]):
            assert torch.equal(chosen_narrow, sdpa(q, k, narrow))
    assert not torch.equal(flash, math_backend)  # the two backends round differently here
    assert_attention_close(chosen, q, k, v, kernel="torch-sdpa-flash-cpu")
    assert_attention_close(math_backend, q, k, v, kernel="torch-sdpa-math")
    with pytest.raises(AttentionMismatch):
        assert_attention_close(chosen, q, k, v, kernel="torch-sdpa-math")


# -- overflow: predicted, or a bug ------------------------------------------------------------


def _overflowing_sdpa():
    """float16 inputs whose scaled score q1·k2 is 160000, past float16's largest finite 65504,
    and torch's math backend on the CPU with its scores kept in float16 (the reduced-precision
    flag): query row 1 comes back NaN where the exact attention is finite."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 16)).astype(np.float16) for _ in range(3))
    q[1], k[2] = 200.0, 200.0
    t = [torch.from_numpy(a)[None, None] for a in (q, k, v)]
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(*t)[0, 0]
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    assert torch.isnan(out[1]).all()
    assert torch.isfinite(out[[0, 2, 3]]).all()
    return out, q, k, v


def test_an_overflow_the_model_predicts_passes_and_is_reported_with_its_term_and_reason():
    out, q, k, v = _overflowing_sdpa()
    oracle = attention_oracle(q, k, v, kernel="torch-sdpa-math-reduced")
    assert oracle.unbounded[1].all()
    assert not oracle.unbounded[[0, 2, 3]].any()
    assert oracle.reason[1, 0].startswith("QKᵀ rounded to the score format: values up to")
    assert (oracle.reason[[0, 2, 3]] == "").all()
    failing, ratio = oracle.check(out)
    assert not failing.any()
    assert (ratio[1] == 0).all()
    expected = (
        r"^kernel 'torch-sdpa-math-reduced' \(float16 inputs\) overflowed where the exact value "
        r"is finite at 16 of 64 elements; the model allows this: its bound's 'overflow' term is "
        r"infinite there \(QKᵀ rounded to the score format: values up to 1\.6e\+05 may overflow "
        r"float16 \(largest finite 65504\)\); first at index \(1, 0\): actual nan, exact "
    )
    with pytest.warns(PredictedOverflow, match=expected):
        assert_attention_close(out, q, k, v, kernel="torch-sdpa-math-reduced")
    with pytest.warns(PredictedOverflow, match=expected):
        oracle.assert_close(out)
    # a finite mismatch elsewhere still fails, and the message counts the unbounded elements
    wrong = out.clone()
    wrong[0, 0] += 0.1
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(wrong, q, k, v, kernel="torch-sdpa-math-reduced")
    text = str(info.value)
    assert text.startswith("1 of 64 elements outside the certified tolerance")
    assert "worst at index (0, 0)" in text
    assert "Besides, kernel 'torch-sdpa-math-reduced' (float16 inputs) overflowed" in text


def test_an_overflow_the_model_does_not_predict_is_a_bug():
    # the default math backend upcasts half inputs to float32: its model predicts no overflow
    out, q, k, v = _overflowing_sdpa()
    assert np.isfinite(attention_tolerance(q, k, v, kernel="torch-sdpa-math")).all()
    with pytest.raises(AttentionMismatch) as info:
        assert_attention_close(out, q, k, v, kernel="torch-sdpa-math")
    assert re.search(
        r"worst at index \(1, 0\): actual nan, exact [-0-9.]+: the kernel overflowed where the "
        r"exact value is finite and the model predicts no overflow: a bug, or a descriptor that "
        r"does not describe the kernel; the tolerance there is [0-9.e-]+, governed by the "
        r"bound's '\w+' term$",
        str(info.value),
    ), str(info.value)


def test_an_unbounded_element_that_stays_finite_passes_without_a_warning():
    _, q, k, v = _overflowing_sdpa()
    oracle = attention_oracle(q, k, v, kernel="torch-sdpa-math-reduced")
    out = np.where(oracle.unbounded, 1e4, oracle.exact)  # anything passes where nothing is proved
    oracle.assert_close(out)
    report = oracle.unbounded_report(out)
    assert report.startswith("16 of 64 elements are unbounded by the model of kernel ")
    assert "at index (1, 0), its bound's 'overflow' term is infinite there (QKᵀ" in report
    bounded = attention_oracle(q[[0]], k[[0]], v[[0]], kernel="torch-sdpa-math")
    assert bounded.unbounded_report(bounded.exact) is None


# -- a negative scale -------------------------------------------------------------------------


def _assert_rounds_the_models_value(out, inputs, model, scale):
    """``out`` (half precision) is the output format's rounding of a float32 value computed by
    ``model`` in some summation order: ``model`` with a float32 output computes ``y`` in XLA's
    order, and Theorem A.5 (``schedule_difference``: each order's A.1 around the same exact
    attention; ``native`` logits may differ, so not A.5') bounds how far another order's value
    lies from it, ``δ``; rounding
    to nearest is monotone, so ``fl(y - δ) <= out <= fl(y + δ)``: the emulation's own output
    wherever ``y`` is farther than ``δ`` from a rounding midpoint (the CPU's kernels choose the
    order: AVX2's and AVX-512's differ)."""
    import mhanum as mn
    from mhanum.bounds import schedule_difference
    from mhanum.formats import round_to

    wide = model.replace(output_format="float32")
    y = np.asarray(mn.attention(*inputs, scale=scale, numerics=wide), np.float64)
    q, k, v, mask = inputs
    delta = schedule_difference(q, k, v, mask, numerics_a=wide, numerics_b=wide, scale=scale).total
    fmt = model.format_of("output")
    lo, hi = round_to(y - delta, fmt), round_to(y + delta, fmt)
    assert np.all((lo <= out) & (out <= hi)), np.argwhere((out < lo) | (out > hi))
    exact = np.asarray(mn.attention(*inputs, scale=scale, numerics=model), np.float64)
    assert np.all((lo <= exact) & (exact <= hi))  # the emulation's own output is one of them


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_negative_scale_with_torchs_math_backend(dtype):
    # attention.cpp: q times -sqrt(|scale|), k times sqrt(|scale|): bit for bit the model's
    # rounding of -q with |scale|, so the tolerance is that model's bound
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(16)
    np_dtype, tdtype = DTYPES[dtype]
    q, k, v = (rng.standard_normal((2, 3, 9, 16)).astype(np.float32).astype(np_dtype)
               for _ in range(3))  # fmt: skip
    mask = rng.random((9, 9)) < 0.7
    mask[:, 0] = True
    t = [torch.from_numpy(np.asarray(a, np.float32)).to(tdtype) for a in (q, k, v)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(scale):
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            return torch.nn.functional.scaled_dot_product_attention(
                *t, attn_mask=torch.from_numpy(mask), scale=scale
            )

    out = sdpa(-0.3)
    oracle = attention_oracle(q, k, v, mask=mask, scale=-0.3, kernel="torch-sdpa-math")
    oracle.assert_close(out)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    (model,) = get_kernel("torch-sdpa-math").candidates(dtype)
    bound = attention_bound(-q64, k64, v64, mask, numerics=model, scale=0.3)
    exact = np.abs(oracle.exact)
    np.testing.assert_array_equal(oracle.tolerance, bound.total + 2.0**-52 * exact)
    # attention_tolerance charges the reference's rounding on max_j |v_j| >= |exact| instead
    top = np.abs(v64).max(axis=-2, keepdims=True)
    assert (top >= exact).all()
    np.testing.assert_array_equal(
        bound.total + 2.0**-52 * top,
        attention_tolerance(-q, k, v, mask=mask, scale=0.3, kernel="torch-sdpa-math"),
    )
    if dtype != "float32":  # half inputs: torch's output is the model's, rounded once
        _assert_rounds_the_models_value(out.double().numpy(), (-q64, k64, v64, mask), model, 0.3)
    with pytest.raises(AttentionMismatch):  # the sign dropped
        oracle.assert_close(sdpa(0.3))


# -- bad input --------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    q, k, v = _inputs(9, 3, 3, 8, "float32")
    with pytest.raises(InvalidArgument, match=r"^kernel: .*flash-attention-3-fp8 is not modelled"):
        attention_tolerance(q, k, v, kernel="flash-attention-3-fp8")
    with pytest.raises(InvalidArgument, match=r"^dtype: expected one of \('bfloat16', 'float16'\)"):
        attention_tolerance(q, k, v, kernel="flash-attention-2")
    with pytest.raises(InvalidArgument, match=r"^kernel: expected one of"):
        attention_tolerance(q, k, v, kernel="nope")
    with pytest.raises(InvalidArgument, match=r"^dtype: expected one of \('float32',\) for kernel"):
        attention_tolerance(q, k, v, kernel="jax-xla-tf32", dtype="bfloat16")
    with pytest.raises(InvalidArgument, match=r"^mask: expected a boolean array"):
        attention_tolerance(q, k, v, mask=np.zeros((3, 3)), kernel="jax-xla")
    out = _jax(q, k, v)
    with pytest.raises(InvalidArgument, match=r"^actual: expected shape \(3, 8\)"):
        assert_attention_close(out[:2], q, k, v, kernel="jax-xla")


def test_every_descriptor_states_its_evidence_and_models():
    for kern in KERNELS.values():
        assert kern.evidence
        assert all(len(e) > 20 for e in kern.evidence)
        assert kern.formats
        for fmt in kern.formats:
            assert kern.as_dict()["models"][fmt]
    # FlashAttention-2 takes half precision only
    assert KERNELS["flash-attention-2"].formats == ("bfloat16", "float16")


@pytest.mark.parametrize(
    "kernel",
    [
        "flash-attention-2",
        "torch-sdpa-flash-cuda",
        "torch-sdpa-efficient",
        "flex-attention",
        "flash-attention-3",
    ],
)
@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_every_flash_attention_candidate_meets_the_descriptors_tolerance(kernel, fmt):
    # no GPU here: each candidate's emulation (the kernel's arithmetic as modelled, tensor
    # cores included) must lie within the descriptor's tolerance, causal and with a long row
    import mhanum as mn

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[fmt]
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 70, 32)).astype(np.float32).astype(dt) for _ in range(3))
    oracle = attention_oracle(q, k, v, is_causal=True, kernel=kernel)
    assert np.all(np.isfinite(oracle.tolerance))
    keep = np.tril(np.ones((70, 70), bool))
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    seen = set()
    for num in get_kernel(kernel).candidates(fmt):
        # key blocks of 70 or more are one block here: the same arithmetic, emulated once
        key = (num.dot, min(num.softmax_block or 70, 70))
        if key in seen:
            continue
        seen.add(key)
        out = np.asarray(mn.attention(q64, k64, v64, keep, numerics=num), np.float64)
        failing, ratio = oracle.check(out)
        assert not failing.any(), (num.describe(), float(ratio.max()))


def test_jax_layout_with_batches_heads_and_a_per_head_mask():
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 6, 3, 8)).astype(np.float32) for _ in range(3))
    mask = rng.random((2, 3, 6, 6)) < 0.6
    mask[..., 0] = True
    out = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)))
    assert_attention_close(out, q, k, v, mask=mask, kernel="jax-xla", layout="blhd")
    with pytest.raises(AttentionMismatch):  # the same output read in the other layout is wrong
        assert_attention_close(
            np.swapaxes(out, 1, 2), np.swapaxes(q, 1, 2), np.swapaxes(k, 1, 2),
            np.swapaxes(v, 1, 2), mask=mask[:, :, ::-1], kernel="jax-xla",
        )  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"^layout: expected one of"):
        attention_tolerance(q, k, v, kernel="jax-xla", layout="bshd")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_query_attention_of_torch(dtype):
    rng = np.random.default_rng(12)
    tdtype = DTYPES[dtype][1]
    q = torch.from_numpy(rng.standard_normal((2, 6, 5, 8), np.float32)).to(tdtype)
    k, v = (torch.from_numpy(rng.standard_normal((2, 2, 5, 8), np.float32)).to(tdtype)
            for _ in range(2))  # fmt: skip
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
    assert_attention_close(out, q, k, v, is_causal=True, enable_gqa=True, kernel="torch-sdpa-math")
    with pytest.raises(AttentionMismatch):  # the groups read in the wrong order are wrong
        assert_attention_close(
            out[:, [1, 0, 3, 2, 5, 4]], q, k, v, is_causal=True, enable_gqa=True,
            kernel="torch-sdpa-math",
        )  # fmt: skip
    with pytest.raises(InvalidArgument, match=r"^k: expected a number of key/value heads"):
        attention_tolerance(q, k[:, :1].expand(2, 4, 5, 8)[:, :4], v, enable_gqa=True,
                            kernel="torch-sdpa-math")  # fmt: skip


def test_torch_multihead_attention_with_a_fully_masked_row():
    from mhanum import MHAParams
    from mhanum.adapters import torch as adapter
    from mhanum.testing import assert_mha_close, mha_oracle

    params = MHAParams.random(16, seed=2)
    layer = adapter.load(params, 4)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    mask = rng.random((2, 6, 6)) < 0.6
    mask[..., 0] = True
    mask[1, 3] = False  # a row that attends no key: SDPA's heads return 0, the layer its bias
    out = adapter.run(layer, x, x, mask, path="sdpa")
    p32 = adapter.extract(layer)
    oracle = mha_oracle(x, x, p32, 4, mask=mask[:, None], kernel="torch-sdpa-flash-cpu")
    np.testing.assert_array_equal(oracle.exact[1, 3], np.asarray(p32.bo, np.float64))
    assert np.all(oracle.tolerance[1, 3] == 0)
    assert_mha_close(out, x, x, p32, 4, mask=mask[:, None], kernel="torch-sdpa-flash-cpu")
    wrong = np.array(out)
    wrong[1, 3] += 1e-6  # the convention's answer is exact: any change is caught
    with pytest.raises(AttentionMismatch, match=r"index \(1, 3, "):
        assert_mha_close(wrong, x, x, p32, 4, mask=mask[:, None], kernel="torch-sdpa-flash-cpu")


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_the_memory_efficient_kernel_with_a_bias(fmt):
    # xFormers' kernel takes an additive bias (a boolean mask arrives as -inf in it), in the
    # input type; each candidate's emulation meets the tolerance with one, and past head
    # dimension 128 (another algorithm) no tolerance is offered
    import mhanum as mn

    dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[fmt]
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32).astype(dt) for _ in range(3))
    bias = (rng.standard_normal((2, 40, 40)) * 3).astype(np.float32).astype(dt)
    bias[:, :, 7] = -np.inf
    oracle = attention_oracle(q, k, v, bias=bias, kernel="torch-sdpa-efficient")
    assert np.all(np.isfinite(oracle.tolerance))
    q64, k64, v64, b64 = (np.asarray(a, np.float64) for a in (q, k, v, bias))
    for num in get_kernel("torch-sdpa-efficient").candidates(fmt):
        out = np.asarray(mn.attention(q64, k64, v64, bias=b64, numerics=num), np.float64)
        failing, ratio = oracle.check(out)
        assert not failing.any(), (num.describe(), float(ratio.max()))
    wide = np.zeros((3, 160), dt)
    with pytest.raises(InvalidArgument, match=r"^q: expected head dimensions <= 128 for kernel"):
        attention_tolerance(wide, wide, wide, kernel="torch-sdpa-efficient")


def test_flex_attentions_float32_candidates_with_a_bias_and_a_soft_cap():
    # flex_attention's score_mod as an additive bias or a soft-cap, then the base-2 softmax;
    # float32 dots are fused multiply-adds, within the 'ieee' dot's charge
    import mhanum as mn

    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(3))
    bias = (rng.standard_normal((2, 40, 40)) * 3).astype(np.float32)
    mask = rng.random((2, 40, 40)) < 0.7
    mask[..., 0] = True
    q64, k64, v64, b64 = (np.asarray(a, np.float64) for a in (q, k, v, bias))
    for kw in ({"bias": bias}, {"softcap": 2.0}):
        oracle = attention_oracle(q, k, v, mask=mask, kernel="flex-attention", **kw)
        assert np.all(np.isfinite(oracle.tolerance))
        emu = {"bias": b64} if "bias" in kw else kw
        for num in get_kernel("flex-attention").candidates("float32"):
            out = np.asarray(mn.attention(q64, k64, v64, mask, numerics=num, **emu), np.float64)
            failing, ratio = oracle.check(out)
            assert not failing.any(), (num.describe(), kw, float(ratio.max()))


_TORCH_FLOATS = [
    name
    for name in ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
]  # fmt: skip


@pytest.mark.parametrize("name", _TORCH_FLOATS)
def test_a_tensor_is_read_exactly_in_every_format_torch_holds(name):
    from mhanum.testing.oracle import as_float64

    dtype = getattr(torch, name)
    if torch.finfo(dtype).bits == 8:  # every bit pattern
        t = torch.arange(256, dtype=torch.uint8).view(dtype)
    else:  # the extremes of the format and random values over its range
        info = torch.finfo(dtype)
        edges = [info.max, -info.max, info.tiny, info.tiny / 4, info.eps, 1.0, -0.0, 0.0]
        spread = torch.tensor(np.random.default_rng(0).standard_normal(200) * 1e3)
        t = torch.cat([torch.tensor(edges, dtype=torch.float64), spread]).to(dtype)
        t = t.reshape(8, 26).T  # (not contiguous)
    got = as_float64(t, "q")
    want = t.double().numpy()
    assert got.dtype == np.float64
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fine = ~np.isnan(want)
    np.testing.assert_array_equal(got[fine], want[fine])
    np.testing.assert_array_equal(np.signbit(got[fine]), np.signbit(want[fine]))


@pytest.mark.parametrize("tensor", [torch.tensor([[1, 2]]), torch.tensor([[True, False]])])
def test_a_tensor_of_integers_or_bools_is_refused_naming_the_argument(tensor):
    from mhanum.testing.oracle import as_float64

    with pytest.raises(InvalidArgument, match=r"^q: expected a floating-point array, got dtype"):
        as_float64(tensor, "q")
