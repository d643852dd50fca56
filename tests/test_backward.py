"""The backward pass: the emulation (textbook and FlashAttention-2, atomic-add orders bit for
bit), Theorems B.1-B.3 against the certified reference gradients, and refusals by name.

Every tolerance is a bound of papers/backward.md; the reference is
:func:`mhanum.reference.attention_grad` (Arb, certified to 17 digits, so its rounding to float64
is within one ulp of the exact gradient and is covered by the bound's own float64 slack).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mhanum import InvalidArgument, reference
from mhanum.bounds.backward import attention_grad_bound, dq_order_difference
from mhanum.bounds.forward import attention_bound
from mhanum.emulate.backward import attention_grad
from mhanum.formats import round_to
from mhanum.numerics import Backward, Numerics

L, D = 12, 4  # one shape for every example: one compilation per numerics and algorithm
FLASH = Backward("flash2", block_q=4, block_k=4)
PRESETS = (
    "fp64",
    "fp32",
    "tf32",
    "bf16",
    "bf16-fp32acc",
    "fp16",
    "fp16-fp32acc",
    "tensor-core-bf16",
    "fp8-e4m3-fp32acc",
    "tpu-bf16-3pass",
)


def _violations(q, k, v, g, mask=None, bias=None, scale=None, numerics="fp32", backward=None):
    """The entries where a computed gradient leaves its bound (none may), and the bounds."""
    grads = attention_grad(
        q, k, v, g, mask, bias=bias, scale=scale, numerics=numerics, backward=backward
    )
    exact = reference.attention_grad(q, k, v, g, mask=mask, bias=bias, scale=scale, digits=17)
    bounds = attention_grad_bound(
        q, k, v, g, mask, bias=bias, scale=scale, numerics=numerics, backward=backward
    )
    bad = {}
    for name, got, want, b in zip(("dq", "dk", "dv", "dbias"), grads, exact, bounds, strict=False):
        got = np.asarray(got, np.float64)
        if not np.isfinite(b.total).all():
            assert b.reasons, f"{name}: an infinite bound must say why"
        finite = np.isfinite(got)
        # a NaN/inf gradient under a finite bound is a violation too
        over = ~(np.abs(np.where(finite, got, np.inf) - want) <= b.total)
        if over.any():
            bad[name] = float(np.max(np.abs(got - want)[over] / b.total[over]))
    return bad, bounds


@st.composite
def _problem(draw, span=8):
    """q, k, v, d_out of the fixed shape with entries scaled by 2^e (e within ±span), a causal
    or random mask (every row keeps a key) and an optional bias."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    exps = [draw(st.integers(-span, span // 2)) for _ in range(4)]
    q, k, v, g = (rng.standard_normal((L, D)) * 2.0**e for e in exps)
    kind = draw(st.sampled_from(["none", "causal", "random"]))
    mask = None
    if kind == "causal":
        mask = np.tril(np.ones((L, L), bool))
    elif kind == "random":
        mask = rng.random((L, L)) < 0.6
        mask[np.arange(L), rng.integers(0, L, L)] = True
    bias = rng.standard_normal((L, L)) * 3 if draw(st.booleans()) else None
    return q, k, v, g, mask, bias


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
@pytest.mark.parametrize("numerics", PRESETS)
@given(problem=_problem())
def test_every_gradient_is_within_its_bound(numerics, backward, problem):
    q, k, v, g, mask, bias = problem
    bad, _ = _violations(q, k, v, g, mask, bias, numerics=numerics, backward=backward)
    assert not bad, bad


@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc", "fp16"])
@given(
    e=st.integers(-140, 120),
    scale_exp=st.integers(-60, 3),
    tiny=st.booleans(),
)
def test_bound_holds_across_the_exponent_range(numerics, e, scale_exp, tiny):
    """Inputs and scales over the whole exponent range, subnormal entries: the bound holds,
    or it is infinite with its reason (a gradient that overflows is never under a finite one)."""
    rng = np.random.default_rng((e + 200) * 1000 + scale_exp + 100)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    v = v * 2.0**e
    g = g * 2.0 ** (-e // 2)
    if tiny:
        q[0, 0] = k[1, 1] = 2.0**-130  # subnormal in float32, 0 in the half formats
    bad, _ = _violations(q, k, v, g, None, None, 2.0**scale_exp, numerics, FLASH)
    assert not bad, bad


def test_a_gradient_that_overflows_has_an_infinite_bound_with_its_reason():
    rng = np.random.default_rng(0)
    q, k, g = (rng.standard_normal((L, D)) for _ in range(3))
    v = rng.standard_normal((L, D)) * 6e4  # near float16's largest finite, 65504
    grads = attention_grad(q, k, v, g, numerics="fp16", backward=FLASH)
    bounds = attention_grad_bound(q, k, v, g, numerics="fp16", backward=FLASH)
    assert not np.isfinite(np.asarray(grads.dq, np.float64)).all()
    assert np.isinf(bounds.dq.total).all()
    assert any("overflow float16" in r for r in bounds.dq.reasons)
    assert "inf:" in str(bounds.dq)


@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc"])
def test_the_terms_add_up_to_the_total_and_name_the_stages(numerics):
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    b = attention_grad_bound(q, k, v, g, numerics=numerics, backward=FLASH)
    for bound in b[:4]:
        np.testing.assert_array_equal(bound.total, sum(bound.terms.values()))
    assert set(b.dq.terms) == {"upstream", "inputs", "accumulation", "output"}
    assert set(b.stages) == {"P", "dP", "D", "dS"}
    assert b.dq.theorem == "B.2"
    assert attention_grad_bound(q, k, v, g, numerics=numerics).dq.theorem == "B.1"


def test_stored_probabilities_carry_their_rounding_relatively():
    """B.1 step 3: the rounding of ``P`` into bfloat16 is ``u_p·P`` on a normal entry, not an
    absolute ``u_p``. Every logit is 0, so ``P = 1/64`` exactly, and the float32 softmax's own
    roundings are within ``64·2⁻²⁴``, 0.1% of ``u_p = 2⁻⁸``."""
    rng = np.random.default_rng(2)
    q = np.zeros((64, 16))
    k, v, g = (round_to(rng.standard_normal((64, 16)), "bfloat16") for _ in range(3))
    bad, _ = _violations(q, k, v, g, numerics="bf16-fp32acc")
    assert not bad, bad
    eps_p = attention_grad_bound(q, k, v, g, numerics="bf16-fp32acc").stages["P"]
    u_p, p = 2.0**-8, 1 / 64
    assert (eps_p >= u_p * p).all()
    assert (eps_p <= 1.01 * u_p * p).all()


def test_logit_errors_of_improbable_keys_do_not_move_the_probable_ones():
    """B.1 step 3's ``W``: a bias of -40.3 on half the keys rounds into bfloat16 with an error
    near ``2⁻⁸·40``, but those keys' probability is ``e^-40``, so the other keys' ``P = 1/32``
    keep the bound of exact logits (within 1%, as above). ``max Δ`` would charge them 0.16."""
    rng = np.random.default_rng(3)
    q = np.zeros((64, 16))
    k, v, g = (round_to(rng.standard_normal((64, 16)), "bfloat16") for _ in range(3))
    bias = np.zeros((64, 64))
    bias[:, 32:] = -40.3
    bad, _ = _violations(q, k, v, g, bias=bias, numerics="bf16-fp32acc")
    assert not bad, bad
    eps_p = attention_grad_bound(q, k, v, g, bias=bias, numerics="bf16-fp32acc").stages["P"]
    assert (eps_p[:, :32] <= 1.01 * 2.0**-8 / 32).all()


def test_flash_probabilities_in_the_normal_range_are_not_charged_a_flush():
    """B.2's rounding of the recomputed ``P`` into float16 for ``dV``: ``u_p·P`` where ``P``
    lies in float16's normal range, not ``u_p·P + η_p`` (``η_p = 2⁻¹⁴``, 8 times ``u_p/64``).
    Every logit is 0, so ``P = 1/64``; the scores' underflow allowance ``η_s = 2⁻¹⁴`` on each
    logit adds at most ``e^{2η_s} - 1 < 0.5·u_p`` to ``P``'s ratio."""
    rng = np.random.default_rng(5)
    q = np.zeros((64, 16))
    k, v, g = (round_to(rng.standard_normal((64, 16)), "float16") for _ in range(3))
    bad, bounds = _violations(q, k, v, g, numerics="fp16-fp32acc", backward=FLASH)
    assert not bad, bad
    rounding = 2.0**-11 / 64 * np.abs(g).sum(axis=0)
    assert (bounds.dv.terms["upstream"] <= 1.6 * rounding).all()


def test_dq_keeps_the_probabilities_error_coupled_through_d():
    """B.1 step 7': P̂'s error π enters dS through P̂_j and through D̂, and through k it is
    Σ_j π_j (t_j k_j - dP_j k̄). With uniform probabilities (q = 0) over keys ±K, k̄ = 0, so
    the second part vanishes, where step 6's entrywise bound carries Σ_j err_dS,j |k_j| in
    full: here the coupled form is below 3/4 of that."""
    rng = np.random.default_rng(4)
    half = round_to(rng.standard_normal((32, 16)), "bfloat16")
    q, k = np.zeros((64, 16)), np.concatenate([half, -half])
    v, g = (round_to(rng.standard_normal((64, 16)), "bfloat16") for _ in range(2))
    bad, bounds = _violations(q, k, v, g, numerics="bf16-fp32acc")
    assert not bad, bad
    entrywise = 0.25 * (bounds.stages["dS"] @ np.abs(k))  # c = 1/4
    assert (bounds.dq.terms["upstream"] < 0.75 * entrywise).all()


def test_flash_dq_carries_d_error_as_common_to_the_row():
    """B.2 step 7'': D̂'s error e_D is one number per row, so its share -P_j e_D of dŜ_j is,
    through k, -e_D k̄. Over keys ±K with uniform probabilities k̄ = 0, and dq's upstream term
    is the entrywise one less that share, Σ_j P_j e_D |k_j| (with dS kept in float32, so
    that no rounding of dS hides it); here that share is most of dS's error."""
    rng = np.random.default_rng(4)
    half = round_to(rng.standard_normal((32, 16)), "bfloat16")
    q, k = np.zeros((64, 16)), np.concatenate([half, -half])
    v, g = (round_to(rng.standard_normal((64, 16)), "bfloat16") for _ in range(2))
    bw = Backward("flash2", block_q=16, block_k=16, ds_format="float32")
    for preset in ("bf16-fp32acc", "fp16-fp32acc"):
        bad, bounds = _violations(q, k, v, g, numerics=preset, backward=bw)
        assert not bad, bad
        share = bounds.stages["D"] / 64  # P_j = 1/64 exactly (every logit is 0)
        assert (share > 0.5 * bounds.stages["dS"]).all()
        without = 0.25 * ((bounds.stages["dS"] - share) @ np.abs(k))  # c = 1/4
        assert (bounds.dq.terms["upstream"] <= 1.001 * without).all()


def test_flash_d_reads_the_forward_error_along_d_out():
    """B.2 step 5 through Theorem A.1g: D = Σ_c G_c Ô_c carries the forward output's error
    along each row's G, where the logits' share Σ_j (p̃_j - p_j) G·v_j cancels over the
    columns; on random normal bf16 inputs at L = d = 64 D's error is below 0.4 of the
    entrywise Σ_c |G_c| ε_O,c of A.1's classic steps (0.09-0.19 measured). A.1 with the known
    roundings (steps 3k, 6k: the scores and probabilities rounded into bfloat16 known, with
    their signs), which A.1g cannot take apart, is smaller still here: D's error is then that
    entrywise sum, to within its other parts (at most 1.001 of it measured)."""
    rng = np.random.default_rng(0)
    q, k, v, g = (round_to(rng.standard_normal((64, 64)), "bfloat16") for _ in range(4))
    bad, bounds = _violations(
        q, k, v, g, numerics="bf16-fp32acc", backward=Backward("flash2", block_q=32, block_k=32)
    )
    assert not bad, bad
    for known, factor in ((False, 0.4), (True, 1.01)):
        forward = attention_bound(q, k, v, numerics="bf16-fp32acc", known_rounding=known).total
        entrywise = (np.abs(g) * forward).sum(axis=-1, keepdims=True)
        assert (bounds.stages["D"] < factor * entrywise).all()


def test_the_known_roundings_in_b2_are_the_callers_choice():
    """``known_rounding=False`` keeps B.2's ``D`` on A.1g alone (a kernel that does not opt in):
    on the inputs above, above the entrywise sum of A.1 with the known roundings in some row,
    and the gradients within the bound still; a non-bool is refused by name."""
    rng = np.random.default_rng(0)
    q, k, v, g = (round_to(rng.standard_normal((16, 16)), "bfloat16") for _ in range(4))
    bw = Backward("flash2", block_q=8, block_k=8)
    classic = attention_grad_bound(q, k, v, g, numerics="bf16-fp32acc", backward=bw,
                                   known_rounding=False)  # fmt: skip
    forward = attention_bound(q, k, v, numerics="bf16-fp32acc").total
    entrywise = (np.abs(g) * forward).sum(axis=-1, keepdims=True)
    assert (classic.stages["D"] > 1.01 * entrywise).any()
    grads = attention_grad(q, k, v, g, numerics="bf16-fp32acc", backward=bw)
    exact = reference.attention_grad(q, k, v, g, digits=17)
    for got, want, b in zip(
        grads[:3], exact[:3], (classic.dq, classic.dk, classic.dv), strict=True
    ):
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= b.total)
    with pytest.raises(InvalidArgument, match="known_rounding: expected True or False"):
        attention_grad_bound(q, k, v, g, numerics="bf16-fp32acc", known_rounding="yes")


def test_textbook_d_charges_the_logits_share_against_dp_minus_d():
    """B.1 step 5': the logits' share of P̂'s error sums to 0 over the row, so it enters
    D = Σ_k dP_k P̂_k as Σ_k (dP_k - D) π_k, not Σ_k |dP_k| |π_k|. Values nearly alike over
    the keys make dP_ij nearly constant along each row (so dP - D is small), and bf16 scores
    make the logits' error the largest part of P̂'s: D's error then stays below the entrywise
    Σ_k |dP_k| ε_P,k, which bounded it before (ratio >= 1 on every row; 0.23 in the median row
    and 0.87 in the worst, where P̂'s rounding into bf16, which keeps |dP|, weighs most, against
    step 3′'s ε_P, itself smaller on probable keys: 0.07 and 0.45 against the ε_P before it),
    and every gradient within its bound."""
    rng = np.random.default_rng(3)
    q, k, g = (round_to(2 * rng.standard_normal((32, 16)), "bfloat16") for _ in range(3))
    v = round_to(1 + 2.0**-6 * rng.standard_normal((32, 16)), "bfloat16")
    bad, bounds = _violations(q, k, v, g, numerics="bf16-fp32acc")
    assert not bad, bad
    d_p = np.abs(g @ v.T)
    entrywise = (d_p * bounds.stages["P"]).sum(axis=-1, keepdims=True)
    ratio = bounds.stages["D"] / entrywise
    assert ratio.max() < 0.95
    assert np.median(ratio) < 0.35


def _fp32_problem():
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal((64, 16)) for _ in range(4))


def test_an_atomic_add_order_is_reproduced_bit_for_bit():
    q, k, v, g = _fp32_problem()
    order = (3, 7, 0, 5, 1, 6, 2, 4)
    bw = Backward("flash2", block_q=16, block_k=8, dq_order=order)
    a = attention_grad(q, k, v, g, numerics="fp32", backward=bw)
    b = attention_grad(q, k, v, g, numerics="fp32", backward=bw)
    for x, y in zip(a[:4], b[:4], strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@given(seed=st.integers(0, 2**32 - 1))
def test_two_orders_differ_within_theorem_b3(seed):
    q, k, v, g = _fp32_problem()
    perms = np.random.default_rng(seed)
    a_order, b_order = (tuple(int(i) for i in perms.permutation(8)) for _ in range(2))
    runs = [
        attention_grad(
            q, k, v, g, numerics="fp32",
            backward=Backward("flash2", block_q=16, block_k=8, dq_order=o),
        ).dq
        for o in (a_order, b_order)
    ]  # fmt: skip
    bound = dq_order_difference(
        q, k, v, g, numerics="fp32", backward=Backward("flash2", block_q=16, block_k=8)
    )
    diff = np.abs(np.asarray(runs[0], np.float64) - np.asarray(runs[1], np.float64))
    assert (diff <= bound.total).all()


def test_orders_do_differ_and_only_dq_depends_on_them():
    q, k, v, g = _fp32_problem()
    bw = Backward("flash2", block_q=16, block_k=8)
    a = attention_grad(q, k, v, g, numerics="fp32", backward=bw)
    differ = 0
    for seed in range(6):
        order = tuple(int(i) for i in np.random.default_rng(seed).permutation(8))
        b = attention_grad(q, k, v, g, numerics="fp32", backward=bw.__class__(
            "flash2", block_q=16, block_k=8, dq_order=order))  # fmt: skip
        differ += int(np.any(np.asarray(a.dq) != np.asarray(b.dq)))
        for x, y in zip(a[1:4], b[1:4], strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert differ > 0  # the order is observable in float32


def test_one_key_block_and_the_textbook_have_no_order():
    q, k, v, g = _fp32_problem()
    for bw in ("textbook", Backward("flash2", block_k=64)):
        b = dq_order_difference(q, k, v, g, numerics="fp32", backward=bw)
        assert np.all(b.total == 0)


def test_fully_masked_rows_follow_each_algorithm():
    rng = np.random.default_rng(2)
    q, k, v, g = (rng.standard_normal((4, 2)) for _ in range(4))
    mask = np.ones((4, 4), bool)
    mask[1] = False
    text = attention_grad(q, k, v, g, mask, numerics="fp32")
    flash = attention_grad(q, k, v, g, mask, numerics="fp32", backward=Backward("flash2"))
    assert np.isnan(np.asarray(text.dq)[1]).all()  # autograd through -inf - (-inf)
    assert (np.asarray(flash.dq)[1] == 0).all()  # lse = -inf, P = 0
    with pytest.raises(InvalidArgument, match=r"mask: expected every row"):
        attention_grad_bound(q, k, v, g, mask, numerics="fp32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "reverse"}, "backward.algorithm"),
        ({"block_q": 0}, "backward.block_q"),
        ({"block_k": True}, "backward.block_k"),
        ({"grad_format": "float8_e4m3fn"}, "backward.grad_format"),
        ({"algorithm": "flash2", "dq_order": (0, 0)}, "backward.dq_order"),
        ({"dq_order": (0,)}, "backward.dq_order"),
    ],
)
def test_bad_backward_fields_are_named(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Backward(**kwargs)


def test_bad_calls_are_named():
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((8, 4)) for _ in range(4))
    with pytest.raises(InvalidArgument, match=r"backward\.dq_order: expected a permutation of 2"):
        attention_grad(q, k, v, g, backward=Backward("flash2", block_k=4, dq_order=(0, 1, 2)))
    with pytest.raises(InvalidArgument, match=r"d_out: expected the output's shape"):
        attention_grad(q, k, v, g[:, :3])
    with pytest.raises(InvalidArgument, match=r"numerics\.exp_form"):
        attention_grad(q, k, v, g, numerics=Numerics(exp_form="exp2"))
    with pytest.raises(InvalidArgument, match=r"numerics\.kv_splits"):
        attention_grad_bound(q, k, v, g, numerics=Numerics(kv_splits=2))
    with pytest.raises(InvalidArgument, match=r"numerics\.softmax"):
        attention_grad_bound(q, k, v, g, numerics=Numerics(softmax="naive"))
    with pytest.raises(InvalidArgument, match=r"numerics\.mask_value"):
        attention_grad_bound(
            q, k, v, g, np.tril(np.ones((8, 8), bool)), numerics=Numerics(mask_value="finfo.min")
        )
    with pytest.raises(InvalidArgument, match=r"backward: expected a Backward"):
        attention_grad(q, k, v, g, backward=3)
    with pytest.raises(InvalidArgument, match=r"d_out"):
        attention_grad(q, k, v, np.full((8, 4), np.nan))


@pytest.mark.parametrize(
    ("numerics", "backward"), [("fp32", "textbook"), ("bf16-fp32acc", "flash2")]
)
def test_the_gradient_search_finds_no_violation(numerics, backward):
    from mhanum.search import gradient_worst_case

    shape = {"q_len": 6, "kv_len": 8, "d_k": 4}
    case = gradient_worst_case(numerics, shape, backward=backward, budget=20, mask="causal")
    assert not case.violation, (case.gradient, case.index, case.ratio)
    assert case.gradient in ("dq", "dk", "dv", "dbias")
    assert case.evaluations == 20
    # the case is the measurement it reports: re-measured against the reference
    grads = attention_grad(
        case.q, case.k, case.v, case.d_out, case.mask, numerics=numerics, backward=backward
    )
    exact = reference.attention_grad(case.q, case.k, case.v, case.d_out, mask=case.mask, digits=17)
    i = ("dq", "dk", "dv", "dbias").index(case.gradient)
    got = float(np.asarray(grads[i], np.float64)[case.index])
    assert abs(got - exact[i][case.index]) == case.error


def test_the_gradient_search_catches_a_bound_too_small():
    """A bound divided by 1000 is exceeded, and the search says so."""
    from mhanum.search import gradient_worst_case

    def too_small(*args, **kwargs):
        b = attention_grad_bound(*args, **kwargs)
        return b._replace(dq=dataclasses.replace(b.dq, total=b.dq.total / 1000))

    shape = {"q_len": 6, "kv_len": 8, "d_k": 4}
    case = gradient_worst_case("bf16-fp32acc", shape, budget=10, bound=too_small)
    assert case.violation
    assert case.gradient == "dq"


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc", "fp16", "tensor-core-fp16"])
@given(problem=_problem(span=4))
def test_the_a_priori_bound_covers_every_admissible_input(numerics, backward, problem):
    """Theorem B.4 from the inputs' own norms: every gradient's error is within it (and the
    norms are attained, so the inputs are at the edge of the admissible set)."""
    from mhanum.bounds.backward import attention_grad_bound_a_priori

    q, k, v, g, mask, _ = problem
    grads = attention_grad(q, k, v, g, mask, numerics=numerics, backward=backward)
    exact = reference.attention_grad(q, k, v, g, mask=mask, digits=17)
    b = attention_grad_bound_a_priori(
        L, L, D,
        q_norm=float(np.linalg.norm(q, axis=-1).max()),
        k_norm=float(np.linalg.norm(k, axis=-1).max()),
        v_max=float(np.abs(v).max()),
        d_out_max=float(np.abs(g).max()),
        numerics=numerics, backward=backward,
    )  # fmt: skip
    assert b.dq.theorem == "B.4"
    for got, want, bound in zip(grads, exact, b[:4], strict=False):
        err = np.abs(np.asarray(got, np.float64) - want)
        assert (err <= bound.total).all(), float(np.max(err / bound.total))


def test_the_a_priori_bound_refuses_bad_norms_and_says_why_it_is_infinite():
    from mhanum.bounds.backward import attention_grad_bound_a_priori

    with pytest.raises(InvalidArgument, match="q_norm"):
        attention_grad_bound_a_priori(4, 4, 2, q_norm=-1.0, k_norm=1.0, v_max=1.0, d_out_max=1.0)
    huge = attention_grad_bound_a_priori(
        4, 4, 2, q_norm=1.0, k_norm=1.0, v_max=6e4, d_out_max=6e4, numerics="fp16"
    )
    assert np.isinf(huge.dq.total).all()
    assert any("overflow float16" in r for r in huge.dq.reasons)


def test_an_operand_that_overflows_its_tf32_conversion_is_named():
    """float32's largest values round up to inf in tf32 (10 fraction bits): a d_out there makes
    dv NaN, and the bound says inf, with the operand conversion as the reason."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((L, D)) for _ in range(3))
    g = np.full((L, D), float(np.finfo(np.float32).max))
    grads = attention_grad(q, k, v, g, numerics="tf32")
    bounds = attention_grad_bound(q, k, v, g, numerics="tf32")
    assert not np.isfinite(np.asarray(grads.dv)).all()
    assert np.isinf(bounds.dv.total).all()
    assert any("operand read into the operand format" in r for r in bounds.dv.reasons)


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc"])
@given(problem=_problem(span=4))
def test_the_probabilistic_bound_states_its_probability_and_holds(numerics, backward, problem):
    q, k, v, g, mask, bias = problem
    b = attention_grad_bound(
        q, k, v, g, mask, bias=bias, numerics=numerics, backward=backward, probability=0.99
    )
    assert b.dq.theorem == "B.5"
    assert b.dq.probability >= 0.99
    assert b.dq.lam is not None
    assert any("independent" in a for a in b.dq.assumptions)
    deterministic = attention_grad_bound(
        q, k, v, g, mask, bias=bias, numerics=numerics, backward=backward
    )
    assert np.all(b.dq.total <= deterministic.dq.total)
    grads = attention_grad(q, k, v, g, mask, bias=bias, numerics=numerics, backward=backward)
    exact = reference.attention_grad(q, k, v, g, mask=mask, bias=bias, digits=17)
    for got, want, bound in zip(grads, exact, b[:4], strict=False):
        assert (np.abs(np.asarray(got, np.float64) - want) <= bound.total).all()


@pytest.mark.parametrize(("algorithm", "sink"), [("textbook", None), ("flash2", 0.5)])
def test_the_probabilistic_bound_counts_one_chain_per_term(algorithm, sink):
    """B.5's Bound.probability is the union bound over every term of every sum and dot (R.6's
    corollary), counted by hand: ``q kᵀ``, the row sums, ``G Vᵀ``, ``D``, ``dQ``, ``dK``,
    ``dV`` and the sink's column sum, per batch element."""
    from mhanum.bounds.union import union_failure
    from mhanum.numerics import resolve

    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((3, n, 4)) for n in (6, 5))
    v, g = (rng.standard_normal((3, n, 2)) for n in (5, 6))
    b = attention_grad_bound(q, k, v, g, numerics="fp32", backward=algorithm, lam=6.0, sink=sink)
    lq, n, d, dv = 6, 5 + (sink is not None), 4, 2
    chains = lq * n * d + lq * n + lq * n * dv  # q kᵀ, the row sums, G Vᵀ
    chains += lq * (dv if algorithm == "flash2" else n)  # D
    chains += lq * n * (2 * d + dv) + (lq if sink is not None else 0)  # dQ, dK, dV, dsink
    want = 1.0 - union_failure(6.0, 3 * chains, resolve("fp32"))
    assert b.dq.probability == pytest.approx(want, rel=1e-12, abs=0)


def test_the_probabilistic_bound_refuses_what_it_does_not_model():
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((4, 2)) for _ in range(4))
    with pytest.raises(InvalidArgument, match="lam"):
        attention_grad_bound(q, k, v, g, numerics="tensor-core-bf16", lam=4.0)
    with pytest.raises(InvalidArgument, match="lam, probability"):
        attention_grad_bound(q, k, v, g, lam=4.0, probability=0.9)
    with pytest.raises(InvalidArgument, match="probability"):
        attention_grad_bound(q, k, v, g, probability=1.5)


def test_a_gradient_case_is_saved_replayed_bit_for_bit_and_never_overwritten(tmp_path, capsys):
    import json

    from mhanum import cases, cli

    args = ["search", "--backward", "flash2", "--preset", "bf16-fp32acc", "--q-len", "4",
            "--kv-len", "8", "--d-k", "4", "--block", "4", "--mask", "causal", "--budget", "6",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backward"] == "flash2"
    assert 0 <= result["ratio"] <= 1
    path = result["case"]
    case = cases.load_gradient(path)
    assert case.backward == Backward("flash2", block_q=4, block_k=4)
    assert case.mask is not None
    assert case.ratio == result["ratio"]
    again = cases.replay(path)
    assert again.bit_for_bit
    assert again.ratio == case.ratio
    assert cli.main(["replay", path]) == 0
    assert "bit for bit" in capsys.readouterr().out
    assert cli.main(args) == 2  # the case exists: never overwritten without --force
    assert "--force" in capsys.readouterr().err
    assert cli.main([*args, "--random"]) == 2
    assert "--backward: expected none of --random" in capsys.readouterr().err


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
@pytest.mark.parametrize("numerics", ["fp32", "bf16-fp32acc", "fp16"])
@given(problem=_problem(span=4), sigma=st.floats(-6, 6))
def test_sinks_and_their_gradient_are_within_the_bound(numerics, backward, problem, sigma):
    """A sink is one more key (k = v = 0, bias σ): every gradient, and dsink (its column of dS
    summed), against the certified reference; a row with every key masked attends the sink."""
    q, k, v, g, mask, bias = problem
    sink = np.array([sigma])
    if mask is not None:
        mask = mask.copy()
        mask[0] = False  # the first row attends the sink alone
    grads = attention_grad(
        q[None], k[None], v[None], g[None], mask, bias=bias, numerics=numerics,
        backward=backward, sink=sink,
    )  # fmt: skip
    exact = reference.attention_grad(
        q[None], k[None], v[None], g[None], mask=mask, bias=bias, sink=sink, digits=17
    )
    b = attention_grad_bound(
        q[None], k[None], v[None], g[None], mask, bias=bias, numerics=numerics,
        backward=backward, sink=sink,
    )  # fmt: skip
    pairs = zip(grads, exact, (b.dq, b.dk, b.dv, b.dbias, b.dsink), strict=True)
    for got, want, bound in pairs:
        got = np.asarray(got, np.float64)
        assert got.shape == np.shape(want) == np.shape(bound.total)
        assert (np.abs(got - want) <= bound.total).all()


def test_scores_that_overflow_the_score_format_before_a_small_scale_are_named():
    """fp16-fp32acc rounds q kᵀ to float16 before the scale: a product past 65504 is inf there
    (and inf·0 NaN under a scale that flushes), however small the scale."""
    rng = np.random.default_rng(6)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    q[:, 0] = 65504.0
    k[:, 0] = 4.0
    grads = attention_grad(q, k, v, g, scale=1e-30, numerics="fp16-fp32acc")
    bounds = attention_grad_bound(q, k, v, g, scale=1e-30, numerics="fp16-fp32acc")
    assert not np.isfinite(np.asarray(grads.dq)).all()
    assert np.isinf(bounds.dq.total).all()
    assert any("q kᵀ rounded to the score format" in r for r in bounds.dq.reasons)


@pytest.mark.parametrize("backward", ["textbook", FLASH], ids=["textbook", "flash2"])
def test_a_scale_past_the_score_formats_range_makes_every_bound_infinite(backward):
    # found by the range-edge property test: 3.4028236692e38 rounds to inf in float32, so the
    # logits are inf (or NaN) and every gradient is NaN; dv's bound was finite (P <= 1)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((L, D)) for _ in range(4))
    q, k = q * 2.0**-62, k * 2.0**-62
    scale = 3.402823669209385e38
    grads = attention_grad(q, k, v, g, scale=scale, numerics="fp32", backward=backward)
    bounds = attention_grad_bound(q, k, v, g, scale=scale, numerics="fp32", backward=backward)
    assert np.isnan(np.asarray(grads.dv, np.float64)).any()
    for name in ("dq", "dk", "dv", "dbias"):
        b = getattr(bounds, name)
        assert np.isinf(b.total).all()
        assert any("the scale 3.40282e+38 rounded" in r for r in b.reasons)


@pytest.mark.parametrize("backward", ["textbook", "flash2"])
def test_the_output_rounding_is_charged_on_the_gradient_not_its_magnitude_sum(backward):
    # Step 8: d_out rows g and -g against uniform probabilities make dV = Pᵀ d_out = 0 while
    # Σ_i P|d_out| is |g|/4. The output's rounding is charged on an enclosure of |dV| from the
    # float64 midpoints, so it is second order in u: at most 2u_o times the other terms (it was
    # u_o·P|d_out|, first order, before)
    num = Numerics.preset("bf16-fp32acc")  # accumulated in float32, rounded to bfloat16
    rng = np.random.default_rng(3)
    q, k = np.zeros((2, 8)), round_to(rng.standard_normal((8, 8)), "bfloat16")
    v = round_to(rng.standard_normal((8, 4)), "bfloat16")
    g = round_to(rng.standard_normal(4), "bfloat16")
    d_out = np.stack([g, -g])
    bounds = attention_grad_bound(q, k, v, d_out, numerics=num, backward=backward)
    got = attention_grad(q, k, v, d_out, numerics=num, backward=backward)
    exact = reference.attention_grad(q, k, v, d_out)
    assert np.all(np.asarray(exact.dv) == 0)
    dv = bounds.dv
    assert np.all(np.abs(np.asarray(got.dv, np.float64)) <= dv.total)
    u_o, eta_o = num.format_of("output").u, num.format_of("output").smallest_normal
    rest = dv.terms["upstream"] + dv.terms["inputs"] + dv.terms["accumulation"]
    assert np.all(dv.terms["output"] <= 2 * u_o * rest + 2 * eta_o)
    assert np.all(dv.terms["output"] < u_o * np.abs(g) / 4)


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 40), ties=st.booleans())
def test_pair_sums_enclose_the_direct_sum(seed, n, ties):
    # Step 6′'s Σ_{l≠j} w_l |a_j + a_l| by one sort per row: never below the direct O(n²) sum,
    # and above it by no more than its float64 allowance (4n + 16)u64 on the magnitudes
    from mhanum.bounds.backward.gradients import _pair_sums

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((3, n)) * 2.0 ** rng.integers(-30, 30, (3, 1))
    if ties:  # equal, opposite and zero values: a_l = -a_j splits exactly at a tie
        a = np.round(a / np.abs(a).max() * 3) * 2.0**-3
    w = rng.random((3, n)) * (rng.random((3, n)) < 0.8)  # masked keys weigh 0
    got = _pair_sums(w, a)
    pair = np.abs(a[:, :, None] + a[:, None, :]) * w[:, None, :]
    direct = pair.sum(axis=-1) - np.diagonal(pair, axis1=1, axis2=2)
    mass = np.abs(a) * w.sum(axis=-1, keepdims=True) + (w * np.abs(a)).sum(-1, keepdims=True)
    assert np.all(got >= direct - (n + 2) * 2.0**-53 * mass)  # the direct sum's own rounding
    assert np.all(got <= direct + (8 * n + 40) * 2.0**-53 * mass)


def test_pair_sums_in_blocks_of_rows_are_the_rows_evaluated_at_once(monkeypatch):
    # _pair_sums evaluates blocks of PAIR_ROWS entries side by side: every row is its own, so
    # the blocks (here of 2 rows, over a batch and a broadcast w) give the same bits
    from mhanum.bounds.backward import gradients

    rng = np.random.default_rng(7)
    a = np.round(rng.standard_normal((2, 5, 9)) * 4) / 4  # ties, opposites and zeros
    w = rng.random((1, 5, 9))
    whole = gradients._pair_sums(w, a)
    monkeypatch.setattr(gradients, "PAIR_ROWS", 18)
    monkeypatch.setenv("MHANUM_THREADS", "2")
    assert np.array_equal(gradients._pair_sums(w, a), whole)
    assert whole.shape == a.shape
