"""mhanum._threads: the bounds' pool of threads lives on between calls, and a map inside an item
gets threads of its own. (What glibc keeps for reuse is measured by ``benchmarks/bound_speed.py``,
which prints the page faults per call.)"""

from __future__ import annotations

import threading
import time

from mhanum._threads import map_threads


def _whose(x: int) -> tuple[int, threading.Thread]:
    time.sleep(0.01)  # (long enough for both threads to take items)
    return x * x, threading.current_thread()


def test_the_pool_lives_on_between_calls(monkeypatch):
    monkeypatch.setenv("MHANUM_THREADS", "2")
    first = map_threads(_whose, range(8))
    second = map_threads(_whose, range(8))
    assert [r[0] for r in first] == [r[0] for r in second] == [x * x for x in range(8)]
    assert all(r[1].name.startswith("mhanum") for r in first + second)
    # the same thread objects (held here, so none is a new thread at a recycled address)
    assert {r[1] for r in second} <= {r[1] for r in first}


def test_a_map_inside_an_item_runs_on_threads_of_its_own(monkeypatch):
    # every pool thread waiting on a map of its own would deadlock on a shared pool
    monkeypatch.setenv("MHANUM_THREADS", "2")
    results: list[list[list[int]]] = []

    def outer() -> None:
        results.append(map_threads(lambda i: [r[0] for r in map_threads(_whose, range(i, i + 4))],
                                   range(4)))  # fmt: skip

    runner = threading.Thread(target=outer, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "map_threads inside map_threads did not return"
    assert results == [[[x * x for x in range(i, i + 4)] for i in range(4)]]
