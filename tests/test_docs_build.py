"""The documentation site builds with ``mkdocs build --strict``, and the theory page lists every
theorem of ``papers/``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_theory_page_lists_every_theorem_of_the_papers():
    theory = (ROOT / "docs" / "theory.md").read_text()
    for paper in sorted((ROOT / "papers").glob("*.md")):
        for number in re.findall(
            r"^#+ (?:\d+\. )?Theorem ([A-Z]\.\d+)", paper.read_text(), re.MULTILINE
        ):
            assert f"[{number}](papers/{paper.name}#" in theory, (number, paper.name)


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e .[docs]")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    for page in (
        "index.html",
        "theory/index.html",
        "api/index.html",
        "papers/attention/index.html",
    ):
        assert (site / page).exists(), page
    api = (site / "api" / "index.html").read_text()
    assert "attention_bound" in api
    assert "head_partition_difference" in api
