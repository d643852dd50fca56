"""How the bounds' and the reference's float64 products use the BLAS library numpy calls.

Both work on many small float64 products between elementwise passes: the bounds multiply
chunks of ``rows × keys`` weights by ``keys × d`` values (a long inner dimension, a narrow
result, a few milliseconds each), and the double-double reference splits every product into
several exact ones (Ozaki's scheme). A multithreaded BLAS gains nothing on such products, and its
worker threads, which wait busily for the next product, slow the passes between them. On a 2-core
machine with OpenBLAS's default of one thread per core, ``attention_bound`` took twice as long at
``L = 4096`` as with one thread (``python benchmarks/bound_speed.py --blas-threads``), and
``reference.multi_head_attention`` 3.3 times as long (docs/performance.md). So the bounds and
the reference run with one BLAS thread, and :func:`one_blas_thread` restores the caller's
setting when they return.

The limit is the BLAS library's own setting, so it holds for the whole process while a bound or
a reference runs: another thread of the caller's that multiplies matrices meanwhile does so with
one BLAS thread too. Nothing relies on the number of threads: every float64 product of the
bounds' evaluation is charged as a dot summed in any order (``evaluation_rounding``), and the
reference's products are exact, or bounded, in any summation order (papers/reference.md,
Lemmas 1, 4 and 5).
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
