"""mhanum.testing for decoder attention: a kernel that rotates q and k itself (``rope=``) or reads
k and v back from a quantized cache (``kv_cache=``) is checked against the exact attention of the
exactly rotated, unquantized inputs. Kernels that compute as modelled (mhanum's emulation, a
``transformers``-style RoPE followed by torch's SDPA, a torch fp8/int8 cache) pass; one that
forgets a cache scale, rotates at the wrong positions or in the wrong layout is caught, with a
message that names the worst element; bad arguments are named."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import mhanum
from mhanum import InvalidArgument
from mhanum.kvcache import KVQuant
from mhanum.rope import Rope, reference_rope
from mhanum.testing import (
    KV_CACHE_KERNELS,
    KV_CACHE_NOT_MODELLED,
    AttentionMismatch,
    assert_attention_close,
    get_kernel,
    get_kv_cache,
)
from mhanum.testing import attention_oracle as oracle_of

torch = pytest.importorskip("torch")

KERNEL = "torch-sdpa-math"
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WORST = re.compile(r"worst at index \(\d+, \d+, \d+\): actual ")


def _inputs(seed: int, fmt: str, lq: int = 16, lk: int = 32, d: int = 32, heads: int = 2):
    """q, k, v of ``fmt`` (numpy), ``(heads, L, d)``."""
    rng = np.random.default_rng(seed)
    return tuple(
        rng.standard_normal((heads, n, d)).astype(np.float32).astype(NP_DTYPES[fmt])
        for n in (lq, lk, lk)
    )


def _f64(*xs):
    return tuple(np.asarray(x, np.float64) for x in xs)


def _as_modelled(fmt: str):
    """The numerics the kernel descriptor states (torch's math backend: one candidate)."""
    (num,) = get_kernel(KERNEL).candidates(fmt)
    return num


def _sdpa(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _t(x, fmt: str):
    return torch.from_numpy(np.asarray(x, np.float32)).to(TORCH_DTYPES[fmt])


# -- RoPE ---------------------------------------------------------------------------------------


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _transformers_rope(x, positions: np.ndarray, base: float):
    """``transformers``' default RoPE (``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``):
    float32 inverse frequencies, angles and cos/sin tables, stored in x's dtype, then
    ``x * cos + rotate_half(x) * sin`` in x's dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.from_numpy(positions).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return (x * cos) + (_rotate_half(x) * sin)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_a_kernel_rotating_as_its_rope_states_is_within_the_oracles_tolerance(fmt, layout):
    """mhanum's emulation of the rotation and of the descriptor's numerics, at positions past
    2^12 and for a decoding step (default positions: the query is the last key), meets the
    tolerance around the exact attention of the exactly rotated inputs."""
    q, k, v = _inputs(0, fmt)
    rope = Rope(dim=32, base=5e5, layout=layout, table_format=fmt, rotation_format=fmt)
    cases = [
        (q, (np.arange(4096, 4112), np.arange(4080, 4112))),
        (q[:, -1:], None),
    ]
    for queries, positions in cases:
        out = mhanum.attention(
            *_f64(queries, k, v), numerics=_as_modelled(fmt), rope=rope, positions=positions
        )
        assert_attention_close(out, queries, k, v, kernel=KERNEL, rope=rope, positions=positions)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_transformers_style_rope_then_torch_sdpa_is_within_the_oracles_tolerance(fmt):
    """A PyTorch RoPE as ``transformers`` computes it (float32 tables stored in the inputs'
    dtype, the rotation in that dtype) followed by torch's SDPA math backend: the ``Rope``
    states those formats, and the kernel meets the oracle's tolerance at positions 1000+."""
    q, k, v = _inputs(1, fmt)
    positions = (np.arange(1016, 1032), np.arange(1000, 1032))
    rope = Rope(dim=32, table_format=fmt, rotation_format=fmt)
    tq = _transformers_rope(_t(q, fmt), positions[0], rope.base)
    tk = _transformers_rope(_t(k, fmt), positions[1], rope.base)
    out = _sdpa(tq, tk, _t(v, fmt))
    oracle = oracle_of(q, k, v, kernel=KERNEL, rope=rope, positions=positions)
    oracle.assert_close(out)
    # the tolerance is the rotation's and the attention's, not vacuous: below max|v| everywhere
    assert np.all(oracle.tolerance < np.abs(np.asarray(v, np.float64)).max())


def test_the_oracles_exact_answer_is_the_attention_of_the_exact_rotations():
    """The oracle's tolerance covers the reference's own float64 rotation: against the
    attention of the exactly rotated inputs (200-bit mpmath rotation, then the certified
    reference), the oracle's exact answer is within its charge plus the reference's rounding,
    and the emulated kernel within the tolerance."""
    import mpmath

    from mhanum import reference
    from mhanum.rope import exact_inv_freq

    ctx = mpmath.MPContext()
    ctx.prec = 200
    q, k, v = _inputs(2, "float32", lq=4, lk=6, d=8, heads=1)
    rope = Rope(dim=8)
    positions = (np.arange(60_002, 60_006), np.arange(60_000, 60_006))
    omega = exact_inv_freq(rope, 60_006, prec=200)

    def rotated(x, pos):
        out = np.zeros_like(x, dtype=np.float64)
        for r, p in enumerate(pos):
            for j in range(8):
                partner, sign, i = (j + 4, -1, j) if j < 4 else (j - 4, 1, j - 4)
                theta = ctx.mpf(int(p)) * omega[i]
                y = ctx.mpf(float(x[0, r, j])) * ctx.cos(theta) + sign * ctx.mpf(
                    float(x[0, r, partner])
                ) * ctx.sin(theta)
                out[0, r, j] = float(y)
        return out

    rq, rk = rotated(q, positions[0]), rotated(k, positions[1])
    truth = reference.attention(rq, rk, *_f64(v))
    oracle = oracle_of(q, k, v, kernel=KERNEL, rope=rope, positions=positions)
    out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled("float32"), rope=rope,
                           positions=positions)  # fmt: skip
    # ``truth`` is itself off the exact attention: the 200-bit rotations rounded to float64
    # (2^-53 relative per entry) move each logit by at most ``delta`` (the oracle's own lemma),
    # and the certified reference rounds once more (2^-52 relative)
    g_q, g_k = 2.0**-53 * np.abs(rq), 2.0**-53 * np.abs(rk)
    moved = (g_q * (np.abs(rk) + g_k).max(axis=-2) + np.abs(rq) * g_k.max(axis=-2)).sum(-1)
    delta = moved[..., None] / math.sqrt(8) * (1 + 2.0**-40)
    slack = np.expm1(2 * delta) * np.abs(np.asarray(v, np.float64)).max() * (1 + 2.0**-40)
    slack = slack + 2.0**-52 * np.abs(truth)
    assert np.all(np.abs(np.asarray(out, np.float64) - truth) <= oracle.tolerance + slack)
    assert np.all(np.abs(oracle.exact - truth) <= oracle.tolerance + slack)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "bug", ["positions off by one", "interleaved for half", "half for interleaved"]
)
def test_a_kernel_with_the_wrong_rotation_is_caught(fmt, bug):
    """Keys rotated one position on, or pairs taken in the other layout: far outside the
    tolerance, and the message names the worst element."""
    q, k, v = _inputs(3, fmt)
    right = "interleaved" if bug == "half for interleaved" else "half"
    rope = Rope(dim=32, layout=right, table_format=fmt, rotation_format=fmt)
    positions = (np.arange(16, 32), np.arange(32))
    if bug == "positions off by one":
        used, at = rope, (positions[0], positions[1] + 1)
    else:
        wrong = "half" if right == "interleaved" else "interleaved"
        used, at = Rope(dim=32, layout=wrong, table_format=fmt, rotation_format=fmt), positions
    out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled(fmt), rope=used, positions=at)
    with pytest.raises(AttentionMismatch, match=WORST):
        assert_attention_close(out, q, k, v, kernel=KERNEL, rope=rope, positions=positions)


# -- quantized KV caches ------------------------------------------------------------------------


def _torch_cache(x, cache: KVQuant):
    """A torch cache with dynamic scales: ``(codes, scales)`` as float32 tensors, the scale
    ``absmax / code_max`` in float32 per group (token: over heads and channels; token_head:
    over channels), the quotient in float32, fp8 saturated, int8 rounded half to even."""
    x32 = x.float()
    dims = {"token": (0, 2), "token_head": (2,)}[cache.granularity]
    top = cache.code_max
    scale = x32.abs().amax(dim=dims, keepdim=True) / top
    y = x32 / scale
    if cache.format == "int8":
        codes = torch.round(y).clamp(-top, top).to(torch.int8)
    else:
        codes = y.clamp(-top, top).to(getattr(torch, cache.format))
    return codes.float(), scale


def _cached_kernel(q, k, v, cache, forget: str | None = None):
    """k and v stored in the torch cache and read back (``ŝ·c`` in float32, then the queries'
    type), then torch's SDPA; ``forget``: the scale the kernel does not apply."""
    (ck, sk), (cv, sv) = _torch_cache(k, cache), _torch_cache(v, cache)
    k_read = ck if forget == "k_scale" else ck * sk
    v_read = cv if forget == "v_scale" else cv * sv
    return _sdpa(q, k_read.to(q.dtype), v_read.to(q.dtype))


# (cache format, granularity, the forgotten scales the tolerance catches): e5m2's two
# significand bits leave the bound on the logits (d = 32, |k| up to ~12) so wide that the
# tolerance is of the order of the values themselves: a forgotten k_scale, which only moves the
# softmax weights (its output stays a mean of the values), is not certain to leave it
CACHES = [
    ("int8", "token", ("k_scale", "v_scale")),
    ("float8_e4m3fn", "token_head", ("k_scale", "v_scale")),
    ("float8_e5m2", "token", ("v_scale",)),
]


@pytest.mark.parametrize(("cache_format", "granularity", "caught"), CACHES)
@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_a_kernel_that_forgets_a_cache_scale_is_caught_and_one_that_applies_them_passes(
    cache_format, granularity, caught, fmt
):
    """A per-token cache: reading ``ŝ·c`` passes; reading the codes of K (or V) without their
    scale fails, naming the worst element (for e5m2, the forgotten v_scale only)."""
    q, k, v = _inputs(4, fmt, lq=8)
    k = (np.asarray(k, np.float32) * 3.0).astype(NP_DTYPES[fmt])  # |k| up to ~12: codes differ
    cache = KVQuant(cache_format, granularity=granularity)
    tq, tk, tv = (_t(x, fmt) for x in (q, k, v))
    oracle = oracle_of(q, k, v, kernel=KERNEL, kv_cache=cache)
    oracle.assert_close(_cached_kernel(tq, tk, tv, cache))
    for forgotten in caught:
        with pytest.raises(AttentionMismatch, match=WORST):
            oracle.assert_close(_cached_kernel(tq, tk, tv, cache, forget=forgotten))


def test_the_emulated_cache_is_within_the_tolerance_for_every_granularity():
    """mhanum's own emulation of the cache (``attention(..., kv_cache=)``) with the descriptor's
    numerics passes for every granularity."""
    q, k, v = _inputs(5, "bfloat16", lq=4)
    for granularity in ("tensor", "head", "token", "token_head"):
        cache = KVQuant("float8_e4m3fn", granularity=granularity)
        out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled("bfloat16"), kv_cache=cache)
        assert_attention_close(out, q, k, v, kernel=KERNEL, kv_cache=cache)


@pytest.mark.mhanum_kernel(KERNEL)
def test_the_plugin_fixture_forwards_the_decoder_keywords(attention_oracle):
    q, k, v = _inputs(6, "float32", lq=4, lk=8, d=16, heads=1)
    rope = Rope(dim=16)
    out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled("float32"), rope=rope)
    attention_oracle.assert_close(out, q, k, v, rope=rope)
    cache = KVQuant("int8", granularity="token")
    out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled("float32"), kv_cache=cache)
    attention_oracle.assert_close(out, q, k, v, kv_cache=cache)
    with pytest.raises(AttentionMismatch, match=WORST):  # a kernel that does not rotate
        attention_oracle.assert_close(out, q, k, v, rope=rope)


def _vllm_kernel(q, k, v, scale: float, *, forget_k_scale: bool = False):
    """vLLM's fp8 cache as read from its sources: ``x / scale`` in float32, saturated, e4m3
    codes; read back as ``(code.float() * scale).to(q.dtype)``; then an attention.
    ``forget_k_scale``: the keys' codes read without the scale."""
    s = torch.tensor(scale, dtype=torch.float32)

    def store(x):
        return (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def read(c, scaled=True):
        return ((c.float() * s) if scaled else c.float()).to(q.dtype)

    return _sdpa(q, read(store(k), not forget_k_scale), read(store(v)))


def test_the_vllm_fp8_convention_with_a_calibrated_scale():
    """``vllm-fp8-e4m3`` with the deployment's scale: a kernel that stores and reads as vLLM
    does passes; one that forgets the scale on read fails."""
    q, k, v = _inputs(7, "bfloat16", lq=4)
    scale = float(np.max(np.abs(np.asarray(k, np.float32)))) / 448.0 * 4.0
    cache = get_kv_cache("vllm-fp8-e4m3", scale=scale)
    assert math.isclose(float(cache.scale), scale)
    tq, tk, tv = (_t(x, "bfloat16") for x in (q, k, v))
    oracle = oracle_of(q, k, v, kernel=KERNEL, kv_cache=cache)
    oracle.assert_close(_vllm_kernel(tq, tk, tv, scale))
    with pytest.raises(AttentionMismatch, match=WORST):
        oracle.assert_close(_vllm_kernel(tq, tk, tv, scale, forget_k_scale=True))
    # by name, with vLLM's default scale 1.0
    out = mhanum.attention(*_f64(q, k, v), numerics=_as_modelled("bfloat16"),
                           kv_cache=KV_CACHE_KERNELS["vllm-fp8-e4m3"].cache)  # fmt: skip
    assert_attention_close(out, q, k, v, kernel=KERNEL, kv_cache="vllm-fp8-e4m3")


def _vllm_dynamic_kernel(q, k, v, *, v_divisor: float = 100.0):
    """vLLM's calc_kv_scales then its fp8 cache: ``k_scale = max|k| / 200`` and ``v_scale =
    max|v| / v_divisor`` (float32 tensors), each stored and read back with its own scale."""
    k_scale = k.abs().max() / torch.tensor(200.0, dtype=torch.float32)
    v_scale = v.abs().max() / torch.tensor(v_divisor, dtype=torch.float32)

    def cached(x, s):
        codes = (x.float() / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (codes.float() * s).to(q.dtype)

    return _sdpa(q, cached(k, k_scale), cached(v, v_scale))


def test_vllms_dynamic_scales_are_a_pair_of_caches():
    """``vllm-fp8-dynamic``: K's scale divides its absolute maximum by 200, V's by 100, so the
    two caches differ (the pair of K's and V's). A kernel computing them as vLLM does passes;
    one that reads V with K's scale fails."""
    q, k, v = _inputs(8, "bfloat16", lq=4)
    v = (np.asarray(v, np.float32) + 4.0).astype(NP_DTYPES["bfloat16"])  # outputs near 4
    k_cache, v_cache = get_kv_cache("vllm-fp8-dynamic")
    assert (k_cache.divisor, v_cache.divisor) == (200.0, 100.0)
    tq, tk, tv = (_t(x, "bfloat16") for x in (q, k, v))
    oracle = oracle_of(q, k, v, kernel=KERNEL, kv_cache="vllm-fp8-dynamic")
    oracle.assert_close(_vllm_dynamic_kernel(tq, tk, tv))
    k_scale = float(np.max(np.abs(np.asarray(k, np.float32)))) / 200.0
    v_scale = float(np.max(np.abs(np.asarray(v, np.float32)))) / 100.0
    codes = (tv.float() / v_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    wrong_v = (codes.float() * k_scale).to(tq.dtype)  # v's codes, k's scale
    k_read = ((tk.float() / k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
              * k_scale).to(tq.dtype)  # fmt: skip
    with pytest.raises(AttentionMismatch, match=WORST):
        oracle.assert_close(_sdpa(tq, k_read, wrong_v))


def _flashinfer_kernel(q, k, v, k_scale: float, v_scale: float, *, forget: str = ""):
    """FlashInfer's fp8 read as its sources state it, over a cache vLLM writes: the attention
    of the codes with ``sm_scale * k_scale`` (a Python float), then ``out *= v_scale`` in the
    output's dtype. ``forget``: ``"k"`` or ``"v"``, the scale a buggy kernel leaves out."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def codes(x, s):
        stored = (x.float() / torch.tensor(s, dtype=torch.float32)).clamp(-448.0, 448.0)
        return stored.to(torch.float8_e4m3fn).to(q.dtype)

    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if forget != "k":
        sm_scale *= k_scale
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, codes(k, k_scale), codes(v, v_scale), scale=sm_scale
        )
    if forget != "v":
        out *= v_scale
    return out


@pytest.mark.parametrize("fmt", ["bfloat16", "float32"])
def test_flashinfers_fp8_read_is_the_accumulator_placement(fmt):
    """``flashinfer-fp8-e4m3``: the kernel attends the codes, K's scale in the softmax scale
    and V's on the output (papers/kvcache.md, K.0 item 3). A kernel that computes so passes
    the certified tolerance against the exact attention of the unquantized k and v; one that
    forgets either scale fails it."""
    q, k, v = _inputs(11, fmt, lq=4)
    k_scale = float(np.max(np.abs(np.asarray(k, np.float32)))) / 448.0 * 2.0
    v_scale = float(np.max(np.abs(np.asarray(v, np.float32)))) / 448.0 * 3.0
    cache = get_kv_cache("flashinfer-fp8-e4m3", scale=k_scale, v_scale=v_scale)
    tq, tk, tv = (_t(x, fmt) for x in (q, k, v))
    oracle = oracle_of(q, k, v, kernel=KERNEL, kv_cache=cache)
    oracle.assert_close(_flashinfer_kernel(tq, tk, tv, k_scale, v_scale))
    for forget in ("k", "v"):
        with pytest.raises(AttentionMismatch, match=WORST):
            oracle.assert_close(_flashinfer_kernel(tq, tk, tv, k_scale, v_scale, forget=forget))


def test_every_kv_cache_descriptor_states_its_evidence():
    for name, desc in KV_CACHE_KERNELS.items():
        assert desc.name == name
        assert desc.evidence
        assert all(".py" in e or ".cu" in e for e in desc.evidence)
        assert desc.cache.placement == ("accumulator" if "flashinfer" in name else "operand")
        assert desc.as_dict()["cache"]["format"] == desc.cache.format
    assert "fp8 path runs" in KV_CACHE_NOT_MODELLED["vllm-flash-attn-fp8"]
    assert not set(KV_CACHE_KERNELS) & set(KV_CACHE_NOT_MODELLED)


# -- bad arguments ------------------------------------------------------------------------------

_X = np.ones((1, 4, 8), np.float32)
_Y = np.full((1, 4, 8), 0.1, np.float32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rope": {"dim": 8}}, r"rope: expected a mhanum\.rope\.Rope, got dict"),
        ({"positions": np.arange(4)}, "positions: expected only with rope="),
        (
            {"rope": Rope(dim=8), "positions": np.arange(3)},
            "positions: expected 4 positions of the queries, got 3",
        ),
        ({"rope": Rope(dim=16)}, "rope: expected a rotary dimension of at most d_k = 8"),
        (
            {"rope": Rope(dim=8), "positions": [0, -1, 2, 3]},
            "positions: expected non-negative positions",
        ),
        ({"kv_cache": "int8"}, r"kv_cache: expected a mhanum\.kvcache\.KVQuant, a pair of them"),
        ({"kv_cache": "vllm-flash-attn-fp8"}, "vllm-flash-attn-fp8 is not modelled: .*fp8"),
        ({"kv_cache": 8}, r"kv_cache: expected a mhanum\.kvcache\.KVQuant, a pair of them"),
        (
            {"kv_cache": KVQuant("int8", granularity="head", placement="accumulator")},
            r"kv_cache: expected the accumulator placement .* granularity='tensor'",
        ),
        (
            {"kv_cache": (KVQuant("int8", placement="accumulator"), KVQuant("int8"))},
            r"kv_cache: expected the accumulator placement for both k and v",
        ),
        (
            {"kv_cache": KVQuant("int8"), "rope": Rope(dim=8)},
            r"kv_cache: expected K.s cache with given scales",
        ),
        (
            {"rope": Rope(dim=8, rotation_format="bfloat16"), "q_values": _Y},
            "rope.rotation_format: expected a format that holds q exactly",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    kwargs = dict(kwargs)
    q = kwargs.pop("q_values", _X)
    with pytest.raises(InvalidArgument, match=match):
        oracle_of(q, _X, _X, kernel=KERNEL, **kwargs)


def test_bad_kv_cache_descriptor_arguments_are_named():
    with pytest.raises(InvalidArgument, match=r"kv_cache\.scale: expected positive finite"):
        get_kv_cache("vllm-fp8-e4m3", scale=-1.0)
    with pytest.raises(InvalidArgument, match="scale: expected None with a KVQuant"):
        get_kv_cache(KVQuant("int8"), scale=2.0)
    with pytest.raises(InvalidArgument, match="vllm-flash-attn-fp8 is not modelled"):
        get_kv_cache("vllm-flash-attn-fp8")


def test_the_reference_rotation_is_charged_not_assumed():
    """The charge for the float64 rotation is part of the tolerance: the tolerance with RoPE
    exceeds the bound's total by at least the rotation's charge, which is positive at large
    positions (a float64 angle off by ~p·2^-53)."""
    from mhanum.bounds import attention_bound

    q, k, v = _inputs(8, "float32", lq=4, lk=4, d=8, heads=1)
    rope = Rope(dim=8)
    positions = np.arange(2**20, 2**20 + 4)
    oracle = oracle_of(q, k, v, kernel=KERNEL, rope=rope, positions=positions)
    bound = attention_bound(*_f64(q, k, v), numerics=_as_modelled("float32"), rope=rope,
                            positions=positions)  # fmt: skip
    extra = oracle.tolerance - bound.total - 2.0**-52 * np.abs(oracle.exact)
    _, g_q = reference_rope(np.asarray(q, np.float64), positions, rope)
    assert np.all(g_q > 0)
    assert np.all(extra > 0)
