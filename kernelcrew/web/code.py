"""Source as the UI shows it: Python highlighted by Pygments, and a unified diff against the reference."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field
from functools import cache

from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from kernelcrew.task import parse_python

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


def unified_diff(reference: str, candidate: str, names: tuple[str, str], context: int = 3) -> list[DiffLine]:
    """The candidate against the reference, as classified lines (the template escapes the text)."""
    lines = difflib.unified_diff(
        reference.splitlines(),
        candidate.splitlines(),
        fromfile=names[0],
        tofile=names[1],
        lineterm="",
        n=context,
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


def _statements(source: str) -> list[tuple[str, str]]:
    """Each top-level statement of ``source`` as ``(name, text)``, decorators included (names of
    functions and classes; ``""`` for the rest)."""
    lines = source.splitlines()
    out = []
    for node in parse_python(source).body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        name = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else ""
        out.append((name, "\n".join(lines[first - 1 : node.end_lineno])))
    return out


@dataclass
class Part:
    """One function or class the answer adds (a kernel, its launcher, a helper)."""

    name: str
    lines: int
    code: Markup
    """Its highlighted source."""


@dataclass
class Replaced:
    """What the answer replaces: the reference's ``Model`` against its ``ModelNew``, and the kernels
    and helpers it adds, each on its own."""

    diff: list[DiffLine]
    parts: list[Part] = field(default_factory=list)


def replaced_part(reference: str, candidate: str) -> Replaced | None:
    """``Model`` against ``ModelNew`` and the definitions the candidate adds (what it shares with the
    reference, such as ``get_inputs``, is left out); None when either class cannot be found."""
    from kernelcrew.task import TaskError
    from kernelcrew.tools.packaging import unpack

    try:
        candidate, _ = unpack(candidate)  # the torch.compile packaging is generated, not the answer
        ref, cand = _statements(reference), _statements(candidate)
    except (SyntaxError, TaskError):
        return None
    model = next((text for name, text in ref if name == "Model"), None)
    new = next((text for name, text in cand if name == "ModelNew"), None)
    if model is None or new is None:
        return None
    shared = {text for _, text in ref}
    parts = [
        Part(name, text.count("\n") + 1, highlight_python(text + "\n"))
        for name, text in cand
        if name and name != "ModelNew" and text not in shared
    ]
    names = ("reference: Model", "answer: ModelNew")
    diff = unified_diff(model, new, names, context=max(model.count("\n"), new.count("\n")) + 1)
    return Replaced(diff, parts)


__all__ = [
    "DiffLine",
    "Part",
    "Replaced",
    "highlight_css",
    "highlight_python",
    "replaced_part",
    "unified_diff",
]
