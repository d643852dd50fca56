"""Certified gradients of attention (``reference.attention_grad``).

Each gradient is checked against the backward pass written out in mpmath at 60 digits and
rounded to nearest: equal, element by element, with masks, biases, given scales and batch
dimensions. The bias gradient's rows sum to exactly 0 (the softmax's Jacobian annihilates
constants), so the certified, rounded rows sum to at most their roundings; rows whose ``dP`` are
all equal have exactly zero gradients; bad inputs are refused by name.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

from mhanum import InvalidArgument, reference


def _closed_form(q, k, v, d_out, mask=None, bias=None, scale=None, softcap=None, sink=None):
    """The textbook backward in mpmath at 60 digits, for 2-D inputs, rounded to nearest (and
    the sink logit's gradient, unrounded, when a sink is given)."""
    with mpmath.workdps(60):
        c = 1 / mpmath.sqrt(q.shape[1]) if scale is None else mpmath.mpf(scale)
        lq, lk = q.shape[0], k.shape[0]
        keep = np.ones((lq, lk), bool) if mask is None else mask
        a = [
            [c * mpmath.fsum(mpmath.mpf(x) * y for x, y in zip(q[i], k[j], strict=True))
             for j in range(lk)]
            for i in range(lq)
        ]  # fmt: skip
        slope = [[mpmath.mpf(1)] * lk for _ in range(lq)]
        if softcap is not None:
            cap = mpmath.mpf(softcap)
            slope = [[1 - mpmath.tanh(x / cap) ** 2 for x in row] for row in a]
            a = [[cap * mpmath.tanh(x / cap) for x in row] for row in a]
        s = [
            [a[i][j] + (0 if bias is None else mpmath.mpf(bias[i, j])) for j in range(lk)]
            for i in range(lq)
        ]
        p, p_sink = [], []
        for i in range(lq):
            logits = [s[i][j] for j in range(lk) if keep[i, j]]
            top = max(logits + ([] if sink is None else [mpmath.mpf(sink)]))
            e = [mpmath.exp(s[i][j] - top) if keep[i, j] else mpmath.mpf(0) for j in range(lk)]
            e_sink = mpmath.mpf(0) if sink is None else mpmath.exp(mpmath.mpf(sink) - top)
            total = mpmath.fsum(e) + e_sink
            p.append([x / total for x in e])
            p_sink.append(e_sink / total)
        dp = [[mpmath.fsum(mpmath.mpf(a) * b for a, b in zip(d_out[i], v[j], strict=True))
               for j in range(lk)] for i in range(lq)]  # fmt: skip
        ds, d_sink = [], mpmath.mpf(0)
        for i in range(lq):
            d_i = mpmath.fsum(p[i][j] * dp[i][j] for j in range(lk))  # the sink's dP is 0
            ds.append([p[i][j] * (dp[i][j] - d_i) for j in range(lk)])
            d_sink += p_sink[i] * (0 - d_i)
        da = [[ds[i][j] * slope[i][j] for j in range(lk)] for i in range(lq)]

        def mat(rows):
            return np.array([[float(x) for x in row] for row in rows])

        dv = [[mpmath.fsum(p[i][j] * d_out[i][t] for i in range(lq)) for t in range(v.shape[1])]
              for j in range(lk)]  # fmt: skip
        dq = [[c * mpmath.fsum(da[i][j] * k[j][t] for j in range(lk)) for t in range(q.shape[1])]
              for i in range(lq)]  # fmt: skip
        dk = [[c * mpmath.fsum(da[i][j] * q[i][t] for i in range(lq)) for t in range(q.shape[1])]
              for j in range(lk)]  # fmt: skip
        return mat(dq), mat(dk), mat(dv), mat(ds), float(d_sink)


def _inputs(seed, lq=3, lk=5, d=4, dv=3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((lq, d)), rng.standard_normal((lk, d)),
            rng.standard_normal((lk, dv)), rng.standard_normal((lq, dv)))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"scale": 0.3},
        {"bias": np.random.default_rng(9).standard_normal((3, 5))},
        {"mask": np.tril(np.ones((3, 5), bool), k=1)},
        {"softcap": 0.7},
        {"sink": 1.25, "mask": np.tril(np.ones((3, 5), bool), k=1)},
        {"softcap": 2.0, "sink": -0.5, "bias": np.random.default_rng(8).standard_normal((3, 5))},
    ],
)
def test_the_gradients_are_the_closed_form_rounded_to_nearest(kwargs):
    q, k, v, d_out = _inputs(0)
    got = reference.attention_grad(q, k, v, d_out, **kwargs)
    want = _closed_form(q, k, v, d_out, **kwargs)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got[:4], want[:4], strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    if "sink" in kwargs:
        assert got.dsink == want[4]


def test_batch_dimensions_broadcast():
    q, k, v, d_out = _inputs(1)
    qb = np.stack([q, 2 * q])
    got = reference.attention_grad(qb, k, v, d_out)
    for b in range(2):
        one = reference.attention_grad(qb[b], k, v, d_out)
        np.testing.assert_array_equal(got.dq[b], one.dq)
        np.testing.assert_array_equal(got.dk[b], one.dk)  # dk per batch element


def test_the_bias_gradient_rows_sum_to_their_roundings():
    q, k, v, d_out = _inputs(2, lq=4, lk=16)
    ds = reference.attention_grad(q, k, v, d_out).dbias
    # Σ_j dS_ij = 0 exactly; each certified entry is within half an ulp of its exact value, and
    # the float64 sum of 16 terms adds at most 15 roundings of the partial sums
    half_ulps = 0.5 * np.spacing(np.abs(ds)).sum(axis=-1)
    summation = 15 * 2.0**-53 * np.abs(ds).sum(axis=-1)
    assert np.all(np.abs(ds.sum(axis=-1)) <= half_ulps + summation)


def test_rows_whose_value_products_are_equal_have_exactly_zero_gradients():
    q, k = np.zeros((1, 2)), np.ones((3, 2))
    got = reference.attention_grad(q, k, np.eye(3), np.ones((1, 3)))
    for zero in (got.dq, got.dk, got.dbias):
        assert not np.any(zero)
    np.testing.assert_array_equal(got.dv, np.full((3, 3), 1 / 3))


def test_bad_inputs_are_refused_by_name():
    q, k, v, d_out = _inputs(3)
    with pytest.raises(InvalidArgument, match="d_out:"):
        reference.attention_grad(q, k, v, d_out[:, :2])
    with pytest.raises(InvalidArgument, match="mask:"):
        reference.attention_grad(q, k, v, d_out, mask=np.zeros((3, 5), bool))
    with pytest.raises(InvalidArgument, match="d_out:"):
        reference.attention_grad(q, k, v, np.full_like(d_out, np.nan))
