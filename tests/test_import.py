"""``import mhanum`` is cheap: its public names load on first access (PEP 562).

Timings live in ``benchmarks/import_time.py``; these tests check what is imported.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import types

import pytest

import mhanum

HEAVY = ("hypothesis", "scipy", "matplotlib", "torch", "tensorflow", "flax", "jax", "transformers")


def run_fresh(code: str) -> object:
    """What ``code`` prints as JSON on its last line, run in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_import_mhanum_imports_no_heavy_package():
    loaded = run_fresh(
        f"import json, sys, mhanum\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    assert loaded == []


def test_every_public_name_resolves_in_a_fresh_interpreter():
    missing = run_fresh(
        "import json, mhanum\n"
        "print(json.dumps([n for n in mhanum.__all__ if getattr(mhanum, n, None) is None]))"
    )
    assert missing == []


@pytest.mark.parametrize("name", mhanum.__all__)
def test_public_name_resolves_once(name):
    value = getattr(mhanum, name)
    assert getattr(mhanum, name) is value
    assert name in dir(mhanum)
    if isinstance(value, types.ModuleType):
        assert value is importlib.import_module(f"mhanum.{name}")


def test_submodules_import_and_are_attributes():
    code = (
        "import json, mhanum, mhanum.bounds\n"
        "import mhanum.search\n"
        "print(json.dumps([mhanum.bounds is sys.modules['mhanum.bounds'], "
        "mhanum.search.__name__, mhanum.reference.__name__]))"
    )
    assert run_fresh("import sys\n" + code) == [True, "mhanum.search", "mhanum.reference"]


def test_importing_a_submodule_does_not_hide_the_function_of_the_same_name():
    code = (
        "import json, mhanum.attention\n"
        "print(json.dumps([callable(mhanum.attention), mhanum.attention.__name__]))"
    )
    assert run_fresh(code) == [True, "attention"]


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = mhanum.no_such_name
    assert not hasattr(mhanum, "_private_probe")


def test_version_is_eager():
    assert run_fresh("import json, mhanum\nprint(json.dumps(mhanum.__version__))") == (
        mhanum.__version__
    )
