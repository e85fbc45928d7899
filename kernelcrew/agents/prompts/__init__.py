"""Prompt templates of the agents, one Markdown file per agent, rendered into chat messages."""

from __future__ import annotations

import re
import string
from functools import cache
from importlib import resources

from kernelcrew.agents.llm import Message

_SECTION = re.compile(r"^## (system|user)[ \t]*$", re.M | re.I)
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

CODER_RETRY = (
    "That reply cannot be used: {problem}. Reply with the complete candidate source in one ```python "
    "block that defines class ModelNew, with no other text; keep it short enough to finish."
)
"""The coder's second chance after an empty, refused, cut-off or code-less reply."""

PLANNER_RETRY = (
    "That answer was not valid ({problem}). Reply with one JSON object with the keys strategy, "
    "rationale, expected_gain (a number > 0) and params."
)
"""The planner's second chance after an invalid, empty, refused or ruled-out answer."""


@cache
def _template(name: str) -> tuple[str, str]:
    """The (system, user) templates of ``<name>.md``."""
    if not _NAME.match(name):
        raise ValueError(f"bad prompt name {name!r}")
    path = resources.files(__name__).joinpath(f"{name}.md")
    if not path.is_file():
        raise FileNotFoundError(f"no prompt {name!r} ({name}.md in kernelcrew/agents/prompts)")
    text = path.read_text(encoding="utf-8")
    parts = _SECTION.split(text)
    sections: dict[str, str] = {}
    for title, body in zip(parts[1::2], parts[2::2], strict=True):
        sections[title.lower()] = body.strip("\n")
    if set(sections) != {"system", "user"}:
        raise ValueError(f"prompt {name}.md needs a '## system' and a '## user' section")
    return sections["system"], sections["user"]


def fields(name: str) -> set[str]:
    """The placeholders ``{field}`` that :func:`render` needs for prompt ``name``."""
    return {
        f
        for part in _template(name)
        for _, f, _, _ in string.Formatter().parse(part)
        if f  # literal text and escaped braces have no field name
    }


def render(name: str, **values: object) -> list[Message]:
    """The system and user messages of prompt ``name`` with its ``{field}`` placeholders filled.

    A missing field raises KeyError naming it; a field the prompt does not use raises TypeError.
    """
    system, user = _template(name)
    needed = fields(name)
    missing = sorted(needed - values.keys())
    if missing:
        raise KeyError(f"prompt {name!r} needs field(s) {', '.join(missing)}")
    unknown = sorted(values.keys() - needed)
    if unknown:
        raise TypeError(f"prompt {name!r} has no field(s) {', '.join(unknown)}")
    return [
        Message("system", system.format_map(values)),
        Message("user", user.format_map(values)),
    ]
