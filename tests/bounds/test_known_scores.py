"""Step 3k of Theorem A.1 (papers/attention.md): the scores a kernel rounds into a coarser
format than it accumulates them in are known wherever their enclosure lies within one rounding
interval; step 6k then rounds the probabilities of those scores, so the output's error carries
the scores' roundings with their signs.

The closed form below would fail without the step (the logits term charges ``u_s|s|`` per key,
with no sign); the property tests check the bound against the certified reference on the
kernel's emulation, at rounding boundaries of the score format (ties included, for the dot
and for the scale's product), with scales over the exponent range, masks of every kind and
the exp2 forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import Numerics, reference
from mhanum.bounds import attention_bound
from mhanum.formats import get_format, round_to

KNOWN = "known_probabilities"


def _numerics(score: str, **kw: object) -> Numerics:
    """Inputs and accumulation in float32, scores rounded into ``score``, a float32 softmax,
    probabilities in bfloat16 (step 6k's condition), a float32 output."""
    base: dict[str, object] = {
        "input": "float32", "accum": "float32", "score_format": score,
        "softmax_format": "float32", "prob_format": "bfloat16", "output_format": "float32",
    }  # fmt: skip
    return Numerics(**{**base, **kw})


def _error(q, k, v, num, mask=None, scale=None, bias=None, sink=None) -> np.ndarray:
    kw = {"scale": scale, "bias": bias, "sink": sink}
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num, **kw), np.float64)
    exact = reference.attention(q, k, v, mask=mask, **kw)
    return np.abs(out - np.asarray(exact, np.float64))


def _bias(kind: str, n: int, f_s, rng) -> tuple[np.ndarray | None, float | None]:
    """A bias of ``kind`` over ``n × n`` scores, or a sink's logit."""
    if kind == "normal":
        return rng.standard_normal((n, n)) * 4, None
    if kind == "midpoints":  # midpoints between neighbouring values of the score format
        base = round_to(rng.uniform(1, 2, (n, n)), f_s)
        return base * (1 + 2.0**-f_s.precision), None
    if kind == "alibi":  # -slope·|i - j|
        i = np.arange(n)
        return -0.25 * np.abs(i[:, None] - i[None, :]).astype(np.float64), None
    if kind == "sink":
        return None, float(rng.standard_normal())
    return None, None


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_a_known_score_rounding_is_charged_with_its_sign():
    """One query, two keys, ``d = 1``, scale 1: the scores ``x = 1.3`` (a float32 value far
    from a bfloat16 rounding boundary) and 0. The kernel rounds ``x`` to ``fl(x) = 1.296875``,
    so its weights are the bfloat16 roundings ``c`` of ``softmax(fl(x), 0)``, and the output
    before its float32 rounding is ``c·v``: the term is ``|c·v - o|`` (``o`` the exact output)
    up to the float64 evaluation, and the computed error is that. Without step 3k the score's
    rounding is charged as ``u_s|x|`` on both sides (the classic charge: more than three
    times as much here)."""
    num = _numerics("bfloat16")
    x = float(round_to(1.3, "float32"))
    q, k = np.array([[x]]), np.array([[1.0], [0.0]])
    v = np.array([[1.0, -0.5], [0.25, 2.0]])
    bound = attention_bound(q, k, v, numerics=num, scale=1.0)
    s_hat = float(round_to(x, "bfloat16"))
    c = round_to(_softmax(np.array([[s_hat, 0.0]])), "bfloat16")
    o = _softmax(np.array([[x, 0.0]])) @ v
    closed = np.abs(c @ v - o)
    known = bound.terms[KNOWN]
    assert np.all(known >= closed * (1 - 2.0**-40))
    assert np.all(known <= closed * (1 + 2.0**-20) + 2.0**-40)
    without = attention_bound(q, k, v, numerics=num, scale=1.0, known_rounding=False)
    assert np.all(bound.total * 3 < without.total)
    err = _error(q, k, v, num, scale=1.0)
    assert np.all(err <= bound.total)
    assert np.all(err >= closed - 2.0**-23 * np.abs(c @ v))


def test_a_known_score_plus_a_bias_is_charged_with_its_sign():
    """The closed form above with a bias ``b = 0.2`` on the first key: the kernel adds
    ``fl(0.2) = 0.2001953125`` to ``fl(x) = 1.296875`` and rounds the sum, 191.625 spacings
    of bfloat16 above 0 (not a tie), to ``1.5``; the term is ``|c·v - o|`` for the weights
    ``c`` of those scores, the exact output ``o`` that of ``x + 0.2``."""
    num = _numerics("bfloat16")
    x = float(round_to(1.3, "float32"))
    q, k = np.array([[x]]), np.array([[1.0], [0.0]])
    v = np.array([[1.0, -0.5], [0.25, 2.0]])
    bias = np.array([[0.2, 0.0]])
    bound = attention_bound(q, k, v, numerics=num, scale=1.0, bias=bias)
    s_hat = 1.5  # fl(1.296875 + 0.2001953125)
    assert float(round_to(1.296875 + float(round_to(0.2, "bfloat16")), "bfloat16")) == s_hat
    c = round_to(_softmax(np.array([[s_hat, 0.0]])), "bfloat16")
    o = _softmax(np.array([[x + 0.2, 0.0]])) @ v
    closed = np.abs(c @ v - o)
    known = bound.terms[KNOWN]
    assert np.all(known >= closed * (1 - 2.0**-40))
    assert np.all(known <= closed * (1 + 2.0**-20) + 2.0**-40)
    err = _error(q, k, v, num, scale=1.0, bias=bias)
    assert np.all(err <= bound.total)


def test_a_score_on_a_rounding_midpoint_is_not_taken_as_known():
    """The score ``1 + 2^-8`` is the midpoint of bfloat16's ``1`` and ``1 + 2^-7``, exact in
    float32: the emulation rounds it to even (``1``), a kernel with another tie rule up; the
    score's enclosure straddles the midpoint, so step 3k leaves the key to the classic charge,
    and the bound covers the outputs of both roundings. A score ``2^-20`` past the midpoint is
    within the dot's error of it: both roundings are covered there too."""
    num = _numerics("bfloat16")
    v = np.array([[1.0], [0.0]])
    k = np.array([[1.0], [0.0]])
    for x in (1 + 2.0**-8, 1 + 2.0**-8 + 2.0**-20):
        q = np.array([[x]])
        bound = attention_bound(q, k, v, numerics=num, scale=1.0)
        o = float((_softmax(np.array([[x, 0.0]])) @ v)[0, 0])
        for s_hat in (1.0, 1 + 2.0**-7):
            c = round_to(_softmax(np.array([[s_hat, 0.0]])), "bfloat16")
            assert bound.total[0, 0] >= abs(float((c @ v)[0, 0]) - o)
        assert np.all(_error(q, k, v, num, scale=1.0) <= bound.total)


@pytest.mark.parametrize("preset", ["bf16-fp32acc", "fp16-fp32acc"])
def test_the_presets_bound_follows_the_error(preset):
    """Random normal inputs in the preset's format (``L = d = 64``): scores, probabilities
    and output rounded into the input format, as the presets do. With the scores known, the
    bound's median over the error is below 5 (1.7 in bfloat16, 4.2 in float16), at least four
    times below the classic steps' (22 and 29), and the bound holds entrywise."""
    rng = np.random.default_rng(3)
    inp = Numerics.preset(preset).format_of("input").name
    q, k, v = (round_to(rng.standard_normal((64, 64)), inp) for _ in range(3))
    err = _error(q, k, v, preset)
    bound = attention_bound(q, k, v, numerics=preset)
    classic = attention_bound(q, k, v, numerics=preset, known_rounding=False)
    assert np.all(err <= bound.total)
    ratio = np.median(bound.total / err)
    assert ratio < 5.0
    assert np.median(classic.total / err) > 4 * ratio


def _scales() -> st.SearchStrategy[float | None]:
    """The default scale, powers of two over the exponent range, a scale whose products tie
    (3: ``fl(ŝ1·3)`` lands on midpoints), an irrational one, and ones whose constant is
    subnormal or overflows a product."""
    return st.sampled_from([None, 1.0, 0.125, 3.0, 0.1, math.pi, 2.0**-20, 2.0**-130, 2.0**40])


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    score=st.sampled_from(["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]),
    softmax_form=st.sampled_from([("safe", "exp"), ("naive", "exp"), ("safe", "exp2")]),
    summation=st.sampled_from(["native", "sequential", "pairwise"]),
    n=st.sampled_from([2, 9, 33]),
    spread=st.sampled_from([-8.0, 0.0, 2.0, 4.0]),
    ties=st.booleans(),
    scale=_scales(),
    mask=st.sampled_from(["none", "causal", "fill", "add"]),
    bias=st.sampled_from(["none", "normal", "midpoints", "alibi", "sink"]),
)
def test_sound_where_scores_are_rounded_coarser(
    seed, score, softmax_form, summation, n, spread, ties, scale, mask, bias
):
    """The emulation within the bound, with the scores rounded into bfloat16, float16 or an
    fp8 format after a float32 accumulation: queries spread from tiny to wide, keys whose
    dots with the first query lie on rounding midpoints of the score format (``ties``: one
    nonzero product each, exact in float32), every mask convention, biases (normal, on
    midpoints of the score format, ALiBi's slopes, a sink's logit)."""
    softmax, form = softmax_form
    extra: dict[str, object] = {"softmax": softmax, "exp_form": form, "summation": summation}
    finite = mask in ("fill", "add") or (mask == "causal" and score == "float8_e4m3fn")
    if finite and form == "exp":  # (a finite constant, exp only; e4m3fn has no -inf)
        extra.update(mask_mode="add" if mask == "add" else "fill", mask_value=-30.0)
    elif finite:
        mask = "none"
    num = _numerics(score, **extra)
    f_s = get_format(score)
    rng = np.random.default_rng(seed)
    d = 4
    q = round_to(rng.standard_normal((n, d)) * 2.0**spread, "float32")
    k = round_to(rng.standard_normal((n, d)), "float32")
    if ties:
        # q[0] = e_0, so q[0]·k_j = k_j0: midpoints between neighbouring values of F_s
        q[0] = np.eye(d)[0]
        base = round_to(rng.uniform(1, 2, n), score)
        k[:, 0] = base + 2.0 ** (1 - f_s.precision) * base / 2
        k[:, 0] = round_to(k[:, 0], "float32")
    v = round_to(rng.standard_normal((n, d)), "float32")
    m = None if mask == "none" else np.tril(np.ones((n, n), bool))
    b, sink = _bias("none" if (bias == "sink" and form == "exp2") else bias, n, f_s, rng)
    bound = attention_bound(q, k, v, m, numerics=num, scale=scale, bias=b, sink=sink)
    err = _error(q, k, v, num, m, scale, bias=b, sink=sink)
    # an infinite entry (a range the computation may leave: a NaN output) comes with a reason
    infinite = np.isinf(bound.total)
    assert not infinite.any() or bound.reasons
    assert np.all((err <= bound.total) | infinite)


def test_the_format_edges_hold():
    """Inputs near float32's largest finite value scaled down to finite bfloat16 scores, and
    subnormal values and scores: the output within the bound, and finite."""
    rng = np.random.default_rng(6)
    q = round_to(rng.standard_normal((8, 4)) * 2.0**60, "float32")
    k = round_to(rng.standard_normal((8, 4)) * 2.0**60, "float32")
    v = round_to(rng.standard_normal((8, 4)), "float32") * get_format("float32").max_finite / 4
    v[0] = get_format("float32").smallest_subnormal
    num = _numerics("bfloat16")
    for scale in (2.0**-125, 2.0**-100):
        bound = attention_bound(q, k, v, numerics=num, scale=scale)
        assert np.all(np.isfinite(bound.total))
        assert np.all(_error(q, k, v, num, scale=scale) <= bound.total)
