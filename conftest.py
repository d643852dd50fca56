"""Doctest collection (``--doctest-modules`` over ``mhanum/``): an adapter module imports its
framework, so it is collected only where that framework is installed."""

from __future__ import annotations

import importlib.util

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
