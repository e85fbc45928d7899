"""Seed knowledge: curated strategies per architecture, written by us, loaded on first use.

``knowledge_base/seed/<arch>.json`` (validated by :class:`~kernelcrew.knowledge_base.schemas.SeedFile`)
lists, per architecture, the strategies worth trying and for what: applicability (pattern kinds),
a strategy name the playbook or the planner knows, recommended parameters (lists of values to try)
and the advice in a few sentences. Seeds are stored with ``source = "seed"``, public, without any
timing: they are advice, not measured wins. :func:`ensure_seeds` loads them idempotently; a
changed seed file (a new kernelcrew version) updates the stored seeds, and a removed entry goes.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from kernelcrew.knowledge_base.db import lock
from kernelcrew.knowledge_base.models import Meta, Win
from kernelcrew.knowledge_base.schemas import SeedFile, describe_errors

SEED_DIR = Path(__file__).parent / "seed"
SEED_OWNER = "kernelcrew"
FINGERPRINT_KEY = "seed_fingerprint"
SEED_LOCK_KEY = 0x6B63_7364  # "kcsd"


class SeedError(ValueError):
    """A seed file shipped with kernelcrew is invalid (a packaging bug, named with its file)."""


@cache
def seed_files(directory: Path = SEED_DIR) -> tuple[SeedFile, ...]:
    """Every seed file, validated; each file is named after its architecture (``sm_90.json``)."""
    files = []
    for path in sorted(directory.glob("*.json")):
        try:
            seed = SeedFile.model_validate_json(path.read_bytes())
        except ValidationError as exc:
            raise SeedError(f"{path.name}: {describe_errors(exc)}") from None
        if seed.arch != path.stem:
            raise SeedError(f"{path.name}: declares arch {seed.arch!r}; the file must be named after it")
        files.append(seed)
    if not files:
        raise SeedError(f"no seed files in {directory}")
    return tuple(files)


def fingerprint(files: tuple[SeedFile, ...]) -> str:
    """A hash of the seeds' content: loading is skipped while it matches the stored one."""
    blob = json.dumps([f.model_dump(mode="json") for f in files], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def ensure_seeds(session: Session, directory: Path = SEED_DIR) -> int:
    """Load or refresh the seed records in the caller's transaction; how many rows were written."""
    files = seed_files(directory)
    wanted = fingerprint(files)
    meta = session.get(Meta, FINGERPRINT_KEY)
    if meta is not None and meta.value == wanted:
        return 0
    lock(session, SEED_LOCK_KEY)  # two processes on a fresh PostgreSQL database: one loads, one waits
    meta = session.get(Meta, FINGERPRINT_KEY, populate_existing=True)
    if meta is not None and meta.value == wanted:
        return 0
    stored = {w.seed_id: w for w in session.scalars(select(Win).where(Win.source == "seed"))}
    written = 0
    keep = set()
    for seed in files:
        for entry in seed.entries:
            seed_id = f"{seed.arch}/{entry.name}"
            keep.add(seed_id)
            values = {
                "arch": seed.arch,
                "strategy": entry.strategy,
                "pattern_kinds": list(entry.applies_to),
                "tags": list(entry.tags),
                "params": dict(entry.params),
                "description": entry.advice,
            }
            row = stored.get(seed_id)
            if row is None:
                session.add(
                    Win(
                        source="seed",
                        seed_id=seed_id,
                        gpu_model=None,
                        versions={},
                        signature="",
                        signature_key="",
                        owner=SEED_OWNER,
                        visibility="public",
                        team=None,
                        scope="public",
                        confirmations=1,
                        **values,
                    )
                )
                written += 1
            elif any(getattr(row, k) != v for k, v in values.items()):
                for k, v in values.items():
                    setattr(row, k, v)
                written += 1
    for seed_id, row in stored.items():
        if seed_id not in keep:
            session.delete(row)
            written += 1
    if meta is None:
        session.add(Meta(key=FINGERPRINT_KEY, value=wanted))
    else:
        meta.value = wanted
    session.flush()
    return written


__all__ = ["SEED_DIR", "SeedError", "ensure_seeds", "fingerprint", "seed_files"]
