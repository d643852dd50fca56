"""Test configuration: 64-bit JAX and the Hypothesis profiles ``dev`` and ``ci``."""

from __future__ import annotations

import os
from pathlib import Path

# One BLAS thread per process: `-n 2` on 2 cores already fills them, and threaded BLAS on small
# products oversubscribes them (about 100x slower in the reference's Ozaki products). Set before
# numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The bounds' chunks of rows on one thread per process for the same reason
# (tests/test_bound_rows.py sets its own numbers of threads).
os.environ.setdefault("MHANUM_THREADS", "1")
# PyTorch's CPU kernels by one instruction set on every x86 machine (AVX2; AVX-512 machines
# otherwise dispatch to other kernels, whose float32 roundings differ), so that the figures the
# docs print from torch are the same wherever the tests run. Set before torch is imported.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)

# JAX's persistent compilation cache: a compiled function is reused by the other xdist worker
# and by later runs (MHANUM_JAX_CACHE names the directory; default .jax_cache/ at the root).
_CACHE = os.environ.get("MHANUM_JAX_CACHE") or str(
    Path(__file__).resolve().parents[1] / ".jax_cache"
)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
# The same cache for the spawned processes of the sweep tests (process pools, Dask workers),
# which read JAX's configuration from the environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("full", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests listed in tests/slow.txt (measured: see tests/tiers.py) join the slow tier."""
    from tests.tiers import read

    slow = read()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
