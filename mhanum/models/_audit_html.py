"""The audit as an HTML page with a heatmap per preset (PNG and SVG files beside it)."""

from __future__ import annotations

import html
from pathlib import Path

from mhanum._errors import InvalidArgument
from mhanum.models._audit import Audit, render, verdict_line
from mhanum.models._heatmap import heatmap_data, heatmap_png, heatmap_svg

__all__ = ["check_html_directory", "html_files", "html_page", "write_html"]

PAGE = "index.html"


def html_files(presets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The names of the files :func:`write_html` writes for ``presets``: the page, then a
    ``heatmap-PRESET.png`` and ``.svg`` per preset."""
    names = [PAGE]
    for p in presets:
        names += [f"heatmap-{p}.png", f"heatmap-{p}.svg"]
    return tuple(names)


def check_html_directory(
    directory: str | Path, presets: tuple[str, ...] | list[str], *, force: bool = False
) -> Path:
    """``directory`` as a ``Path``, if :func:`write_html` may write its files there.

    Raises:
        InvalidArgument: if ``directory`` is a file, or (without ``force``) already holds one
            of the files to be written; other files in it are never touched.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        msg = f"html: expected a directory, got the file {str(out)!r}"
        raise InvalidArgument(msg)
    existing = [name for name in html_files(presets) if (out / name).exists()]
    if existing and not force:
        msg = (
            f"html: expected a directory without {', '.join(existing)}, got {str(out)!r} "
            "holding them (pass --force to overwrite them; other files are never touched)"
        )
        raise InvalidArgument(msg)
    return out


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
li.certified { color: #1a7f37; } li.probable { color: #2b6cb0; }
li.measured { color: #b7791f; } li.not-within { color: #c53030; }
img { max-width: 100%; border: 1px solid #ddd; }
""".strip()


def html_page(result: Audit, *, verbose: bool = False) -> str:
    """The page's HTML: the verdicts, a heatmap per preset, then the text audit."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>mhanum audit: {esc(Path(result.model).name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>mhanum audit</h1>",
        f"<p>model: <code>{esc(result.model)}</code></p>",
    ]
    if result.verdicts:
        items = "".join(
            f'<li class="{v.verdict.replace(" ", "-")}"><b>{esc(v.preset)}</b>: '
            f"{esc(verdict_line(v))}</li>"
            for v in result.verdicts
        )
        parts += ["<h2>Verdicts</h2>", f'<ul id="verdicts">{items}</ul>']
    parts.append("<h2>Heatmaps</h2>")
    for name in result.presets:
        parts.append(
            f'<figure><img src="heatmap-{esc(name)}.svg" alt="heatmap of {esc(name)}">'
            f'<figcaption>{esc(name)} (<a href="heatmap-{esc(name)}.png">PNG</a>): per head, '
            "the head's attention before the output projection (bound: Theorem A.1); per layer, "
            "the whole layer (A.2, and A.3 with the stated probability)"
            + (", as multiples of the layer's tolerance" if result.verdicts else "")
            + "</figcaption></figure>"
        )
    parts += ["<h2>Audit</h2>", f"<pre>{esc(render(result, verbose=verbose))}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(
    result: Audit, directory: str | Path, *, force: bool = False, verbose: bool = False
) -> Path:
    """Write the audit as ``DIRECTORY/index.html`` with ``heatmap-PRESET.png`` and ``.svg``.

    Args:
        result: the audit.
        directory: where to write (created if missing).
        force: overwrite those files if they exist (other files are never touched).
        verbose: the page's text audit with the a priori bounds and the heads.

    Returns:
        The page's path.

    Raises:
        InvalidArgument: as :func:`check_html_directory`.
    """
    out = check_html_directory(directory, result.presets, force=force)
    out.mkdir(parents=True, exist_ok=True)
    for name in result.presets:
        data = heatmap_data(result, name)
        (out / f"heatmap-{name}.png").write_bytes(heatmap_png(data))
        (out / f"heatmap-{name}.svg").write_text(heatmap_svg(data), encoding="utf-8")
    target = out / PAGE
    target.write_text(html_page(result, verbose=verbose), encoding="utf-8")
    return target
