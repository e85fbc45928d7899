"""The service's tables (users, API tokens, jobs, job events, job messages) and their operations.

They live in the service package, below the API, the web UI and the orchestrator: the orchestrator
leases and finishes jobs and writes their events without importing FastAPI, and the API only adds
HTTP on top. They share the knowledge base's declarative ``Base`` and the one Alembic history.

Tokens are stored as a SHA-256 hash and a short prefix (to name them); the token itself is shown
once. Leasing: one queued job, or a running job whose lease expired (its orchestrator died), is
taken in one transaction -- ``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL; on SQLite the
transaction already holds the write lock (``BEGIN IMMEDIATE``), so the select-then-update is atomic.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import uuid
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    and_,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from kernelcrew.knowledge_base.db import Base, transaction
from kernelcrew.records import JobResult
from kernelcrew.service.summary import summarize

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
ENDED = ("succeeded", "failed", "cancelled")
MODES = ("optimize", "verify")
SCOPES = ("submit", "read", "admin")
TOKEN_PREFIX = "kc_"


def now() -> datetime:
    return datetime.now(UTC)


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    team: Mapped[str | None] = mapped_column(String(128), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSON)
    webhook_secret: Mapped[str] = mapped_column(String(64))
    """Signs this token's webhooks (HMAC-SHA256); not a credential for the API."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Job(Base):
    __tablename__ = "jobs"
    # a user's job list, newest first, read from the index without sorting
    __table_args__ = (Index("ix_jobs_owner_id_created_at", "owner_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    token_id: Mapped[int | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="SET NULL"), nullable=True
    )
    status: Mapped[str] = mapped_column(String(16), index=True)
    mode: Mapped[str] = mapped_column(String(16))
    task_source: Mapped[str] = mapped_column(Text)
    candidate_source: Mapped[str | None] = mapped_column(Text, nullable=True)
    options: Mapped[dict[str, Any]] = mapped_column(JSON)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    event_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """The sequence number of the job's last event (0: none yet); see :func:`add_event`."""
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """A :class:`~kernelcrew.records.JobResult`'s JSON (read it with :meth:`outcome`)."""
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    def outcome(self) -> JobResult | None:
        """The stored result as a record (rows of older versions included), or None before it ends."""
        return None if self.result is None else JobResult.model_validate(self.result)

    def to_dict(self) -> dict[str, Any]:
        def iso(d: datetime | None) -> str | None:
            return None if d is None else d.isoformat()

        return {
            "id": self.id,
            "status": self.status,
            "mode": self.mode,
            "options": self.options,
            "attempts": self.attempts,
            "cancel_requested": self.cancel_requested,
            "error": self.error,
            "created_at": iso(self.created_at),
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            **self.summary(),
        }

    def summary(self) -> dict[str, Any]:
        """:func:`~kernelcrew.service.summary.summarize`'s fields, cached per job until its status or
        result changes (a job list would otherwise parse every task and result on every read)."""
        key = summary_key(self.id, self.status, self.finished_at, self.updated_at)
        hit = cached_summary(key)
        if hit is not None:
            return hit
        made = summarize(self.task_source, self.outcome(), self.status).to_dict()
        cache_summary(key, made)
        return dict(made)


#: Job summaries kept per process (a few KB each).
SUMMARY_CACHE_SIZE = 4096
_SUMMARIES: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
_SUMMARY_LOCK = threading.Lock()


def summary_key(job_id: str, status: str, finished_at: Any, updated_at: Any) -> tuple[Any, ...]:
    """What a job's summary depends on, from columns a list can read without the sources: the
    result is written only with a new status and end time (:func:`finish_job`), the task never."""
    return (job_id, status, finished_at, updated_at)


def cached_summary(key: tuple[Any, ...]) -> dict[str, Any] | None:
    """A copy of the summary cached under ``key`` (see :func:`summary_key`), or None."""
    with _SUMMARY_LOCK:
        hit = _SUMMARIES.get(key)
        if hit is None:
            return None
        _SUMMARIES.move_to_end(key)
        return dict(hit)


def cache_summary(key: tuple[Any, ...], summary: dict[str, Any]) -> None:
    with _SUMMARY_LOCK:
        _SUMMARIES[key] = summary
        while len(_SUMMARIES) > SUMMARY_CACHE_SIZE:
            _SUMMARIES.popitem(last=False)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)


class JobMessage(Base):
    __tablename__ = "job_messages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=now)
    taken_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


# ------------------------------------------------------------------------------------------------
# Users and tokens
# ------------------------------------------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, user: str, scopes: list[str]) -> tuple[ApiToken, str]:
    """A new token for ``user`` (created if new); returns the row and the token, shown only once."""
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"scopes must be among {', '.join(SCOPES)}; got {', '.join(scopes) or 'none'}")
    row = session.scalar(select(User).where(User.name == user))
    if row is None:
        row = User(name=user)
        session.add(row)
        session.flush()
    prefix = secrets.token_hex(4)  # names the token in lists and `token revoke`; no "_" in it
    token = f"{TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
    tok = ApiToken(
        user_id=row.id,
        prefix=prefix,
        token_hash=hash_token(token),
        scopes=list(dict.fromkeys(scopes)),
        webhook_secret=secrets.token_hex(32),
    )
    session.add(tok)
    session.flush()
    return tok, token


def revoke_token(session: Session, prefix_or_id: str) -> ApiToken | None:
    key = prefix_or_id.removeprefix(TOKEN_PREFIX).split("_", 1)[0]
    cond = ApiToken.prefix == key
    if key.isdigit():
        cond = or_(cond, ApiToken.id == int(key))
    tok = session.scalar(select(ApiToken).where(cond))
    if tok is not None and tok.revoked_at is None:
        tok.revoked_at = now()
    return tok


def list_tokens(session: Session, user: str | None = None) -> list[tuple[ApiToken, str]]:
    """Every token (or ``user``'s) with its user's name, oldest first; the tokens themselves are
    not stored, only their hashes, so a list shows prefixes."""
    query = select(ApiToken, User.name).join(User, User.id == ApiToken.user_id).order_by(ApiToken.id)
    if user is not None:
        query = query.where(User.name == user)
    return [(tok, name) for tok, name in session.execute(query)]


def authenticate(session: Session, token: str) -> tuple[ApiToken, User] | None:
    """The live token and its user, or None (unknown or revoked)."""
    found = session.execute(
        select(ApiToken, User)
        .join(User, User.id == ApiToken.user_id)
        .where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None))
    ).first()  # one query: every API request runs it
    return None if found is None else (found[0], found[1])


# ------------------------------------------------------------------------------------------------
# Jobs
# ------------------------------------------------------------------------------------------------


def new_job_id() -> str:
    return uuid.uuid4().hex


def add_event(session: Session, job_id: str, kind: str, data: dict[str, Any]) -> int:
    """Append one event to the job's stream; returns its sequence number (1, 2, ...).

    The number comes from the job's ``event_seq`` counter, incremented with ``UPDATE ...
    RETURNING`` in the caller's transaction: the update locks the job's row until that transaction
    ends (PostgreSQL; SQLite holds the database's write lock), so concurrent writers to one job
    queue there and get consecutive numbers, and a rolled-back transaction takes its number back.
    Events of one job therefore also become visible in their order, which the streams rely on.
    """
    seq = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(event_seq=Job.event_seq + 1)
        .returning(Job.event_seq)
        .execution_options(synchronize_session=False)
    ).scalar_one()
    loaded = session.identity_map.get(identity_key(Job, job_id))
    if loaded is not None:  # keep a loaded row's counter true without reading it again
        set_committed_value(loaded, "event_seq", seq)
    session.add(JobEvent(job_id=job_id, seq=seq, type=kind, data=data))
    session.flush()
    return seq


def lease_job(engine: Engine, owner: str, lease_s: float, max_attempts: int = 5) -> Job | None:
    """Take one queued job, or a running one whose lease expired; None when there is none.

    A job whose orchestrators died ``max_attempts`` times fails instead of being taken again: a
    job that kills its orchestrator is never looped.
    """
    t = now()
    with transaction(engine) as s:
        cond = or_(Job.status == "queued", and_(Job.status == "running", Job.lease_expires_at < t))
        while True:
            job = s.scalar(
                select(Job).where(cond).order_by(Job.created_at).limit(1).with_for_update(skip_locked=True)
            )
            if job is None:
                return None
            if job.status != "running" or job.attempts < max_attempts:
                break
            error = f"its orchestrator was lost {job.attempts} times; not retried again"
            job.status, job.error, job.finished_at, job.updated_at = "failed", error, t, t
            job.lease_owner = job.lease_expires_at = None
            add_event(s, job.id, "status", {"status": "failed", "error": error})
            s.flush()
        resumed = job.status == "running"
        job.status = "running"
        job.lease_owner = owner
        job.lease_expires_at = t + timedelta(seconds=lease_s)
        job.attempts += 1
        job.started_at = job.started_at or t
        job.updated_at = t
        add_event(s, job.id, "status", {"status": "running", "orchestrator": owner, "resumed": resumed})
        s.flush()
        return job


def renew_lease(engine: Engine, job_id: str, owner: str, lease_s: float) -> bool:
    """Extend our lease; False when it is no longer ours (expired and taken by another)."""
    with transaction(engine) as s:
        res = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.status == "running")
            .values(lease_expires_at=now() + timedelta(seconds=lease_s))
        )
        return res.rowcount == 1


def finish_job(
    engine: Engine,
    job_id: str,
    owner: str,
    status: str,
    *,
    result: JobResult | None = None,
    error: str | None = None,
) -> bool:
    """End a job we hold (False: the lease was lost, another orchestrator owns it now), storing its
    result's JSON."""
    t = now()
    with transaction(engine) as s:
        res = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == owner, Job.status == "running")
            .values(
                status=status,
                result=None if result is None else result.model_dump(mode="json"),
                error=error,
                lease_owner=None,
                lease_expires_at=None,
                finished_at=t,
                updated_at=t,
            )
        )
        if res.rowcount != 1:
            return False
        add_event(s, job_id, "status", {"status": status, "error": error})
        return True


def take_messages(engine: Engine, job_id: str) -> list[str]:
    """The job's chat messages not yet given to the crew, marked as taken."""
    with transaction(engine) as s:
        rows = s.scalars(
            select(JobMessage)
            .where(JobMessage.job_id == job_id, JobMessage.taken_at.is_(None))
            .order_by(JobMessage.id)
        ).all()
        for row in rows:
            row.taken_at = now()
        return [r.text for r in rows]


def cancel_requested(engine: Engine, job_id: str) -> bool:
    with transaction(engine) as s:
        return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


__all__ = [
    "ENDED",
    "MODES",
    "SCOPES",
    "STATUSES",
    "ApiToken",
    "Job",
    "JobEvent",
    "JobMessage",
    "User",
    "add_event",
    "authenticate",
    "create_token",
    "finish_job",
    "lease_job",
    "renew_lease",
    "revoke_token",
    "take_messages",
]
