"""Writing the knowledge base: verified wins only, deduplicated and counted; export and import.

:func:`add_win` takes the win's description (:class:`~kernelcrew.knowledge_base.schemas.WinIn`)
and the verifier's verdict, and refuses (:class:`WinRefused`) anything that is not a pass with
positive timings; the timings stored are the verdict's, never the caller's. On a GPU clock the
candidate must also be faster than eager (and, when the verdict says, significantly so); a CPU
record (``clock = "cpu-wall"``) is kept whatever its time, labelled, since CPU timings decide
nothing.

Deduplication: one row per (GPU model, signature, strategy, scope), the scope being the owner's
(private), the team's or everyone's (public). A second win for the same row counts one more
confirmation and, when faster (higher speedup over eager), replaces the evidence. A job confirms a
row once, so a finalize that runs again (a resumed or continued run) does not count twice.
Concurrent writers are safe: the row is read ``FOR UPDATE``, and an insert that loses a race to
the unique constraint merges into the winner's row.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kernelcrew.knowledge_base.models import VISIBILITIES, Confirmation, Reader, Win, scope_of, visible_to
from kernelcrew.knowledge_base.patterns import signature_key
from kernelcrew.knowledge_base.schemas import (
    EXPORT_FORMAT,
    EXPORT_VERSION,
    MAX_FILE_BYTES,
    ExportFile,
    ExportRecord,
    WinIn,
    describe_errors,
)

CLOCKS = ("cuda-event", "cpu-wall")
#: The columns a faster win replaces in its row (the row's identity and counters stay).
EVIDENCE_FIELDS = (
    "versions",
    "signature",
    "pattern_kinds",
    "description",
    "bottleneck",
    "tags",
    "params",
    "clock",
    "before_ms",
    "after_ms",
    "speedup_eager",
    "speedup_compile",
    "sol_fraction",
    "candidate_source",
    "source_kind",
    "ncu_summary",
    "job_id",
)


class WinRefused(ValueError):
    """What was offered is not a verified win (or is not described well enough to store)."""


class ImportRefused(ValueError):
    """An import file that cannot be used; nothing of it was written."""


@dataclass(frozen=True)
class Evidence:
    """The timings of a verified win, taken from the verifier's verdict."""

    clock: str
    before_ms: float
    after_ms: float
    speedup_eager: float
    speedup_compile: float | None


@dataclass(frozen=True)
class AddResult:
    """What :func:`add_win` did: ``inserted``, ``improved`` (faster: evidence replaced),
    ``confirmed`` (one more confirmation) or ``unchanged`` (this job had already confirmed it)."""

    id: uuid.UUID
    action: str
    confirmations: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "id": str(self.id)}


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def evidence_from_verdict(verdict: Mapping[str, Any]) -> Evidence:
    """The timings of a verifier pass; :class:`WinRefused` saying why for anything else.

    ``verdict`` is the verifier's report as ``kernelcrew verify --json`` prints it (``verdict``,
    ``baseline_ms``, ``candidate_ms``, ``speedup``, ``speedup_significant``, ``speedup_vs_compile``,
    and ``clock`` at the top or under ``timing``).
    """
    if not isinstance(verdict, Mapping):
        raise WinRefused(f"a win needs the verifier's verdict (a mapping), not {type(verdict).__name__}")
    if verdict.get("verdict") != "pass":
        stage = f" at stage {verdict['stage']}" if verdict.get("stage") else ""
        raise WinRefused(
            f"not a verifier pass (verdict {verdict.get('verdict')!r}{stage}): only verified wins are stored"
        )
    before, after = _positive(verdict.get("baseline_ms")), _positive(verdict.get("candidate_ms"))
    if before is None or after is None:
        raise WinRefused(
            "a verified win needs positive eager and candidate timings (baseline_ms, candidate_ms); got "
            f"{verdict.get('baseline_ms')!r} and {verdict.get('candidate_ms')!r}"
        )
    clock = verdict.get("clock") or (verdict.get("timing") or {}).get("clock")
    if clock not in CLOCKS:
        raise WinRefused(f"unknown timing clock {clock!r} (expected {' or '.join(CLOCKS)})")
    if clock == "cuda-event":
        if not after < before:
            raise WinRefused(f"not faster than eager ({after:.4g} ms vs {before:.4g} ms): not a win")
        if verdict.get("speedup_significant") is False:
            raise WinRefused("the speedup over eager is within the timing noise: not a win")
    speedup = _positive(verdict.get("speedup")) or before / after
    return Evidence(clock, before, after, speedup, _positive(verdict.get("speedup_vs_compile")))


def add_win(
    session: Session,
    win: WinIn | Mapping[str, Any],
    *,
    verdict: Mapping[str, Any],
    owner: str,
    visibility: str = "private",
    team: str | None = None,
) -> AddResult:
    """Store a verified win (or confirm / improve the row it duplicates); see the module docstring.

    Runs in the caller's transaction; raises :class:`WinRefused` before writing anything when
    the verdict is not a pass, the timings are missing, or the description is invalid.
    """
    if not isinstance(win, WinIn):
        try:
            win = WinIn.model_validate(dict(win))
        except ValidationError as exc:
            raise WinRefused(f"invalid win: {describe_errors(exc)}") from None
    evidence = evidence_from_verdict(verdict)
    if (evidence.clock == "cpu-wall") != (win.arch == "cpu"):
        raise WinRefused(f"a {evidence.clock} timing cannot be a win on {win.arch}")
    try:
        scope = scope_of(owner, visibility, team)
    except ValueError as exc:
        raise WinRefused(str(exc)) from None
    fields = {
        **win.model_dump(exclude={"job_id"}),
        **asdict(evidence),
        "job_id": win.job_id,
        "source": "verified",
        "signature_key": signature_key(win.signature),
        "owner": owner,
        "visibility": visibility,
        "team": team if visibility == "team" else None,
        "scope": scope,
    }
    return _merge(session, fields, job_key=win.job_id or f"anonymous:{uuid.uuid4()}", confirmations=1)


def _find(session: Session, fields: Mapping[str, Any]) -> Win | None:
    return session.scalars(
        select(Win)
        .where(
            Win.gpu_model == fields["gpu_model"],
            Win.signature_key == fields["signature_key"],
            Win.strategy == fields["strategy"],
            Win.scope == fields["scope"],
        )
        .with_for_update()
    ).one_or_none()


def _merge(session: Session, fields: dict[str, Any], *, job_key: str, confirmations: int) -> AddResult:
    """Insert the win, or fold it into the row with the same dedupe key."""
    existing = _find(session, fields)
    if existing is None:
        row = Win(**fields, confirmations=confirmations)
        try:
            with session.begin_nested():
                session.add(row)
                session.flush()
        except IntegrityError:
            existing = _find(session, fields)  # another writer inserted it first: merge into theirs
            if existing is None:
                raise
        else:
            session.add(Confirmation(win_id=row.id, job_id=job_key, speedup_eager=fields["speedup_eager"]))
            session.flush()
            return AddResult(row.id, "inserted", row.confirmations)
    seen = session.scalar(
        select(Confirmation.id).where(Confirmation.win_id == existing.id, Confirmation.job_id == job_key)
    )
    if seen is None:
        existing.confirmations += 1
        session.add(Confirmation(win_id=existing.id, job_id=job_key, speedup_eager=fields["speedup_eager"]))
    faster = fields["speedup_eager"] > (existing.speedup_eager or 0.0)
    if faster:
        for name in EVIDENCE_FIELDS:
            setattr(existing, name, fields[name])
    session.flush()
    action = "improved" if faster else ("confirmed" if seen is None else "unchanged")
    return AddResult(existing.id, action, existing.confirmations)


def get_win(session: Session, win_id: uuid.UUID | str, reader: Reader) -> Win | None:
    """The record ``win_id`` if ``reader`` may see it (None otherwise: existence is not leaked)."""
    try:
        key = win_id if isinstance(win_id, uuid.UUID) else uuid.UUID(str(win_id))
    except ValueError:
        raise ValueError(f"not a record id: {win_id!r} (ids are UUIDs)") from None
    return session.scalars(select(Win).where(Win.id == key, visible_to(reader))).one_or_none()


def win_to_dict(win: Win, *, with_source: bool = True) -> dict[str, Any]:
    """A record as plain JSON-ready data."""
    data = {
        "id": str(win.id),
        "source": win.source,
        "seed_id": win.seed_id,
        "gpu_model": win.gpu_model,
        "arch": win.arch,
        "signature": win.signature,
        "pattern_kinds": list(win.pattern_kinds),
        "strategy": win.strategy,
        "tags": list(win.tags),
        "params": dict(win.params),
        "description": win.description,
        "bottleneck": win.bottleneck,
        "clock": win.clock,
        "before_ms": win.before_ms,
        "after_ms": win.after_ms,
        "speedup_eager": win.speedup_eager,
        "speedup_compile": win.speedup_compile,
        "sol_fraction": win.sol_fraction,
        "source_kind": win.source_kind,
        "ncu_summary": win.ncu_summary,
        "versions": dict(win.versions),
        "job_id": win.job_id,
        "owner": win.owner,
        "visibility": win.visibility,
        "team": win.team,
        "confirmations": win.confirmations,
        "created_at": win.created_at.isoformat(),
        "updated_at": win.updated_at.isoformat(),
    }
    if with_source:
        data["candidate_source"] = win.candidate_source
    return data


def export_wins(session: Session, reader: Reader) -> dict[str, Any]:
    """Every verified win ``reader`` may see, as an import file (seeds ship with kernelcrew: left out)."""
    rows = session.scalars(
        select(Win).where(visible_to(reader), Win.source == "verified").order_by(Win.created_at, Win.id)
    )
    records = [
        ExportRecord(
            id=w.id,
            gpu_model=w.gpu_model or "",
            arch=w.arch,
            signature=w.signature,
            pattern_kinds=list(w.pattern_kinds),
            strategy=w.strategy,
            candidate_source=w.candidate_source or "",
            description=w.description,
            tags=list(w.tags),
            params=dict(w.params),
            versions=dict(w.versions),
            bottleneck=w.bottleneck,
            source_kind=w.source_kind,
            sol_fraction=w.sol_fraction,
            ncu_summary=w.ncu_summary,
            job_id=w.job_id,
            clock=w.clock or "",
            before_ms=w.before_ms or 0.0,
            after_ms=w.after_ms or 0.0,
            speedup_eager=w.speedup_eager or 0.0,
            speedup_compile=w.speedup_compile,
            owner=w.owner,
            visibility=w.visibility,
            team=w.team,
            confirmations=w.confirmations,
            created_at=w.created_at,
        )
        for w in rows
    ]
    doc = ExportFile(
        format=EXPORT_FORMAT, version=EXPORT_VERSION, exported_at=datetime.now(UTC), records=records
    )
    return doc.model_dump(mode="json")


def parse_import(raw: bytes | str) -> ExportFile:
    """Validate an export file; :class:`ImportRefused` with every problem found (nothing is written)."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_FILE_BYTES:
        raise ImportRefused(f"the file is {size} bytes; the limit is {MAX_FILE_BYTES}")
    try:
        return ExportFile.model_validate_json(raw)
    except ValidationError as exc:
        raise ImportRefused(f"not a valid kernelcrew knowledge-base file: {describe_errors(exc)}") from None


#: Static check of an imported candidate source: the problems found, none when it may be stored.
#: The knowledge base stores sources and never runs them; the caller (command line, API) passes the
#: verifier's static rules (``kernelcrew.api.kb.source_problems``), which live above this package.
SourceCheck = Callable[[str], list[str]]


def import_wins(
    session: Session,
    raw: bytes | str,
    reader: Reader,
    *,
    check_source: SourceCheck,
    visibility: str = "private",
) -> dict[str, int]:
    """Import an export file into the caller's transaction; counts of what happened to each record.

    An import is data: nothing in it is executed. The whole file is validated first (fields, sizes,
    counts, and every candidate source through ``check_source``); the caller commits once, so a bad
    file or a failing row leaves the database as it was. Imported records belong to ``reader`` and
    are private to them unless ``visibility`` shares them (``team``: the reader's team, else the
    file's; the file's own visibility is never taken). A record never changes a row another owner
    holds: it is ``skipped``. Re-importing a file changes nothing: a record confirms its row once
    (by its job id, else its id in the file). The importing side trusts the exporting side's
    verification: records must carry its timings.
    """
    if visibility not in VISIBILITIES:
        raise ImportRefused(f"unknown visibility {visibility!r} (choose {', '.join(VISIBILITIES)})")
    doc = parse_import(raw)
    problems = [
        f"records[{i}].candidate_source: {problem}"
        for i, rec in enumerate(doc.records)
        for problem in check_source(rec.candidate_source)
    ]
    if problems:
        more = f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ImportRefused(
            "a candidate source breaks the static rules (imports are data: nothing was run): "
            + "; ".join(problems[:8])
            + more
        )
    counts: Counter[str] = Counter()
    for i, rec in enumerate(doc.records):
        vis = visibility
        team = (reader.team or rec.team) if vis == "team" else None
        if vis == "team" and not team:
            raise ImportRefused(
                f"records[{i}]: visibility 'team' needs a team (the file and reader have none)"
            )
        fields = {
            **rec.model_dump(
                exclude={"id", "source", "owner", "visibility", "team", "confirmations", "created_at"}
            ),
            "source": "verified",
            "signature_key": signature_key(rec.signature),
            "owner": reader.owner,
            "visibility": vis,
            "team": team,
            "scope": scope_of(reader.owner, vis, team),
        }
        held = _find(session, fields)
        if held is not None and held.owner != reader.owner:
            counts["skipped"] += 1  # someone else's row in a shared scope: theirs to change
            continue
        result = _merge(
            session, fields, job_key=rec.job_id or f"import:{rec.id}", confirmations=rec.confirmations
        )
        counts[result.action] += 1
    return {
        "records": len(doc.records),
        **{k: counts[k] for k in ("inserted", "improved", "confirmed", "unchanged", "skipped")},
    }


__all__ = [
    "AddResult",
    "Evidence",
    "ImportRefused",
    "SourceCheck",
    "WinRefused",
    "add_win",
    "evidence_from_verdict",
    "export_wins",
    "get_win",
    "import_wins",
    "parse_import",
    "win_to_dict",
]
