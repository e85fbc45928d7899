"""Knowledge base: verified wins and curated seeds, the jobs that confirmed them, and its meta facts.

Revision ID: 0001_knowledge_base
Revises:
Create Date: 2026-05-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_knowledge_base"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kb_wins",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("seed_id", sa.String(120), nullable=True),
        sa.Column("gpu_model", sa.String(64), nullable=True),
        sa.Column("arch", sa.String(16), nullable=False),
        sa.Column("versions", sa.JSON(), nullable=False),
        sa.Column("signature", sa.Text(), nullable=False),
        sa.Column("signature_key", sa.String(64), nullable=False),
        sa.Column("pattern_kinds", sa.JSON(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("bottleneck", sa.String(16), nullable=True),
        sa.Column("strategy", sa.String(80), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("clock", sa.String(16), nullable=True),
        sa.Column("before_ms", sa.Float(), nullable=True),
        sa.Column("after_ms", sa.Float(), nullable=True),
        sa.Column("speedup_eager", sa.Float(), nullable=True),
        sa.Column("speedup_compile", sa.Float(), nullable=True),
        sa.Column("sol_fraction", sa.Float(), nullable=True),
        sa.Column("candidate_source", sa.Text(), nullable=True),
        sa.Column("source_kind", sa.String(16), nullable=True),
        sa.Column("ncu_summary", sa.JSON(), nullable=True),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("visibility", sa.String(8), nullable=False),
        sa.Column("team", sa.String(128), nullable=True),
        sa.Column("scope", sa.String(140), nullable=False),
        sa.Column("confirmations", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_kb_wins"),
        sa.UniqueConstraint("seed_id", name="uq_kb_wins_seed_id"),
        sa.UniqueConstraint(
            "gpu_model",
            "signature_key",
            "strategy",
            "scope",
            name="uq_kb_wins_gpu_model_signature_key_strategy_scope",
        ),
        sa.CheckConstraint("visibility IN ('private', 'team', 'public')", name="ck_kb_wins_visibility"),
        sa.CheckConstraint("source IN ('verified', 'seed')", name="ck_kb_wins_source"),
        sa.CheckConstraint("visibility <> 'team' OR team IS NOT NULL", name="ck_kb_wins_team_named"),
        sa.CheckConstraint(
            "source = 'seed' OR (gpu_model IS NOT NULL AND before_ms > 0 AND after_ms > 0"
            " AND candidate_source IS NOT NULL)",
            name="ck_kb_wins_verified_evidence",
        ),
        sa.CheckConstraint("confirmations >= 1", name="ck_kb_wins_confirmations"),
    )
    for column in ("gpu_model", "arch", "signature_key", "strategy", "owner", "team"):
        op.create_index(f"ix_kb_wins_{column}", "kb_wins", [column])

    op.create_table(
        "kb_confirmations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("win_id", sa.Uuid(), nullable=False),
        sa.Column("job_id", sa.String(80), nullable=False),
        sa.Column("speedup_eager", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_kb_confirmations"),
        sa.ForeignKeyConstraint(
            ["win_id"], ["kb_wins.id"], name="fk_kb_confirmations_win_id_kb_wins", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("win_id", "job_id", name="uq_kb_confirmations_win_id_job_id"),
    )
    op.create_index("ix_kb_confirmations_win_id", "kb_confirmations", ["win_id"])

    op.create_table(
        "kb_meta",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_kb_meta"),
    )


def downgrade() -> None:
    op.drop_table("kb_meta")
    op.drop_index("ix_kb_confirmations_win_id", table_name="kb_confirmations")
    op.drop_table("kb_confirmations")
    for column in ("gpu_model", "arch", "signature_key", "strategy", "owner", "team"):
        op.drop_index(f"ix_kb_wins_{column}", table_name="kb_wins")
    op.drop_table("kb_wins")
