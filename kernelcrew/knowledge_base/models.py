"""The knowledge base's tables: one row per verified win (or curated seed), and who confirmed it.

``kb_wins`` holds both kinds of knowledge, told apart by ``source``:

* ``verified``: a candidate that passed the verifier and was measured faster than eager on a GPU
  model (or, labelled ``clock = "cpu-wall"``, a verified candidate timed on a CPU). It carries the
  evidence: before/after times, speedups, the candidate's source.
* ``seed``: advice written by us per architecture (``knowledge_base/seed/*.json``), with no
  timings; ``seed_id`` makes loading it idempotent.

Every read goes through :func:`visible_to`: a reader sees public records, their team's ``team``
records and every record they own. ``scope`` is the deduplication scope (``user:<owner>``,
``team:<team>`` or ``public``): within one scope, one row per (GPU model, signature, strategy).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    Uuid,
    and_,
    or_,
)
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.sql.elements import ColumnElement

from kernelcrew.knowledge_base.db import Base

VISIBILITIES = ("private", "team", "public")
SOURCES = ("verified", "seed")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite keeps none: it is added back on read)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime: kernelcrew stores UTC timestamps with their timezone")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Win(Base):
    """One verified win (``source = "verified"``) or one curated strategy (``source = "seed"``)."""

    __tablename__ = "kb_wins"
    __table_args__ = (
        UniqueConstraint("gpu_model", "signature_key", "strategy", "scope"),
        CheckConstraint("visibility IN ('private', 'team', 'public')", name="visibility"),
        CheckConstraint("source IN ('verified', 'seed')", name="source"),
        CheckConstraint("visibility <> 'team' OR team IS NOT NULL", name="team_named"),
        CheckConstraint(
            "source = 'seed' OR (gpu_model IS NOT NULL AND before_ms > 0 AND after_ms > 0"
            " AND candidate_source IS NOT NULL)",
            name="verified_evidence",
        ),
        CheckConstraint("confirmations >= 1", name="confirmations"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    source: Mapped[str] = mapped_column(String(16))
    """``verified`` (a verifier pass, timed) or ``seed`` (curated advice, no timings)."""
    seed_id: Mapped[str | None] = mapped_column(String(120), unique=True)
    """A seed's stable name (``sm_90/fused_pointwise``); None for verified wins."""

    gpu_model: Mapped[str | None] = mapped_column(String(64), index=True)
    """The GPU model slug (``h100-sxm``; ``cpu`` for CPU timings); None for seeds (per architecture)."""
    arch: Mapped[str] = mapped_column(String(16), index=True)
    """``sm_80``, ``sm_89``, ``sm_90``, ``sm_100``, ... or ``cpu``."""
    versions: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """torch, triton, CUDA, driver versions of the measurement."""

    signature: Mapped[str] = mapped_column(Text, default="")
    """The pattern signature (:func:`kernelcrew.knowledge_base.patterns.signature`); empty for seeds."""
    signature_key: Mapped[str] = mapped_column(String(64), index=True, default="")
    """sha256 of ``signature``: the deduplication key (an index on text would be too long)."""
    pattern_kinds: Mapped[list[str]] = mapped_column(JSON, default=list)
    """What it applies to: ``pointwise``, ``reduction``, ``matmul``, ``conv``, ``attention``, ``other``."""
    description: Mapped[str] = mapped_column(Text, default="")
    bottleneck: Mapped[str | None] = mapped_column(String(16))
    """What bound the reference before: ``memory``, ``compute``, ``latency``, ``launch``; None if unknown."""

    strategy: Mapped[str] = mapped_column(String(80), index=True)
    """The playbook strategy (``fused_pointwise``, ``torch_compile``, ...) or ``custom:<name>``."""
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Tuned parameters (``BLOCK_SIZE``, ``num_warps``, ...); for seeds, lists of values to try."""

    clock: Mapped[str | None] = mapped_column(String(16))
    """``cuda-event`` or ``cpu-wall`` (CPU timings: never GPU speedups); None for seeds."""
    before_ms: Mapped[float | None] = mapped_column(Float)
    after_ms: Mapped[float | None] = mapped_column(Float)
    speedup_eager: Mapped[float | None] = mapped_column(Float)
    speedup_compile: Mapped[float | None] = mapped_column(Float)
    sol_fraction: Mapped[float | None] = mapped_column(Float)
    """Fraction of the hardware's speed of light the candidate reached; None when not measured."""
    candidate_source: Mapped[str | None] = mapped_column(Text)
    source_kind: Mapped[str | None] = mapped_column(String(16))
    """``kernel`` (own), ``library`` or ``compiler``, as the verifier's trace classified it."""
    ncu_summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    job_id: Mapped[str | None] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(128), index=True)
    visibility: Mapped[str] = mapped_column(String(8), default="private")
    team: Mapped[str | None] = mapped_column(String(128), index=True)
    scope: Mapped[str] = mapped_column(String(140))
    confirmations: Mapped[int] = mapped_column(Integer, default=1)
    """How many jobs found this win (the best of them is what the row shows)."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Confirmation(Base):
    """One job that found a win; a job confirms a win once, however often its finalize runs."""

    __tablename__ = "kb_confirmations"
    __table_args__ = (UniqueConstraint("win_id", "job_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    win_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("kb_wins.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(String(80))
    speedup_eager: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Meta(Base):
    """Small facts about the knowledge base itself (the fingerprint of the loaded seed files)."""

    __tablename__ = "kb_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


@dataclass(frozen=True)
class Reader:
    """Who reads: a user and, optionally, their team. Every query of the knowledge base takes one."""

    owner: str
    team: str | None = None

    def __post_init__(self) -> None:
        if not self.owner.strip():
            raise ValueError("a reader needs an owner name")


def visible_to(reader: Reader) -> ColumnElement[bool]:
    """The WHERE clause of what ``reader`` may see: public, their team's, and everything they own."""
    clauses = [Win.visibility == "public", Win.owner == reader.owner]
    if reader.team:
        clauses.append(and_(Win.visibility == "team", Win.team == reader.team))
    return or_(*clauses)


def scope_of(owner: str, visibility: str, team: str | None) -> str:
    """The deduplication scope of a record: one owner's, one team's, or everyone's."""
    if visibility == "public":
        return "public"
    if visibility == "team":
        if not team:
            raise ValueError("visibility 'team' needs a team name")
        return f"team:{team}"
    if visibility == "private":
        return f"user:{owner}"
    raise ValueError(f"unknown visibility {visibility!r} (choose {', '.join(VISIBILITIES)})")


__all__ = ["SOURCES", "VISIBILITIES", "Confirmation", "Meta", "Reader", "Win", "scope_of", "visible_to"]
