"""The bounds are evaluated by blocks of query rows: on threads
(``mhanum._threads.map_threads``), the bound is the same, bit for bit, whatever the number of
threads, and equal to the chunks' bounds evaluated one by one, stacked; a band mask is formed a
block of rows at a time (``bounds.forward.keys.BandRows``), with the dense mask's bound."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import mhanum.bounds.forward.head as head_module
from mhanum import masks
from mhanum._errors import InvalidArgument
from mhanum._threads import MAX_DEFAULT_THREADS, bound_threads, map_threads
from mhanum.bounds import attention_bound, mha_bound, projections
from mhanum.bounds.forward.evaluation import quiet
from mhanum.bounds.forward.stage import Head, Setting
from mhanum.numerics import Numerics
from mhanum.params import MHAParams

# rows × keys past one chunk (head.CHUNK): 700 rows of 700 keys are two chunks, four in
# bf16-fp32acc (half the logits: head.chunk_logits)
L = 700


def _inputs() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, L, 16)) for _ in range(3))
    q[0, 5] *= 40.0  # a row whose logits' errors are large (evaluated in log space)
    v[1, 7] = 1e30  # a large value: the median keeps it out of the centre
    return q, k, v


def _bound(monkeypatch: pytest.MonkeyPatch, threads: str, **kw: Any) -> Any:
    monkeypatch.setenv("MHANUM_THREADS", threads)
    q, k, v = _inputs()
    return attention_bound(q, k, v, numerics="bf16-fp32acc", **kw)


@pytest.mark.parametrize("kw", [{}, {"mask": masks.causal()}, {"lam": 4.0}])
def test_the_bound_is_the_same_bit_for_bit_on_one_two_and_three_threads(monkeypatch, kw):
    one, two, three = (_bound(monkeypatch, n, **kw) for n in ("1", "2", "3"))
    for other in (two, three):
        np.testing.assert_array_equal(other.total, one.total)
        assert other.terms.keys() == one.terms.keys()
        for name in one.terms:
            np.testing.assert_array_equal(other.terms[name], one.terms[name])
        assert other.reasons == one.reasons


def test_the_chunks_run_on_the_pools_threads(monkeypatch):
    names: list[str] = []
    inner = head_module.evaluate_head

    def spy(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return inner(*args)

    monkeypatch.setattr(head_module, "evaluate_head", spy)
    _bound(monkeypatch, "2")
    assert len(names) == 8  # two heads of four chunks
    assert all(name.startswith("mhanum") for name in names)
    names.clear()
    _bound(monkeypatch, "1")
    assert names == [threading.current_thread().name] * 8


@pytest.mark.parametrize("side_by_side", [head_module.SIDE_BY_SIDE, 1])
def test_small_heads_in_one_piece_run_in_turn_larger_ones_side_by_side(monkeypatch, side_by_side):
    """Heads in one piece are evaluated on the pool where one holds at least SIDE_BY_SIDE
    logits, in the caller's thread below: the same bits either way."""
    names: list[str] = []
    inner = head_module.evaluate_head

    def spy(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return inner(*args)

    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((3, 40, 8)) for _ in range(3))
    monkeypatch.setenv("MHANUM_THREADS", "1")
    alone = attention_bound(q, k, v, numerics="bf16-fp32acc")
    monkeypatch.setattr(head_module, "evaluate_head", spy)
    monkeypatch.setattr(head_module, "SIDE_BY_SIDE", side_by_side)
    monkeypatch.setenv("MHANUM_THREADS", "2")
    got = attention_bound(q, k, v, numerics="bf16-fp32acc")
    assert len(names) == 3  # 40 x 40 = 1,600 logits a head
    if side_by_side > 40 * 40:
        assert names == [threading.current_thread().name] * 3
    else:
        assert all(name.startswith("mhanum") for name in names)
    np.testing.assert_array_equal(got.total, alone.total)
    assert got.reasons == alone.reasons


def test_a_head_in_chunks_is_its_chunks_evaluated_alone_and_stacked():
    q, k, v = (x[0] for x in _inputs())
    keep = np.tril(np.ones((L, L), bool))
    zero = np.zeros_like(q)
    head = Head(q, k, v, keep, (zero, zero, zero))
    setting = Setting(Numerics.preset("bf16-fp32acc"), 0.25, False)
    chunks = head_module._row_chunks(head, head_module.chunk_logits(setting))
    assert len(chunks) == 4
    whole = head_module.evaluate_rows(head, setting)
    with quiet():
        alone = [head_module.evaluate_head(head.rows(cut), setting) for cut in chunks]
    np.testing.assert_array_equal(whole[1], np.concatenate([a[1] for a in alone]))
    for name in whole[0]:
        np.testing.assert_array_equal(
            whole[0][name],
            np.concatenate([np.broadcast_to(a[0][name], a[1].shape) for a in alone]),
        )


def test_the_keys_side_is_taken_once_per_head_in_chunks(monkeypatch):
    calls: list[int] = []
    inner = head_module.keys_step

    def spy(head: Head, setting: Setting) -> Any:
        calls.append(head.q.shape[-2])
        return inner(head, setting)

    monkeypatch.setattr(head_module, "keys_step", spy)
    _bound(monkeypatch, "2")
    assert calls == [L, L]  # two heads of four chunks: once each, for the whole head


def test_the_keys_range_findings_are_the_chunks_own_in_their_order():
    # R.1 and R.2 on k and v are found once for a head (operands.keys_step) and taken by each
    # chunk where its own stages check: the head in chunks records what its chunks record
    # alone, with the reasons in the order of the stages that find them
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((L, 16)) * 300.0 for _ in range(3))
    q[3], k[5], v[:, 2] = 7e4, 6.6e4, 6.6e4
    zero = np.zeros_like(q)
    head = Head(q, k, v, np.ones((L, L), bool), (zero, zero, zero))
    setting = Setting(Numerics.preset("fp16").replace(scale="qk"), 4.0, False)
    chunks = head_module._row_chunks(head, head_module.chunk_logits(setting))
    assert len(chunks) == 2
    whole = head_module.evaluate_rows(head, setting)[4]
    with quiet():
        alone = [head_module.evaluate_head(head.rows(cut), setting)[4] for cut in chunks]
    assert whole.reasons == list(dict.fromkeys(r for a in alone for r in a.reasons))
    # in the order of the stages: R.1, step 2' (q, then k), R.2
    assert [r.split(":")[0] for r in whole.reasons[:10]] == [
        "q in the input format", "k in the input format", "v in the input format",
        "q read into the scale format", "q times the scale factor 2",
        "k read into the scale format", "k times the scale factor 2",
        "q read into the accumulation format", "k read into the accumulation format",
        "v read into the accumulation format",
    ]  # fmt: skip
    assert whole.where.keys() == alone[0].where.keys()
    for name in whole.where:
        np.testing.assert_array_equal(
            whole.where[name], np.concatenate([a.where.get(name, False) for a in alone])
        )


def test_a_projection_in_blocks_of_rows_is_its_blocks_evaluated_alone_and_stacked(monkeypatch):
    # A.2 (a) belongs to each row of x: linear takes blocks of rows (projections.BLOCK outputs)
    # side by side, and stacks what each block gives alone
    monkeypatch.setattr(projections, "BLOCK", 64)  # 8 rows of 8 outputs
    rng = np.random.default_rng(7)
    x, w, b = rng.standard_normal((20, 16)), rng.standard_normal((16, 8)), rng.standard_normal(8)
    x_given = np.abs(rng.standard_normal((20, 16))) * 1e-9
    num = Numerics.preset("bf16-fp32acc")
    out = num.format_of("input")
    whole = projections.linear(x, x_given, w, b, num, out, lam=3.0)
    cuts = [slice(0, 8), slice(8, 16), slice(16, 20)]
    alone = [projections.linear(x[c], x_given[c], w, b, num, out, lam=3.0) for c in cuts]
    for name in ("y", "given", "fixed"):
        np.testing.assert_array_equal(
            getattr(whole, name), np.concatenate([getattr(a, name) for a in alone])
        )
    assert whole.kappa == alone[0].kappa
    np.testing.assert_array_equal(whole.slope, alone[0].slope)
    assert whole.rounded is not None
    for name in ("rest", "sigma", "before"):
        parts = [getattr(a.rounded, name) for a in alone if a.rounded is not None]
        np.testing.assert_array_equal(
            getattr(whole.rounded, name)[0], np.concatenate([r[0] for r in parts])
        )
        assert getattr(whole.rounded, name)[1] == parts[0][1]


def test_mha_bound_in_blocks_and_chunks_is_the_same_on_one_and_two_threads(monkeypatch):
    monkeypatch.setattr(projections, "BLOCK", 256)  # projections of 8 rows a block
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 40, 32))
    params = MHAParams.random(32, seed=2)
    bounds = []
    for threads in ("1", "2"):
        monkeypatch.setenv("MHANUM_THREADS", threads)
        bounds.append(mha_bound(x, x, params, 4, numerics="fp32"))
    np.testing.assert_array_equal(bounds[0].total, bounds[1].total)
    assert bounds[0].reasons == bounds[1].reasons


def test_map_threads_keeps_the_items_order_and_raises_what_an_item_raises(monkeypatch):
    monkeypatch.setenv("MHANUM_THREADS", "2")
    assert map_threads(lambda x: x * x, list(range(7))) == [x * x for x in range(7)]

    def fail(x: int) -> int:
        if x == 3:
            raise ValueError("item 3")
        return x

    with pytest.raises(ValueError, match="item 3"):
        map_threads(fail, list(range(5)))


@pytest.mark.parametrize("text", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("MHANUM_THREADS", text)
    with pytest.raises(InvalidArgument, match="MHANUM_THREADS: expected a positive integer"):
        bound_threads()


def test_the_default_is_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("MHANUM_THREADS", raising=False)
    assert bound_threads() == min(len(os.sched_getaffinity(0)), MAX_DEFAULT_THREADS)
    monkeypatch.setenv("MHANUM_THREADS", "5")
    assert bound_threads() == 5


def test_the_double_double_reference_in_blocks_of_rows_is_the_same_enclosure(monkeypatch):
    """Each row's enclosure depends on its own row of q, mask and bias: blocks of rows on
    threads give the whole problem's enclosure (papers/reference.md, Lemma 4)."""
    from mhanum.reference import _fastref

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 1024, 8)) for _ in range(3))
    excluded = ~np.tril(np.ones((2, 1024, 1024), bool))
    bias = np.where(excluded, 0.0, rng.standard_normal((2, 1024, 1024)))
    scale = _fastref.scale_ball(None, 8)
    results = []
    for n in ("1", "2", "3"):
        monkeypatch.setenv("MHANUM_THREADS", n)
        assert len(_fastref._row_blocks(1024, excluded.size)) == int(n)
        with np.errstate(all="ignore"):
            results.append(_fastref.attention(q, k, v, excluded, bias, scale, "zero"))
    (one, u_one), *others = results
    for ball, undefined in others:
        np.testing.assert_array_equal(undefined, u_one)
        for a, b in zip(ball, one, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_gradient_bound_and_oracle_are_the_same_on_one_and_two_threads(monkeypatch):
    """B.1 step 7′'s chunks of query rows, and the gradient oracle's reference and candidate
    bounds, side by side: the same values, and the caller's BLAS setting comes back."""
    from threadpoolctl import ThreadpoolController, threadpool_limits

    from mhanum.bounds import attention_grad_bound
    from mhanum.testing import attention_grad_tolerance

    rng = np.random.default_rng(7)
    q, k, v, g = (rng.standard_normal((512, 64)) for _ in range(4))
    qt, kt, vt, gt = (x.astype(np.float32)[None, None] for x in (q, k, v, g))
    runs = []
    for n in ("1", "2"):
        monkeypatch.setenv("MHANUM_THREADS", n)
        with threadpool_limits(limits=2, user_api="blas"):
            b = attention_grad_bound(q, k, v, g, numerics="bf16-fp32acc")
            tol = attention_grad_tolerance(qt, kt, vt, gt, kernel="torch-sdpa-math")
            blas = {
                lib["num_threads"]
                for lib in ThreadpoolController().info()
                if lib["user_api"] == "blas"
            }
        assert blas == {2}
        runs.append((b, tol))
    (b1, t1), (b2, t2) = runs
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(b2, name).total, getattr(b1, name).total)
        np.testing.assert_array_equal(t2[name], t1[name])


def test_the_gradient_oracles_own_products_take_one_blas_thread_too(monkeypatch):
    """The oracle's products outside the bounds (the candidates' product terms) run with one
    BLAS thread whichever thread takes them: with the caller's two, OpenBLAS splits a
    300 × 130 product differently and the tolerance moved by an ulp with the thread count."""
    from threadpoolctl import threadpool_limits

    from mhanum.testing import attention_grad_oracle

    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((1, 2, 300, 130)).astype(np.float32) for _ in range(4))
    runs = []
    for n in ("1", "2"):
        monkeypatch.setenv("MHANUM_THREADS", n)
        with threadpool_limits(limits=2, user_api="blas"):
            runs.append(attention_grad_oracle(q, k, v, g, kernel="jax-xla"))
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(runs[1][name].tolerance, runs[0][name].tolerance)


BANDS = [
    masks.causal(),
    masks.window(5, 0),
    masks.window(3, 2),
    masks.causal(offset=-3),  # the first three rows attend no key
    masks.bottom_right(masks.causal(), 300, 700),
]


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("shape", [(300, 700), (700, 700)])
def test_a_band_formed_a_block_of_rows_at_a_time_gives_the_dense_masks_bound(band, shape):
    """A band alone under -inf masking is never formed for a whole head
    (bounds.forward.keys.BandRows): the bound is that of its dense array, bit for bit."""
    lq, lk = shape
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, lq, 16))
    k, v = (rng.standard_normal((2, lk, 16)) for _ in range(2))
    lazy = attention_bound(q, k, v, band, numerics="bf16-fp32acc")
    dense = attention_bound(q, k, v, band.array(lq, lk), numerics="bf16-fp32acc")
    assert lazy.reasons == dense.reasons
    assert lazy.terms.keys() == dense.terms.keys()
    np.testing.assert_array_equal(lazy.total, dense.total)
    for name in lazy.terms:
        np.testing.assert_array_equal(lazy.terms[name], dense.terms[name])


def test_the_band_of_a_head_is_formed_per_block_of_rows():
    from mhanum.bounds.forward.keys import BandRows, keep_and_bias

    num = Numerics.preset("bf16-fp32acc")
    keep, masked, bias, replaced = keep_and_bias(masks.causal(), None, (2, 700, 700), num)
    assert isinstance(keep, BandRows)
    assert isinstance(replaced, BandRows)
    assert masked is None
    assert bias is None
    assert keep[(1,)].shape == (700, 700)
    np.testing.assert_array_equal(
        keep.rows(slice(5, 9))[1], np.tril(np.ones((700, 700), bool))[5:9]
    )
    np.testing.assert_array_equal(replaced.rows(slice(0, 3))[0], ~keep.rows(slice(0, 3))[0])
    # with a finite masking constant the masked keys are an array, as before
    finite = num.replace(mask_value=-1e4)
    keep, masked, _, _ = keep_and_bias(masks.causal(), None, (2, 700, 700), finite)
    assert isinstance(keep, np.ndarray)
    assert isinstance(masked, np.ndarray)
