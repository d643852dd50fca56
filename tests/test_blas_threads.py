"""The bounds' and the reference's float64 products run with one BLAS thread, and the caller's
setting comes back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController, threadpool_limits

import mhanum.bounds.backward.b1 as b1_module
import mhanum.bounds.backward.mha as mha_grad_module
import mhanum.bounds.backward.order_difference as order_module
import mhanum.bounds.forward.head as head_module
import mhanum.reference._fastref as fastref_module
from mhanum import reference
from mhanum.bounds import (
    attention_bound,
    attention_bound_along,
    attention_grad_bound,
    dq_order_difference,
    mha_bound,
    mha_grad_bound,
)
from mhanum.params import MHAParams


def _blas_threads() -> list[int]:
    return [
        lib["num_threads"] for lib in ThreadpoolController().info() if lib["user_api"] == "blas"
    ]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The BLAS libraries' threads each time a head's or a backward's evaluation, or the
    double-double reference, starts."""
    calls: list[list[int]] = []
    for module, name in (
        (head_module, "evaluate_head"),
        (b1_module, "gradient_bounds"),
        (order_module, "gradient_bounds"),
        (mha_grad_module, "gradient_bounds"),
        (fastref_module, "attention"),
        (fastref_module, "multi_head_attention"),
    ):
        inner = getattr(module, name)

        def spy(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            calls.append(_blas_threads())
            return _inner(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


def test_bounds_and_references_run_with_one_blas_thread_and_restore_the_callers(seen):
    assert _blas_threads(), "numpy's BLAS is not visible to threadpoolctl"
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((6, 4)) for _ in range(4))
    x = rng.standard_normal((1, 6, 8))
    params = MHAParams.random(8, seed=0)
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        assert set(before) == {2}
        attention_bound(q, k, v, numerics="bf16-fp32acc")
        attention_bound_along(q, k, v, g, numerics="bf16-fp32acc")
        mha_bound(x, x, params, 2, numerics="bf16-fp32acc")
        attention_grad_bound(q, k, v, g, numerics="bf16-fp32acc")
        dq_order_difference(q, k, v, g, numerics="fp32")
        mha_grad_bound(x, x, params, 2, np.ones((1, 6, 8)), numerics="bf16-fp32acc")
        reference.attention(q, k, v)
        reference.multi_head_attention(x, x, params, 2)
        assert _blas_threads() == before
    assert len(seen) >= 8
    assert all(set(threads) == {1} for threads in seen)
