"""mkdocs hooks of the mhanum site (``hooks:`` in ``mkdocs.yml``).

* ``on_config``: pages listed in ``nav`` that do not exist (yet) are dropped with an info
  message, so ``mkdocs build --strict`` passes while other pages are still being written.
* ``on_files``: the derivations in ``papers/`` (outside ``docs/``) are added to the site as
  ``papers/<name>.md``, unchanged, so the theory page links to them and they render with math.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.mhanum")

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ("papers/*.md", "papers/measurements/README.md")
FIGURES = ("papers/figures/*.png", "papers/figures/*.svg")  # the images the papers show


def _papers() -> list[Path]:
    return sorted({path for pattern in PAPERS for path in ROOT.glob(pattern)})


def _exists(page: str, docs: Path) -> bool:
    """A page of ``docs/``, or one of the papers this hook adds."""
    return (docs / page).exists() or (ROOT / page) in _papers()


def _prune(items: list[Any], docs: Path) -> list[Any]:
    kept: list[Any] = []
    for item in items:
        if isinstance(item, dict):
            (title, value), *_ = item.items()
            if isinstance(value, list):
                value = _prune(value, docs)
                if value:
                    kept.append({title: value})
                continue
            if isinstance(value, str) and value.endswith(".md") and not _exists(value, docs):
                log.info("nav: leaving out %r: docs/%s does not exist", title, value)
                continue
        elif isinstance(item, str) and item.endswith(".md") and not _exists(item, docs):
            log.info("nav: leaving out docs/%s: it does not exist", item)
            continue
        kept.append(item)
    return kept


def on_config(config: Any) -> Any:
    if config.nav:
        config.nav = _prune(config.nav, Path(config.docs_dir))
    return config


def on_files(files: Files, config: Any) -> Files:
    figures = sorted({path for pattern in FIGURES for path in ROOT.glob(pattern)})
    for path in [*_papers(), *figures]:
        uri = path.relative_to(ROOT).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
