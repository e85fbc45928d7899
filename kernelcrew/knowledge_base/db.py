"""The database every stored part of kernelcrew shares: declarative Base, engines, sessions, migrations.

One database holds the knowledge base and the service's tables (users, tokens, jobs, events), in
one Alembic history (``kernelcrew/migrations``, written by hand). The URL
comes from ``KERNELCREW_DATABASE_URL`` (:func:`kernelcrew.config.resolve_database_url`): empty means
a SQLite file in the data directory, so the CLI needs nothing running; PostgreSQL goes through
psycopg 3.

SQLite is opened in WAL mode with a busy timeout and foreign keys on, and SQLAlchemy (not the
``sqlite3`` driver's legacy mode) emits ``BEGIN IMMEDIATE`` for every transaction: reads, DDL and
savepoints are then really transactional, and two writers queue on the busy timeout instead of
failing when one upgrades a read to a write. :func:`upgrade` runs ``alembic upgrade head`` inside
one such transaction (on PostgreSQL, under a transaction-scoped advisory lock), so two processes
that start on a fresh database at once both end at head, one after the other.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, MetaData, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from kernelcrew.config import Settings, get_settings, resolve_database_url

#: The one Alembic history (``kernelcrew/migrations``): beside the packages, since its environment
#: imports every module that defines tables (the service's too); loaded by path, never imported here.
MIGRATIONS = Path(__file__).parents[1] / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Key of the PostgreSQL advisory lock that serializes migrations (any fixed 64-bit number).
MIGRATION_LOCK_KEY = 0x6B63_6B62  # "kckb"

#: Constraint names Alembic can rely on, the same on SQLite and PostgreSQL.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """The declarative base of every kernelcrew table (knowledge base now, service tables later)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class DatabaseError(RuntimeError):
    """The database cannot be opened or migrated; the message names it without its password."""


def safe_url(url: str) -> str:
    """``url`` with its password masked, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # an unparsable URL: show its scheme only
        return url.split("://", 1)[0] + "://..."


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """A new engine for ``url`` (already resolved), with kernelcrew's SQLite settings when it is SQLite."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise DatabaseError(f"not a database URL: {safe_url(url)} ({exc})") from exc
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() not in ("psycopg", ""):
        raise DatabaseError(f"PostgreSQL is used through psycopg 3 (postgresql+psycopg://): {safe_url(url)}")
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        if parsed.database and parsed.database != ":memory:":
            _enable_wal(cursor)
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _enable_wal(cursor: Any) -> None:
    """Switch the database file to WAL mode, waiting out other connections doing the same.

    The switch needs the exclusive lock. When two connections to a fresh file try it at once, each
    holds a shared lock and wants the other's gone, and SQLite answers one of them "database is
    locked" at once, without calling the busy handler (it would deadlock). Retry that until the
    busy timeout: the other connection finishes its switch and this one finds the file in WAL.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def alembic_config(connection: Any = None) -> Any:
    """The Alembic configuration of kernelcrew's migrations (no alembic.ini: everything is here)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("path_separator", "os")
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database to ``revision`` in one transaction; safe when processes race.

    SQLite: ``BEGIN IMMEDIATE`` takes the write lock before Alembic reads the version table, so a
    second process waits (busy timeout) and then finds the database at head. PostgreSQL: a
    transaction-scoped advisory lock does the same (DDL is transactional there too).
    """
    from alembic import command
    from alembic.util.exc import CommandError

    where = safe_url(str(engine.url))
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            command.upgrade(alembic_config(connection), revision)
    except SQLAlchemyError as exc:
        raise DatabaseError(f"cannot migrate the database {where}: {exc}") from exc
    except CommandError as exc:  # e.g. a revision this version does not know: a newer kernelcrew migrated it
        raise DatabaseError(
            f"cannot migrate the database {where}: {exc} (was it migrated by a newer kernelcrew?)"
        ) from exc


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None when it was never migrated)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    """The head of the migration history shipped with this version of kernelcrew."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise DatabaseError("the migration history is empty")
    return head


def lock(session: Session, key: int) -> None:
    """Serialize a critical section across processes until the transaction ends.

    PostgreSQL: a transaction-scoped advisory lock on ``key``. SQLite: nothing to do, the
    transaction already holds the database's write lock (``BEGIN IMMEDIATE``).
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


_migrated: set[str] = set()
_migrate_lock = threading.Lock()


@lru_cache(maxsize=8)
def _engine_for(url: str) -> Engine:
    return make_engine(url)


def get_engine(settings: Settings | None = None, *, migrate: bool = True) -> Engine:
    """The process-wide engine of the configured database, migrated to head on first use."""
    url = resolve_database_url(settings or get_settings())
    engine = _engine_for(url)
    if migrate and url not in _migrated:
        with _migrate_lock:
            if url not in _migrated:
                upgrade(engine)
                _migrated.add(url)
    return engine


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to ``engine``; objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(engine: Engine) -> Iterator[Session]:
    """One session in one transaction: committed on success, rolled back on any error."""
    # a plain Session: a sessionmaker per call would build a new Session subclass every time
    with Session(engine, expire_on_commit=False) as session, session.begin():
        yield session


__all__ = [
    "Base",
    "DatabaseError",
    "get_engine",
    "head_revision",
    "lock",
    "make_engine",
    "safe_url",
    "session_factory",
    "transaction",
    "upgrade",
]
