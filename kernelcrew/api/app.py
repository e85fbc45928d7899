"""The REST API: jobs, their events (SSE) and chat, the knowledge base, the workers; ``/api/v1``.

The API only stores and reads: jobs are run by orchestrators (``kernelcrew orchestrator``), never in
this process. Every route but the health checks needs a bearer token (``kernelcrew token create``)
with the right scope; a job is visible to its owner only (404 to anyone else, admins aside).
"""

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError
from sqlalchemy import func, select, text

from kernelcrew.config import Settings, get_settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.task import TaskError, check_source, validate_in_sandbox
from kernelcrew.worker import jobs

PREFIX = "/api/v1"
#: The largest offset or event sequence number a query takes (a 32-bit column; larger ones overflow).
MAX_INT = 2**31 - 1


@dataclass
class Principal:
    user_id: int
    user: str
    team: str | None
    token_id: int
    scopes: list[str]

    def can(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


class JobOptions(BaseModel):
    """What a job may ask for; anything else is refused (422) rather than failing the job later."""

    model_config = ConfigDict(extra="forbid")

    backend: str = "auto"
    model: str = ""
    max_iters: int = Field(6, ge=1, le=200)
    time_budget_s: float = Field(900.0, gt=0, le=7 * 86400)
    precision: Literal["strict", "relaxed"] = "strict"
    device: Literal["cuda", "cpu"] = "cuda"
    gpu: str | None = Field(None, description="A GPU model (h100-sxm) or architecture (sm_90).")
    local_only: bool = False
    compile_modes: str = "auto"
    quick: bool = False
    seed: int | None = None
    timing: bool = True
    use_kb: bool = False
    webhook_url: HttpUrl | None = None


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


def read_source(raw: bytes | str | None, what: str, kind: str, max_bytes: int) -> str | None:
    """An uploaded source checked as the API checks it: size (413), UTF-8 and a valid ``kind`` (422)."""
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > max_bytes:
        raise HTTPException(413, f"the {what} is {len(data)} bytes; at most {max_bytes}")
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(422, f"the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        check_source(source, kind, f"{what}.py")
    except TaskError as exc:
        raise HTTPException(422, f"the {what} is not a valid {kind}: {exc}") from exc
    return source


async def check_task_imports(task: str, settings: Settings) -> None:
    """Import the task once in a sandbox child (422 if that fails or outlasts the bound).

    Shared by the REST route and the web form. User code: never in this process; in a thread, so
    the event loop keeps serving while the child runs. Where user code cannot be isolated here, the
    job is refused (503): the service never runs it unisolated.
    """
    from kernelcrew.tools import sandbox

    refusal = await run_in_threadpool(sandbox.service_refusal, settings)
    if refusal is not None:
        raise HTTPException(503, f"this service cannot isolate user code, so it takes no jobs: {refusal}")
    try:
        await run_in_threadpool(
            validate_in_sandbox,
            task,
            "task",
            "task.py",
            timeout_s=settings.api_validate_timeout_s,
            settings=settings,
        )
    except TaskError as exc:
        raise HTTPException(422, f"the task is not usable: {exc}") from exc


def enqueue_job(
    session: Any,
    who: Principal,
    task: str,
    candidate: str | None,
    mode: str,
    options: dict[str, Any],
    max_active: int,
) -> jobs.Job:
    """Queue a checked job for ``who``; 429 when they already have ``max_active`` queued or running.

    Shared by the REST route and the web form, so both apply the same limit and write the same events.
    """
    active = session.scalar(
        select(func.count())
        .select_from(jobs.Job)
        .where(jobs.Job.owner_id == who.user_id, jobs.Job.status.in_(("queued", "running")))
    )
    if active >= max_active:
        raise HTTPException(429, f"{active} jobs are queued or running; at most {max_active}")
    t = jobs.now()
    job = jobs.Job(
        id=jobs.new_job_id(),
        owner_id=who.user_id,
        token_id=who.token_id,
        status="queued",
        mode=mode,
        task_source=task,
        candidate_source=candidate,
        options=options,
        cancel_requested=False,
        attempts=0,
        created_at=t,
        updated_at=t,
    )
    session.add(job)
    session.flush()
    jobs.add_event(session, job.id, "status", {"status": "queued"})
    return job


def add_message(session: Any, job: jobs.Job, text: str, user: str) -> None:
    """A chat message: a running job takes it at its next plan; an ended optimize job is queued again."""
    session.add(jobs.JobMessage(job_id=job.id, text=text, created_at=jobs.now()))
    jobs.add_event(session, job.id, "message", {"text": text, "user": user})
    if job.status in ("succeeded", "failed") and job.mode == "optimize":
        job.status = "queued"
        job.cancel_requested = False
        job.finished_at = None
        jobs.add_event(session, job.id, "status", {"status": "queued", "resumed_by": "message"})


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


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or get_settings()
    engine = get_engine(s)
    limiter = RateLimiter(s.api_rate_per_minute)
    bearer = HTTPBearer(auto_error=False)
    app = FastAPI(title="kernelcrew", version="1", docs_url="/docs", openapi_url="/openapi.json")

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
            result = dict(job.result or {})
            best = result.pop("_best_py", None)
            report_md = result.pop("_report_md", None)
            return {**job.to_dict(), "result": result, "best_source": best, "report_md": report_md}

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


__all__ = [
    "PREFIX",
    "Principal",
    "add_message",
    "create_app",
    "enqueue_job",
    "job_event_stream",
    "read_source",
]
