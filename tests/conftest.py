"""Test configuration: 64-bit JAX and the Hypothesis profiles ``dev`` and ``ci``."""

from __future__ import annotations

import os

# One BLAS thread per process: `-n 2` on 2 cores already fills them, and threaded BLAS on small
# products oversubscribes them (about 100x slower in the reference's Ozaki products). Set before
# numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)

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
