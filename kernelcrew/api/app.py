"""The REST API: jobs, their events (SSE) and chat, the knowledge base, the workers; ``/api/v1``.

The API only stores and reads: jobs are run by orchestrators (``kernelcrew orchestrator``), never in
this process. Every route but the health checks needs a bearer token (``kernelcrew token create``)
with the right scope; a job is visible to its owner only (404 to anyone else, admins aside).
"""

import json
import threading
import time
from collections import defaultdict, deque
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import func, select, text

from kernelcrew.api.inputs import bounded_validation_error, reject_nul
from kernelcrew.api.kb import KbImported, source_problems
from kernelcrew.config import Settings, get_settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from kernelcrew.service.auth import Principal
from kernelcrew.service.events import job_event_stream
from kernelcrew.service.submissions import (
    JobOptions,
    add_message,
    check_task_imports,
    enqueue_job,
    read_source,
)

PREFIX = "/api/v1"
#: The largest offset or event sequence number a query takes (a 32-bit column; larger ones overflow).
MAX_INT = 2**31 - 1


class JobIn(BaseModel):
    task: str = Field(description="The task's Python source (Model, get_inputs, get_init_inputs).")
    candidate: str | None = Field(None, description="A ModelNew source (needed for mode=verify).")
    mode: str = Field("optimize", description="optimize or verify")
    options: dict[str, Any] = Field(default_factory=dict)


class MessageIn(BaseModel):
    text: str = Field(min_length=1, max_length=10_000)


class RateLimiter:
    """At most ``per_minute`` requests per token in any 60 s window (per API process)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.hits: dict[int, deque[float]] = defaultdict(deque)
        self.lock = threading.Lock()

    def allow(self, key: int) -> bool:
        t = time.monotonic()
        with self.lock:
            q = self.hits[key]
            while q and q[0] < t - 60:
                q.popleft()
            if len(q) >= self.per_minute:
                return False
            q.append(t)
            return True


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or get_settings()
    engine = get_engine(s)
    limiter = RateLimiter(s.api_rate_per_minute)
    bearer = HTTPBearer(auto_error=False)
    app = FastAPIOffline(  # /docs and /redoc with their assets served from here, not from a CDN
        title="kernelcrew",
        version="1",
        docs_url="/docs",
        redoc_url="/redoc",
        static_url="/docs/assets",
        openapi_url="/openapi.json",
        dependencies=[Depends(reject_nul)],
    )
    app.add_exception_handler(RequestValidationError, bounded_validation_error)  # type: ignore[arg-type]

    def principal(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Principal:
        if creds is None or not creds.credentials:
            raise HTTPException(401, "a bearer token is needed", headers={"WWW-Authenticate": "Bearer"})
        with transaction(engine) as session:
            found = jobs.authenticate(session, creds.credentials)
            if found is None:
                raise HTTPException(
                    401, "the token is unknown or revoked", headers={"WWW-Authenticate": "Bearer"}
                )
            tok, user = found
            who = Principal(user.id, user.name, user.team, tok.id, list(tok.scopes))
        if not limiter.allow(who.token_id):
            raise HTTPException(429, f"more than {s.api_rate_per_minute} requests a minute with this token")
        return who

    def scoped(scope: str):
        def dep(who: Principal = Depends(principal)) -> Principal:
            if not who.can(scope):
                raise HTTPException(403, f"this token lacks the {scope!r} scope")
            return who

        return dep

    Reader_ = Annotated[Principal, Depends(scoped("read"))]
    Submitter = Annotated[Principal, Depends(scoped("submit"))]

    def own_job(session: Any, job_id: str, who: Principal) -> jobs.Job:
        job = session.get(jobs.Job, job_id)
        if job is None or (job.owner_id != who.user_id and "admin" not in who.scopes):
            raise HTTPException(404, f"no job {job_id}")
        return job

    # -- health ---------------------------------------------------------------------------------

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        from kernelcrew.worker import store

        checks: dict[str, str] = {}
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            checks["database"] = "ok"
        except Exception as exc:
            checks["database"] = f"error: {exc}"
        try:
            store.client(s.broker_url).ping()
            checks["broker"] = "ok"
        except Exception as exc:
            checks["broker"] = f"error: {exc}"
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"ok": ok, **checks}, status_code=200 if ok else 503)

    # -- jobs -----------------------------------------------------------------------------------

    async def _job_input(request: Request) -> tuple[str, str | None, str, dict[str, Any]]:
        length = int(request.headers.get("content-length") or 0)
        if length > 2 * s.api_max_upload_bytes + 65536:
            raise HTTPException(
                413, f"the request is {length} bytes; sources are at most {s.api_max_upload_bytes}"
            )
        ctype = request.headers.get("content-type", "")
        if ctype.startswith("multipart/form-data"):
            form = await request.form()

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
                parsed = JobIn.model_validate_json(body)
            except ValueError as exc:
                raise HTTPException(422, f"not a job: {exc}") from exc
            raw_task, raw_cand, mode, options = parsed.task, parsed.candidate, parsed.mode, parsed.options
        if raw_task is None:
            raise HTTPException(422, "the task is missing")
        if not isinstance(options, dict):
            raise HTTPException(422, "options must be a JSON object")
        try:
            checked = JobOptions.model_validate(options)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise HTTPException(422, f"bad options: {problems}") from exc
        options = checked.model_dump(mode="json")  # stored complete: what the job ran with
        if mode not in jobs.MODES:
            raise HTTPException(422, f"mode must be one of {', '.join(jobs.MODES)}")
        task = read_source(raw_task, "task", "task", s.api_max_upload_bytes)
        candidate = read_source(raw_cand or None, "candidate", "candidate", s.api_max_upload_bytes)
        if mode == "verify" and candidate is None:
            raise HTTPException(422, "a verify job needs a candidate")
        await check_task_imports(task or "", s)
        return task or "", candidate, mode, options

    @app.post(
        f"{PREFIX}/jobs",
        status_code=201,
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/json": {"schema": JobIn.model_json_schema()},
                    "multipart/form-data": {"schema": {"type": "object"}},
                }
            }
        },
    )
    async def create_job(request: Request, who: Submitter) -> dict[str, Any]:
        """Queue a job (JSON or multipart with fields task, candidate, mode, options)."""
        task, candidate, mode, options = await _job_input(request)
        with transaction(engine) as session:
            return enqueue_job(session, who, task, candidate, mode, options, s.api_max_active_jobs).to_dict()

    @app.get(f"{PREFIX}/jobs")
    def list_jobs(
        who: Reader_,
        status: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        offset: Annotated[int, Query(ge=0, le=MAX_INT)] = 0,
    ) -> dict[str, Any]:
        with transaction(engine) as session:
            q = select(jobs.Job).where(jobs.Job.owner_id == who.user_id)
            if status:
                q = q.where(jobs.Job.status == status)
            total = session.scalar(select(func.count()).select_from(q.subquery()))
            rows = session.scalars(q.order_by(jobs.Job.created_at.desc()).limit(limit).offset(offset)).all()
            return {"items": [r.to_dict() for r in rows], "total": total, "limit": limit, "offset": offset}

    @app.get(f"{PREFIX}/jobs/{{job_id}}")
    def get_job(job_id: str, who: Reader_) -> dict[str, Any]:
        with transaction(engine) as session:
            return own_job(session, job_id, who).to_dict()

    @app.post(f"{PREFIX}/jobs/{{job_id}}/cancel")
    def cancel_job(job_id: str, who: Submitter) -> dict[str, Any]:
        with transaction(engine) as session:
            job = own_job(session, job_id, who)
            if job.status in jobs.ENDED:
                raise HTTPException(409, f"job {job_id} already ended ({job.status})")
            job.cancel_requested = True
            if job.status == "queued":
                job.status = "cancelled"
                job.finished_at = jobs.now()
                jobs.add_event(session, job.id, "status", {"status": "cancelled"})
            return job.to_dict()

    @app.get(f"{PREFIX}/jobs/{{job_id}}/result")
    def job_result(job_id: str, who: Reader_) -> dict[str, Any]:
        with transaction(engine) as session:
            job = own_job(session, job_id, who)
            if job.status not in jobs.ENDED:
                raise HTTPException(409, f"job {job_id} is {job.status}; no result yet")
            outcome = job.outcome()
            if outcome is None:
                return {**job.to_dict(), "result": {}, "best_source": None, "report_md": None}
            return {
                **job.to_dict(),
                "result": outcome.report.model_dump(mode="json"),
                "best_source": outcome.best_source,
                "report_md": outcome.report_md,
            }

    @app.get(f"{PREFIX}/jobs/{{job_id}}/events")
    def job_events(
        job_id: str,
        who: Reader_,
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

    @app.post(f"{PREFIX}/jobs/{{job_id}}/messages", status_code=202)
    def post_message(job_id: str, body: MessageIn, who: Submitter) -> dict[str, Any]:
        """A chat message: a running job takes it at its next plan; an ended optimize job resumes with it."""
        with transaction(engine) as session:
            job = own_job(session, job_id, who)
            add_message(session, job, body.text, who.user)
            return job.to_dict()

    # -- knowledge base and workers -------------------------------------------------------------

    seeded: list[bool] = []

    @app.get(f"{PREFIX}/kb")
    def kb_search(
        who: Reader_,
        q: str = "",
        arch: str | None = None,
        gpu_model: str | None = None,
        k: Annotated[int, Query(ge=1, le=100)] = 10,
    ) -> dict[str, Any]:
        from kernelcrew.knowledge_base import KnowledgeBase, Reader
        from kernelcrew.knowledge_base.embeddings import Embedder
        from kernelcrew.knowledge_base.seeds import ensure_seeds

        if not seeded:
            with transaction(engine) as session:
                ensure_seeds(session)
            seeded.append(True)
        kb = KnowledgeBase(engine, Reader(who.user, who.team), embedder=Embedder.from_settings(s))
        try:
            return {"items": kb.search(q, arch=arch, gpu_model=gpu_model, k=k)}
        except ValueError as exc:  # an architecture that is not sm_XY or cpu
            raise HTTPException(422, str(exc)) from exc

    @app.post(
        f"{PREFIX}/kb/import",
        response_model=KbImported,
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
        },
    )
    async def import_kb(
        request: Request, who: Submitter, visibility: Literal["private", "team", "public"] = "private"
    ) -> KbImported:
        """Import a `kernelcrew kb export` file as the caller's records (private unless shared): all or none.

        The file is data: every field is checked and every candidate source must pass the static
        rules; nothing in it runs. Sharing with everyone (public) needs the admin scope."""
        from starlette.concurrency import run_in_threadpool

        from kernelcrew.knowledge_base import KnowledgeBase, Reader
        from kernelcrew.knowledge_base.store import ImportRefused

        if visibility == "public" and "admin" not in who.scopes:
            raise HTTPException(403, "importing public records needs the 'admin' scope")
        limit = s.api_max_kb_import_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise HTTPException(413, f"an import file is at most {limit} bytes")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise HTTPException(413, f"an import file is at most {limit} bytes")
        kb = KnowledgeBase(engine, Reader(who.user, who.team))

        def work() -> dict[str, int]:
            return kb.import_file(bytes(raw), check_source=source_problems, visibility=visibility)

        try:
            counts = await run_in_threadpool(work)
        except ImportRefused as exc:
            raise HTTPException(422, f"{exc}; nothing was imported") from exc
        return KbImported(**counts, visibility=visibility)

    @app.get(f"{PREFIX}/workers")
    def workers(who: Reader_) -> dict[str, Any]:
        import redis

        from kernelcrew.worker.inventory import list_workers

        try:
            return {"items": [w.to_dict() for w in list_workers(s)]}
        except redis.RedisError as exc:
            raise HTTPException(503, f"the broker is not reachable: {exc}") from exc

    from kernelcrew.web import mount_web

    mount_web(app, s, engine)
    return app


__all__ = ["PREFIX", "create_app"]
