"""The pytest plugin's gradient fixture ``attention_grad_oracle``, through the installed entry
point, in a real pytest run of a kernel's backward tests: a correct backward pass passes, one
with its dK scaled twice fails naming the gradient."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

KERNEL_TESTS = """
import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def grads(q, k, v, g, *, bug=False):
    t = [torch.from_numpy(a).requires_grad_(True) for a in (q, k, v)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)
    out.backward(torch.from_numpy(g))
    dk = t[1].grad * (2 if bug else 1)
    return {"dq": t[0].grad, "dk": dk, "dv": t[2].grad}


def inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, 16, 16)).astype(np.float32) for _ in range(4)]


@pytest.mark.mhanum_kernel("torch-sdpa-flash-cpu")
def test_flash_backward(attention_grad_oracle):
    q, k, v, g = inputs()
    attention_grad_oracle.assert_close(grads(q, k, v, g), q, k, v, g, is_causal=True)


@pytest.mark.mhanum_kernel("torch-sdpa-flash-cpu")
def test_flash_backward_with_a_bug(attention_grad_oracle):
    q, k, v, g = inputs()
    attention_grad_oracle.assert_close(grads(q, k, v, g, bug=True), q, k, v, g, is_causal=True)
"""


@pytest.mark.slow
def test_the_gradient_fixture_checks_a_backward_pass_in_a_real_pytest_run(tmp_path):
    (tmp_path / "test_kernel.py").write_text(textwrap.dedent(KERNEL_TESTS))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
         "-W", "error", str(tmp_path / "test_kernel.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "1 failed, 1 passed" in out, out
    assert "test_flash_backward_with_a_bug" in out
    assert "GradientMismatch: dk: " in out


def test_the_fixture_value_binds_a_kernel_by_hand():
    import numpy as np

    from mhanum.pytest_plugin import GradKernelOracle
    from mhanum.testing import GradientMismatch

    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((6, 16)).astype(np.float32) for _ in range(4))
    fixture = GradKernelOracle("jax-xla")
    oracle = fixture.oracle(q, k, v, g)
    assert set(fixture.tolerance(q, k, v, g)) == {"dq", "dk", "dv"}
    fixture.assert_close({"dv": oracle["dv"].exact}, q, k, v, g)
    with pytest.raises(GradientMismatch, match=r"^dv: "):
        fixture.assert_close({"dv": oracle["dv"].exact + 1e-3}, q, k, v, g)
    with pytest.raises(TypeError, match=r"kernel: expected @pytest\.mark\.mhanum_kernel"):
        GradKernelOracle().oracle(q, k, v, g)
