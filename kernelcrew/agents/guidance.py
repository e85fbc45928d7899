"""The user's messages read as commands; one message may hold several ("keep fp32, only triton").

A message is split into clauses at commas, semicolons and the words "and" / "then"; each clause
that is a command is one :data:`Command`, each that is not is kept as ``("unknown", clause)`` (an
LLM planner reads it as free text). Commands (case-insensitive):

    only triton | only kernels | triton only    own kernels only (no library or compiler candidates)
    no torch.compile | no compile               no torch.compile candidates
    keep fp32 | stay in fp32 | fp32 only        the strict precision policy
    try <strategy>                              that strategy next
    skip <strategy> | no <strategy>             never that strategy
    more iterations | more steps                three more steps
    stop                                        finish now with the best so far
"""

from __future__ import annotations

import re

Command = tuple[str, str]
"""``(action, argument)``: only_kernels, no_compiler, keep_fp32, try, skip, more, stop or unknown."""

_SPLIT = re.compile(r"\s*(?:[,;]|\band\b|\bthen\b)\s*", re.I)
_COMMANDS: list[tuple[str, re.Pattern[str]]] = [
    (
        "only_kernels",
        re.compile(
            r"(?:use\s+)?only\s+(?:use\s+)?(?:own\s+)?(?:triton|kernels?|cuda)(?:\s+kernels?)?|triton\s+only",
            re.I,
        ),
    ),
    (
        "no_compiler",
        re.compile(r"(?:no|skip|never|don'?t use)\s+(?:torch[._ ]?compile|compile|the compiler)", re.I),
    ),
    (
        "keep_fp32",
        re.compile(r"keep\s+(?:it\s+)?(?:in\s+)?fp32|stay\s+in\s+fp32|fp32\s+only|strict precision", re.I),
    ),
    ("more", re.compile(r"more\s+(?:iterations|steps)", re.I)),
    ("stop", re.compile(r"stop(?:\s+now)?", re.I)),
    ("try", re.compile(r"try\s+(?P<name>[\w:-]+)", re.I)),
    ("skip", re.compile(r"(?:skip|no)\s+(?P<name>[\w:-]+)", re.I)),
]


def parse_commands(message: str) -> list[Command]:
    """Every command of ``message`` in order, each clause that is none as ``("unknown", clause)``."""
    commands: list[Command] = []
    for clause in _SPLIT.split(message.strip()):
        clause = clause.strip().rstrip(".!").strip()
        if not clause:
            continue
        for action, pattern in _COMMANDS:
            m = pattern.fullmatch(clause)
            if m is not None:
                name = m.groupdict().get("name")
                commands.append((action, name.lower() if name else ""))
                break
        else:
            commands.append(("unknown", clause))
    return commands or [("unknown", message)]


def parse_guidance(message: str) -> Command:
    """The first command of ``message``, or ``("unknown", message)`` when it holds none."""
    known = [c for c in parse_commands(message) if c[0] != "unknown"]
    return known[0] if known else ("unknown", message)
