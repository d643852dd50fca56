"""A quantized KV cache as a numerical stage (``mhanum.kvcache``, papers/kvcache.md): Theorem
K.1 against the exact entries, for both ways of dividing by the scale, against torch's own fp8
conversion, at the edges of the formats, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum import InvalidArgument
from mhanum.formats import get_format, round_to
from mhanum.kvcache import (
    GRANULARITIES,
    KV_FORMATS,
    PLACEMENTS,
    KVQuant,
    dequantize,
    kv_error,
    quantize,
    scales,
)


def _cache(seed: int, fmt: str = "bfloat16") -> np.ndarray:
    """``(batch, heads, tokens, d)`` with channels over 28 binades, a zero token and a zero
    head (dynamic scales of an all-zero group), one outlier channel."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 16, 8)) * np.exp2(rng.integers(-20, 8, (1, 1, 1, 8)))
    x[0, 0, 3] = 0.0
    x[1, 2] = 0.0
    x[..., 5] *= 2.0**6
    return round_to(x, fmt)


def _reciprocal_kernel(x: np.ndarray, q: KVQuant) -> np.ndarray:
    """A kernel that multiplies by the rounded reciprocal of the scale (two roundings)."""
    s = scales(x, q)
    inv = round_to(1.0 / s, "float32")
    y = round_to(x * inv, "float32")
    top = q.code_max
    c = (
        np.clip(np.rint(y), -top, top)
        if q.format == "int8"
        else round_to(np.clip(y, -top, top), q.format)
    )
    return round_to(c * s, "float32") if q.placement == "operand" else c * s


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_read_entries_are_within_theorem_k1(fmt: str, granularity: str, placement: str) -> None:
    """K.1: the entries read back (the operand, or ``ŝ·c`` before the accumulator's product)
    are within ``kv_error`` of the exact ones, whether the kernel divides by the scale or
    multiplies by its reciprocal; and the bound is not vacuous (median within 200x)."""
    for seed in range(3):
        x = _cache(seed)
        q = KVQuant(fmt, granularity=granularity, placement=placement)
        codes, s = quantize(x, q)
        divided = dequantize(codes, s, q) if placement == "operand" else codes * s
        bound = kv_error(x, q)
        for read in (divided, _reciprocal_kernel(x, q)):
            assert np.all(np.abs(read - x) <= bound)
        err = np.abs(divided - x)
        assert np.median(bound[err > 0] / err[err > 0]) <= 200


def test_the_codes_are_torchs_own_fp8_conversion() -> None:
    """The emulated fp8 codes are what ``torch``'s ``float8`` dtypes store for the same quotients."""
    torch = pytest.importorskip(
        "torch", reason="torch is not installed: pip install -e .[frameworks]"
    )
    x = _cache(0)
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        q = KVQuant(fmt, granularity="token_head")
        codes, s = quantize(x, q)
        quotient = torch.tensor(round_to(x / s, "float32"), dtype=torch.float32)
        top = q.code_max
        stored = quotient.clamp(-top, top).to(getattr(torch, fmt)).double().numpy()
        assert np.array_equal(stored, codes)


def test_given_scales_that_saturate_are_charged_and_unsaturated_overflow_is_infinite() -> None:
    """A given scale too small for the values: saturated codes are clipped (charged exactly);
    without saturation the entries that may overflow get an infinite bound."""
    x = np.full((1, 1, 4, 4), 1000.0)
    x[0, 0, 0] = [0.5, -2.0, 3.0, 0.0]
    q = KVQuant("float8_e4m3fn", scale=1.0)
    codes, s = quantize(x, q)
    err = np.abs(dequantize(codes, s, q) - x)
    bound = kv_error(x, q)
    assert np.all(err <= bound)
    assert err.max() == pytest.approx(1000.0 - 448.0)
    unsat = kv_error(x, KVQuant("float8_e4m3fn", scale=1.0, saturate=False))
    assert np.all(np.isinf(unsat[0, 0, 1:]))
    assert np.all(np.isfinite(unsat[0, 0, 0]))


def test_dynamic_scales_are_absmax_over_the_divisor_per_group() -> None:
    x = _cache(1)
    q = KVQuant("int8", granularity="token")
    s = scales(x, q)
    assert s.shape == (2, 1, 16, 1)
    expected = round_to(np.max(np.abs(x), axis=(1, 3), keepdims=True) / 127.0, "float32")
    assert np.array_equal(s, np.where(expected > 0, expected, 1.0))
    assert scales(x, KVQuant("float8_e4m3fn", granularity="tensor")).shape == (1, 1, 1, 1)
    vllm_like = KVQuant("float8_e4m3fn", divisor=200.0)
    assert float(scales(x, vllm_like).item()) == pytest.approx(np.abs(x).max() / 200, rel=2**-23)


def test_a_kernel_that_forgets_the_scale_is_far_outside_the_bound() -> None:
    """Reading the codes without ``k_scale`` (a known bug class) is off by far more than K.1."""
    x = _cache(2)
    q = KVQuant("float8_e4m3fn", granularity="head")
    codes, _ = quantize(x, q)
    forgot = np.abs(codes - x)
    assert np.max(forgot / kv_error(x, q)) > 100


def test_the_accumulator_placement_states_its_extra_rounding() -> None:
    assert KVQuant("int8", placement="accumulator").accumulator_rounding == get_format("float32").u
    assert KVQuant("int8").accumulator_rounding == 0.0


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: KVQuant("int4"), "kv_cache.format: expected one of"),
        (lambda: KVQuant("int8", granularity="channel"), "kv_cache.granularity: expected one of"),
        (lambda: KVQuant("int8", placement="probs"), "kv_cache.placement"),
        (lambda: KVQuant("int8", scale=0.0), "kv_cache.scale: expected positive finite scales"),
        (lambda: KVQuant("int8", scale=[1.0, np.nan]), "kv_cache.scale: expected positive finite"),
        (lambda: KVQuant("int8", scale=-1.0), "kv_cache.scale"),
        (lambda: KVQuant("int8", scale="abc"), "kv_cache.scale: expected positive finite"),
        (lambda: KVQuant("int8", divisor=0), "kv_cache.divisor"),
        (lambda: KVQuant("int8", scale_format="float12"), "kv_cache.scale_format"),
        (lambda: kv_error(np.ones((4, 4)), KVQuant("int8")), "x: expected a cache shaped"),
        (lambda: kv_error(np.full((1, 2, 2), np.inf), KVQuant("int8")), "x: expected finite"),
        (
            lambda: scales(
                np.ones((1, 2, 3, 4)), KVQuant("int8", granularity="head", scale=[1.0, 2.0, 3.0])
            ),
            r"kv_cache.scale: expected scales broadcastable to \(1, 2, 1, 1\)",
        ),
    ],
)
def test_bad_input_is_refused_by_name(make, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        make()


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
def test_attention_over_a_quantized_cache_is_within_theorem_a1_with_k1(
    fmt: str, preset: str
) -> None:
    """``attention_bound(..., kv_cache=)``: the emulated kernel (k and v stored in the cache and
    read back, then the attention's numerics) is within the bound of the exact attention of the
    given k and v; a kernel that forgets the scales (reads the codes) is far outside it."""
    import mhanum
    from mhanum import reference
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(KV_FORMATS.index(fmt))
    q, k, v = (round_to(rng.standard_normal((2, 16, 8)), "bfloat16") for _ in range(3))
    k[..., 2] *= 16.0  # an outlier channel
    exact = reference.attention(q, k, v)
    for granularity in GRANULARITIES:
        cache = KVQuant(fmt, granularity=granularity)
        out = np.asarray(mhanum.attention(q, k, v, numerics=preset, kv_cache=cache), np.float64)
        bound = attention_bound(q, k, v, numerics=preset, kv_cache=cache).total
        assert np.all(np.abs(out - exact) <= bound + 2.0**-52 * np.abs(exact))
    codes_k, _ = quantize(k, KVQuant(fmt, granularity="head"))
    codes_v, _ = quantize(v, KVQuant(fmt, granularity="head"))
    forgot = np.asarray(mhanum.attention(q, codes_k, codes_v, numerics=preset), np.float64)
    bound = attention_bound(q, k, v, numerics=preset, kv_cache=KVQuant(fmt, granularity="head"))
    assert np.max(np.abs(forgot - exact) / bound.total) > 10


def test_a_cache_in_an_attention_problem_is_checked() -> None:
    from mhanum.problem import AttentionProblem
    from mhanum.rope import Rope

    x = np.ones((4, 8))
    with pytest.raises(
        InvalidArgument, match=r"kv_cache: expected a mhanum\.kvcache\.KVQuant or a pair"
    ):
        AttentionProblem.of(x, x, x, kv_cache="int8")
    with pytest.raises(InvalidArgument, match=r"kv_cache: expected K.s cache with given scales"):
        AttentionProblem.of(x, x, x, kv_cache=KVQuant("int8"), rope=Rope(dim=8))
    with pytest.raises(InvalidArgument, match="kv_cache: expected placement='accumulator'"):
        KVQuant("int8").accumulated(x)
    with pytest.raises(InvalidArgument, match="granularity='tensor'"):
        KVQuant("int8", granularity="head", placement="accumulator").accumulated(x)
    acc = KVQuant("int8", placement="accumulator")
    with pytest.raises(InvalidArgument, match="descale: expected None with a cache"):
        AttentionProblem.of(x, x, x, kv_cache=acc, descale=(1.0, 1.0, 1.0))
    with pytest.raises(InvalidArgument, match="sink: expected None with a cache"):
        AttentionProblem.of(x, x, x, kv_cache=acc, sink=0.0)
    # the accumulator placement reads ŝ·c exactly, within K.1 of x
    y = np.linspace(-3.0, 3.0, 32).reshape(4, 8)
    read, err = acc.read(y)
    codes, scale, err_acc = acc.accumulated(y)
    np.testing.assert_array_equal(read, codes * scale)
    np.testing.assert_array_equal(err, err_acc)
    assert np.all(np.abs(read - y) <= err)


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16-fp32acc"])
@pytest.mark.parametrize("scale", [None, 0.01, 3.0])
def test_the_accumulator_placement_is_within_theorem_a1_with_k1(
    fmt: str, preset: str, scale: float | None
) -> None:
    """K.0 item 3 (FlashInfer): the dots read the codes, K's scale joins the scores' constant
    and V's multiplies the output once it is in the output format. The emulation computes so
    (checked against that computation written out), and is within Theorem A.1 of the exact
    attention of the given k and v, with K.1's errors of the codes against ``x/ŝ`` as the
    operands' errors and the scales as an fp8 descale (step 7'')."""
    import mhanum
    from mhanum import masks, reference
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(len(fmt) + (0 if scale is None else int(100 * scale)))
    q = round_to(rng.standard_normal((2, 48, 16)), "bfloat16")
    k, v = (rng.standard_normal((2, 48, 16)) * np.array([1.0, 5.0])[:, None, None] for _ in "kv")
    cache = KVQuant(fmt, scale=scale, placement="accumulator")
    out = np.asarray(
        mhanum.attention(q, k, v, masks.causal(), numerics=preset, kv_cache=cache), np.float64
    )
    (ck, sk, _), (cv, sv, _) = cache.accumulated(k), cache.accumulated(v)
    inner = mhanum.attention(q, ck, cv, masks.causal(), numerics=preset, scale=0.25 * sk)
    by_hand = round_to(
        np.asarray(inner, np.float64) * sv, mhanum.Numerics.preset(preset).format_of("output")
    )
    np.testing.assert_array_equal(out, by_hand)
    exact = reference.attention(q, k, v, mask=masks.causal())
    bound = attention_bound(q, k, v, masks.causal(), numerics=preset, kv_cache=cache)
    finite = np.isfinite(bound.total)
    assert finite.all() or bound.reasons
    assert np.all(np.abs(out - exact)[finite] <= (bound.total + 2.0**-52 * np.abs(exact))[finite])
    if scale is not None:  # (a given scale of 3 leaves int8 codes of 0 and ±1: nothing to see)
        return
    # with dynamic scales, a kernel that leaves K's scale out of the scores' constant is
    # outside the bound
    forgot = mhanum.attention(q, ck, cv, masks.causal(), numerics=preset, scale=0.25)
    forgot = round_to(
        np.asarray(forgot, np.float64) * sv, mhanum.Numerics.preset(preset).format_of("output")
    )
    assert np.max((np.abs(forgot - exact) / bound.total)[finite]) > 1


def test_k_and_v_may_have_caches_of_their_own() -> None:
    """A pair ``(k's, v's)``: vLLM's calibrated k_scale and v_scale differ (and its dynamic
    scales divide by 200 and 100). The emulation reads each from its own cache and stays within
    the bound; a kernel that reads v back with k's scale is far outside it."""
    import mhanum
    from mhanum import reference
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(11)
    q, k, v = (round_to(rng.standard_normal((2, 16, 8)), "bfloat16") for _ in range(3))
    v = v * 4.0  # codes below 448 with v's scale: nothing saturates
    pair = (KVQuant("float8_e4m3fn", scale=0.01), KVQuant("float8_e4m3fn", scale=0.05))
    exact = reference.attention(q, k, v)
    out = np.asarray(mhanum.attention(q, k, v, numerics="fp32", kv_cache=pair), np.float64)
    bound = attention_bound(q, k, v, numerics="fp32", kv_cache=pair).total
    assert np.all(np.abs(out - exact) <= bound + 2.0**-52 * np.abs(exact))
    k_read, v_read = pair[0].read(k)[0], pair[1].read(v)[0]
    # a kernel that dequantizes v's codes with k's scale
    wrong = pair[1].read(v)[0] * (0.01 / 0.05)
    bad = np.asarray(mhanum.attention(q, k_read, wrong, numerics="fp32"), np.float64)
    assert np.max(np.abs(bad - exact) / bound) > 2
    good = np.asarray(mhanum.attention(q, k_read, v_read, numerics="fp32"), np.float64)
    assert np.all(np.abs(good - exact) <= bound + 2.0**-52 * np.abs(exact))
    with pytest.raises(InvalidArgument, match=r"kv_cache: expected a mhanum\.kvcache\.KVQuant or"):
        attention_bound(q, k, v, kv_cache=(pair[0],))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("cache_format", KV_FORMATS)
def test_values_past_the_scale_formats_range_give_infinite_bounds_quietly(
    cache_format: str, placement: str
) -> None:
    """Values near 1e300 need a scale past float32's range: ``ŝ = inf``, a zero code reads as
    NaN and K.1's bound over the scale is ``inf/inf``. The bound is +inf with its reasons,
    never NaN, and no floating-point warning escapes (warnings are errors in this suite)."""
    from mhanum.bounds import attention_bound

    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 5, 8)) for _ in range(3))
    k[0, 0] = 0.0  # zero codes
    cache = KVQuant(cache_format, placement=placement)
    bound = attention_bound(q, k * 1e300, v * 1e300, kv_cache=cache)
    assert np.isposinf(bound.total).all()
    assert bound.reasons


@pytest.mark.parametrize(("preset", "fmt"), [("fp32", "float32"), ("bf16-fp32acc", "bfloat16")])
@pytest.mark.parametrize("cache_format", KV_FORMATS)
def test_rotated_keys_in_a_cache_are_within_corollary_k3(
    preset: str, fmt: str, cache_format: str
) -> None:
    """Corollary K.3 (papers/kvcache.md): the kernel rotates k as the Rope states, then stores
    the rotated keys in a cache with given scales and reads them back. K.1 grows with
    ``|x|`` for a given scale, so the bound takes it at the float64 rotation plus Theorem
    P.1's error. The emulation is within the bound of the exact attention of the exactly
    rotated inputs (against the reference of the float64 rotation, whose distance to the exact
    one is the ``evaluation`` term); dynamic scales of rotated keys are refused by name."""
    import mhanum
    from mhanum import reference
    from mhanum.bounds import attention_bound
    from mhanum.rope import Rope, reference_rope

    rng = np.random.default_rng(KV_FORMATS.index(cache_format))
    q, k, v = (round_to(rng.standard_normal((32, 16)), fmt) for _ in range(3))
    k[:, 3] *= 8.0  # an outlier channel
    rope = Rope(dim=16, base=5e5, table_format=fmt, rotation_format=fmt)
    positions = (np.arange(4096, 4128), np.arange(4096, 4128))
    top = float(np.abs(k).max()) * 1.5
    scale = top / (127.0 if cache_format == "int8" else get_format(cache_format).max_finite)
    cache = (KVQuant(cache_format, scale=scale), KVQuant(cache_format))  # V's scales dynamic
    kw = {"numerics": preset, "rope": rope, "positions": positions, "kv_cache": cache}
    out = np.asarray(mhanum.attention(q, k, v, **kw), np.float64)
    b = attention_bound(q, k, v, **kw)
    q64, k64 = (reference_rope(x, p, rope)[0] for x, p in zip((q, k), positions, strict=True))
    exact = reference.attention(q64, k64, v)
    err = np.abs(out - exact)
    assert np.all(err <= b.total + b.terms["evaluation"] + 2.0**-52 * np.abs(exact))
    # the cache's error is charged: the bound exceeds the one without the cache
    plain = attention_bound(q, k, v, numerics=preset, rope=rope, positions=positions)
    assert np.all(b.total >= plain.total)
    with pytest.raises(InvalidArgument, match=r"kv_cache: expected K's cache with given scales"):
        attention_bound(q, k, v, numerics=preset, rope=rope, positions=positions,
                        kv_cache=KVQuant(cache_format))  # fmt: skip
