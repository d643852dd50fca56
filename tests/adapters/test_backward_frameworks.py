"""Real frameworks' gradients (torch autograd through SDPA, ``jax.vjp`` through
``jax.nn.dot_product_attention``) against the certified reference, within Theorem B.1's bound
for the textbook backward with the numerics of the frameworks' math paths: float32 throughout,
or for half precision dots accumulated and the softmax computed in float32 with every stored
tensor, ``dP`` and ``dS`` included, in the dtype."""

from __future__ import annotations

import numpy as np
import pytest

from mhanum import Backward, reference
from mhanum.adapters import jax as jax_adapter
from mhanum.bounds.backward import attention_grad_bound
from mhanum.formats import round_to

torch_adapter = pytest.importorskip("mhanum.adapters.torch")

CASES = [("float32", "fp32"), ("bfloat16", "bf16-fp32acc"), ("float16", "fp16-fp32acc")]


def _inputs(dtype: str):
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((2, 16, 8)) for _ in range(4)]
    return [round_to(a, dtype) for a in arrays], np.tril(np.ones((16, 16), bool))


@pytest.mark.parametrize(("dtype", "numerics"), CASES)
@pytest.mark.parametrize("path", ["torch-math", "torch-flash", "jax"])
def test_framework_gradients_are_within_the_textbook_bound(path, dtype, numerics):
    (q, k, v, g), mask = _inputs(dtype)
    if path == "jax":
        got = jax_adapter.sdpa_grad(q, k, v, g, mask, dtype=dtype)
    else:
        backend = path.split("-")[1]
        got = torch_adapter.sdpa_grad(q, k, v, g, mask, backend=backend, dtype=dtype)
    exact = reference.attention_grad(q, k, v, g, mask=mask, digits=17)
    backward = Backward("textbook", grad_format=dtype)
    bounds = attention_grad_bound(q, k, v, g, mask, numerics=numerics, backward=backward)
    for name, x, want, b in zip(("dq", "dk", "dv"), got, exact, bounds, strict=False):
        err = np.abs(x - want)
        assert (err <= b.total).all(), (name, float(np.max(err / b.total)))
        assert np.max(err) > 0 or dtype == "float32"  # the half formats do round
