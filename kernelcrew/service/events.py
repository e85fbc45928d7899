"""A job's events as a stream of Server-Sent Events, read from the database (REST API and web UI)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select

from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs


def job_event_stream(engine: Any, job_id: str, start: int) -> Iterator[str]:
    """The job's events after ``start`` as Server-Sent Events; ends once the job has ended."""
    last, idle = start, 0.0
    while True:
        with transaction(engine) as session:
            status = session.scalar(select(jobs.Job.status).where(jobs.Job.id == job_id))
            rows = session.scalars(
                select(jobs.JobEvent)
                .where(jobs.JobEvent.job_id == job_id, jobs.JobEvent.seq > last)
                .order_by(jobs.JobEvent.seq)
                .limit(200)
            ).all()
            batch = [(r.seq, r.type, r.data) for r in rows]
        for seq, kind, data in batch:
            yield f"id: {seq}\nevent: {kind}\ndata: {json.dumps(data)}\n\n"
            last = seq
        if not batch:
            if status in jobs.ENDED:
                return
            time.sleep(0.5)
            idle += 0.5
            if idle >= 15:
                idle = 0.0
                yield ": keep-alive\n\n"


__all__ = ["job_event_stream"]
