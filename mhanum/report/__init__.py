"""Error-bound reports: ``report.html``, ``report.md`` and ``report.json`` for a grid of configs.

:func:`build` runs a grid of numerics presets × sequence lengths × masks (and head partitions at a
fixed model width), measures the error of :func:`mhanum.attention` against the certified
reference, evaluates the bounds of :mod:`mhanum.bounds` on the same inputs, and writes

* ``report.html`` — self-contained: the figures are embedded as base64 PNG;
* ``report.md`` — the same content, with the figures in ``figures/*.png`` beside it;
* ``report.json`` — every number (Python's ``json``: ``Infinity`` and ``NaN`` may appear).

The grid comes from a TOML file (``mhanum report GRID.toml -o DIR``) whose keys default to the
embedded grid (``mhanum report --print-default-config``). Importing this module imports
matplotlib; ``import mhanum`` does not import it.

Examples:
    >>> import mhanum.report
    >>> mhanum.report.load_config({"lengths": [8, 16]}).lengths
    (8, 16)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mhanum import devices
from mhanum._errors import InvalidArgument
from mhanum.report._compute import CASE_FIELDS, Progress, compute, read_cases
from mhanum.report._config import (
    Config,
    HeadsConfig,
    MaskConstantsConfig,
    VariantsConfig,
    default_toml,
    load_config,
)
from mhanum.report._document import blocks
from mhanum.report._render import Figure, to_html, to_markdown

__all__ = [
    "CASE_FIELDS",
    "FILES",
    "SCHEMA",
    "Config",
    "HeadsConfig",
    "MaskConstantsConfig",
    "Report",
    "VariantsConfig",
    "build",
    "default_toml",
    "load_config",
    "read_cases",
]

SCHEMA = "mhanum.report/1"
"""The ``schema`` field of ``report.json``."""

FILES = ("report.html", "report.md", "report.json")
"""What :func:`build` writes (with ``figures/`` for the Markdown)."""

TITLE = "mhanum error-bound report"


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`build` wrote.

    Attributes:
        out: the report directory.
        data: the content of ``report.json``.
        figures: figure name -> PNG bytes (also in ``out/figures/<name>.png``).
    """

    out: Path
    data: dict[str, Any]
    figures: dict[str, bytes]

    @property
    def html(self) -> Path:
        return self.out / "report.html"

    @property
    def markdown(self) -> Path:
        return self.out / "report.md"

    @property
    def json(self) -> Path:
        return self.out / "report.json"


def _versions() -> dict[str, str]:
    import jax
    import matplotlib
    import mpmath
    import numpy

    from mhanum._version import __version__

    return {
        "mhanum": __version__,
        "jax": jax.__version__,
        "numpy": numpy.__version__,
        "mpmath": mpmath.__version__,
        "matplotlib": matplotlib.__version__,
        "python": platform.python_version(),
    }


def _check_out(out: str | os.PathLike[str], *, force: bool = False) -> Path:
    """``out`` as a path where a report may be written: new, empty, or ``force``.

    Raises:
        InvalidArgument: when ``out`` is a file, or a non-empty directory without ``force``.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        msg = f"out: expected a directory, got the existing file {str(path)!r}"
        raise InvalidArgument(msg)
    if path.is_dir() and any(path.iterdir()) and not force:
        msg = (
            f"out: expected a new or empty directory, got existing {str(path)!r} "
            "(pass --force / force=True to overwrite its report files)"
        )
        raise InvalidArgument(msg)
    return path


def _jsonable(x: Any) -> Any:
    """Tuples become lists (so the data equals what ``json.loads`` gives back)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def build(
    config: Config | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    out: str | os.PathLike[str] = "mhanum-report",
    *,
    cases: Sequence[str | os.PathLike[str]] = (),
    records: Sequence[str | os.PathLike[str]] = (),
    force: bool = False,
    progress: Progress | None = None,
    executor: object = None,
    journal: str | os.PathLike[str] | None = None,
) -> Report:
    """Compute a report and write ``report.html``, ``report.md``, ``report.json`` into ``out``.

    Needs ``jax_enable_x64`` (the ``mhanum`` command sets it). The same config gives the same
    numbers; ``created``, ``seconds`` and ``versions`` in ``report.json`` (and the provenance
    paragraph) are all that differ between two runs on one machine.

    Args:
        config: a :class:`Config`, a mapping of TOML keys, a TOML path, or ``None`` for the
            embedded default grid (:func:`default_toml`).
        out: the report directory; created if missing. An existing non-empty directory is
            refused unless ``force`` (then only the report's own files are replaced).
        cases: worst-case JSON files of the search, or directories of them (:data:`CASE_FIELDS`).
        records: ``mhanum measure`` records files, judged with :func:`mhanum.devices.check`.
        force: overwrite the report files in an existing directory.
        progress: ``progress(done, total, what)`` after each step (the command draws a bar).
        executor: where the grid's cells run: ``None`` (in this process), a
            ``concurrent.futures.Executor`` (:func:`mhanum.parallel.default_executor`) or a
            ``distributed.Client``; the numbers are the same whichever runs them.
        journal: a JSON Lines file recording each finished cell (:mod:`mhanum.parallel`): a
            build stopped part-way and run again with it computes only the missing cells.

    Returns:
        A :class:`Report`.

    Raises:
        InvalidArgument: for a bad config (naming the key), an existing ``out`` without
            ``force``, unreadable cases or records, or a journal of another grid; all checked
            before any computation.
    """
    cfg = load_config(config)
    path = _check_out(out, force=force)
    read_cases(cases)
    for r in records:
        if not Path(r).is_file():
            msg = f"records: expected a records file, got {str(r)!r}"
            raise InvalidArgument(msg)
        devices.read_records(r)
    start = time.perf_counter()
    data: dict[str, Any] = {"schema": SCHEMA, "config": cfg.as_dict()}
    data |= compute(
        cfg, cases=cases, records=records, progress=progress, executor=executor, journal=journal
    )
    data["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    data["versions"] = _versions()
    data["seconds"] = time.perf_counter() - start
    data = _jsonable(data)
    content = blocks(data)
    figures = {b.name: b.png for b in content if isinstance(b, Figure)}
    path.mkdir(parents=True, exist_ok=True)
    fig_dir = path / "figures"
    if fig_dir.is_dir():
        shutil.rmtree(fig_dir)
    fig_dir.mkdir()
    for name, png in figures.items():
        (fig_dir / f"{name}.png").write_bytes(png)
    (path / "report.html").write_text(to_html(TITLE, content), "utf-8")
    (path / "report.md").write_text(to_markdown(TITLE, content), "utf-8")
    (path / "report.json").write_text(json.dumps(data, indent=1) + "\n", "utf-8")
    return Report(path, data, figures)
