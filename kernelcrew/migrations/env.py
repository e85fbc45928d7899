"""Alembic environment of kernelcrew's database, run by :func:`kernelcrew.knowledge_base.db.upgrade`.

The caller hands its connection (already in a transaction, holding the migration lock) through
``config.attributes["connection"]``; without one, the configured database
(``KERNELCREW_DATABASE_URL``) is opened. ``target_metadata`` is every table kernelcrew defines:
the knowledge base's models and the service's, imported here (this environment sits above both, and
nothing imports it), so the test that compares the models with the migration head covers them.
"""

from __future__ import annotations

from alembic import context

from kernelcrew.config import get_settings, resolve_database_url
from kernelcrew.knowledge_base import models  # noqa: F401  (registers the tables on Base.metadata)
from kernelcrew.knowledge_base.db import Base, make_engine
from kernelcrew.service import jobs  # noqa: F401  (the service's tables)

target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """Print the SQL instead of running it (``alembic upgrade head --sql``)."""
    context.configure(
        url=resolve_database_url(get_settings()), target_metadata=target_metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(resolve_database_url(get_settings()))
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
