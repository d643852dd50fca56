"""Theorem A.3‴: multi-head attention's projections' roundings (their dots', biases' and the
storage's) and the scores' roundings as one martingale per output entry, through the output
projection's weights with their signs.

Every measured error lies within the bound; where the theorem applies the bound is several
times tighter than A.2's terms with A.3 alone, and the stated probability counts its events.
A dot's read of the stored projections into its operand format (TF32) is one more relative
rounding per entry, in the martingale like the storage's. Outside its scope (a rotation, the
deterministic bound) nothing changes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mhanum as mn
import mhanum.bounds.forward.across_heads as across_module
import mhanum.bounds.forward.mha as mha_module
import mhanum.bounds.forward.stored as stored_module
from mhanum import masks, reference
from mhanum.bounds import mha_bound
from mhanum.bounds.factors import evaluation_rounding
from mhanum.bounds.forward.stored import queries_exactly, spread
from mhanum.bounds.projections import linear
from mhanum.bounds.union import (
    ENTRIES_SHARE,
    lam_or_probability,
    lam_split,
    split_failure,
    union_failure,
)

SCOPE = ("bf16-fp32acc", "fp16-fp32acc", "fp32", "bf16", "tf32")
# the largest entry's gain over A.3 alone at the size below, measured 1.92, 2.37, 13.0, 1.0 and
# 5.13 (bfloat16 accumulation: the softmax's and the output projection's own sums dominate)
GAINS = {"bf16-fp32acc": 1.6, "fp16-fp32acc": 2.0, "fp32": 8.0, "bf16": 1.0, "tf32": 4.0}


def _layer(seed: int, d_model: int, rows: int) -> tuple[np.ndarray, mn.MHAParams]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d_model)).astype(np.float32).astype(np.float64)
    return x, mn.MHAParams.random(d_model, seed=seed)


def _error(x, params, heads, num, **kw):
    out = np.asarray(mn.multi_head_attention(x, x, params, heads, numerics=num, **kw), np.float64)
    return np.abs(out - reference.multi_head_attention(x, x, params, heads, **kw))


def _without(monkeypatch, *args, **kw):
    """The bound with A.3 alone (A.3‴ out of scope)."""
    with monkeypatch.context() as mp:
        mp.setattr(mha_module, "stored_scope", lambda p, num: False)
        return mha_bound(*args, **kw)


def _with_and_without(monkeypatch, step, x, params, num, replacement=lambda *a: None):
    """The bound at 4 heads and ``λ = 6``, and the same with A.3‴'s ``step`` (``(module,
    name)``) taking nothing (or ``replacement``)."""
    bound = mha_bound(x, x, params, 4, numerics=num, lam=6.0)
    with monkeypatch.context() as mp:
        mp.setattr(*step, replacement)
        return bound, mha_bound(x, x, params, 4, numerics=num, lam=6.0)


def _never_rises_and_holds(bound, before, x, params, num):
    """The bound with a form is never above the one without it (``before``, up to the float64
    evaluation's own rounding), and every measured error at 4 heads lies within it."""
    assert np.all(bound.total <= before.total * (1 + 2.0**-40))
    assert np.all(_error(x, params, 4, num) <= bound.total)


def test_spread_bounds_the_root_sum_square_of_the_exact_values():
    """Minkowski's inequality: the float64 values within their errors, the centre within its."""
    rng = np.random.default_rng(3)
    w = rng.random((4, 6))
    z, z_err = rng.standard_normal((6, 5)), 1e-3 * rng.random((6, 5))
    c, c_err = w @ z / w.sum(-1, keepdims=True), 1e-3 * rng.random((4, 5))
    bound = spread(w, z, z_err, (c, c_err))
    for _ in range(50):
        z_star = z + z_err * rng.uniform(-1, 1, z.shape)
        c_star = c + c_err * rng.uniform(-1, 1, c.shape)
        exact = np.sqrt(np.einsum("ij,ijm->im", w, (z_star[None] - c_star[:, None]) ** 2))
        assert np.all(exact <= bound)
    # closed form: w = (1, 1), z = (1, -1), centre 0, no errors: √2, rounded up
    got = spread(
        np.ones((1, 2)), np.array([[1.0], [-1.0]]), np.zeros((2, 1)), (np.zeros((1, 1)),) * 2
    )
    assert math.sqrt(2) <= got[0, 0] <= math.sqrt(2) * (1 + 8 * evaluation_rounding(2) + 2.0**-46)


@pytest.mark.parametrize("preset", ["bf16-fp32acc", "fp16-fp32acc", "fp32", "tf32"])
def test_a_projections_split_adds_up_and_its_last_rounding_is_within_sigma(preset):
    """``moved + rest = error`` (both non-negative) and the storage's rounding of the value the
    projection accumulates (float32, sequentially, its operands read into TF32 for tf32) is at
    most ``sigma``."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(5, 64, 8)
    x = np.asarray(mn.round_to(x, num.input), np.float64)
    w = np.asarray(mn.round_to(params.wq, num.input), np.float64)
    lin = linear(x, np.zeros_like(x), w, None, num, num.storage_format, lam=None)
    split = lin.roundings(np.zeros_like(x))
    assert split is not None
    moved, sigma = split
    error = lin.error(np.zeros_like(x))
    assert np.all(moved >= 0)
    assert np.all(moved <= error)
    acc = np.zeros(error.shape, np.float32)
    read = num.operand_rounding or num.input
    x32, w32 = (np.asarray(mn.round_to(a, read), np.float32) for a in (x, w))
    for t in range(x.shape[-1]):  # fl_a, term after term
        acc = acc + x32[:, t : t + 1] * w32[t]
    stored = np.asarray(mn.round_to(acc.astype(np.float64), num.storage_format), np.float64)
    assert np.all(np.abs(stored - acc) <= sigma)
    assert np.all(np.abs(stored - x @ w) <= error)


@pytest.mark.parametrize("preset", SCOPE)
def test_across_heads_holds_and_is_tighter(preset, monkeypatch):
    """At ``d_model = 128``, 4 heads, 32 rows (random normal inputs) and ``λ = 6``: every error
    within the bound, the bound never above A.3's alone and its largest entry several times
    smaller."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(11, 128, 32)
    bound = mha_bound(x, x, params, 4, numerics=num, lam=6.0)
    before = _without(monkeypatch, x, x, params, 4, numerics=num, lam=6.0)
    err = _error(x, params, 4, num)
    assert np.all(err <= bound.total)
    assert np.all(bound.total <= before.total * (1 + 2.0**-40))
    gain = before.total.max() / bound.total.max()
    assert gain >= GAINS[preset], gain


@pytest.mark.parametrize("preset", ["tf32", "fp32"])
def test_outside_its_scope_nothing_changes(preset, monkeypatch):
    """A rotation and the deterministic bound keep A.2's terms."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(2, 32, 6)
    for kw in ({"lam": None}, {"probability": 0.99, "rope": mn.rope.Rope(8)}):
        now = mha_bound(x, x, params, 4, numerics=num, **kw)
        before = _without(monkeypatch, x, x, params, 4, numerics=num, **kw)
        np.testing.assert_array_equal(now.total, before.total)


def test_the_probability_counts_one_event_per_output_entry(monkeypatch):
    """One event per output entry (its martingale) and one per head's row (the normaliser's):
    6 rows, ``d_out = 32``, 4 heads."""
    x, params = _layer(4, 32, 6)
    lam = 6.0
    now = mha_bound(x, x, params, 4, numerics="bf16-fp32acc", lam=lam)
    before = _without(monkeypatch, x, x, params, 4, numerics="bf16-fp32acc", lam=lam)
    extra = union_failure(lam, 6 * (32 + 4), mn.Numerics.preset("bf16-fp32acc"))
    assert before.probability - now.probability == pytest.approx(extra, rel=1e-9)


@st.composite
def _layers(draw):
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    preset = draw(st.sampled_from(SCOPE))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if h <= heads and heads % h == 0]))
    d_head = draw(st.sampled_from([2, 4, 8]))
    rows, keys = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    scale = 10.0 ** draw(st.floats(-2, 2))
    d = heads * d_head
    x_q = rng.standard_normal((rows, d)) * scale
    x_kv = rng.standard_normal((keys, d)) * scale
    params = mn.MHAParams.random(
        d, seed=seed % 1000, kv_width=kv * d_head, bias=draw(st.booleans())
    )
    kw = {"num_kv_heads": kv} if kv != heads else {}
    mask = draw(st.sampled_from(["none", "causal", "random"]))
    if mask == "causal" and rows == keys:
        kw["mask"] = masks.causal(rows)
    elif mask == "random":
        m = rng.random((rows, keys)) < 0.6
        m[:, 0] = True
        kw["mask"] = m
    if draw(st.booleans()):
        kw["bias"] = rng.standard_normal((heads, rows, keys))
    if draw(st.integers(0, 4)) == 0:
        kw["sink"] = rng.standard_normal(heads)
    softmax = draw(st.sampled_from(["safe", "naive", "online(4)"]))
    order = draw(st.sampled_from(["native", "sequential", "pairwise"]))
    num = mn.Numerics.preset(preset).replace(softmax=softmax, summation=order)
    return num, heads, x_q, x_kv, params, kw


@given(_layers())
def test_every_error_lies_within_the_bound(layer):
    """Random layers in scope (grouped heads, masks, biases, sinks, inputs over four decades,
    the safe, naive and online softmax, three summation orders): the measured error within
    the bound, stated at probability 0.99."""
    num, heads, x_q, x_kv, params, kw = layer
    out = mn.multi_head_attention(x_q, x_kv, params, heads, numerics=num, **kw)
    err = np.abs(
        np.asarray(out, np.float64) - reference.multi_head_attention(x_q, x_kv, params, heads, **kw)
    )
    bound = mha_bound(x_q, x_kv, params, heads, numerics=num, probability=0.99, **kw)
    finite = np.isfinite(bound.total)
    assert np.all(err[finite] <= bound.total[finite])


@pytest.mark.parametrize(
    ("preset", "unit", "ratio"), [("bf16-fp32acc", 2.0**-8, 1.25), ("tf32", 2.0**-11, 2.0)]
)
def test_the_model_fails_where_every_query_rounds_the_same_way(preset, unit, ratio):
    """The independence model is not a fact of round to nearest. Here every query entry is
    ``±(1 + u) + u/16`` (a midpoint and a sixteenth of a unit beyond), rounded by ``+u(1 -
    2^-4)``: the half of the keys with ``k = 1/2`` all gain ``c·512·u·(15/16)/2`` in their
    logits. bf16-fp32acc (``u = 2^-8``): the storage's rounding into bfloat16; the error is
    1.37 times A.3‴'s bound (probability 0.99 stated). tf32 (``u = 2^-11``): the queries are
    float32 values, exact, and the attention's read of them into TF32 rounds them; the error is
    2.43 times it. Both within the deterministic A.2 (4.7 times the error): inputs of such
    structure belong to ``lam=None`` (papers/attention.md, A.3‴)."""
    d, keys = 512, 64
    sign = np.where(np.arange(d) % 2 == 0, 1.0, -1.0)
    wq, wk, wv = np.zeros((d, d)), np.zeros((d, d)), np.zeros((d, d))
    wq[0], wq[1] = sign, sign * unit + unit / 16
    wk[2] = 0.5
    wv[2], wv[3] = 1.0, -1.0
    params = mn.MHAParams(wq, wk, wv, np.eye(d))
    x_q = np.zeros((1, d))
    x_q[0, :2] = 1.0
    x_kv = np.zeros((keys, d))
    x_kv[: keys // 2, 2] = 1.0
    x_kv[keys // 2 :, 3] = 1.0
    num = mn.Numerics.preset(preset)
    out = mn.multi_head_attention(x_q, x_kv, params, 1, numerics=num)
    err = np.abs(np.asarray(out, np.float64) - reference.multi_head_attention(x_q, x_kv, params, 1))
    probable = mha_bound(x_q, x_kv, params, 1, numerics=num, probability=0.99)
    certain = mha_bound(x_q, x_kv, params, 1, numerics=num)
    assert err.max() > ratio * probable.total.max()
    assert np.all(err <= certain.total)


@pytest.mark.parametrize(
    "preset", ["bf16-fp32acc", "fp16-fp32acc", "fp8-e4m3-fp32acc", "tf32", "fp32"]
)
@pytest.mark.parametrize(
    ("x_scale", "w_scale"),
    [(2.0**-60, 1.0), (2.0**-63, 2.0**-63), (1.0, 2.0**-12), (2.0**30, 1.0), (2.0**8, 2.0**6)],
)
def test_every_error_lies_within_the_bound_at_the_formats_edges(preset, x_scale, w_scale):
    """Inputs and weights over the exponent range: projections below the storage format's
    normal range (their underflow charged; at ``2^-63·2^-63`` below float32's and TF32's, where
    the operand read may flush), near its largest finite value, or beyond it (the bound is
    then inf, with the reason)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 16)) * x_scale
    p = mn.MHAParams.random(16, seed=1)
    p = mn.MHAParams(
        *(
            None if a is None else a * w_scale
            for a in (p.wq, p.wk, p.wv, p.wo, p.bq, p.bk, p.bv, p.bo)
        )
    )
    num = mn.Numerics.preset(preset)
    bound = mha_bound(x, x, p, 2, numerics=num, probability=0.99)
    err = _error(x, p, 2, num)
    finite = np.isfinite(bound.total)
    assert np.all(err[finite] <= bound.total[finite])
    assert finite.all() or bound.reasons


def test_the_queries_coefficients_formed_bound_the_exact_ones():
    """``queries_exactly`` against the coefficients in exact rational arithmetic:
    ``(Σ_t c²σ_t² α*_tm²)^½`` with ``α*_tm = Σ_j p_j k_jt (z*_jm - ō*_m)``, ``z* = v ŵ`` and
    ``ō* = Σ_j p_j z*_j`` exactly, for float64 inputs on scales from 2^-30 to 2^30."""
    from fractions import Fraction

    rng = np.random.default_rng(7)
    for scale in (2.0**-30, 1.0, 2.0**30):
        p = rng.random((3, 5))
        p /= p.sum(-1, keepdims=True)
        k, v, w = (
            rng.standard_normal((5, 4)) * scale,
            rng.standard_normal((5, 2)),
            rng.standard_normal((2, 3)),
        )
        z = v @ w
        z_err = evaluation_rounding(2) * (np.abs(v) @ np.abs(w))
        o_bar = p @ z
        o_err = p @ z_err + evaluation_rounding(5) * (p @ np.abs(z))
        c2_sig = rng.random((3, 4))
        got = queries_exactly(p, k, c2_sig, (z, z_err, o_bar, o_err))
        f = np.vectorize(Fraction, otypes=[object])
        pf, kf, vf, wf = f(p), f(k), f(v), f(w)
        zf = vf.dot(wf)
        of = pf.dot(zf)
        for i in range(3):
            for m in range(3):
                alpha = [
                    sum(pf[i, j] * kf[j, t] * (zf[j, m] - of[i, m]) for j in range(5))
                    for t in range(4)
                ]
                exact = math.sqrt(
                    float(sum(Fraction(c2_sig[i, t]) * alpha[t] ** 2 for t in range(4)))
                )
                assert exact <= got[i, m] * (1 + 2.0**-50)


def test_the_output_projections_read_joins_the_martingale(monkeypatch):
    """tf32: the output projection reads the head outputs into TF32, ``u_op = 2^-11`` each;
    A.2 (a) charges ``u_op Σ_l x̄_l|w_lm|`` without signs. Under A.3‴ the read's increments
    ``δ_l o*_l ŵ_lm`` join the martingale: at ``d_model = 128`` the term ``output_projection``
    falls below a tenth of what it was (measured 0.0081 of it at the largest entry), the
    bound's largest entry falls (measured 1.32 times), and every error stays within it."""
    num = mn.Numerics.preset("tf32")
    x, params = _layer(11, 128, 32)
    bound, before = _with_and_without(
        monkeypatch, (mha_module, "_read_by_the_projection"), x, params, num
    )
    at = np.unravel_index(np.argmax(before.total), before.total.shape)
    proj, proj_before = bound.terms["output_projection"], before.terms["output_projection"]
    assert proj[at] < 0.1 * proj_before[at]
    assert before.total.max() > 1.2 * bound.total.max()
    _never_rises_and_holds(bound, before, x, params, num)


@pytest.mark.parametrize("preset", ["fp32", "tf32", "bf16-fp32acc"])
def test_the_pv_dots_roundings_join_the_martingale(preset, monkeypatch):
    """Each head's ``P·V`` dot (R.8''s form) through the output projection with the weights'
    signs: its increments ``δ_k T_kl ŵ_lm`` join A.3‴'s martingale, where A.2 took the heads'
    ``pv`` bounds (each on its own event) through ``|ŵ|``. At ``d_model = 128`` and ``λ = 6``
    the term ``attention.pv`` falls at the largest entry (measured to 0.022 of it in float32,
    0.14 in tf32, 0.36 in bfloat16 with float32 accumulation); in float32, where the ``P·V``
    roundings were a fifth of the bound, its largest entry falls 1.19 times. The bound is
    never above the one without the second form, and every error lies within it."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(11, 128, 32)
    bound, before = _with_and_without(monkeypatch, (across_module, "_pv_through"), x, params, num)
    at = np.unravel_index(np.argmax(before.total), before.total.shape)
    pv, pv_before = bound.terms["attention.pv"], before.terms["attention.pv"]
    assert pv[at] < {"fp32": 0.05, "tf32": 0.3, "bf16-fp32acc": 0.5}[preset] * pv_before[at]
    if preset == "fp32":
        assert before.total.max() > 1.15 * bound.total.max()
    _never_rises_and_holds(bound, before, x, params, num)


@pytest.mark.parametrize("preset", ["fp32", "tf32", "bf16-fp32acc"])
def test_the_qk_dots_martingale_goes_through_the_signed_weights(preset, monkeypatch):
    """Each head's ``QKᵀ`` dots' martingale (A.3') through ``ŵ`` with its signs, one event per
    output entry, where A.2 took its bound per head output entry through ``|ŵ|``: its increments
    ``p_j (z_jm - ō_m) δ_k T_k`` join A.3‴'s, and ``(1/Z - 1)`` times it is charged with
    Cauchy-Schwarz's ``K^½ b_j`` per key. At ``d_model = 128`` and ``λ = 6`` the term
    ``attention.logits`` at the largest entry falls to half in float32 (measured 0.49; the
    bound's largest entry falls 1.44 times); in tf32 and bfloat16, where the dots are not what
    is loose, it moves by less than 1%. Never above the bound without it; every error within."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(11, 128, 32)
    bound, before = _with_and_without(monkeypatch, (across_module, "_dots_signed"), x, params, num)
    at = np.unravel_index(np.argmax(before.total), before.total.shape)
    logits, logits_before = bound.terms["attention.logits"], before.terms["attention.logits"]
    if preset == "fp32":
        assert logits[at] < 0.6 * logits_before[at]
        assert before.total.max() > 1.35 * bound.total.max()
    _never_rises_and_holds(bound, before, x, params, num)


@pytest.mark.parametrize("preset", ["fp32", "tf32", "bf16-fp32acc"])
def test_the_output_projections_own_roundings_join_the_martingale(preset, monkeypatch):
    """The output projection's own roundings (its dot's, its bias's and the storage's) come
    last; each is a rounding times a partial sum fixed by the roundings before it, so they may
    join A.3‴'s martingale, where A.2 (a) charged them on its own per-chain bound. At
    ``d_model = 128`` and ``λ = 6`` in float32 the term ``output_projection`` at the largest
    entry falls to its rest (the float32 weights are exact: measured 2e-31 of it, below 1e-6
    asserted) and the bound's largest entry falls 1.39 times (1.3 asserted; tf32 1.003). With
    a bfloat16 output the storage's one rounding of ``u_F|y|`` costs more as ``λ`` times a
    root-sum-square than as itself, and the form without it is kept: the bound does not move
    there. Never above the bound without it; every error within."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(11, 128, 32)
    bound, before = _with_and_without(
        monkeypatch, (mha_module, "_projection_roundings"), x, params, num
    )
    at = np.unravel_index(np.argmax(before.total), before.total.shape)
    proj, proj_before = bound.terms["output_projection"], before.terms["output_projection"]
    if preset == "fp32":
        assert proj[at] < 1e-6 * proj_before[at]
        assert before.total.max() > 1.3 * bound.total.max()
    if preset == "bf16-fp32acc":
        np.testing.assert_array_equal(bound.total, before.total)
    _never_rises_and_holds(bound, before, x, params, num)


@pytest.mark.parametrize("preset", ["fp32", "tf32", "bf16-fp32acc"])
def test_the_normaliser_averages_the_rows_logit_errors(preset, monkeypatch):
    """``|1/Z - 1|`` per head's row: ``e^{max δ} - 1`` (the row's largest logit error), or, on
    one more event per row, ``ζ/(1 - ζ)`` with ``Z - 1``'s first-order part a martingale
    (:func:`stored.normaliser`). At ``d_model = 128`` and ``λ = 6`` it is below the certain one
    on every row (measured 0.016-0.038 of it in float32, a tenth asserted; up to 0.52 in tf32
    and 0.73 in bfloat16), the bound's largest entry falls (measured 1.018 times in float32,
    1.014 in tf32, 1.061 in bfloat16; 1.01 asserted), it never rises, and every error stays
    within it."""
    num = mn.Numerics.preset(preset)
    x, params = _layer(11, 128, 32)
    seen = []
    original = stored_module.normaliser

    def spy(p, st, other, rest):
        got = original(p, st, other, rest)
        seen.append((got, np.expm1(rest[0].max(axis=-1, keepdims=True))))
        return got

    monkeypatch.setattr(stored_module, "normaliser", spy)
    bound, before = _with_and_without(
        monkeypatch,
        (stored_module, "normaliser"),
        x,
        params,
        num,
        replacement=lambda p, st, other, rest: np.expm1(rest[0].max(axis=-1, keepdims=True)),
    )
    assert seen
    for got, certain in seen:
        assert np.all(got <= certain)
        if preset == "fp32":
            assert np.all(got < 0.1 * certain)
    assert before.total.max() > 1.01 * bound.total.max()
    _never_rises_and_holds(bound, before, x, params, num)


def test_lam_split_states_at_least_the_probability_asked_for():
    """``lam_split``: the chains' ``λ`` solved on nine tenths of the failure probability, the
    entries' on a tenth, the stated probability (both classes' union bound together) at least
    the one asked for, and the chains' share not exceeded by more than rounding."""
    num = mn.Numerics.preset("fp32")
    for chains, entries, probability in [(7 * 10**7, 33_280, 0.99), (500, 40, 0.5), (10, 10, 0.9)]:
        lam_c, lam_e = lam_split(probability, chains, entries, num)
        failure = split_failure((lam_c, lam_e), (chains, entries), num)
        assert 1 - failure >= probability
        share = 1 - (1 - probability) * (1 - ENTRIES_SHARE)  # the chains' probability
        assert 1 - union_failure(lam_c, chains, num) >= share
        assert 1 - union_failure(lam_c, chains, num) < share + 1e-12  # (no more than that)
        if entries < chains:
            assert lam_e < lam_c
    with pytest.raises(mn.InvalidArgument, match="probability: expected a number in"):
        lam_split(1.5, 10, 10, num)


def test_the_entries_events_take_a_lambda_of_their_own(monkeypatch):
    """With ``probability=``, A.3‴'s per-entry and per-row events (``L_q(d_out + h)``) take a
    tenth of the failure probability and the chains the rest, each class its own ``λ``
    (``bound.lam`` the chains'). At the README demo size in float32 the bound's largest entry
    falls 1.09 times against one ``λ`` for every event (1.05 asserted), the chains' ``λ``
    grows by 0.2% (6.84 to 6.85), the stated probability is the one asked for, and every
    error stays within the bound."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64, 512)).astype(np.float32).astype(np.float64)
    params = mn.MHAParams.random(512, seed=0)
    num = mn.Numerics.preset("fp32")
    bound = mha_bound(x, x, params, 8, numerics=num, probability=0.99)

    def one(lam, probability, counts, num):
        found = lam_or_probability(lam, probability, sum(counts), num)
        return found, found, None

    with monkeypatch.context() as mp:
        mp.setattr(mha_module, "lams_for", one)
        single = mha_bound(x, x, params, 8, numerics=num, probability=0.99)
    assert single.lam < bound.lam < single.lam * 1.003
    assert 0.99 <= bound.probability < 0.99 + 1e-9
    assert single.total.max() > 1.05 * bound.total.max()
    out = np.asarray(mn.multi_head_attention(x, x, params, 8, numerics=num), np.float64)
    err = np.abs(out - reference.multi_head_attention(x, x, params, 8))
    assert np.all(err <= bound.total)
