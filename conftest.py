"""Doctest collection (``--doctest-modules`` over ``mhanum/``): an adapter module imports its
framework, so it is collected only where that framework is installed. And the bound on the
memory mappings of a test process, for the doctests and the tests alike."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest

ADAPTER_FRAMEWORKS = {
    "mhanum/adapters/torch.py": "torch",
    "mhanum/adapters/keras.py": "keras",
    "mhanum/adapters/flax.py": "flax",
}

collect_ignore = [
    path
    for path, framework in ADAPTER_FRAMEWORKS.items()
    if importlib.util.find_spec(framework) is None
]


def _max_map_count() -> int | None:
    """The kernel's limit on one process's memory mappings (Linux), or None where unknown."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


_MAX_MAP_COUNT = _max_map_count()
# /proc/self/maps is read every few tests: reading it costs about 40 ms at 30,000 mappings, and
# a few tests compile far fewer programs than the half of the limit left free
_EVERY = 8
_seen = [0]


def _map_count() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return maps.read().count(b"\n")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Drop JAX's compiled programs once the process holds half its limit of memory mappings
    (checked after every eighth test).

    Every XLA:CPU executable a process keeps loaded holds about six mappings (its code and data,
    each with its own permissions), and JAX keeps every program it compiles. An xdist worker
    compiles thousands; at the kernel's limit (``vm.max_map_count``, 65530 by default) the next
    executable's mapping fails and XLA's loader crashes the worker with a segmentation fault.
    Programs dropped here are compiled again, or read back from the persistent cache, on demand.
    """
    jax = sys.modules.get("jax")
    if jax is None or _MAX_MAP_COUNT is None:
        return
    _seen[0] += 1
    if _seen[0] % _EVERY:
        return
    if _map_count() > _MAX_MAP_COUNT // 2:
        jax.clear_caches()
        gc.collect()
