"""A user's job list with its filters, shared by the API's ``GET /jobs`` and the web job list.

Status and mode are columns, filtered by the database. The verdict, the answer's kind and the
task's name are read from each job's stored result and task source (:mod:`kernelcrew.service.summary`),
so those filters run here, over every job of the owner, newest first: a first query reads only the
columns a summary depends on (:func:`~kernelcrew.service.jobs.summary_key`), the summaries missing from
the per-process cache are computed from their rows in batches, and only the page's rows are loaded in
full. A filter therefore costs one light query over the owner's jobs plus the summaries not cached yet;
storing the summary in columns would make it an index lookup, at the price of a migration that
recomputes every stored job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kernelcrew.records import JobResult
from kernelcrew.service import jobs
from kernelcrew.service.summary import summarize

#: Jobs whose summaries are computed per query when they are not cached.
BATCH = 200
#: The longest task-name substring a filter takes (a task name is at most 80 characters).
MAX_QUERY = 200


@dataclass(frozen=True)
class JobFilter:
    """Which of the owner's jobs a list shows; ``None`` (or an empty ``q``) does not filter."""

    status: str | None = None
    mode: str | None = None
    """``optimize`` or ``verify`` (the job's kind)."""
    verdict: str | None = None
    kind: str | None = None
    """The answer's kind: kernel, hybrid, library, compiler or reference."""
    q: str | None = None
    """A substring of the task's name, any case."""

    @property
    def by_summary(self) -> bool:
        """Whether a filter reads the jobs' summaries (not only their columns)."""
        return bool(self.verdict or self.kind or self.q)

    def matches(self, summary: dict[str, Any]) -> bool:
        if self.verdict and summary["verdict"] != self.verdict:
            return False
        if self.kind and summary["answer_kind"] != self.kind:
            return False
        return not self.q or self.q.casefold() in summary["task_name"].casefold()


def find_jobs(
    session: Session, owner_id: int, where: JobFilter, limit: int, offset: int
) -> tuple[list[jobs.Job], int]:
    """One page of the owner's jobs that pass ``where``, newest first, and how many pass in all."""
    query = select(jobs.Job).where(jobs.Job.owner_id == owner_id)
    if where.status:
        query = query.where(jobs.Job.status == where.status)
    if where.mode:
        query = query.where(jobs.Job.mode == where.mode)
    newest = (jobs.Job.created_at.desc(), jobs.Job.id.desc())
    if not where.by_summary:
        total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
        return list(session.scalars(query.order_by(*newest).limit(limit).offset(offset))), total

    keys = query.with_only_columns(
        jobs.Job.id, jobs.Job.status, jobs.Job.finished_at, jobs.Job.updated_at
    ).order_by(*newest)
    matched = [
        job_id
        for job_id, summary in _summaries(session, session.execute(keys).all())
        if where.matches(summary)
    ]
    page = matched[offset : offset + limit]
    rows = {j.id: j for j in session.scalars(select(jobs.Job).where(jobs.Job.id.in_(page)))} if page else {}
    return [rows[i] for i in page if i in rows], len(matched)


def _summaries(session: Session, keys: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each listed job's id and summary, in the given order: from the cache, else computed from the
    job's task and result, read for the missing ones only."""
    out: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    for job_id, status, finished_at, updated_at in keys:
        hit = jobs.cached_summary(jobs.summary_key(job_id, status, finished_at, updated_at))
        if hit is None:
            missing.append(job_id)
        else:
            out[job_id] = hit
    job = jobs.Job
    for start in range(0, len(missing), BATCH):
        rows = session.execute(
            select(job.id, job.status, job.finished_at, job.updated_at, job.task_source, job.result).where(
                job.id.in_(missing[start : start + BATCH])
            )
        )
        for job_id, status, finished_at, updated_at, task_source, result in rows:
            # the key from this row, not the first query's: the job may have ended in between
            outcome = None if result is None else JobResult.model_validate(result)
            made = summarize(task_source, outcome, status).to_dict()
            jobs.cache_summary(jobs.summary_key(job_id, status, finished_at, updated_at), made)
            out[job_id] = dict(made)
    return [(row[0], out[row[0]]) for row in keys if row[0] in out]


__all__ = ["MAX_QUERY", "JobFilter", "find_jobs"]
