"""Knowledge-base imports as data: the static check of every imported source, and the import's answer."""

from __future__ import annotations

from pydantic import BaseModel

from kernelcrew.task import TaskError, check_source
from kernelcrew.tools.anticheat import static_check


def source_problems(source: str) -> list[str]:
    """Why ``source`` may not enter the knowledge base (none: it may): it must parse as Python,
    define ``ModelNew`` and pass the verifier's static rules. Only its syntax tree is read."""
    try:
        check_source(source, kind="candidate", path="candidate.py")
        findings = static_check(source)
    except TaskError as exc:
        return [str(exc)]
    except (RecursionError, MemoryError, ValueError) as exc:  # nesting too deep for the parser
        return [f"cannot be parsed: {type(exc).__name__}"]
    return [f"{f.message}" + (f" (line {f.line})" if f.line else "") for f in findings]


class KbImported(BaseModel):
    """What an import did: records in the file, and how many were inserted, improved (faster
    evidence for a row of the importer's), confirmed, unchanged, or skipped (another owner's row)."""

    records: int
    inserted: int
    improved: int
    confirmed: int
    unchanged: int
    skipped: int
    visibility: str


__all__ = ["KbImported", "source_problems"]
