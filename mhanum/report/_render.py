"""A report as a list of blocks, and its two renderings: self-contained HTML and Markdown.

Blocks are format-neutral (heading, paragraph, table, figure); text may hold ``code`` spans in
backticks. HTML embeds every figure as a base64 PNG; Markdown links ``figures/<name>.png``.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import re

__all__ = ["Block", "Figure", "Heading", "Paragraph", "Table", "to_html", "to_markdown"]


@dataclasses.dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclasses.dataclass(frozen=True)
class Paragraph:
    text: str


@dataclasses.dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str
    png: bytes
    caption: str


Block = Heading | Paragraph | Table | Figure

_CODE = re.compile(r"`([^`]+)`")

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem;
       color: #1b1b1b; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8rem 0; font-size: 0.85rem; }
th, td { border: 1px solid #c8c8c8; padding: 0.2rem 0.5rem; text-align: right; }
th { background: #f0f0f0; }
td:first-child, th:first-child { text-align: left; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #e0e0e0; }
figcaption { font-size: 0.85rem; color: #444; }
code { background: #f4f4f4; padding: 0 0.2rem; }
"""


def _inline_html(text: str) -> str:
    return _CODE.sub(r"<code>\1</code>", html.escape(text))


def to_html(title: str, blocks: list[Block]) -> str:
    """One self-contained HTML page (no external resource: figures are ``data:`` URIs)."""
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            level = block.level + 1
            out.append(f"<h{level}>{_inline_html(block.text)}</h{level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{_inline_html(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.headers)
            body = "".join(
                "<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>"
                for row in block.rows
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(
                f'<figure id="fig-{block.name}"><img alt="{html.escape(block.caption)}" '
                f'src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline_html(block.caption)}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(title: str, blocks: list[Block], figure_dir: str = "figures") -> str:
    """Markdown (GitHub flavour) with figures linked as ``{figure_dir}/<name>.png``."""
    out = [f"# {title}", ""]
    for block in blocks:
        if isinstance(block, Heading):
            out += ["#" * (block.level + 1) + " " + block.text, ""]
        elif isinstance(block, Paragraph):
            out += [block.text, ""]
        elif isinstance(block, Table):
            out.append("| " + " | ".join(_cell(h) for h in block.headers) + " |")
            out.append("|" + "|".join("---" for _ in block.headers) + "|")
            out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in block.rows]
            out.append("")
        else:
            out += [f"![{block.caption}]({figure_dir}/{block.name}.png)", "", block.caption, ""]
    return "\n".join(out)
