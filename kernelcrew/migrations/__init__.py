"""Alembic migrations of kernelcrew's database (one history: knowledge base, then service tables)."""
