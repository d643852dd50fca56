"""Step 6k of Theorem A.1 (papers/attention.md): the probabilities rounded into a coarser
format than the softmax computes them in are known wherever their enclosure lies within one
rounding interval, and the output's error then carries their roundings with their signs.

The closed forms below would fail under the classic charge ``u_p·Σ_j p̂_j|v_j|``; the property
tests check the bound against the certified reference on the kernel's emulation, at rounding
boundaries of the probability format, on probabilities below its smallest normal number and
at the edges of the inputs' formats."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound, schedule_difference
from mhanum.formats import get_format, round_to

WEIGHTS = ("logits", "softmax", "probability_rounding", "operands")


def _numerics(
    prob: str, inp: str = "bfloat16", softmax: str = "safe", summation: str = "native"
) -> Numerics:
    """Scores, softmax and accumulation in float32, probabilities in ``prob``."""
    return Numerics(
        input=inp, accum="float32", score_format="float32", softmax_format="float32",
        prob_format=prob, output_format="float32", softmax=softmax, summation=summation,
    )  # fmt: skip


def _holds(num: Numerics, seed: int, n: int, spread: float, ties: bool, causal: bool) -> None:
    """The emulation within the bound on ``n`` keys of ``d = 8`` in the input format, the
    queries scaled by ``2^spread``, every other key a copy of the first (``ties``)."""
    inp = num.format_of("input").name
    rng = np.random.default_rng(seed)
    d = 8
    q = round_to(rng.standard_normal((n, d)) * 2.0**spread, inp)
    k = round_to(rng.standard_normal((n, d)), inp)
    if ties:
        k[1::2] = k[0]
    v = round_to(rng.standard_normal((n, d)), inp)
    mask = np.tril(np.ones((n, n), bool)) if causal else None
    bound = attention_bound(q, k, v, mask, numerics=num)
    assert np.all(_error(q, k, v, num, mask) <= bound.total)


def _softmax(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    s = (q @ k.T) / math.sqrt(q.shape[-1])
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _error(q, k, v, num, mask=None, scale=None) -> np.ndarray:
    out = np.asarray(mn.attention(q, k, v, mask, numerics=num, scale=scale), np.float64)
    exact = reference.attention(q, k, v, mask=mask, scale=scale)
    return np.abs(out - np.asarray(exact, np.float64))


@pytest.mark.parametrize("prob", ["bfloat16", "float16", "float8_e4m3fn"])
def test_uniform_rows_are_charged_the_known_rounding_of_one_over_n(prob):
    """``q = 0``: every probability is ``1/3`` exactly, the kernel's float32 ``p̂`` is within a
    few float32 ulps of it, far from a rounding boundary of ``prob``, so ``fl(p̂) = fl(1/3)``
    and the output before its rounding is ``fl(1/3)·Σ_j v_j``: the term is ``|fl(1/3) -
    1/3|·|Σ_j v_j|`` up to the float64 evaluation, where the classic charge is ``u_p·Σ_j
    |v_j|/3`` or more; the computed error is that exactly."""
    num = _numerics(prob)
    rng = np.random.default_rng(0)
    q = np.zeros((2, 8))
    k = round_to(rng.standard_normal((3, 8)), "bfloat16")
    v = round_to(rng.standard_normal((3, 6)), "bfloat16")
    bound = attention_bound(q, k, v, numerics=num)
    c = float(round_to(1 / 3, prob))
    closed = abs(c - 1 / 3) * np.abs(v.sum(axis=0))
    known = bound.terms["known_probabilities"]
    assert np.all(known >= closed)
    assert np.all(known <= closed * (1 + 2.0**-20) + 2.0**-40)
    for name in WEIGHTS:
        assert np.all(bound.terms[name] == 0.0), name
    classic = attention_bound(q, k, v, numerics=num, known_rounding=False)
    assert np.all(known < sum(classic.terms[n] for n in WEIGHTS))
    err = _error(q, k, v, num)
    assert np.all(err <= bound.total)
    assert np.all(err >= closed * (1 - 2.0**-20) - 2.0**-23 * np.abs(c * v.sum(axis=0)))


def test_a_probability_on_a_rounding_boundary_is_charged_both_ways():
    """Two keys whose exact probabilities are ``1/2 ± 2^-9``: the first is the midpoint of
    bfloat16's values ``1/2`` and ``1/2 + 2^-8``, so the kernel's float32 ``p̂`` may round either
    way; the bound takes both (the radius ``2^-9``), and with ``v = (1, 0)`` it covers the
    computed output whichever way the kernel rounded."""
    num = _numerics("bfloat16", inp="float32")
    p = 0.5 + 2.0**-9
    q = np.array([[math.log(p / (1 - p))]])
    k = np.array([[1.0], [0.0]])
    v = np.array([[1.0, 0.0], [0.0, 1.0]])
    bound = attention_bound(q, k, v, numerics=num, scale=1.0)
    err = _error(q, k, v, num, scale=1.0)
    assert np.all(err <= bound.total)
    assert bound.terms["known_probabilities"][0, 0] >= 2.0**-9 * (1 - 2.0**-20)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prob=st.sampled_from(["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]),
    inp=st.sampled_from(["bfloat16", "float16", "float32"]),
    softmax=st.sampled_from(["safe", "naive"]),
    n=st.sampled_from([3, 17, 64]),
    spread=st.sampled_from([0.0, 1.0, 2.5, 4.0]),
    ties=st.booleans(),
    causal=st.booleans(),
)
def test_sound_where_probabilities_are_stored_coarser(
    seed, prob, inp, softmax, n, spread, ties, causal
):
    """Logits from flat to wide (many probabilities below ``prob``'s smallest normal number,
    some flushed), near ties (repeated keys: equal probabilities, several on one boundary),
    causal rows of one key, every input format: the emulation within the bound."""
    num = _numerics(prob, inp=inp, softmax=softmax)
    if softmax == "naive" and spread > 2.0:
        return  # (the naive softmax's exponentials overflow: vacuous rows, tested elsewhere)
    _holds(num, seed, n, spread, ties, causal)


@pytest.mark.parametrize("prob", ["bfloat16", "float16"])
def test_tighter_than_the_classic_charge_on_random_rows(prob):
    """Random normal rows: the known form is taken at most entries, at most the four classic
    terms it replaces, entry by entry, and at the median below a quarter of what step 6 alone
    charges (``u_p·Σ_j p_j|v_j|`` at least); step 6r's probability term likewise."""
    num = _numerics(prob, inp=prob)
    rng = np.random.default_rng(3)
    q, k, v = (round_to(rng.standard_normal((64, 32)), prob) for _ in range(3))
    bound = attention_bound(q, k, v, numerics=num)
    classic = attention_bound(q, k, v, numerics=num, known_rounding=False)
    known = bound.terms["known_probabilities"]
    assert np.mean(known > 0) > 0.5
    replaced = sum(classic.terms[n] for n in WEIGHTS)
    assert np.all(np.where(known > 0, known <= replaced, True))
    p = _softmax(q, k)  # (float64: its error is far below the factor 4 taken here)
    step6 = get_format(prob).u * (p @ np.abs(v))
    assert np.median(known[known > 0]) < np.median(step6) / 4
    relative = attention_bound(q, k, v, numerics=_numerics(prob, inp=prob, softmax="online(64)"))
    assert np.median(relative.terms["probability_rounding"]) < np.median(step6) / 4
    err = _error(q, k, v, num)
    assert np.all(err <= bound.total)


def test_online_softmax_and_operand_roundings_keep_the_classic_terms():
    """Online (unnormalised weights rescaled later): no step 6k, step 6r only; a rounding on
    the dot's read (float16 probabilities read as bfloat16): neither, the same bound as with
    ``known_rounding=False``."""
    rng = np.random.default_rng(4)
    q, k, v = (round_to(rng.standard_normal((16, 8)), "bfloat16") for _ in range(3))
    online = attention_bound(q, k, v, numerics=_numerics("bfloat16", softmax="online(4)"))
    assert "known_probabilities" not in online.terms
    num = Numerics(input="float32", accum="float32", prob_format="float16", dot="bf16x1")
    a = attention_bound(q, k, v, numerics=num)
    b = attention_bound(q, k, v, numerics=num, known_rounding=False)
    assert "known_probabilities" not in a.terms
    np.testing.assert_array_equal(a.total, b.total)


def test_schedule_differences_with_shared_logits_keep_the_logits_term_apart():
    """Theorem A.5' takes A.1's logits term apart: its sides are evaluated without step 6k,
    and the difference of two kernels that share their logits is within it."""
    rng = np.random.default_rng(5)
    q, k, v = (round_to(rng.standard_normal((32, 16)), "bfloat16") for _ in range(3))
    a = _numerics("bfloat16", summation="sequential")
    b = _numerics("bfloat16", softmax="naive", summation="sequential")
    diff = schedule_difference(q, k, v, numerics_a=a, numerics_b=b)
    assert diff.theorem == "A.5'"
    assert not any(name.endswith("known_probabilities") for name in diff.terms)
    out_a, out_b = (np.asarray(mn.attention(q, k, v, numerics=n), np.float64) for n in (a, b))
    assert np.all(np.abs(out_a - out_b) <= diff.total)


def test_known_rounding_must_be_a_bool():
    q = np.ones((2, 2))
    with pytest.raises(InvalidArgument, match="known_rounding: expected True or False"):
        attention_bound(q, q, q, numerics="bf16-fp32acc", known_rounding="yes")


def test_the_format_edges_hold():
    """Inputs near the largest finite bfloat16 with a scale that keeps the logits finite, and
    subnormal values: the output within the bound, and finite."""
    big = get_format("bfloat16").max_finite
    tiny = get_format("bfloat16").smallest_subnormal
    rng = np.random.default_rng(6)
    q = round_to(rng.standard_normal((8, 4)) * 2.0**60, "bfloat16")
    k = round_to(rng.standard_normal((8, 4)) * 2.0**60, "bfloat16")
    v = round_to(rng.standard_normal((8, 4)), "bfloat16") * big / 4
    v[0] = tiny
    num = _numerics("bfloat16")
    bound = attention_bound(q, k, v, numerics=num, scale=2.0**-125)
    err = _error(q, k, v, num, scale=2.0**-125)
    assert np.all(np.isfinite(bound.total))
    assert np.all(err <= bound.total)


# -- step 6r: the roundings' relative errors with their signs (online too) -------------------


def _online(prob: str, block: int, **kw: object) -> Numerics:
    return Numerics(
        input=prob, accum="float32", score_format="float32", softmax_format="float32",
        prob_format=prob, output_format=prob, softmax=f"online({block})", **kw,
    )  # fmt: skip


def test_uniform_online_rows_round_their_weights_exactly():
    """``q = 0``, one block: every exponential is ``exp(0) = 1``, which ``F_p`` holds, so the
    kernel's weights are rounded without error and step 6r charges only the enclosure's width
    (the exponential's and the sums' float32 factors), far below step 6's ``u_p·Σ_j p̂_j|v_j|``
    (``u_p = 2^-8``)."""
    num = _online("bfloat16", 16)
    rng = np.random.default_rng(7)
    q = np.zeros((4, 8))
    k, v = (round_to(rng.standard_normal((12, 8)), "bfloat16") for _ in range(2))
    bound = attention_bound(q, k, v, numerics=num)
    mean_abs = np.abs(v).mean(axis=0)
    assert np.all(bound.terms["probability_rounding"] <= 2.0**-15 * mean_abs)
    assert np.all(_error(q, k, v, num) <= bound.total)


def test_a_tensor_core_reads_half_precision_weights_without_charge():
    """A float16 tensor core reads the float16 weights exactly, and a random normal row's
    weights are far above float16's smallest normal number (``2^-14``), so the operands term
    is 0; each key was charged ``2^-14·Σ|v|`` per key for a possible flush before."""
    num = Numerics(
        input="float16", accum="float32", score_format="float32", softmax_format="float32",
        prob_format="float16", output_format="float16", softmax="online(32)",
        dot="tensor-core(a100-fp16)", exp_form="exp2-folded", online_sums="running",
    )  # fmt: skip
    rng = np.random.default_rng(8)
    q, k, v = (round_to(rng.standard_normal((32, 16)), "float16") for _ in range(3))
    bound = attention_bound(q, k, v, numerics=num)
    assert np.all(bound.terms["operands"] == 0.0)
    assert np.all(_error(q, k, v, num) <= bound.total)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    prob=st.sampled_from(["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"]),
    block=st.sampled_from([1, 4, 16, 64]),
    n=st.sampled_from([3, 17, 64]),
    spread=st.sampled_from([0.0, 1.0, 2.5, 4.0]),
    ties=st.booleans(),
    causal=st.booleans(),
    form=st.sampled_from(["exp", "exp2-folded", "exp2-scaled", "exp2"]),
    running=st.booleans(),
)
def test_sound_online_where_weights_are_stored_coarser(
    seed, prob, block, n, spread, ties, causal, form, running
):
    """The online softmax over blocks (the running maximum moves between blocks, which step
    6r's enclosure takes in any order), base-2 exponentials with the scale folded, running
    sums, weights below ``prob``'s smallest normal number and on rounding boundaries."""
    inp = "float16" if prob == "float16" else "bfloat16"
    num = Numerics(
        input=inp, accum="float32", score_format="float32", softmax_format="float32",
        prob_format=prob, output_format=inp, softmax=f"online({block})", exp_form=form,
        online_sums="running" if running else "block",
    )  # fmt: skip
    _holds(num, seed, n, spread, ties, causal)


@pytest.mark.parametrize("softmax", ["safe", "online(8)"])
def test_values_that_the_kernel_rounds_are_covered(softmax):
    """float64 values that are not bfloat16 values: the kernel reads them rounded, and the
    weights' known roundings multiply the rounded values (the share ``Σ_j (|κ̄_j| + r_j)
    ŵ_j (v̄_j - |v_j|)`` of step 6r, ``Σ_j B_j (v̄_j - |v_j|)`` of step 6k)."""
    num = _numerics("bfloat16", inp="bfloat16", softmax=softmax)
    rng = np.random.default_rng(9)
    q, k = (round_to(rng.standard_normal((24, 8)), "bfloat16") for _ in range(2))
    v = rng.standard_normal((24, 8)) * 2.0**10  # far from bfloat16's values
    bound = attention_bound(q, k, v, numerics=num)
    assert np.all(_error(q, k, v, num) <= bound.total)


def test_a_descriptor_opts_in_with_a_bool_only():
    import dataclasses

    from mhanum.testing import KERNELS

    with pytest.raises(InvalidArgument, match="known_rounding: expected True or False"):
        dataclasses.replace(KERNELS["jax-xla"], known_rounding="yes")
    assert dataclasses.replace(KERNELS["jax-xla"], known_rounding=True).known_rounding
