"""The pytest plugin, through its installed entry point, in a real pytest run of a kernel's tests."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

KERNEL_TESTS = """
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from mhanum.testing import attention_inputs


def sdpa(q, k, v, mask, *, wrong_scale=False):
    t = [torch.from_numpy(np.asarray(a, np.float32))[None, None] for a in (q, k, v)]
    m = None if mask is None else torch.from_numpy(mask)[None, None]
    scale = 1.02 / q.shape[-1] ** 0.5 if wrong_scale else None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=m, scale=scale)
    return out[0, 0]


@pytest.mark.mhanum_kernel("torch-sdpa-math")
@settings(max_examples=8, deadline=None, derandomize=True)
@given(case=attention_inputs(lengths=(3, 8), head_dims=(8,)))
def test_sdpa_math(attention_oracle, case):
    out = sdpa(case["q"], case["k"], case["v"], case["mask"])
    attention_oracle.assert_close(out, case["q"], case["k"], case["v"], mask=case["mask"])


@pytest.mark.mhanum_kernel("torch-sdpa-math")
def test_sdpa_with_a_wrong_scale(attention_oracle):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    attention_oracle.assert_close(sdpa(q, k, v, None, wrong_scale=True), q, k, v)
"""


def test_the_fixture_and_marker_check_a_kernel_in_a_real_pytest_run(tmp_path):
    (tmp_path / "test_kernel.py").write_text(textwrap.dedent(KERNEL_TESTS))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
         "-W", "error", str(tmp_path / "test_kernel.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "1 failed, 1 passed" in out, out
    assert "test_sdpa_with_a_wrong_scale" in out
    assert "AttentionMismatch" in out
    assert "outside the certified tolerance of kernel 'torch-sdpa-math'" in out


DOCS = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
PINNED = "    with sdpa_kernel(SDPBackend.MATH):  # the backend the marker describes\n"


def _docs_plugin_example() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    (example,) = [b for b in blocks if "@pytest.mark.mhanum_kernel(" in b]
    return example


def test_the_docs_plugin_example_runs_as_a_test_file(tmp_path):
    # as written, and as the page advises for the CPU flash kernel: its descriptor and backend
    example = _docs_plugin_example()
    assert PINNED in example
    flash = example
    for old, new in (
        (PINNED, PINNED.replace("MATH", "FLASH_ATTENTION")),
        ('mhanum_kernel("torch-sdpa-math")', 'mhanum_kernel("torch-sdpa-flash-cpu")'),
        (
            'attention_inputs(dtype="bfloat16")',
            'attention_inputs(dtype="bfloat16", head_dims=(64,))',
        ),
    ):
        assert old in flash
        flash = flash.replace(old, new)
    (tmp_path / "test_my_sdpa.py").write_text(example)
    (tmp_path / "test_my_sdpa_flash.py").write_text(flash)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
         "-W", "error", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "2 passed in" in out, out
    assert "failed" not in out, out


def test_loading_the_plugin_imports_neither_mhanum_nor_jax():
    code = (
        "import sys, mhanum.pytest_plugin\n"
        "print(sorted(m for m in ('jax', 'mhanum.numerics', 'hypothesis') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
