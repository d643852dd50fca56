"""Split-KV ("flash-decoding"): each split of the keys attended alone, merged by log-sum-exp.

The emulation with one split is the unsplit computation bit for bit (its merge weight is
``exp(lse - (log 1 + lse)) = 1`` exactly); with more splits its output lies within Theorem A.6's
bound of the certified reference (decoding shapes, every softmax algorithm, splits that hold no
attended key, outliers whose log-sum-exps differ by hundreds); two split counts differ by no more
than Theorem A.5 allows; bad split counts are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhanum as mn
from mhanum import InvalidArgument, Numerics, reference
from mhanum.bounds import attention_bound, attention_bound_a_priori, schedule_difference
from tests._grid import covering_grid

SOFTMAXES = ("safe", "online(16)", "naive")


def _inputs(seed: int, q_len: int = 2, kv_len: int = 100, d: int = 16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((q_len, d))
    k = rng.standard_normal((kv_len, d))
    v = rng.standard_normal((kv_len, 8))
    return q, k, v


def _out(q, k, v, num, mask=None):
    return np.asarray(mn.attention(q, k, v, mask, numerics=num), np.float64)


@pytest.mark.parametrize("softmax", SOFTMAXES)
@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc", "fp16"])
def test_one_split_is_the_unsplit_computation(preset, softmax):
    q, k, v = _inputs(0)
    num = Numerics.preset(preset).replace(softmax=softmax)
    np.testing.assert_array_equal(_out(q, k, v, num.replace(kv_splits=1)), _out(q, k, v, num))


def test_the_split_size_follows_flashattention_2():
    num = Numerics(softmax="online(16)", kv_splits=20)
    # 100 keys are 7 blocks of 16: one block per split, so 7 splits run, not 20
    assert num.kv_split_size(100) == 16
    assert Numerics(kv_splits=3).kv_split_size(100) == 34
    assert Numerics().kv_split_size(100) == 100


# 48 cells, each compiling its own programs: the fast run takes 12, in which every pair of preset
# and softmax and every number of splits appears
@pytest.mark.parametrize(
    ("preset", "softmax", "splits"),
    covering_grid(
        [(p, s) for p in ("fp32", "bf16-fp32acc", "fp16", "bf16") for s in SOFTMAXES],
        [2, 3, 7, 100],
    ),
)
def test_split_kv_is_within_theorem_a6(preset, softmax, splits):
    q, k, v = _inputs(1)
    num = Numerics.preset(preset).replace(softmax=softmax, kv_splits=splits)
    bound = attention_bound(q, k, v, numerics=num)
    err = np.abs(_out(q, k, v, num) - reference.attention(q, k, v))
    assert bound.theorem == "A.6"
    assert np.isfinite(bound.total).all()
    assert (err <= bound.total).all(), (err / bound.total).max()
    assert {"split_lse", "split_merge"} <= set(bound.terms)


def test_decoding_one_query_against_a_long_cache():
    # one query, 4096 keys in 32 splits, a few keys far above the rest: the splits' log-sum-exps
    # differ by hundreds, and most merge weights underflow
    q, k, v = _inputs(2, q_len=1, kv_len=4096, d=64)
    k[[5, 2000, 4000]] *= 8.0
    num = Numerics.preset("bf16-fp32acc").replace(softmax="online(64)", kv_splits=32)
    bound = attention_bound(q, k, v, numerics=num)
    err = np.abs(_out(q, k, v, num) - reference.attention(q, k, v))
    assert np.isfinite(bound.total).all()
    assert (err <= bound.total).all()


@pytest.mark.parametrize("softmax", SOFTMAXES)
def test_splits_without_an_attended_key_drop_out(softmax):
    # a causal mask over 4 splits: the first query attends the first split only
    q, k, v = _inputs(3, q_len=8, kv_len=8)
    mask = np.tril(np.ones((8, 8), bool))
    num = Numerics(softmax=softmax.replace("16", "2"), kv_splits=4)
    out = _out(q, k, v, num, mask)
    bound = attention_bound(q, k, v, mask, numerics=num)
    err = np.abs(out - reference.attention(q, k, v, mask=mask))
    assert np.isfinite(bound.total).all()
    assert (err <= bound.total).all()
    # one attended key: its split's output is v_0 exactly, its weight exp(0) = 1
    np.testing.assert_array_equal(out[0], np.float32(v[0]))


def test_a_fully_masked_row_is_zero_under_split_kv_and_its_bound_says_why():
    q, k, v = _inputs(4, q_len=2, kv_len=8)
    mask = np.ones((2, 8), bool)
    mask[1] = False
    num = Numerics(kv_splits=2)
    out = _out(q, k, v, num, mask)
    np.testing.assert_array_equal(out[1], 0.0)
    bound = attention_bound(q, k, v, mask, numerics=num)
    assert np.isinf(bound.total[1]).all()
    assert np.isfinite(bound.total[0]).all()
    assert bound.reasons


@pytest.mark.parametrize("preset", ["fp32", "bf16-fp32acc"])
def test_two_split_counts_differ_within_theorem_a5(preset):
    q, k, v = _inputs(5, q_len=4, kv_len=256, d=32)
    a = Numerics.preset(preset).replace(softmax="online(32)")
    b = a.replace(kv_splits=5)
    diff = np.abs(_out(q, k, v, a) - _out(q, k, v, b))
    bound = schedule_difference(q, k, v, numerics_a=a, numerics_b=b)
    assert diff.max() > 0  # the split changes the output
    assert (diff <= bound.total).all()


def test_the_probabilistic_bound_counts_every_splits_events():
    q, k, v = _inputs(6)
    plain = attention_bound(q, k, v, numerics="fp32", probability=0.999)
    split = attention_bound(q, k, v, numerics=Numerics(kv_splits=4), probability=0.999)
    assert split.lam > plain.lam
    assert split.probability >= 0.999


@pytest.mark.parametrize("splits", [0, -2, True, 2.5, "4"])
def test_bad_split_counts_are_refused_by_name(splits):
    with pytest.raises(InvalidArgument, match=r"numerics\.kv_splits"):
        Numerics(kv_splits=splits)


def test_split_kv_is_refused_where_it_is_not_modelled():
    with pytest.raises(InvalidArgument, match=r"numerics\.kv_splits"):
        attention_bound_a_priori(
            4, 64, 16, q_norm=4.0, k_norm=4.0, v_max=1.0, numerics=Numerics(kv_splits=2)
        )


@pytest.mark.parametrize("offset", [0, 8])
@pytest.mark.parametrize("splits", [1, 4])
def test_flashattention_split_kv_with_the_folded_exp2_is_within_a6(splits, offset):
    # FlashAttention-2/3's split kernels: lse = fl(m·fl(scale)) + log(ℓ·2^-k), m unscaled
    q, k, v = _inputs(7, q_len=4, kv_len=256, d=32)
    num = Numerics.preset("bf16-fp32acc").replace(
        softmax="online(32)",
        exp_form="exp2-folded",
        online_sums="running",
        kv_splits=splits,
        prob_offset=offset,
        prob_format="float8_e4m3fn" if offset else None,
    )
    bound = attention_bound(q, k, v, numerics=num)
    err = np.abs(_out(q, k, v, num) - reference.attention(q, k, v))
    assert np.isfinite(bound.total).all()
    assert (err <= bound.total).all()
    if splits == 1:  # one split: the merge weight is exactly 1
        unsplit = num.replace(kv_splits=None)
        np.testing.assert_array_equal(_out(q, k, v, num), _out(q, k, v, unsplit))
