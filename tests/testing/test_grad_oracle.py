"""mhanum.testing's gradient oracle: no false alarm on real backward passes (torch autograd on the
CPU, ``jax.vjp``), planted bugs caught with a message naming the gradient, the worst element and
the governing term, and bad input refused by name."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mhanum import InvalidArgument, Numerics, reference
from mhanum.numerics import Backward
from mhanum.testing import (
    BACKWARD_KERNELS,
    BACKWARD_NOT_MODELLED,
    BackwardKernel,
    GradientMismatch,
    assert_attention_grad_close,
    attention_grad_tolerance,
    get_backward_kernel,
)
from mhanum.testing import attention_grad_oracle as grad_oracle

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

CASTS = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draw(rng, shape, dtype, spread=1.0):
    return (spread * rng.standard_normal(shape)).astype(np.float32).astype(CASTS[dtype])


def torch_grads(q, k, v, g, *, backend, dtype, mask=None, bias=None, causal=False, scale=None,
                gqa=False):  # fmt: skip
    from torch.nn.attention import SDPBackend, sdpa_kernel

    td = TORCH[dtype]
    t = [torch.from_numpy(np.asarray(a, np.float64)).to(td).requires_grad_(True) for a in (q, k, v)]
    attn = None
    if mask is not None:
        attn = torch.from_numpy(np.asarray(mask, bool))
    if bias is not None:
        attn = torch.from_numpy(np.asarray(bias, np.float64)).to(td).requires_grad_(True)
    chosen = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        out = torch.nn.functional.scaled_dot_product_attention(
            *t, attn_mask=attn, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    out.backward(torch.from_numpy(np.asarray(g, np.float64)).to(td))
    grads = {n: x.grad.double().numpy() for n, x in zip(("dq", "dk", "dv"), t, strict=True)}
    if bias is not None and attn.grad is not None:
        grads["dbias"] = attn.grad.double().numpy()
    return grads


def jax_grads(q, k, v, g, *, dtype, mask=None, bias=None, causal=False, scale=None):
    """``jax.vjp`` in the (B, L, H, d) layout jax.nn takes (inputs given that way)."""
    import jax.numpy as jnp

    jd = CASTS[dtype]
    args = [jnp.asarray(np.asarray(a, np.float64), dtype=jd) for a in (q, k, v)]
    jb = None if bias is None else jnp.asarray(np.asarray(bias, np.float64), dtype=jd)
    jm = None if mask is None else jnp.asarray(mask)

    def f(a, b, c, bb):
        return jax.nn.dot_product_attention(a, b, c, bias=bb, mask=jm, is_causal=causal,
                                            scale=scale)  # fmt: skip

    _, vjp = jax.vjp(f, *args, jb)
    gs = vjp(jnp.asarray(np.asarray(g, np.float64), dtype=jd))
    out = {n: np.asarray(x, np.float64) for n, x in zip(("dq", "dk", "dv"), gs[:3], strict=True)}
    if bias is not None:
        out["dbias"] = np.asarray(gs[3], np.float64)
    return out


@pytest.mark.parametrize("dtype", list(CASTS))
@pytest.mark.parametrize("kernel", ["torch-sdpa-math", "torch-sdpa-flash-cpu", "jax-xla"])
def test_real_backward_passes_raise_no_false_alarm(kernel, dtype):
    rng = np.random.default_rng(1)
    q, k, v, g = (draw(rng, (1, 2, 12, 16), dtype) for _ in range(4))
    if kernel == "jax-xla":  # the blhd layout, as jax.nn takes it
        q, k, v, g = (np.swapaxes(a, 1, 2) for a in (q, k, v, g))
        grads = jax_grads(q, k, v, g, dtype=dtype, causal=True)
        oracle = grad_oracle(q, k, v, g, is_causal=True, kernel=kernel, layout="blhd")
    else:
        backend = "math" if kernel == "torch-sdpa-math" else "flash"
        grads = torch_grads(q, k, v, g, backend=backend, dtype=dtype, causal=True)
        oracle = grad_oracle(q, k, v, g, is_causal=True, kernel=kernel)
    for name, (failing, ratio) in oracle.check(grads).items():
        assert not failing.any(), (name, float(ratio.max()))
        # the half formats' gradients do round: the comparison is not vacuous
        assert dtype == "float32" or ratio.max() > 1e-3, name
    assert set(oracle) == {"dq", "dk", "dv"}


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    kernel=st.sampled_from(["torch-sdpa-math", "torch-sdpa-flash-cpu", "jax-xla"]),
    dtype=st.sampled_from(list(CASTS)),
    lq=st.sampled_from([1, 5, 16]),
    lk=st.sampled_from([1, 7, 16]),
    masked=st.booleans(),
    biased=st.booleans(),
    spread=st.sampled_from([0.25, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
# one key (P = 1, dS = 0 exactly) and wide float16 logits with a mask and a bias
@example(kernel="jax-xla", dtype="float16", lq=5, lk=1, masked=False, biased=False, spread=1.0,
         seed=0)  # fmt: skip
@example(kernel="torch-sdpa-math", dtype="float16", lq=16, lk=16, masked=True, biased=True,
         spread=3.0, seed=1)  # fmt: skip
def test_no_false_alarm_on_drawn_inputs(kernel, dtype, lq, lk, masked, biased, spread, seed):
    rng = np.random.default_rng(seed)
    q, g = (draw(rng, (1, 2, lq, 16), dtype, spread) for _ in range(2))
    k, v = (draw(rng, (1, 2, lk, 16), dtype, spread) for _ in range(2))
    mask = None
    if masked:
        mask = rng.random((lq, lk)) < 0.7
        mask[np.arange(lq), rng.integers(0, lk, lq)] = True
    bias = draw(rng, (lq, lk), dtype) if biased and kernel != "torch-sdpa-flash-cpu" else None
    if kernel == "jax-xla":
        grads = jax_grads(*(a.swapaxes(1, 2) for a in (q, k, v, g)), dtype=dtype, mask=mask,
                          bias=bias)  # fmt: skip
        grads = {n: (x.swapaxes(1, 2) if n != "dbias" else x) for n, x in grads.items()}
    else:
        backend = "math" if kernel == "torch-sdpa-math" else "flash"
        if bias is not None and mask is not None:  # torch takes one attn_mask: -inf masks
            bias, mask = np.where(mask, bias, -np.inf).astype(bias.dtype), None
        grads = torch_grads(q, k, v, g, backend=backend, dtype=dtype, mask=mask, bias=bias)
    oracle = grad_oracle(q, k, v, g, mask=mask, bias=bias, kernel=kernel)
    for name, (failing, ratio) in oracle.check(grads).items():
        assert not failing.any(), (name, float(ratio.max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_heads_and_a_broadcast_bias_sum_their_gradients(dtype):
    rng = np.random.default_rng(3)
    q, g = (draw(rng, (1, 4, 8, 16), dtype) for _ in range(2))
    k, v = (draw(rng, (1, 2, 8, 16), dtype) for _ in range(2))
    bias = draw(rng, (8, 8), dtype)
    grads = torch_grads(q, k, v, g, backend="math", dtype=dtype, bias=bias, gqa=True)
    oracle = grad_oracle(q, k, v, g, bias=bias, enable_gqa=True, kernel="torch-sdpa-math")
    assert oracle["dk"].exact.shape == k.shape
    assert oracle["dbias"].exact.shape == bias.shape
    # the oracle's exact grouped gradient is the sum of the per-head exact gradients
    rep = [np.repeat(np.asarray(a, np.float64), 2, axis=1) for a in (k, v)]
    ref = reference.attention_grad(np.asarray(q, np.float64), *rep, np.asarray(g, np.float64),
                                   bias=np.asarray(bias, np.float64), digits=17)  # fmt: skip
    np.testing.assert_allclose(oracle["dk"].exact, ref.dk.reshape(1, 2, 2, 8, 16).sum(axis=2))
    np.testing.assert_allclose(oracle["dbias"].exact, ref.dbias.sum(axis=(0, 1)))
    for name, (failing, ratio) in oracle.check(grads).items():
        assert not failing.any(), (name, float(ratio.max()))
    # a group's gradient counted once instead of summed is caught
    with pytest.raises(GradientMismatch, match=r"^dk: "):
        oracle.assert_close({"dk": grads["dk"] / 2})


def test_a_planted_bug_names_the_gradient_the_worst_element_and_the_term():
    rng = np.random.default_rng(4)
    q, k, v, g = (draw(rng, (1, 2, 16, 16), "float32") for _ in range(4))
    grads = torch_grads(q, k, v, g, backend="flash", dtype="float32")
    oracle = grad_oracle(q, k, v, g, kernel="torch-sdpa-flash-cpu")
    bad = dict(grads)
    bad["dv"] = grads["dv"].copy()
    bad["dv"][0, 1, 3, 7] += 1e-4
    with pytest.raises(GradientMismatch) as info:
        oracle.assert_close(bad)
    text = str(info.value)
    assert text.startswith("dv: 1 of 512 elements outside the certified tolerance")
    assert "worst at index (0, 1, 3, 7)" in text
    assert "'torch-sdpa-flash-cpu'" in text
    assert "governed by the bound's" in text
    assert "dq:" not in text  # only the failing gradient is named
    # the same perturbation is within the tolerance of no element: it fails wherever it lands
    assert np.max(oracle["dv"].tolerance) < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_wrong_scale_in_the_backward_is_caught(dtype):
    """dq and dk scaled by 1.01 (a scale applied to one operand only, say): beyond rounding in
    the half formats too."""
    rng = np.random.default_rng(5)
    q, k, v, g = (draw(rng, (1, 2, 16, 16), dtype) for _ in range(4))
    grads = torch_grads(q, k, v, g, backend="flash", dtype=dtype)
    oracle = grad_oracle(q, k, v, g, kernel="torch-sdpa-flash-cpu")
    oracle.assert_close(grads)
    with pytest.raises(GradientMismatch, match="dq: "):
        oracle.assert_close({"dq": grads["dq"] * 1.01})


def test_the_blhd_layout_transposes_the_bhld_answer():
    rng = np.random.default_rng(6)
    q, k, v, g = (draw(rng, (1, 2, 8, 16), "float32") for _ in range(4))
    a = grad_oracle(q, k, v, g, kernel="jax-xla")
    b = grad_oracle(*(np.swapaxes(x, 1, 2) for x in (q, k, v, g)), kernel="jax-xla", layout="blhd")
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(np.swapaxes(b[name].tolerance, 1, 2), a[name].tolerance)
        np.testing.assert_array_equal(np.swapaxes(b[name].exact, 1, 2), a[name].exact)


def test_the_softmax_products_term_widens_jax_and_only_jax():
    """jax's softmax backward P∘dP - P∘D rounds more than P∘(dP - D): the oracle adds that
    term for it, and a descriptor with the fused form does not."""
    rng = np.random.default_rng(7)
    q, k, v, g = (draw(rng, (2, 16, 16), "float32") for _ in range(4))
    jax_kernel = get_backward_kernel("jax-xla")
    fused = BackwardKernel(
        "fused", jax_kernel.models, ("test",), scale_rule="power-of-two", grouped=None
    )
    with_products = grad_oracle(q, k, v, g, kernel=jax_kernel)
    without = grad_oracle(q, k, v, g, kernel=fused)
    for name in ("dq", "dk"):
        assert (with_products[name].tolerance > without[name].tolerance).all()
    np.testing.assert_array_equal(with_products["dv"].tolerance, without["dv"].tolerance)


def test_a_band_mask_and_is_causal_give_the_same_oracle():
    from mhanum import masks

    rng = np.random.default_rng(12)
    q, k, v, g = (draw(rng, (1, 2, 8, 16), "float32") for _ in range(4))
    a = grad_oracle(q, k, v, g, is_causal=True, kernel="torch-sdpa-flash-cpu")
    b = grad_oracle(q, k, v, g, mask=masks.causal(), kernel="torch-sdpa-flash-cpu")
    c = grad_oracle(q, k, v, g, mask=np.tril(np.ones((8, 8), bool)), kernel="torch-sdpa-flash-cpu")
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(a[name].tolerance, b[name].tolerance)
        np.testing.assert_array_equal(a[name].tolerance, c[name].tolerance)
    # and a mask changes the answer: the comparison could fail
    d = grad_oracle(q, k, v, g, kernel="torch-sdpa-flash-cpu")
    assert not np.array_equal(a["dq"].exact, d["dq"].exact)


def test_the_tolerance_function_gives_every_gradient():
    rng = np.random.default_rng(8)
    q, k, v, g = (draw(rng, (8, 16), "float32") for _ in range(4))
    b = draw(rng, (8, 8), "float32")
    tol = attention_grad_tolerance(q, k, v, g, bias=b, kernel="jax-xla")
    assert set(tol) == {"dq", "dk", "dv", "dbias"}
    assert all(np.isfinite(t).all() and (t > 0).all() for t in tol.values())
    assert tol["dbias"].shape == (8, 8)


def test_sinks_get_their_gradient_checked():
    rng = np.random.default_rng(9)
    q, k, v, g = (draw(rng, (2, 8, 16), "float32").astype(np.float64) for _ in range(4))
    sink = np.array([0.5, -1.0])
    num = Numerics(input="float32", accum="float32")
    kern = BackwardKernel("own", {"float32": ((num, Backward("textbook")),)}, ("test",))
    oracle = grad_oracle(q[None], k[None], v[None], g[None], sink=sink, kernel=kern)
    exact = reference.attention_grad(q[None], k[None], v[None], g[None], sink=sink, digits=17)
    np.testing.assert_allclose(oracle["dsink"].exact, exact.dsink.sum(axis=0))
    assert oracle["dsink"].tolerance.shape == (2,)
    oracle.assert_close({"dsink": oracle["dsink"].exact})
    with pytest.raises(GradientMismatch, match="dsink: "):
        oracle.assert_close({"dsink": oracle["dsink"].exact * (1 + 1e-3)})


def _inputs():
    rng = np.random.default_rng(10)
    return tuple(draw(rng, (1, 2, 8, 16), "float32") for _ in range(4))


BAD = [
    ({"kernel": "nope"}, "kernel: expected one of"),
    ({"kernel": "flash-attention-3"}, "flash-attention-3's backward is not modelled"),
    ({"kernel": "flash-attention-2"}, "dtype: expected one of"),
    ({"layout": "bshd"}, "layout: expected one of"),
    ({"dtype": "int8"}, "dtype: expected one of"),
    ({"kernel": "jax-xla", "scale": "big"}, "scale: expected a real number"),
    ({"kernel": "jax-xla", "sink": np.zeros(2)}, "sink: expected None for kernel 'jax-xla'"),
    ({"mask": np.zeros((8, 8), bool)}, "mask: expected every query row to attend some key"),
    (
        {"kernel": "torch-sdpa-flash-cpu", "enable_gqa": True, "k_heads": 1, "length": 40},
        "enable_gqa: expected False for kernel 'torch-sdpa-flash-cpu' with more than 32 queries",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    q, k, v, g = _inputs()
    kwargs = dict(kwargs)
    length = kwargs.pop("length", None)
    if length is not None:
        q, k, v, g = (np.concatenate([a] * 5, axis=-2)[..., :length, :] for a in (q, k, v, g))
    heads = kwargs.pop("k_heads", None)
    if heads is not None:
        k, v = k[:, :heads], v[:, :heads]
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        grad_oracle(q, k, v, g, **kwargs)


def test_bad_arrays_and_gradients_are_refused_by_name():
    q, k, v, g = _inputs()
    with pytest.raises(InvalidArgument, match=r"d_out: expected the output's shape"):
        grad_oracle(q, k, v, g[..., :4, :], kernel="jax-xla")
    with pytest.raises(
        InvalidArgument, match="q: expected a float16, bfloat16, float32 or float64 array"
    ):
        grad_oracle(q.astype(np.int32), k, v, g, kernel="jax-xla")
    with pytest.raises(InvalidArgument, match="k: expected a number of key/value heads"):
        grad_oracle(q, k[:, :1].repeat(3, axis=1), v, g, enable_gqa=True, kernel="torch-sdpa-math")
    long_q, long_g = (np.concatenate([a] * 5, axis=-2) for a in (q, g))
    with pytest.raises(InvalidArgument, match=r"q: expected at most 32 rows for bfloat16"):
        grad_oracle(long_q, k, v, long_g, kernel="torch-sdpa-flash-cpu", dtype="bfloat16")
    huge = np.full(q.shape, 1e19, np.float32)
    with pytest.raises(InvalidArgument, match=r"q: expected logits of magnitude below 2\.38e"):
        grad_oracle(huge, huge, v, g, mask=np.tril(np.ones((8, 8), bool)), kernel="jax-xla")
    oracle = grad_oracle(q, k, v, g, kernel="jax-xla")
    with pytest.raises(InvalidArgument, match="grads: expected gradients among"):
        oracle.check({"dbias": q})
    with pytest.raises(InvalidArgument, match="grads: expected names among"):
        oracle.check({"dx": q})
    with pytest.raises(InvalidArgument, match="grads: expected at least one gradient"):
        oracle.check((None, None, None))
    with pytest.raises(InvalidArgument, match="grads: expected a mapping"):
        oracle.check(q)
    with pytest.raises(InvalidArgument, match="actual: expected shape"):
        oracle.check({"dq": q[..., :4]})
    with pytest.raises(InvalidArgument, match="name: expected one of"):
        oracle["dbias"]


def test_every_descriptor_is_bounded_and_describes_itself():
    import json

    q, k, v, g = (np.asarray(a, np.float64) for a in _inputs())
    for name, kern in BACKWARD_KERNELS.items():
        assert kern.evidence
        assert name == kern.name
        json.dumps(kern.as_dict())
        for fmt in kern.formats:
            oracle = grad_oracle(q, k, v, g, kernel=kern, dtype=fmt, scale=0.25)
            assert all(np.isfinite(o.tolerance).all() for o in oracle.oracles.values()), name
    assert not set(BACKWARD_NOT_MODELLED) & set(BACKWARD_KERNELS)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("models", {}, "models: expected at least one"),
        ("models", {"float32": ((1, 2),)}, r"models\['float32'\]: expected"),
        ("scale_rule", "sometimes", "scale_rule: expected one of"),
        ("softmax_backward", "fast", "softmax_backward: expected one of"),
        ("grouped", "summed", "grouped: expected None, 'per-head' or 'one-dot'"),
        ("mask_fill", -1.0, "mask_fill: expected None or a finite number below -1e4"),
    ],
)
def test_a_bad_descriptor_is_refused_by_field(field, value, message):
    base = {
        "name": "x",
        "models": {"float32": ((Numerics(), Backward()),)},
        "evidence": ("test",),
        field: value,
    }
    with pytest.raises(InvalidArgument, match=message):
        BackwardKernel(**base)


def test_the_assert_function_matches_the_oracle():
    rng = np.random.default_rng(11)
    q, k, v, g = (draw(rng, (1, 2, 8, 16), "bfloat16") for _ in range(4))
    grads = torch_grads(q, k, v, g, backend="math", dtype="bfloat16")
    assert_attention_grad_close(grads, q, k, v, g, kernel="torch-sdpa-math")
    wrong = {**grads, "dk": -grads["dk"]}
    with pytest.raises(GradientMismatch, match=r"^dk: \d+ of 256 elements"):
        assert_attention_grad_close(wrong, q, k, v, g, kernel="torch-sdpa-math")
    assert math.isfinite(float(np.max(grad_oracle(q, k, v, g)["dq"].tolerance)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [None, 0.3, -0.2], ids=["default", "0.3", "negative"])
def test_torch_math_with_its_scale_split_over_q_and_k_is_within_the_tolerance(dtype, scale):
    """d = 64: PyTorch's math path multiplies q, k, dq and dk by sqrt(1/8) (or sqrt(|scale|)),
    which is no power of two: Numerics(scale="qk") models it (step 2' of papers/backward.md).
    Real autograd is within the tolerance; dq and dk scaled once more by sqrt(c) (a scale
    applied thrice) are not."""
    rng = np.random.default_rng(64)
    q, k, v, g = (draw(rng, (1, 2, 24, 64), dtype) for _ in range(4))
    got = torch_grads(q, k, v, g, backend="math", dtype=dtype, causal=True, scale=scale)
    oracle = grad_oracle(q, k, v, g, kernel="torch-sdpa-math", is_causal=True, scale=scale)
    oracle.assert_close(got)
    c = abs(scale) if scale is not None else 1 / 8
    with pytest.raises(GradientMismatch, match="dq: "):
        oracle.assert_close({"dq": got["dq"] * math.sqrt(c)})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale", [None, 0.3], ids=["default", "0.3"])
def test_jax_with_a_scale_that_is_no_power_of_two_is_within_the_tolerance(dtype, scale):
    """d = 128: jax.nn multiplies dS by 1/sqrt(128) (no power of two) before the dots, in
    float32: Backward(scale_at="ds") models it (steps 6s and 8s of papers/backward.md). Real
    jax.vjp is within the tolerance; dq off by a scale rounded to bfloat16 (eight times over)
    is not in float32, nor one scaled for d = 64 (a head-dim mix-up) in the half formats."""
    rng = np.random.default_rng(128)
    q, k, v, g = (draw(rng, (1, 16, 2, 128), dtype) for _ in range(4))
    got = jax_grads(q, k, v, g, dtype=dtype, causal=True, scale=scale)
    oracle = grad_oracle(q, k, v, g, kernel="jax-xla", layout="blhd", is_causal=True, scale=scale)
    oracle.assert_close(got)
    c = 1 / math.sqrt(128) if scale is None else scale
    off = (float(ml_dtypes.bfloat16(c)) / c) ** 8 if dtype == "float32" else math.sqrt(2)
    with pytest.raises(GradientMismatch, match="dq: "):
        oracle.assert_close({"dq": got["dq"] * off})


def _jax_gqa_grads(q, k, v, g, dtype, heads_order=None):
    """jax.vjp through jax.nn.dot_product_attention with 4 query heads and fewer key/value
    heads (blhd); ``heads_order`` permutes the query heads before the call (and dq back)."""
    order = np.arange(q.shape[-2]) if heads_order is None else np.asarray(heads_order)
    got = jax_grads(q[..., order, :], k, v, g[..., order, :], dtype=dtype, causal=True)
    got["dq"] = got["dq"][..., np.argsort(order), :]
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_jax_grouped_heads_are_one_dot_over_the_group(dtype, kv_heads):
    """jax.nn forms a group's dk, dv as one einsum over the group's heads and rows: the oracle
    bounds that dot (grouped='one-dot'); real jax.vjp is within the tolerance, and a kernel that
    pairs the query heads with the key/value heads interleaved (head h reads kv head h % K, not
    h // G) is caught."""
    rng = np.random.default_rng(4 + kv_heads)
    q, g = (draw(rng, (1, 12, 4, 64), dtype) for _ in range(2))
    k, v = (draw(rng, (1, 12, kv_heads, 64), dtype) for _ in range(2))
    oracle = grad_oracle(q, k, v, g, kernel="jax-xla", layout="blhd", is_causal=True,
                         enable_gqa=True)  # fmt: skip
    assert oracle["dk"].exact.shape == k.shape
    oracle.assert_close(_jax_gqa_grads(q, k, v, g, dtype))
    if kv_heads == 2:
        with pytest.raises(GradientMismatch, match="dk: "):
            oracle.assert_close(_jax_gqa_grads(q, k, v, g, dtype, heads_order=[0, 2, 1, 3]))


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default", "0.3"])
def test_torch_cpu_flash_with_a_scale_that_is_no_power_of_two_is_within_the_tolerance(scale):
    """d = 128, float32, two key blocks of 512 and several query blocks: PyTorch's CPU flash
    backward scales each block's partial with its GEMM's alpha (or its operand: the BLAS does
    not say), modelled by Backward(scale_at="partials") and ("ds"); real autograd is within the
    tolerance, and dq off by a scale rounded to bfloat16 (eight times over) is not."""
    rng = np.random.default_rng(512)
    q, g = (draw(rng, (1, 1, 96, 128), "float32") for _ in range(2))
    k, v = (draw(rng, (1, 1, 600, 128), "float32") for _ in range(2))
    got = torch_grads(q, k, v, g, backend="flash", dtype="float32", causal=False, scale=scale)
    oracle = grad_oracle(q, k, v, g, kernel="torch-sdpa-flash-cpu", scale=scale)
    oracle.assert_close(got)
    c = 1 / math.sqrt(128) if scale is None else scale
    off = (float(ml_dtypes.bfloat16(c)) / c) ** 8
    with pytest.raises(GradientMismatch, match="dq: "):
        oracle.assert_close({"dq": got["dq"] * off})
