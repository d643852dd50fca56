"""The gradients' double-double path: :func:`mhanum.reference.attention_grad` encloses them in
double-double balls first and returns them where every entry is certified, else computes them
in Arb; both certify to the same digits, so they agree to them, and the fast path needs no
python-flint."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhanum import reference
from mhanum.reference import _certify
from mhanum.reference._spec import check_options, check_scale, score_spec

flint = pytest.importorskip("flint")


def _arb(q, k, v, g, mask, bias, scale):
    """The Arb path alone, for the comparison."""
    shape = (q.shape[-2], k.shape[-2])
    spec = score_spec(mask, bias, check_scale(scale), shape, q.shape[-1], "zero", None)
    options = check_options(17, 8192, "zero", "arb", False)
    return _certify.arb_backend().attention_grad(q, k, v, g, spec, options, sink_column=False)


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 5)),
    exps=st.tuples(*(st.integers(-30, 30) for _ in range(4))),
    scale=st.one_of(st.none(), st.floats(1e-3, 10.0)),
    masked=st.booleans(),
    biased=st.booleans(),
)
def test_the_double_double_path_agrees_with_arb_to_the_digits_both_certify(
    seed, sizes, exps, scale, masked, biased
):
    rng = np.random.default_rng(seed)
    lq, lk, d = sizes
    q, k, v, g = (
        rng.standard_normal(shape) * 2.0**e
        for shape, e in zip(((lq, d), (lk, d), (lk, d), (lq, d)), exps, strict=True)
    )
    mask = None
    if masked:
        mask = rng.random((lq, lk)) < 0.6
        mask[:, 0] = True
    bias = rng.standard_normal((lq, lk)) * 4 if biased else None
    fast = reference.attention_grad(q, k, v, g, mask=mask, bias=bias, scale=scale, digits=17)
    slow = _arb(q, k, v, g, mask, bias, scale)
    for a, b in zip(fast[:4], slow, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # both within 10^-17 relative of the exact value: within 2^-55 of each other
        assert np.all(np.abs(a - b) <= 2.0**-55 * np.abs(b) + 2.0**-1074)


def test_without_python_flint_the_certified_entries_come_from_the_double_double_path(
    monkeypatch,
):
    """A machine without python-flint (the README's install) gets certified gradients of an
    ordinary problem; one the double-double balls cannot certify (an exact zero in dq: every
    key 0) needs Arb and says so."""

    def missing():
        raise ImportError("python-flint is not installed")

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((6, 4)) for _ in range(4))
    with_arb = reference.attention_grad(q, k, v, g, digits=17)
    monkeypatch.setattr(_certify, "arb_backend", missing)
    monkeypatch.setattr(reference, "arb_backend", missing)
    without = reference.attention_grad(q, k, v, g, digits=17)
    for a, b in zip(without[:4], with_arb[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ImportError, match="python-flint"):
        reference.attention_grad(q, np.zeros_like(k), v, g, digits=17)


def test_the_double_double_path_makes_long_rows_cheap():
    """L = 512: the enclosure certifies every entry (no Arb call), so the reference of a
    kernel test at today's lengths is a matter of seconds."""
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((512, 64)) for _ in range(4))
    calls = []
    original = _certify.arb_backend

    def counted():
        calls.append(1)
        return original()

    import mhanum.reference as ref

    ref_backend = ref.arb_backend
    try:
        ref.arb_backend = counted
        grads = reference.attention_grad(q, k, v, g, mask=np.tril(np.ones((512, 512), bool)))
    finally:
        ref.arb_backend = ref_backend
    assert calls == []
    assert all(np.isfinite(np.asarray(x)).all() for x in grads[:4])
