"""The handle the crew and the CLI hold: one database and the reader it acts for.

``KnowledgeBase.open(settings)`` migrates the configured database on first use and loads the seed
knowledge; each method then runs in its own short transaction, so a handle can live as long as a
run (or a worker process) without holding locks. The service builds one per request with the
authenticated user as the reader.
"""

from __future__ import annotations

import getpass
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from kernelcrew.config import Settings, get_settings
from kernelcrew.knowledge_base import retrieval, store
from kernelcrew.knowledge_base.db import DatabaseError, get_engine, safe_url, transaction
from kernelcrew.knowledge_base.embeddings import Embedder
from kernelcrew.knowledge_base.models import Reader, scope_of
from kernelcrew.knowledge_base.patterns import TaskSignature
from kernelcrew.knowledge_base.schemas import WinIn
from kernelcrew.knowledge_base.seeds import ensure_seeds


def local_owner(settings: Settings) -> str:
    """Who the CLI acts as: ``KERNELCREW_KB_OWNER``, else the OS user name."""
    if settings.kb_owner.strip():
        return settings.kb_owner.strip()
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (some containers)
        return "local"


class KnowledgeBase:
    """Verified wins and seeds, read and written as ``reader``; new wins get ``visibility``."""

    def __init__(
        self, engine: Engine, reader: Reader, *, visibility: str = "private", embedder: Embedder | None = None
    ) -> None:
        scope_of(reader.owner, visibility, reader.team)  # a team visibility needs the reader's team
        self.engine = engine
        self.reader = reader
        self.visibility = visibility
        self.embedder = embedder

    @classmethod
    def open(
        cls,
        settings: Settings | None = None,
        *,
        owner: str | None = None,
        team: str | None = None,
        visibility: str = "private",
    ) -> KnowledgeBase:
        """The configured database (migrated, seeds loaded) for ``owner`` (default: :func:`local_owner`)."""
        s = settings or get_settings()
        reader = Reader(owner or local_owner(s), team if team is not None else (s.kb_team.strip() or None))
        kb = cls(get_engine(s), reader, visibility=visibility, embedder=Embedder.from_settings(s))
        with kb._session() as session:
            ensure_seeds(session)
        return kb

    @property
    def where(self) -> str:
        """The database, for messages (password masked)."""
        return safe_url(str(self.engine.url))

    @contextmanager
    def _session(self) -> Iterator[Session]:
        """One transaction; a lost server or a database locked for too long is a DatabaseError."""
        try:
            with transaction(self.engine) as session:
                yield session
        except OperationalError as exc:
            raise DatabaseError(f"{self.where}: {exc.orig or exc}") from exc

    def hits_for_task(
        self, task: Mapping[str, Any] | TaskSignature | str, gpu_model: str | None, arch: str, *, k: int = 5
    ) -> list[dict[str, Any]]:
        """:func:`kernelcrew.knowledge_base.retrieval.hits_for_task` as this handle's reader."""
        with self._session() as session:
            return retrieval.hits_for_task(
                session, task, gpu_model, arch, self.reader, k=k, embedder=self.embedder
            )

    def record_win(self, win: WinIn | Mapping[str, Any], *, verdict: Mapping[str, Any]) -> store.AddResult:
        """Store a verified win owned by this reader (:func:`kernelcrew.knowledge_base.store.add_win`)."""
        with self._session() as session:
            return store.add_win(
                session,
                win,
                verdict=verdict,
                owner=self.reader.owner,
                visibility=self.visibility,
                team=self.reader.team,
            )

    def search(
        self, query: str, *, arch: str | None = None, gpu_model: str | None = None, k: int = 10
    ) -> list[dict[str, Any]]:
        with self._session() as session:
            return retrieval.search(
                session, query, self.reader, arch=arch, gpu_model=gpu_model, k=k, embedder=self.embedder
            )

    def get(self, win_id: uuid.UUID | str) -> dict[str, Any] | None:
        """One record with its source, or None when it does not exist or this reader may not see it."""
        with self._session() as session:
            win = store.get_win(session, win_id, self.reader)
            return None if win is None else store.win_to_dict(win)

    def export(self) -> dict[str, Any]:
        with self._session() as session:
            return store.export_wins(session, self.reader)

    def import_file(
        self, raw: bytes | str, *, check_source: store.SourceCheck, visibility: str = "private"
    ) -> dict[str, int]:
        """Import an export file in one transaction: all of it, or (on any error) none of it
        (:func:`kernelcrew.knowledge_base.store.import_wins`)."""
        with self._session() as session:
            return store.import_wins(
                session, raw, self.reader, check_source=check_source, visibility=visibility
            )


__all__ = ["KnowledgeBase", "local_owner"]
