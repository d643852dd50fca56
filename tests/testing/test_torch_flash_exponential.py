"""The evidence of ``torch-sdpa-flash-cpu``'s exponential: measured through the kernel's logsumexp.

PyTorch's CPU flash kernel returns, per query row, ``lse = m + log(l)`` in float32, ``l`` the
float sum of the exponentials ``exp(ŝ_j - m)`` it also rounds into the probabilities. A row of
one key at score 0 and ``N - 1`` keys at score ``t`` has ``m = 0`` and ``l = E(0) + (N - 1)E(t)``
(``E`` the kernel's exponential, ``E(0) = 1``), so ``E(t) = expm1(lse)/(N - 1)``, known to within
the float32 ``lse``'s rounding and ``log``'s (``resolution`` below) and the sum's roundings
(``N·2^-24`` relative). The descriptor's candidates state the exponential's relative error as
``2·exp_ulps·u_m``; these tests show the kernel within it, with the measurement's own error
added to what was measured. The suite runs torch's AVX2 kernels (``tests/conftest.py``), whose
half-precision path uses a fast exponential (about 1.5e-4 relative at worst).
"""

from __future__ import annotations

import numpy as np
import pytest

from mhanum.testing import KERNELS

torch = pytest.importorskip("torch")

N = 64  # keys per row: more than one vector, so the vectorised exponential computes them
ROWS = 8192
CALLS = 24


def _measured(dtype, seed):
    """``(E(t)/exp(t) - 1, the measurement's error bound)`` over ``CALLS·ROWS`` arguments
    ``t = fl(a·scale)`` in [-4.2, 0): about six periods of a base-2 range reduction."""
    rng = np.random.default_rng(seed)
    td = getattr(torch, dtype)
    k = torch.zeros(1, 1, N, 16, dtype=td)
    k[0, 0, 1:, 0] = 1.0
    v = torch.zeros(1, 1, N, 16, dtype=td)
    rels, errs = [], []
    for _ in range(CALLS):
        a = -(1 + rng.integers(0, 1024, ROWS) / 1024.0)  # q·k = a, read in the half format
        q = torch.zeros(1, 1, ROWS, 16, dtype=td)
        q[0, 0, :, 0] = torch.from_numpy(a).to(td)
        scale = float(np.float32(rng.uniform(0.02, 2.1)))
        lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)[1]
        lse = lse.double().numpy()[0, 0]
        a_read = q[0, 0, :, 0].double().numpy()  # the half value the kernel reads
        t = (a_read.astype(np.float32) * np.float32(scale)).astype(np.float64)  # fl(q·k·scale)
        e = np.exp(t)
        l_exact = 1 + (N - 1) * e
        # lse within 1.5 ulps of float32 of log(l) (its rounding and log's): l within that, and
        # E(t) = (l - 1)/(N - 1) within l·1.5·ulp(lse)/(l - 1); the sum within N·2^-24
        ulp = np.spacing(np.abs(lse).astype(np.float32)).astype(np.float64)
        resolution = l_exact * 1.5 * ulp / (l_exact - 1) * 1.01 + N * 2.0**-24
        rels.append(np.expm1(lse) / (N - 1) / e - 1)
        errs.append(resolution)
    return np.concatenate(rels), np.concatenate(errs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_half_path_exponential_is_within_the_descriptors_bound(dtype):
    """Every measured ``E(t)`` of the half-precision path is within the descriptor's stated
    error, the measurement's own error added; and that error is the fast exponential's, far
    above the 20 ulps of the float32 path (so the descriptor's larger ``exp_ulps`` is needed)."""
    (num,) = KERNELS["torch-sdpa-flash-cpu"].models[dtype]
    stated = 2 * num.exp_ulps * 2.0**-24
    rel, err = _measured(dtype, seed=0)
    assert np.all(np.abs(rel) + err <= stated), float(np.max(np.abs(rel) + err))
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert np.max(np.abs(rel)) > 2 * 20 * 2.0**-24 * 10  # the fast exponential is in use


def test_the_float32_path_exponential_is_within_20_ulps():
    """Float32 inputs: the vectorised ``exp_u20`` within its 20 ulps (``exp_ulps = 20``)."""
    (num,) = KERNELS["torch-sdpa-flash-cpu"].models["float32"]
    rel, err = _measured("float32", seed=1)
    assert np.all(np.abs(rel) <= 2 * num.exp_ulps * 2.0**-24 + err)
