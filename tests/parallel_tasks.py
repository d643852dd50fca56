"""Task functions of tests/test_parallel.py, in a module that imports no JAX: a spawned worker
that runs them starts in a fraction of a second."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np


def draw(spec: int, seed: np.random.SeedSequence) -> dict[str, object]:
    """The spec and a normal draw from the task's seed; slower for small specs, so that tasks
    finish out of order on several workers."""
    time.sleep(0.02 * (spec % 3))
    return {"spec": spec, "draw": float(np.random.default_rng(seed).standard_normal())}


def logged(spec: tuple[int, str, int | None], seed: np.random.SeedSequence) -> dict[str, object]:
    """``draw``, recording each run as a file in a directory; the task ``crash`` ends its
    worker process (``os._exit``) the first time it runs."""
    x, folder, crash = spec
    runs = Path(folder)
    if x == crash and not (runs / "crashed").exists():
        (runs / "crashed").touch()
        os._exit(1)
    n = len(list(runs.glob(f"ran-{x}-*")))
    (runs / f"ran-{x}-{n}").touch()
    return draw(x, seed)


def fails(spec: int, seed: np.random.SeedSequence) -> int:
    """Raises for spec 3."""
    if spec == 3:
        msg = "task three fails"
        raise RuntimeError(msg)
    return spec
