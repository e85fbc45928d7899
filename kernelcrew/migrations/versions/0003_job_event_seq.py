"""Jobs count their events (``jobs.event_seq``), so concurrent writers get distinct sequence numbers;
an index on ``(owner_id, created_at)`` serves a user's job list, newest first.

A plain ``ALTER TABLE ... ADD COLUMN`` with a server default on every database, SQLite included:
no batch mode, which would copy ``jobs`` into a new table and drop the old one, and with foreign
keys on, that drop deletes the rows that cascade from it (events, messages). The counter is then
set to each job's highest event number.

Revision ID: 0003_job_event_seq
Revises: 0002_service
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_job_event_seq"
down_revision = "0002_service"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("event_seq", sa.Integer(), nullable=False, server_default="0"))
    op.execute(
        "UPDATE jobs SET event_seq = COALESCE("
        "(SELECT MAX(job_events.seq) FROM job_events WHERE job_events.job_id = jobs.id), 0)"
    )
    op.create_index("ix_jobs_owner_id_created_at", "jobs", ["owner_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_id_created_at", table_name="jobs")
    op.drop_column("jobs", "event_seq")
