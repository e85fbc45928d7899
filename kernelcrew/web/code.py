"""Source as the UI shows it: Python highlighted by Pygments, and a unified diff against the reference."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cache

from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

_FORMATTER_OPTIONS = {"cssclass": "hl", "linenos": "table", "wrapcode": True}


def highlight_python(source: str) -> Markup:
    """Highlighted HTML of ``source`` with line numbers; Pygments escapes the text itself."""
    return Markup(highlight(source, PythonLexer(), HtmlFormatter(**_FORMATTER_OPTIONS)))


@cache
def highlight_css() -> str:
    """The colours of the highlighted code, generated from Pygments so they match its classes."""
    light = HtmlFormatter(style="default").get_style_defs(".hl")
    return light + "\n.hl .linenos { color: #6b7280; padding-right: .75em; user-select: none; }\n"


@dataclass
class DiffLine:
    kind: str
    """``add``, ``del``, ``hunk``, ``ctx`` or ``file``."""
    text: str


def unified_diff(reference: str, candidate: str, names: tuple[str, str]) -> list[DiffLine]:
    """The candidate against the reference, as classified lines (the template escapes the text)."""
    lines = difflib.unified_diff(
        reference.splitlines(), candidate.splitlines(), fromfile=names[0], tofile=names[1], lineterm="", n=3
    )
    out = []
    for line in lines:
        if line.startswith(("---", "+++")):
            kind = "file"
        elif line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+"):
            kind = "add"
        elif line.startswith("-"):
            kind = "del"
        else:
            kind = "ctx"
        out.append(DiffLine(kind, line))
    return out


__all__ = ["DiffLine", "highlight_css", "highlight_python", "unified_diff"]
