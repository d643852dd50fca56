"""Collection of modules that need an optional dependency, and the bound on the memory mappings
of a test process, for the doctests (``--doctest-modules`` over ``mhanum/``) and the tests alike."""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

OPTIONAL_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "mhanum/adapters/flax.py": ("flax",),
    "mhanum/adapters/keras.py": ("keras", "tensorflow"),
    "mhanum/adapters/torch.py": ("torch",),
    "mhanum/adapters/transformers.py": ("torch", "transformers"),
}
"""Module (relative to the root) -> the top-level packages its import needs beyond mhanum's own
dependencies and the ``test`` extra. Where one is missing the module's doctests are skipped,
with the reason, instead of failing to import (tests/test_optional_dependencies.py keeps the
table complete)."""


collect_ignore = ["mhanum/measure.py"]  # the deprecated alias: importing it warns (an error here)


def _missing(module: str) -> list[str]:
    return [
        package
        for package in OPTIONAL_DEPENDENCIES.get(module, ())
        if importlib.util.find_spec(package) is None
    ]


class _MissingDependency(pytest.File):
    """A module whose optional dependency is not installed: collecting it is a skip."""

    def __init__(self, *, reason: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reason = reason

    def collect(self) -> list[pytest.Item]:
        pytest.skip(self.reason)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(
    file_path: Path, parent: pytest.Collector
) -> Generator[None, list[pytest.Collector], list[pytest.Collector]]:
    """A module of :data:`OPTIONAL_DEPENDENCIES` whose packages are missing is collected as a skip
    that names them (the doctest plugin would import it and fail)."""
    collectors = yield
    if not collectors or not file_path.is_relative_to(parent.config.rootpath):
        return collectors
    module = file_path.relative_to(parent.config.rootpath).as_posix()
    missing = _missing(module)
    if not missing:
        return collectors
    reason = f"{module} needs {', '.join(missing)} (not installed)"
    return [_MissingDependency.from_parent(parent, path=file_path, reason=reason)]


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
