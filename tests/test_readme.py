"""The README's Python example runs as written, and the output it shows is what the code prints
(the conventions of ``tests/test_docs_examples.py``)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from tests.test_docs_examples import (
    examples,
    run_examples,
    run_page,
    torch_kernels,
    unprinted_prose_figures,
)

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
FRAMEWORKS = ("torch", "tensorflow", "keras")


def test_readme_python_blocks_run():
    found = [e for e in examples(README.read_text()) if e.kind == "python"]
    assert found
    namespace: dict[str, object] = {}  # one namespace: later blocks use earlier names
    run_examples(README, found, namespace)
    assert namespace["y"].shape == namespace["y_ref"].shape == (64, 512)


@pytest.mark.slow
def test_readme_shows_what_its_commands_print():
    found = [e for e in examples(README.read_text()) if e.kind == "command"]
    shown = {e.source for e in found}
    assert {"mhanum demo", "mhanum compare --seed-example"} <= shown
    if any(importlib.util.find_spec(m) is None for m in FRAMEWORKS):
        found = [e for e in found if "compare" not in e.source]  # needs torch and keras
        run_examples(README, found, {})
    else:
        run_page(README, ("command",))  # with the torch CPU kernels the README names


def test_readme_names_the_torch_kernels_of_its_figures():
    """``mhanum compare`` prints torch's rounding error, which depends on torch's CPU kernels."""
    assert torch_kernels(README.read_text()) == "AVX2"


def test_readme_prose_quotes_only_figures_its_output_prints():
    assert unprinted_prose_figures(README.read_text()) == []
