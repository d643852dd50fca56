"""mhanum.testing's multi-head attention gradient oracle (Theorem B.6): a backward pass that
rounds as a descriptor's candidate (mhanum's emulation) passes for every input and weight
gradient; planted bugs in a weight's or an input's gradient fail, naming it; bad input is
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum import InvalidArgument, MHAParams
from mhanum.emulate import backward as emulate
from mhanum.testing import (
    GradientMismatch,
    assert_mha_grad_close,
    get_backward_kernel,
    mha_grad_oracle,
    mha_grad_tolerance,
)

E, H, L = 16, 2, 8


def _layer(seed: int = 0, biases: bool = True):
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (0.5 * rng.standard_normal(shape)).astype(np.float32).astype(np.float64)

    b = (lambda: w(E)) if biases else (lambda: None)
    params = MHAParams(w(E, E), w(E, E), w(E, E), w(E, E), b(), b(), b(), b())
    return params, w(2, L, E), w(2, L, E), w(2, L, E)


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("torch-sdpa-math", "float32"), ("torch-sdpa-flash-cpu", "float32"),
     ("torch-sdpa-flash-cpu", "bfloat16")],
)  # fmt: skip
def test_a_backward_pass_that_rounds_as_a_candidate_passes(kernel, dtype):
    params, x, y, g = _layer()
    kern = get_backward_kernel(kernel)
    oracle = mha_grad_oracle(x, y, params, H, g, kernel=kern, dtype=dtype, scale=0.25)
    assert set(oracle) == {"dx_q", "dx_kv", "dwq", "dwk", "dwv", "dwo", "dbq", "dbk", "dbv", "dbo"}
    for num, bw in kern.candidates(dtype, L):
        grads = emulate.mha_grad(x, y, params, H, g, numerics=num, backward=bw, scale=0.25)
        for name, (failing, ratio) in oracle.check(grads).items():
            assert not failing.any(), (name, float(ratio.max()))
        assert_mha_grad_close(grads, x, y, params, H, g, kernel=kern, dtype=dtype, scale=0.25)


def test_planted_bugs_in_the_layer_gradients_are_caught():
    params, x, y, g = _layer(1)
    kern = get_backward_kernel("torch-sdpa-math")
    num, bw = kern.candidates("float32", L)[0]
    good = emulate.mha_grad(x, y, params, H, g, numerics=num, backward=bw, scale=0.25)
    oracle = mha_grad_oracle(x, y, params, H, g, kernel=kern, scale=0.25)
    # dWo summed over one batch element only
    one = emulate.mha_grad(x[:1], y[:1], params, H, g[:1], numerics=num, backward=bw, scale=0.25)
    with pytest.raises(GradientMismatch, match=r"^dwo: "):
        oracle.assert_close({"dwo": one.params.wo})
    # dx_kv with one of its two paths (dK Wkᵀ, dV Wvᵀ) halved, roughly
    with pytest.raises(GradientMismatch, match=r"dx_kv: "):
        oracle.assert_close({"dx_kv": np.asarray(good.dx_kv) * 0.5, "dx_q": good.dx_q})
    oracle.assert_close({"dx_q": good.dx_q})


def test_the_tolerance_function_and_a_layer_without_biases():
    params, x, y, g = _layer(2, biases=False)
    tol = mha_grad_tolerance(x, y, params, H, g, kernel="torch-sdpa-flash-cpu", scale=0.25)
    assert set(tol) == {"dx_q", "dx_kv", "dwq", "dwk", "dwv", "dwo"}
    assert all(np.isfinite(t).all() and (t > 0).all() for t in tol.values())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kernel": "jax-xla"}, "kernel: expected a backward descriptor whose softmax backward"),
        ({"num_heads": 3}, "num_heads: expected a divisor of wq's 16 columns"),
        ({"num_heads": 0}, "num_heads: expected an integer >= 1"),
        ({"kernel": "torch-sdpa-math", "scale": 0.125}, "scale: expected a power of four"),
        ({"dtype": "int4"}, "dtype: expected one of"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    params, x, y, g = _layer()
    heads = kwargs.pop("num_heads", H)
    with pytest.raises(InvalidArgument, match=message):
        mha_grad_oracle(x, y, params, heads, g, **kwargs)
