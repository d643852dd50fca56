"""How the bounds' float64 evaluation uses the BLAS library that numpy calls.

The a posteriori bounds multiply chunks of ``rows × keys`` float64 weights by ``keys × d``
values, between elementwise passes over the same chunks: products with a long inner dimension
and a narrow result, a few milliseconds each. A multithreaded BLAS gains nothing on them, and its
worker threads, which wait busily for the next product, slow the elementwise passes between the
products. On a 2-core machine, OpenBLAS's default of one thread per core made ``attention_bound``
2.4× slower at ``L = 4096`` than one thread (``python benchmarks/bound_speed.py``,
docs/performance.md). So the bounds run their products with one BLAS thread, and
:func:`one_blas_thread` restores the caller's setting when they return.

The limit is the BLAS library's own setting, so it holds for the whole process while a bound
runs: another thread of the caller's that multiplies matrices meanwhile does so with one BLAS
thread too. No bound relies on the number of threads: every float64 product of their
evaluation is charged as a dot summed in any order (``evaluation_rounding``), so a BLAS that
splits the sums differently on more threads stays within the same charge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from threadpoolctl import ThreadpoolController

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def _controller() -> ThreadpoolController:
    """The BLAS libraries loaded when the first bound runs (scanning them costs milliseconds,
    so it is done once; a library loaded later keeps its own threads)."""
    return ThreadpoolController()


def one_blas_thread(fn: F) -> F:
    """``fn`` with the BLAS libraries limited to one thread while it runs (module docstring)."""

    @functools.wraps(fn)
    def limited(*args: Any, **kwargs: Any) -> Any:
        with _controller().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)

    return limited  # type: ignore[return-value]
