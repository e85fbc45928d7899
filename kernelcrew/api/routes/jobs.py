"""Jobs: submit, list, read, cancel, their result, their events (SSE) and chat messages."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernelcrew.api.deps import EngineDep, Reader, SessionDep, SettingsDep, Submitter, own_job
from kernelcrew.api.inputs import shorten
from kernelcrew.api.schemas import (
    AUTH_ERRORS,
    JobCreate,
    JobMode,
    JobPublic,
    JobResultPublic,
    JobsPublic,
    JobStatus,
    MessageCreate,
    errors,
)
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs
from kernelcrew.service.events import job_event_stream
from kernelcrew.service.listing import MAX_QUERY, JobFilter, find_jobs
from kernelcrew.service.submissions import (
    JobOptions,
    add_message,
    check_task_imports,
    enqueue_job,
    read_source,
)
from kernelcrew.service.summary import AnswerKind, Verdict

#: The largest offset or event sequence number a query takes (a 32-bit column; larger ones overflow).
MAX_INT = 2**31 - 1

router = APIRouter(prefix="/jobs", tags=["jobs"])


async def read_job_input(request: Request, s: Settings) -> tuple[str, str | None, str, dict[str, Any]]:
    """The submitted task, candidate, mode and checked options, from JSON or multipart (413/422)."""
    length = request.headers.get("content-length") or "0"
    if length.isdigit() and int(length) > 2 * s.api_max_upload_bytes + 65536:
        raise HTTPException(
            413, f"the request is {length} bytes; sources are at most {s.api_max_upload_bytes}"
        )
    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        try:
            form = await request.form()
        except StarletteHTTPException as exc:  # Starlette's 400 for a body that is not multipart
            raise HTTPException(422, f"the multipart body cannot be read: {exc.detail}") from exc

        async def field(name: str) -> bytes | str | None:
            value = form.get(name)
            if value is None or isinstance(value, str):
                return value
            return await value.read()

        raw_task, raw_cand = await field("task"), await field("candidate")
        mode = str(form.get("mode") or "optimize")
        try:
            options = json.loads(str(form.get("options") or "{}"))
        except json.JSONDecodeError as exc:
            raise HTTPException(422, f"options is not JSON: {exc}") from exc
    else:
        body = await request.body()
        if len(body) > 2 * s.api_max_upload_bytes + 65536:
            raise HTTPException(413, "the request is too large")
        try:
            parsed = JobCreate.model_validate_json(body)
        except ValidationError as exc:
            raise HTTPException(422, f"not a job: {problems(exc)}") from exc
        raw_task, raw_cand, mode, options = parsed.task, parsed.candidate, parsed.mode, parsed.options
    if raw_task is None:
        raise HTTPException(422, "the task is missing")
    if not isinstance(options, dict):
        raise HTTPException(422, "options must be a JSON object")
    try:
        checked = JobOptions.model_validate(options)
    except ValidationError as exc:
        raise HTTPException(422, f"bad options: {problems(exc)}") from exc
    options = checked.model_dump(mode="json")  # stored complete: what the job ran with
    if mode not in jobs.MODES:
        raise HTTPException(422, f"mode must be one of {', '.join(jobs.MODES)}; got {shorten(mode, 40)!r}")
    task = read_source(raw_task, "task", "task", s.api_max_upload_bytes)
    candidate = read_source(raw_cand or None, "candidate", "candidate", s.api_max_upload_bytes)
    if mode == "verify" and candidate is None:
        raise HTTPException(422, "a verify job needs a candidate")
    await check_runnable(options, s)
    await check_task_imports(task or "", s)
    return task or "", candidate, mode, options


def problems(exc: ValidationError) -> str:
    """A validation error as one short line per field: where, and why (never the refused value)."""
    found = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:10]]
    return shorten("; ".join(found), 1000)


async def check_runnable(options: dict[str, Any], s: Settings) -> None:
    """409 when the live worker inventory shows that no worker online could run the job (its device
    or GPU); accepted when the inventory is empty or unreachable, since it cannot tell then
    (workers not started yet, or orchestrators that run GPU work themselves with ``--local``)."""
    import redis

    from kernelcrew.worker.errors import NoWorkerOnline
    from kernelcrew.worker.inventory import list_workers
    from kernelcrew.worker.routing import pick_queue

    try:
        online = await run_in_threadpool(list_workers, s)
    except redis.RedisError:
        return
    if not online:
        return
    try:
        pick_queue(online, options.get("gpu"), device=options.get("device") or "cuda")
    except NoWorkerOnline as exc:
        raise HTTPException(409, f"no worker online could run this job: {exc}") from exc


#: One event of the stream; ``data`` is the event's JSON (a status change, a plan, a verdict, ...).
SSE_EVENT = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "description": "The event's sequence number (resume after it)."},
        "event": {"type": "string", "description": "The event's type: status, plan, verify, ..."},
        "data": {"type": "string", "description": "The event as JSON."},
    },
}

JOB_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": JobCreate.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["task"],
                    "properties": {
                        "task": {"type": "string", "format": "binary", "description": "The task file."},
                        "candidate": {
                            "type": "string",
                            "format": "binary",
                            "description": "A ModelNew file.",
                        },
                        "mode": {"type": "string", "enum": list(jobs.MODES)},
                        "options": {"type": "string", "description": "The job options as a JSON object."},
                    },
                }
            },
        },
    }
}


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    responses=errors(
        *AUTH_ERRORS,
        409,
        413,
        503,
        e409=(
            "No worker online could run the job (its device or GPU), as the live worker inventory "
            "shows. When the inventory is empty or unreachable the job is accepted: it cannot tell."
        ),
        e422="The task, candidate, mode or an option is invalid; nothing was stored.",
        e429="Too many requests a minute with this token, or too many queued and running jobs.",
        e503="This service cannot isolate user code, so it takes no jobs.",
    ),
    openapi_extra=JOB_BODY,
)
async def create_job(request: Request, who: Submitter, settings: SettingsDep, engine: EngineDep) -> JobPublic:
    """Queue a job (JSON or multipart with fields task, candidate, mode, options)."""
    task, candidate, mode, options = await read_job_input(request, settings)
    with transaction(engine) as session:
        job = enqueue_job(session, who, task, candidate, mode, options, settings.api_max_active_jobs)
        return JobPublic.model_validate(job.to_dict())


@router.get(
    "",
    response_model=JobsPublic,
    responses=errors(
        *AUTH_ERRORS,
        e422="A filter or paging parameter is invalid (its name is the error's loc), or has a NUL byte.",
    ),
)
def list_jobs(
    who: Reader,
    session: SessionDep,
    status: Annotated[JobStatus | None, Query(description="Only jobs in this status.")] = None,
    mode: Annotated[JobMode | None, Query(description="Only optimize jobs, or only verify jobs.")] = None,
    verdict: Annotated[Verdict | None, Query(description="Only jobs with this verdict.")] = None,
    kind: Annotated[
        AnswerKind | None,
        Query(description="Only jobs whose answer is of this kind (reference: none faster)."),
    ] = None,
    q: Annotated[
        str | None,
        Query(
            min_length=1, max_length=MAX_QUERY, description="Only tasks whose name contains this, any case."
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
) -> JobsPublic:
    """The caller's jobs, newest first, filtered over all of them (then paged); ``total`` counts the
    jobs that pass the filters."""
    where = JobFilter(status=status, mode=mode, verdict=verdict, kind=kind, q=q)
    rows, total = find_jobs(session, who.user_id, where, limit, offset)
    items = [JobPublic.model_validate(r.to_dict()) for r in rows]
    return JobsPublic(items=items, total=total, limit=limit, offset=offset)


@router.get("/{job_id}", response_model=JobPublic, responses=errors(*AUTH_ERRORS, 404))
def read_job(job_id: str, who: Reader, session: SessionDep) -> JobPublic:
    """One of the caller's jobs."""
    return JobPublic.model_validate(own_job(session, job_id, who).to_dict())


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    responses=errors(*AUTH_ERRORS, 404, 409, e409="The job has already ended."),
)
def cancel_job(job_id: str, who: Submitter, session: SessionDep) -> JobPublic:
    """Cancel a job: a queued one at once, a running one at its next step."""
    job = own_job(session, job_id, who)
    if job.status in jobs.ENDED:
        raise HTTPException(409, f"job {job_id} already ended ({job.status})")
    job.cancel_requested = True
    if job.status == "queued":
        job.status = "cancelled"
        job.finished_at = jobs.now()
        jobs.add_event(session, job.id, "status", {"status": "cancelled"})
    return JobPublic.model_validate(job.to_dict())


@router.get(
    "/{job_id}/result",
    response_model=JobResultPublic,
    responses=errors(*AUTH_ERRORS, 404, 409, e409="The job has not ended yet."),
)
def read_job_result(job_id: str, who: Reader, session: SessionDep) -> JobResultPublic:
    """An ended job's result: the report's JSON, the best source and the report in markdown."""
    job = own_job(session, job_id, who)
    if job.status not in jobs.ENDED:
        raise HTTPException(409, f"job {job_id} is {job.status}; no result yet")
    outcome = job.outcome()
    if outcome is None:
        return JobResultPublic(**job.to_dict(), result={}, best_source=None, report_md=None)
    return JobResultPublic(
        **job.to_dict(),
        result=outcome.report.model_dump(mode="json"),
        best_source=outcome.best_source,
        report_md=outcome.report_md,
    )


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "Server-Sent Events (`id` = sequence number, `event` = type, `data` = JSON).",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        **errors(*AUTH_ERRORS, 404),
    },
)
def job_events(
    job_id: str,
    who: Reader,
    engine: EngineDep,
    last_event_id: Annotated[str | None, Header()] = None,
    after: Annotated[int | None, Query(ge=0, le=MAX_INT)] = None,
) -> StreamingResponse:
    """Server-Sent Events of the job (``id`` = sequence number); ends when the job has ended."""
    with transaction(engine) as session:
        own_job(session, job_id, who)
    digits = last_event_id or ""  # a header: anything may come ("²" is a digit to isdigit())
    resume = min(int(digits[:12]), MAX_INT) if digits.isascii() and digits.isdigit() else 0
    start = after if after is not None else resume

    return StreamingResponse(
        job_event_stream(engine, job_id, start),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache"},
    )


@router.post(
    "/{job_id}/messages",
    status_code=202,
    response_model=JobPublic,
    responses=errors(
        *AUTH_ERRORS,
        400,
        404,
        409,
        e409="The job takes no messages: a verify job, or a cancelled one.",
        e422="The message is empty, longer than 10000 characters, or contains a NUL byte.",
    ),
)
def create_message(job_id: str, body: MessageCreate, who: Submitter, session: SessionDep) -> JobPublic:
    """A chat message: a running job takes it at its next plan; an ended optimize job resumes with it."""
    job = own_job(session, job_id, who)
    add_message(session, job, body.text, who.user)
    return JobPublic.model_validate(job.to_dict())
