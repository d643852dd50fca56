"""The soft-capped backward (``softcap=c``: ``dA = dS ∘ sech²(s/c)`` for dq and dk): the
emulation against the certified reference within Theorem B.7's bound, from caps far above the
logits to caps that saturate ``tanh`` (where the reference needs ``sech²``, not ``1 - tanh²``);
two orders of the ``dQ`` additions within B.3, and the a priori bound with a cap (B.9)."""

from __future__ import annotations

import numpy as np
import pytest

import mhanum
from mhanum import Backward, InvalidArgument, reference
from mhanum.bounds.backward import (
    attention_grad_bound,
    attention_grad_bound_a_priori,
    dq_order_difference,
)
from mhanum.formats import round_to

MASK = np.tril(np.ones((6, 6), bool))
MASK8 = np.tril(np.ones((8, 8), bool))
UP = 1 + 2.0**-40  # float64 norms may fall a few ulps below the exact ones
# (input scale, cap): logits well inside the cap, around it, and 10^3 times past it
CASES = [(0.3, 30.0), (3.0, 2.0), (30.0, 0.5)]


def _inputs(scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [scale * rng.standard_normal((2, 6, 4)) for _ in range(4)]


@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16", "tensor-core-bf16"])
@pytest.mark.parametrize(("scale", "cap"), CASES)
def test_soft_capped_gradients_are_within_theorem_b7(preset, algorithm, scale, cap):
    q, k, v, g = _inputs(scale)
    backward = Backward(algorithm, block_q=4, block_k=2) if algorithm == "flash2" else algorithm
    got = mhanum.attention_grad(q, k, v, g, MASK, numerics=preset, backward=backward, softcap=cap)
    exact = reference.attention_grad(q, k, v, g, mask=MASK, softcap=cap, digits=17)
    bounds = attention_grad_bound(q, k, v, g, MASK, numerics=preset, backward=backward, softcap=cap)
    for name in ("dq", "dk", "dv", "dbias"):
        b = getattr(bounds, name)
        err = np.abs(np.asarray(getattr(got, name), np.float64) - getattr(exact, name))
        assert np.isfinite(b.total).all(), (name, b.reasons)
        assert (err <= b.total).all(), (name, float(np.max(err / b.total)))


def test_a_saturated_cap_all_but_stops_dq():
    """Past the cap, sech²(s/c) is below 1e-50: the exact dq nearly vanishes, while dbias (taken
    before the cap) does not. float32's ``1 - t̂²`` cancels to exactly 0, so the computed dq is
    0, and the bound, which charges ``σ̂`` its absolute error (about u), covers the gap."""
    q, k, v, g = _inputs(30.0)
    exact = reference.attention_grad(q, k, v, g, mask=MASK, softcap=0.05, digits=17)
    got = mhanum.attention_grad(q, k, v, g, MASK, numerics="fp32", softcap=0.05)
    bounds = attention_grad_bound(q, k, v, g, MASK, numerics="fp32", softcap=0.05)
    assert np.max(np.abs(exact.dq)) < 1e-50
    assert np.max(np.abs(exact.dbias)) > 1.0
    assert np.all(np.asarray(got.dq) == 0)
    assert (np.abs(exact.dq) <= bounds.dq.total).all()


def test_a_cap_is_checked_by_name():
    q, k, v, g = _inputs(1.0)
    with pytest.raises(InvalidArgument, match="softcap"):
        mhanum.attention_grad(q, k, v, g, softcap=-1.0)
    with pytest.raises(InvalidArgument, match="softcap"):
        attention_grad_bound(q, k, v, g, softcap=0.0)


# Theorems B.3 and B.9: the order difference and the a priori bound with a cap ---------------


@pytest.mark.parametrize(
    ("preset", "scale", "cap"),
    [("fp32", 0.3, 30.0), ("bf16-fp32acc", 3.0, 2.0), ("fp32", 30.0, 0.5)],
)
def test_two_orders_differ_within_theorem_b3_with_a_cap(preset, scale, cap):
    rng = np.random.default_rng(3)
    q, k, v, g = (scale * rng.standard_normal((16, 4)) for _ in range(4))
    orders = [tuple(int(i) for i in rng.permutation(4)) for _ in range(3)]
    runs = [
        np.asarray(
            mhanum.attention_grad(
                q, k, v, g, numerics=preset, softcap=cap,
                backward=Backward("flash2", block_q=4, block_k=4, dq_order=o),
            ).dq,
            np.float64,
        )
        for o in orders
    ]  # fmt: skip
    bound = dq_order_difference(
        q, k, v, g, numerics=preset, backward=Backward("flash2", block_q=4, block_k=4), softcap=cap
    )
    assert np.isfinite(bound.total).all()
    for other in runs[1:]:
        assert (np.abs(runs[0] - other) <= bound.total).all()


def _edge_inputs(scale: float, seed: int):
    """Rows of q and k of norm ``scale`` and v, d_out in [-1, 1] with an entry at 1, so
    the stated norms are attained (the edge of B.4's admissible set)."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((8, 4)) for _ in range(2))
    q, k = (scale * x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v, g = (rng.uniform(-1, 1, (8, 4)) for _ in range(2))
    v[0, 0], g[0, 0] = 1.0, -1.0
    return q, k, v, g


@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
@pytest.mark.parametrize("preset", ["fp32", "tf32", "bf16-fp32acc", "fp16-fp32acc"])
@pytest.mark.parametrize(("scale", "cap"), [(1.0, 30.0), (4.0, 2.0), (12.0, 0.5)])
def test_the_a_priori_bound_with_a_cap_covers_inputs_at_its_edge(preset, algorithm, scale, cap):
    """Theorem B.9: every gradient's error within B.4 with the cap, at the stated norms (the
    inputs' own, rounded into the input format), logits from inside the cap to 36x past it."""
    backward = Backward(algorithm, block_q=4, block_k=4) if algorithm == "flash2" else algorithm
    fmt = mhanum.Numerics.preset(preset).input
    for seed in range(2):
        q, k, v, g = (round_to(x, fmt) for x in _edge_inputs(scale, seed))
        got = mhanum.attention_grad(
            q, k, v, g, MASK8, numerics=preset, backward=backward, softcap=cap
        )
        exact = reference.attention_grad(q, k, v, g, mask=MASK8, softcap=cap, digits=17)
        b = attention_grad_bound_a_priori(
            8, 8, 4,
            q_norm=float(np.linalg.norm(q, axis=-1).max()) * UP,
            k_norm=float(np.linalg.norm(k, axis=-1).max()) * UP,
            v_max=float(np.abs(v).max()), d_out_max=float(np.abs(g).max()),
            numerics=preset, backward=backward, softcap=cap,
        )  # fmt: skip
        assert b.dq.theorem == "B.4"
        for name in ("dq", "dk", "dv", "dbias"):
            bound = getattr(b, name).total
            err = np.abs(np.asarray(getattr(got, name), np.float64) - getattr(exact, name))
            assert np.isfinite(bound).all(), (name, getattr(b, name).reasons)
            assert (err <= bound).all(), (name, float(np.max(err / bound)))


def test_the_cap_bounds_the_logits_whatever_the_norms():
    """Without a cap, B.4's logit range 2c_s·q_norm·k_norm and its error grow with the norms
    until the bound is infinite. With a cap the logits lie in [-c, c]: once the scores' error
    exceeds 2c (in units of s/c, tanh moves by at most 2) the capped logits' enclosure no
    longer depends on the norms, so neither do the bounds that read only P and d_out (dv; the
    textbook's dbias and its stages P, D and dS), bit for bit."""
    kw = {"v_max": 1.0, "d_out_max": 1.0, "numerics": "fp32"}
    for algorithm in ("textbook", "flash2"):
        plain = attention_grad_bound_a_priori(16, 16, 16, q_norm=1e4, k_norm=1e4,
                                              backward=algorithm, **kw)  # fmt: skip
        assert np.isinf(plain.dv.total).all()
        assert plain.dv.reasons
        capped = [
            attention_grad_bound_a_priori(
                16, 16, 16, q_norm=n, k_norm=n, backward=algorithm, softcap=2.0, **kw
            )
            for n in (1e4, 1e5)
        ]
        for b in capped:
            for name in ("dq", "dk", "dv", "dbias"):
                assert np.isfinite(getattr(b, name).total).all(), getattr(b, name).reasons
        # FlashAttention-2's D reads A.4, whose float64 evaluation term (2^-52 (d + 2) c_s
        # q_norm k_norm, at most 2c with the cap) still grows: only what reads P stays fixed
        textbook = algorithm == "textbook"
        for name in ("dv", "dbias") if textbook else ("dv",):
            np.testing.assert_array_equal(getattr(capped[0], name).total,
                                          getattr(capped[1], name).total)  # fmt: skip
        for stage in ("P", "D", "dS") if textbook else ("P",):
            assert capped[0].stages[stage] == capped[1].stages[stage]
    # where both are finite, the capped range 2c (not 2c_s·q_norm·k_norm) shrinks P's bound
    big = {"q_norm": 1e3, "k_norm": 1e3, **kw}
    assert (attention_grad_bound_a_priori(16, 16, 16, softcap=30.0, **big).stages["P"]
            < attention_grad_bound_a_priori(16, 16, 16, **big).stages["P"])  # fmt: skip


@pytest.mark.parametrize("cap", [0.0, -2.0, float("inf"), float("nan"), True, "30"])
def test_a_bad_cap_is_refused_by_name_by_b3_and_b4(cap):
    q, k, v, g = _inputs(1.0)
    with pytest.raises(InvalidArgument, match="softcap: expected a finite number > 0"):
        dq_order_difference(q, k, v, g, backward=Backward("flash2", block_k=2), softcap=cap)
    with pytest.raises(InvalidArgument, match="softcap: expected a finite number > 0"):
        attention_grad_bound_a_priori(4, 4, 2, q_norm=1.0, k_norm=1.0, v_max=1.0,
                                      d_out_max=1.0, softcap=cap)  # fmt: skip


# the gradient search with a cap, its saved case and the command -------------------------------


def test_a_capped_gradient_search_is_saved_and_replayed_bit_for_bit(tmp_path, capsys):
    """``mhanum search --backward flash2 --softcap C``: every evaluation is capped (emulation,
    reference and Theorem B.7), the case records the cap and replays with it bit for bit."""
    import json

    from mhanum import cases, cli

    args = ["search", "--backward", "flash2", "--preset", "bf16-fp32acc", "--q-len", "4",
            "--kv-len", "8", "--d-k", "4", "--block", "4", "--mask", "causal", "--budget", "6",
            "--softcap", "0.5", "--out", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["softcap"] == 0.5
    assert 0 <= result["ratio"] <= 1
    case = cases.load_gradient(result["case"])
    assert case.softcap == 0.5
    # the saved measurement is the capped one: re-measured here against the capped reference
    grads = mhanum.attention_grad(case.q, case.k, case.v, case.d_out, case.mask,
                                  numerics=case.numerics, backward=case.backward, softcap=0.5)  # fmt: skip
    for got, saved in zip(grads[:4], case.gradients, strict=True):
        assert np.asarray(got, np.float64).tobytes() == saved.tobytes()
    exact = reference.attention_grad(
        case.q, case.k, case.v, case.d_out, mask=case.mask, softcap=0.5, digits=17
    )
    i = ("dq", "dk", "dv", "dbias").index(case.gradient)
    assert abs(case.gradients[i][case.index] - exact[i][case.index]) == case.error
    again = cases.replay(result["case"])
    assert again.bit_for_bit
    assert again.ratio == case.ratio
    assert cli.main(["replay", result["case"]]) == 0
    assert "bit for bit" in capsys.readouterr().out
    assert cli.main([*args[:-4], "--softcap", "0", "--out", str(tmp_path / "b")]) == 2
    assert "softcap: expected a finite number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
def test_a_capped_gradient_search_finds_no_violation(algorithm):
    from mhanum.search import gradient_worst_case

    backward = Backward(algorithm, block_q=4, block_k=4) if algorithm == "flash2" else algorithm
    shape = {"q_len": 6, "kv_len": 8, "d_k": 4}
    case = gradient_worst_case("fp32", shape, backward=backward, budget=12, softcap=2.0)
    assert case.softcap == 2.0
    assert case.summary()["softcap"] == 2.0
    assert not case.violation, (case.gradient, case.index, case.ratio)
    with pytest.raises(InvalidArgument, match="softcap"):
        gradient_worst_case("fp32", shape, budget=2, softcap=-1.0)


@pytest.mark.parametrize("cap", [2.0**-20, 2.0**20])
def test_a_cap_past_the_score_formats_range_is_infinite_with_its_reason(cap):
    # 2^20 or its reciprocal overflows float16 (largest finite 65504): the kernel's dq is NaN,
    # and every bound is infinite with the reason (not an OverflowError from the constant)
    q, k, v, g = _inputs(1.0)
    got = mhanum.attention_grad(q, k, v, g, MASK, numerics="fp16", softcap=cap)
    bounds = attention_grad_bound(q, k, v, g, MASK, numerics="fp16", softcap=cap)
    apriori = attention_grad_bound_a_priori(6, 6, 4, q_norm=4.0, k_norm=4.0, v_max=4.0,
                                            d_out_max=4.0, numerics="fp16", softcap=cap)  # fmt: skip
    for b in (bounds, apriori):
        for name in ("dq", "dk", "dv"):
            assert np.isinf(getattr(b, name).total).all()
            assert any("softcap" in r for r in getattr(b, name).reasons)
    assert np.isnan(np.asarray(got.dq, np.float64)).any()
