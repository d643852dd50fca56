"""``import mhanum`` imports no framework; the adapters are found without importing them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mhanum import InvalidArgument, adapters

FRAMEWORKS = ("torch", "tensorflow", "keras", "flax", "transformers")


def test_import_mhanum_imports_no_framework():
    code = (
        "import sys, mhanum, mhanum.adapters, mhanum.adapters.compare, mhanum.cli\n"
        "mhanum.cli._parser()\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == ""


def test_available_lists_jax_and_model_always():
    names = adapters.available()
    assert {"jax", "model"} <= set(names)
    assert set(names) <= set(adapters.ADAPTERS)


def test_get_rejects_unknown_names():
    with pytest.raises(InvalidArgument, match="framework: expected one of"):
        adapters.get("mxnet")


def test_compare_is_exported():
    import mhanum

    assert mhanum.compare is adapters.compare.compare
