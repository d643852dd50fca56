"""Grouped-query and multi-query attention in the multi-head backward (``num_kv_heads``).

A shared key/value head's gradient is the sum of its query heads' (autograd through
``repeat_interleave``): the emulation sums the group's stored ``dK_h``/``dV_h`` in ``accum``, the
reference sums them exactly, and Theorem B.6 charges the sum (``γ_{g-1}`` on the group's
magnitudes and errors, then the output rounding). The weights' gradients are those of the
grouped weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mhanum
from mhanum import Backward, InvalidArgument, MHAParams, reference
from mhanum import strategies as mst
from mhanum.bounds.backward import mha_grad_bound
from tests.test_mha_backward import gradient_pairs

HEADS, WIDTH = 4, 16
D = WIDTH // HEADS
NAMES = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")


def _layer(kv_heads: int, seed: int = 0):
    params = MHAParams.random(WIDTH, seed=seed, kv_width=kv_heads * D)
    rng = np.random.default_rng(seed + 1)
    x_q, g = (rng.standard_normal((2, 5, WIDTH)) for _ in range(2))
    return params, x_q, rng.standard_normal((2, 6, WIDTH)), g


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("algorithm", ["textbook", "flash2"])
@pytest.mark.parametrize(
    "preset", ["fp32", "bf16-fp32acc", "fp16-fp32acc", "fp16", "tensor-core-bf16"]
)
def test_every_grouped_gradient_is_within_theorem_b6(preset, algorithm, kv_heads):
    """GQA (4 query heads, 2 key/value heads) and MQA (1): every gradient, the grouped weights'
    included, within its bound; ``fp16`` stores every head's gradient in float16, so the group's
    sum rounds in float16 too."""
    params, x_q, x_kv, g = _layer(kv_heads, seed=3)
    mask = np.tril(np.ones((5, 6), bool), 1)
    backward = Backward(algorithm, block_q=2, block_k=4) if algorithm == "flash2" else algorithm
    kw = {"mask": mask, "num_kv_heads": kv_heads}
    got = mhanum.mha_grad(x_q, x_kv, params, HEADS, g, numerics=preset, backward=backward, **kw)
    exact = reference.mha_grad(x_q, x_kv, params, HEADS, g, digits=17, **kw)
    bounds = mha_grad_bound(x_q, x_kv, params, HEADS, g, numerics=preset, backward=backward, **kw)
    for name, x, want, b in gradient_pairs(got, exact, bounds):
        assert np.shape(x) == np.shape(want) == np.shape(b.total), name
        err = np.abs(np.asarray(x, np.float64) - want)
        assert np.isfinite(b.total).all(), (name, b.reasons)
        assert (err <= b.total).all(), (name, float(np.max(err / b.total)))
        assert b.theorem == "B.6"
    assert got.params.wk.shape == params.wk.shape == (WIDTH, kv_heads * D)
    assert sorted(bounds.params) == sorted(NAMES)


@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    preset=st.sampled_from(["bf16-fp32acc", "fp16"]),
    algorithm=st.sampled_from(["textbook", "flash2"]),
    kv_heads=st.sampled_from([1, 2]),
)
def test_grouped_gradients_are_within_theorem_b6_on_drawn_inputs(data, preset, algorithm, kv_heads):
    """Drawn weights and inputs (scaled by up to 2^±4), bands, sinks and soft-caps: every
    gradient of the grouped layer within its bound, or ``inf`` with its reason."""
    params, x_q, x_kv, g = _layer(kv_heads, seed=data.draw(st.integers(0, 2**16)))
    scale = 2.0 ** data.draw(st.integers(-4, 4))
    band = data.draw(mst.bands(q_len=5, kv_len=6))
    kw = {
        "mask": band.array(5, 6),
        "num_kv_heads": kv_heads,
        "sink": data.draw(st.none() | st.just(np.array([0.5, -1.0, 2.0, 0.0]))),
        "softcap": data.draw(st.sampled_from([None, 2.0])),
    }
    backward = Backward(algorithm, block_q=2, block_k=4) if algorithm == "flash2" else algorithm
    x_q, x_kv = scale * x_q, scale * x_kv
    got = mhanum.mha_grad(x_q, x_kv, params, HEADS, g, numerics=preset, backward=backward, **kw)
    exact = reference.mha_grad(x_q, x_kv, params, HEADS, g, digits=17, **kw)
    bounds = mha_grad_bound(x_q, x_kv, params, HEADS, g, numerics=preset, backward=backward, **kw)
    pairs = list(gradient_pairs(got, exact, bounds))
    if kw["sink"] is not None:
        pairs.append(("dsink", got.dsink, exact.dsink, bounds.dsink))
    for name, x, want, b in pairs:
        finite = np.isfinite(b.total)
        err = np.abs(np.asarray(x, np.float64) - want)
        assert (err[finite] <= b.total[finite]).all(), (name, float(np.max(err / b.total)))
        assert finite.all() or b.reasons, name


def test_as_many_key_value_heads_as_heads_is_the_plain_call_bit_for_bit():
    """``num_kv_heads = num_heads``: groups of one head, no sum; every result is the plain
    call's, bit for bit (emulation, reference and bound)."""
    params, x_q, x_kv, g = _layer(HEADS, seed=4)
    numerics, backward = "bf16-fp32acc", Backward("flash2", block_q=2, block_k=4)
    runs = [
        (f, kw) for f in (mhanum.mha_grad, mha_grad_bound) for kw in ({}, {"num_kv_heads": HEADS})
    ]
    out = [f(x_q, x_kv, params, HEADS, g, numerics=numerics, backward=backward, **kw)
           for f, kw in runs]  # fmt: skip
    exact = [reference.mha_grad(x_q, x_kv, params, HEADS, g, digits=17, **kw)
             for kw in ({}, {"num_kv_heads": HEADS})]  # fmt: skip
    for a, b in ((out[0], out[1]), (exact[0], exact[1])):
        for name in ("dx_q", "dx_kv", "dbias"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        for name in NAMES:
            np.testing.assert_array_equal(getattr(a.params, name), getattr(b.params, name))
    for name in ("dx_q", "dx_kv", "dbias"):
        np.testing.assert_array_equal(getattr(out[2], name).total, getattr(out[3], name).total)
    for name in NAMES:
        np.testing.assert_array_equal(out[2].params[name].total, out[3].params[name].total)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_grouped_weights_gradients_are_the_expanded_ones_summed(kv_heads):
    """In the reference, the grouped layer's gradients are the expanded layer's with each key/
    value head's repeated columns summed back; the inputs' gradients are the same (both are
    certified roundings of the same real numbers: within float64's rounding of each other)."""
    params, x_q, x_kv, g = _layer(kv_heads, seed=5)
    group = HEADS // kv_heads
    grouped = reference.mha_grad(x_q, x_kv, params, HEADS, g, num_kv_heads=kv_heads, digits=17)
    full = reference.mha_grad(
        x_q, x_kv, params.expand_kv_heads(HEADS, kv_heads), HEADS, g, digits=17
    )

    def close(a, b, scale):
        assert (np.abs(a - b) <= 2.0**-50 * scale + 2.0**-1074).all()

    for name in ("dx_q", "dx_kv", "dbias"):
        a, b = getattr(grouped, name), getattr(full, name)
        close(a, b, np.abs(b))
    for name in NAMES:
        a, b = getattr(grouped.params, name), getattr(full.params, name)
        if name in ("wk", "wv", "bk", "bv"):
            blocks = b.reshape(*b.shape[:-1], kv_heads, group, D)
            close(
                a,
                blocks.sum(axis=-2).reshape(a.shape),
                np.abs(blocks).sum(axis=-2).reshape(a.shape),
            )
        else:
            close(a, b, np.abs(b))
    assert np.all(grouped.params.bk == 0)  # every head's Σ_j dK_j is 0, and so their sum


@pytest.mark.parametrize(
    ("kv_heads", "width", "match"),
    [(3, 12, "num_kv_heads:"), (0, 4, "num_kv_heads:"), (2, 12, "params.wk:")],
)
def test_bad_grouping_is_refused_by_name(kv_heads, width, match):
    params = MHAParams.random(WIDTH, seed=0, kv_width=width)
    x = np.ones((3, WIDTH))
    for f in (mhanum.mha_grad, reference.mha_grad, mha_grad_bound):
        with pytest.raises(InvalidArgument, match=match):
            f(x, x, params, HEADS, x, num_kv_heads=kv_heads)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_torch_sdpa_enable_gqa_sums_the_groups_gradients(kv_heads):
    """float32 SDPA with ``enable_gqa``: ``dk``, ``dv`` of a shared head are the float32 sums of
    its query heads' (the same call with ``k``, ``v`` repeated), bit for bit; ``dq`` is the
    repeated call's."""
    torch_adapter = pytest.importorskip("mhanum.adapters.torch")
    rng = np.random.default_rng(6)
    q, g = (rng.standard_normal((2, HEADS, 6, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, kv_heads, 6, 8)).astype(np.float32) for _ in range(2))
    mask = np.tril(np.ones((6, 6), bool))
    grouped = torch_adapter.sdpa_grad(q, k, v, g, mask, enable_gqa=True)
    group = HEADS // kv_heads
    k_r, v_r = (np.repeat(x, group, axis=-3) for x in (k, v))
    full = torch_adapter.sdpa_grad(q, k_r, v_r, g, mask)
    np.testing.assert_array_equal(grouped.dq, full.dq)
    for name in ("dk", "dv"):
        parts = getattr(full, name).reshape(2, kv_heads, group, 6, 8).astype(np.float32)
        total = parts[:, :, 0]
        for j in range(1, group):  # head order
            total = total + parts[:, :, j]
        if group <= 2:  # one addition: every order gives the same float32
            np.testing.assert_array_equal(getattr(grouped, name), total)
        else:  # two sums of the same 4 floats in two orders: each within γ_3 of the exact one
            spread = 2 * (3 * 2.0**-24 / (1 - 3 * 2.0**-24)) * np.abs(parts).sum(axis=2)
            assert (np.abs(getattr(grouped, name) - total) <= spread).all()


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_torch_grouped_layer_autograd_is_within_theorem_b6(kv_heads):
    """A float32 grouped-query layer in torch (one packed key/value projection, SDPA with
    ``enable_gqa`` on the math backend, the output projection) differentiated by autograd:
    every gradient within B.6 for fp32 and the textbook backward (head size 16: the math
    path's ``sqrt(1/4)`` on ``q`` and ``k`` is exact, so it computes what the scale on the
    scores does)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    width, heads, d = 64, 4, 16
    p = MHAParams.random(width, seed=7, kv_width=kv_heads * d)
    p = MHAParams(*(np.asarray(getattr(p, n), np.float32).astype(np.float64) for n in NAMES))
    rng = np.random.default_rng(8)
    x_q, x_kv, g = (rng.standard_normal((2, n, width)).astype(np.float32) for n in (6, 5, 6))
    mask = np.tril(np.ones((6, 5), bool), 1)
    t = {n: torch.tensor(getattr(p, n), dtype=torch.float32, requires_grad=True) for n in NAMES}
    tq, tkv = (torch.tensor(a, requires_grad=True) for a in (x_q, x_kv))

    def split(y, n):  # (B, L, n*d) -> (B, n, L, d)
        return y.reshape(*y.shape[:-1], n, d).transpose(-2, -3)

    q = split(tq @ t["wq"] + t["bq"], heads)
    kv = tkv @ torch.cat([t["wk"], t["wv"]], -1) + torch.cat([t["bk"], t["bv"]], -1)
    k, v = (split(a, kv_heads) for a in kv.split(kv_heads * d, -1))
    with sdpa_kernel([SDPBackend.MATH]):
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.from_numpy(mask), enable_gqa=True
        )
    out = o.transpose(-2, -3).reshape(2, 6, width) @ t["wo"] + t["bo"]
    out.backward(torch.from_numpy(g))
    got = {"dx_q": tq.grad, "dx_kv": tkv.grad, **{n: t[n].grad for n in NAMES}}
    kw = {"mask": mask, "num_kv_heads": kv_heads}
    exact = reference.mha_grad(x_q, x_kv, p, heads, g, digits=17, **kw)
    bounds = mha_grad_bound(
        x_q, x_kv, p, heads, g, numerics="fp32", backward=Backward("textbook"), **kw
    )
    for name, _, want, b in gradient_pairs(exact, exact, bounds):
        if name == "dbias":
            continue
        err = np.abs(got[name].double().numpy() - want)
        assert (err <= b.total).all(), (name, float(np.max(err / b.total)))
        if name != "bk":
            assert np.max(err) > 0, name  # float32 does round


def test_a_group_sum_that_may_overflow_makes_its_gradients_infinite_with_the_reason():
    """Two float16 heads' ``dK`` near 40,000 each: their sum may pass float16's 65,504, so the
    bound of every gradient it reaches is ``inf``, and the reason names the sum."""
    from mhanum.bounds.backward.mha import _group_sum

    hit: dict[str, list[str]] = {}

    def fail(why, reaches):
        for name in reaches if why else ():
            hit.setdefault(name, []).extend(why)

    up = np.full((1, 2, 3, 4), 4.0e4)
    num = mhanum.Numerics.preset("fp16")
    total_up, err = _group_sum(up, np.zeros_like(up), 2, num, None, "dk", fail, ("dx_kv", "wk"))
    assert total_up.shape == err.shape == (1, 1, 3, 4)
    assert sorted(hit) == ["dx_kv", "wk"]
    assert "group may overflow float16" in hit["wk"][0]
    ok: dict[str, list[str]] = {}
    _group_sum(up / 4, np.zeros_like(up), 2, num, None, "dk", lambda w, r: ok.update({"w": w}), ())
    assert ok["w"] == []
