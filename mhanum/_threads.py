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

The bounds use the cores another way: a head's query rows are evaluated in chunks that share
nothing (every quantity of Theorem A.1 belongs to one row), so :func:`map_threads` evaluates the
chunks on a pool of threads, one per core this process may run on, at most eight
(``MHANUM_THREADS`` sets another number; ``1`` evaluates them in turn). NumPy releases the interpreter's lock in its
array loops and the BLAS in its products, so the threads run side by side. Each chunk is
evaluated exactly as it would be alone, so the bound is the same, bit for bit, whatever the
number of threads.

The pool lives as long as the process (:func:`map_threads`), and before its first use the
process allocates and frees one block of just under 32 MiB (:func:`reuse_freed_memory`). Both are
for glibc's ``malloc``: a chunk's temporaries are float64 arrays of 2 MB each, and by default
glibc gives such a block back to the system once it is freed, so the next chunk's are faulted in
again page by page (about 30,000 page faults and a third of the time of ``attention_bound`` at
``L = 1024``; ``python benchmarks/bound_speed.py --allocator``). Freeing a block larger than its
current threshold raises glibc's own thresholds (mallopt(3): ``M_MMAP_THRESHOLD`` to the block's
size, at most 32 MiB, and ``M_TRIM_THRESHOLD`` to twice that), after which it keeps up to
64 MiB freed per arena for reuse; threads that live on keep their arenas. A process that once
frees a 32 MiB array is in that state anyway. Nothing else of ``malloc`` is set, and other
allocators and platforms are not touched.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from threadpoolctl import ThreadpoolController

from mhanum._errors import InvalidArgument

__all__ = [
    "MAX_DEFAULT_THREADS",
    "bound_threads",
    "map_threads",
    "one_blas_thread",
    "reuse_freed_memory",
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
R = TypeVar("R")


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


MAX_DEFAULT_THREADS = 8
"""The most threads used by default: each holds one chunk's float64 temporaries (at their peak
about 490 bytes a logit in ``bf16-fp32acc``: 130 MB for ``2**18`` logits, 250 MB for the
``2**19`` of a chunk of many keys, :data:`mhanum.bounds.forward.head.CHUNK_MAX`), so memory
grows with the threads; ``MHANUM_THREADS`` sets more."""


def bound_threads() -> int:
    """The number of threads :func:`map_threads` uses: ``MHANUM_THREADS`` if it is set (a
    positive integer), else the number of cores this process may run on, at most
    :data:`MAX_DEFAULT_THREADS`."""
    text = os.environ.get("MHANUM_THREADS", "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            msg = f"MHANUM_THREADS: expected a positive integer, got {text!r}"
            raise InvalidArgument(msg)
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        cores = os.cpu_count() or 1
    return min(cores, MAX_DEFAULT_THREADS)


def map_threads(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, evaluated on :func:`bound_threads` threads (in turn where
    that is one, or for a single item). ``fn`` must not share mutable state between items;
    NumPy's floating-point error state is per thread, so ``fn`` sets its own.

    The threads are the process's pool (:func:`_pool`), kept between calls; a call from one of
    its own threads (a bound evaluated inside another's chunk) gets a pool of its own for the
    call, so that no thread of the pool waits on another."""
    workers = min(bound_threads(), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    # one BLAS thread while the pool runs, set once here: an item that limits the BLAS itself
    # (one_blas_thread) then finds it limited already and leaves it so, whatever order the
    # items' limits are entered and left in
    with _controller().limit(limits=1, user_api="blas"):
        if getattr(_IN_POOL, "flag", False):
            with concurrent.futures.ThreadPoolExecutor(
                workers, "mhanum-inner", initializer=_mark_pool_thread
            ) as inner:
                return list(inner.map(fn, items))
        return list(_pool(bound_threads()).map(fn, items))


_IN_POOL = threading.local()
_POOL_LOCK = threading.Lock()
_POOLS: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}


def _mark_pool_thread() -> None:
    _IN_POOL.flag = True


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of ``workers`` threads (:func:`bound_threads`), made on first use
    (after :func:`reuse_freed_memory`) and kept; a forked child makes its own."""
    key = (os.getpid(), workers)
    with _POOL_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            reuse_freed_memory()
            pool = concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="mhanum", initializer=_mark_pool_thread
            )
            _POOLS[key] = pool
        return pool


@functools.cache
def reuse_freed_memory() -> None:
    """Allocate and free one block of just under 32 MiB, once per process: glibc's ``malloc``
    then keeps the bounds' freed temporaries for reuse (module docstring). Its dynamic
    threshold moves only for a block of at most 32 MiB, headers and padding included (numpy's
    and glibc's: 64 KiB less leaves room for both)."""
    block = np.empty((32 * 2**20 - 2**16) // 8)
    del block
