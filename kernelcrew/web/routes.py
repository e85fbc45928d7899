"""The UI's pages: sign-in, jobs, new job, job (live), knowledge base, workers.

Pages are rendered on the server (Jinja2); ``static/app.js`` only listens to the event streams and
swaps in the fresh parts of a page, and posts the chat form without a reload. Everything here reads
and writes through the same functions as the REST API (auth, job checks, queueing, chat), so the two
cannot drift apart.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from sqlalchemy import func, select
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from kernelcrew.agents.llm import BACKENDS as LLM_BACKENDS
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
from kernelcrew.service.summary import ANSWER_KINDS, VERDICTS
from kernelcrew.web import views
from kernelcrew.web.auth import (
    SESSION_COOKIE,
    SESSION_MAX_AGE_S,
    SIGNIN_COOKIE,
    Viewer,
    check_csrf,
    new_signin_nonce,
    principal_for,
    require_viewer,
    set_cookie,
    viewer_of,
)
from kernelcrew.web.code import highlight_css, highlight_python, replaced_part, unified_diff

TEMPLATES = Jinja2Templates(directory=Path(__file__).parent / "templates")
TEMPLATES.env.filters["num"] = lambda v, fmt="{:.3g}": "-" if v is None else fmt.format(v)
TEMPLATES.env.filters["pct"] = lambda v: "-" if v is None else f"{v:.1%}"
TEMPLATES.env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)

BACKENDS = ("auto", *LLM_BACKENDS)
#: Jobs a page of the job list shows.
PAGE_SIZE = 100
FORM_OPTION_FIELDS = ("backend", "model", "max_iters", "time_budget_s", "precision", "compile_modes")


def build_router(settings: Settings, engine: Any) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def page(request: Request, name: str, viewer: Viewer | None, status: int = 200, **context: Any):
        return TEMPLATES.TemplateResponse(
            request, name, {"viewer": viewer, "path": request.url.path, **context}, status_code=status
        )

    def own_job(session: Any, job_id: str, viewer: Viewer) -> jobs.Job:
        """The job when the viewer owns it (or is an admin): 404 otherwise, as in the API."""
        job = session.get(jobs.Job, job_id)
        if job is None or (job.owner_id != viewer.who.user_id and "admin" not in viewer.who.scopes):
            raise HTTPException(404, f"no job {job_id}")
        return job

    # -- sign-in ---------------------------------------------------------------------------------

    def signin_page(
        request: Request, error: str = "", status: int = 200, after: str | None = None
    ) -> Response:
        nonce = request.cookies.get(SIGNIN_COOKIE) or new_signin_nonce()
        next_url = safe_next(after or request.query_params.get("next"))
        response = page(request, "signin.html", None, status, csrf=nonce, error=error, next=next_url)
        set_cookie(response, request, SIGNIN_COOKIE, nonce, 3600)
        return response

    @router.get("/signin", response_class=HTMLResponse)
    def read_signin(request: Request) -> Response:
        return signin_page(request)

    @router.post("/signin")
    async def create_session(request: Request) -> Response:
        """Check the token as the API does; on success keep it in the session cookie."""
        form = await request.form()
        check_csrf(form.get("csrf"), request.cookies.get(SIGNIN_COOKIE) or "")
        token = str(form.get("token") or "").strip()
        who = principal_for(engine, token) if token else None
        after = str(form.get("next") or "")
        if who is None:
            return signin_page(request, "This token is unknown or revoked.", 401, after)
        if not who.can("read"):
            return signin_page(request, "This token lacks the read scope the pages need.", 403, after)
        response = RedirectResponse(safe_next(after), status_code=303)
        set_cookie(response, request, SESSION_COOKIE, token, SESSION_MAX_AGE_S)
        response.delete_cookie(SIGNIN_COOKIE, path="/")
        return response

    @router.post("/signout")
    async def delete_session(request: Request) -> Response:
        viewer = require_viewer(request, engine)
        check_csrf((await request.form()).get("csrf"), viewer.csrf)
        response = RedirectResponse("/signin", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # -- jobs ------------------------------------------------------------------------------------

    @router.get("/")
    def read_home() -> Response:
        return RedirectResponse("/jobs", status_code=303)

    @router.get("/jobs", response_class=HTMLResponse)
    def read_jobs(
        request: Request,
        status: str = "",
        verdict: str = "",
        kind: str = "",
        mode: str = "",
        q: str = "",
        offset: str = "",
    ) -> Response:
        """The viewer's jobs through the API's query (:func:`~kernelcrew.service.listing.find_jobs`):
        filtered over all of them, then paged; an unknown filter value filters nothing."""
        viewer = require_viewer(request, engine)
        where = JobFilter(
            status=status if status in jobs.STATUSES else None,
            mode=mode if mode in jobs.MODES else None,
            verdict=verdict if verdict in VERDICTS else None,
            kind=kind if kind in ANSWER_KINDS else None,
            q=q.strip()[:MAX_QUERY] or None,
        )
        start = min(int(offset), 2**31 - 1) if offset.isascii() and offset.isdigit() else 0
        with transaction(engine) as session:
            found, total = find_jobs(session, viewer.who.user_id, where, PAGE_SIZE, start)
            rows = [views.job_row(j) for j in found]
        filters = {k: v for k, v in vars(where).items() if v}

        def at(first: int) -> str:
            query = urlencode({**filters, **({"offset": first} if first else {})})
            return f"/jobs?{query}" if query else "/jobs"

        return page(
            request,
            "jobs.html",
            viewer,
            rows=rows,
            total=total,
            shown=(start + 1, start + len(rows)),
            newer_url=at(max(start - PAGE_SIZE, 0)) if start else None,
            older_url=at(start + PAGE_SIZE) if start + PAGE_SIZE < total else None,
            filters=filters,
            statuses=jobs.STATUSES,
            modes=jobs.MODES,
            verdicts=VERDICTS,
            kinds=ANSWER_KINDS,
        )

    @router.get("/jobs/stream")
    def stream_jobs(request: Request) -> StreamingResponse:
        """One ``changed`` event whenever any of the viewer's jobs gets an event (the list reloads)."""
        viewer = require_viewer(request, engine)
        return sse(jobs_changes(request, engine, viewer.who.user_id))

    @router.get("/jobs/new", response_class=HTMLResponse)
    def read_new_job(request: Request) -> Response:
        viewer = require_viewer(request, engine, "submit")
        return new_job_page(request, viewer, {}, {})

    def new_job_page(
        request: Request, viewer: Viewer, values: dict[str, Any], errors: dict[str, str], status: int = 200
    ) -> Response:
        workers, workers_error = online_workers(settings)
        targets = target_choices(workers)
        defaults = {"mode": "optimize", "backend": "auto", "max_iters": 6, "time_budget_s": 900}
        defaults |= {"precision": "strict", "compile_modes": "auto", "target": targets[0][0]}
        return page(
            request,
            "new_job.html",
            viewer,
            status,
            values={**defaults, **values},
            errors=errors,
            targets=targets,
            workers_error=workers_error,
            backends=BACKENDS,
            max_bytes=settings.api_max_upload_bytes,
        )

    @router.post("/jobs/new")
    async def create_job(request: Request) -> Response:
        """Check the form as the API checks a job; on errors show them next to their inputs."""
        viewer = require_viewer(request, engine, "submit")
        form = await request.form()
        check_csrf(form.get("csrf"), viewer.csrf)
        values = {k: v for k, v in form.items() if isinstance(v, str) and k != "csrf"}
        errors: dict[str, str] = {}
        task = await form_source(form, "task", "task", errors, settings.api_max_upload_bytes)
        candidate = await form_source(form, "candidate", "candidate", errors, settings.api_max_upload_bytes)
        if "task" not in errors and task is None:
            errors["task"] = "Upload a task file or paste its source."
        mode = values.get("mode", "optimize")
        if mode not in jobs.MODES:
            errors["mode"] = f"Choose one of {', '.join(jobs.MODES)}."
        elif mode == "verify" and candidate is None and "candidate" not in errors:
            errors["candidate"] = "A verify job needs a candidate (a ModelNew source)."
        options = form_options(values, errors)
        if errors:
            return new_job_page(request, viewer, values, errors, 422)
        try:
            await check_task_imports(task or "", settings)
            with transaction(engine) as session:
                job = enqueue_job(
                    session, viewer.who, task or "", candidate, mode, options, settings.api_max_active_jobs
                )
                job_id = job.id
        except HTTPException as exc:
            return new_job_page(request, viewer, values, {"form": str(exc.detail)}, exc.status_code)
        return RedirectResponse(f"/jobs/{job_id}", status_code=303)

    @router.get("/jobs/{job_id}", response_class=HTMLResponse)
    def read_job(request: Request, job_id: str) -> Response:
        viewer = require_viewer(request, engine)
        with transaction(engine) as session:
            job = own_job(session, job_id, viewer)
            context = job_context(job, job_events(session, job_id))
        return page(request, "job.html", viewer, **context)

    @router.get("/jobs/{job_id}/events")
    def stream_job(request: Request, job_id: str, after: int = 0) -> StreamingResponse:
        viewer = require_viewer(request, engine)
        with transaction(engine) as session:
            own_job(session, job_id, viewer)
        last = request.headers.get("last-event-id", "")
        return sse(job_event_stream(engine, job_id, int(last) if last.isdigit() else after))

    @router.post("/jobs/{job_id}/messages")
    async def create_message(request: Request, job_id: str) -> Response:
        """A chat message, as the API's messages route: an ended optimize job resumes with it."""
        viewer = require_viewer(request, engine, "submit")
        form = await request.form()
        check_csrf(form.get("csrf"), viewer.csrf)
        text = str(form.get("text") or "").strip()
        if not text or len(text) > 10_000:
            raise HTTPException(422, "a message is 1 to 10000 characters")
        with transaction(engine) as session:
            add_message(session, own_job(session, job_id, viewer), text, viewer.who.user)
        return RedirectResponse(f"/jobs/{job_id}#chat", status_code=303)

    @router.get("/jobs/{job_id}/best.py")
    def download_best(request: Request, job_id: str) -> Response:
        viewer = require_viewer(request, engine)
        with transaction(engine) as session:
            outcome = own_job(session, job_id, viewer).outcome()
        source = outcome.best_source if outcome is not None else None
        if not source:
            raise HTTPException(404, f"job {job_id} has no best source")
        return download(source, f"{job_id}-best.py", "text/x-python")

    @router.get("/jobs/{job_id}/report.{fmt}")
    def download_report(request: Request, job_id: str, fmt: str) -> Response:
        viewer = require_viewer(request, engine)
        with transaction(engine) as session:
            outcome = own_job(session, job_id, viewer).outcome()
        if outcome is None or fmt not in ("json", "md"):
            raise HTTPException(404, f"job {job_id} has no {fmt} report")
        if fmt == "md":
            if not outcome.report_md:
                raise HTTPException(404, f"job {job_id} has no markdown report")
            return download(outcome.report_md, f"{job_id}-report.md", "text/markdown")
        body = json.dumps(views.public_result(outcome), indent=2, default=str)
        return download(body, f"{job_id}-report.json", "application/json")

    # -- knowledge base and workers --------------------------------------------------------------

    @router.get("/kb", response_class=HTMLResponse)
    def read_kb(request: Request, q: str = "", arch: str = "", strategy: str = "") -> Response:
        viewer = require_viewer(request, engine)
        kb = knowledge_base(viewer)
        everything = kb.search("", k=500)
        hits = kb.search(q, arch=arch or None, k=500) if (q or arch) else everything
        hits = [
            h for h in hits if (not arch or h["arch"] == arch) and (not strategy or h["strategy"] == strategy)
        ]
        return page(
            request,
            "kb.html",
            viewer,
            hits=hits[:100],
            q=q,
            arch=arch,
            strategy=strategy,
            archs=sorted({h["arch"] for h in everything}),
            strategies=sorted({h["strategy"] for h in everything}),
        )

    @router.get("/kb/{record_id}", response_class=HTMLResponse)
    def read_kb_record(request: Request, record_id: str) -> Response:
        viewer = require_viewer(request, engine)
        try:
            record = knowledge_base(viewer).get(record_id)
        except ValueError:
            record = None
        if record is None:
            raise HTTPException(404, f"no knowledge-base record {record_id}")
        source = record.get("candidate_source") or ""
        return page(
            request,
            "kb_record.html",
            viewer,
            record=record,
            code=highlight_python(source) if source else None,
        )

    seeded: list[bool] = []

    def knowledge_base(viewer: Viewer) -> Any:
        from kernelcrew.knowledge_base import KnowledgeBase, Reader
        from kernelcrew.knowledge_base.embeddings import Embedder
        from kernelcrew.knowledge_base.seeds import ensure_seeds

        if not seeded:
            with transaction(engine) as session:
                ensure_seeds(session)
            seeded.append(True)
        return KnowledgeBase(
            engine, Reader(viewer.who.user, viewer.who.team), embedder=Embedder.from_settings(settings)
        )

    @router.get("/workers", response_class=HTMLResponse)
    def read_workers(request: Request) -> Response:
        viewer = require_viewer(request, engine)
        workers, error = online_workers(settings)
        return page(request, "workers.html", viewer, workers=workers, error=error, now=time.time())

    @router.get("/static/code.css")
    def read_code_css() -> Response:
        return PlainTextResponse(highlight_css(), media_type="text/css")

    return router


# ------------------------------------------------------------------------------------------------
# Helpers of the pages
# ------------------------------------------------------------------------------------------------


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path on this site only (never ``//host`` or a full URL)."""
    if target and target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/jobs"


def sse(events: Iterator[str] | AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})


async def jobs_changes(
    request: Request, engine: Any, user_id: int, poll_s: float = 1.0
) -> AsyncIterator[str]:
    """``changed`` whenever the newest event among the user's jobs (or their number) changes.

    Async, so that a closed page ends it at once: a sync generator would hold its thread (and the
    server's shutdown) until its next write.
    """
    last: tuple[int, int] | None = None
    idle = 0.0
    while not await request.is_disconnected():
        current = await run_in_threadpool(jobs_mark, engine, user_id)
        if last is not None and current != last:
            yield f"event: changed\ndata: {json.dumps(list(current))}\n\n"
            idle = 0.0
        last = current
        await asyncio.sleep(poll_s)
        idle += poll_s
        if idle >= 15:
            idle = 0.0
            yield ": keep-alive\n\n"


def jobs_mark(engine: Any, user_id: int) -> tuple[int, int]:
    """The newest event id among the user's jobs and how many jobs they have."""
    with transaction(engine) as session:
        mark = session.execute(
            select(func.coalesce(func.max(jobs.JobEvent.id), 0), func.count(func.distinct(jobs.Job.id)))
            .select_from(jobs.Job)
            .outerjoin(jobs.JobEvent, jobs.JobEvent.job_id == jobs.Job.id)
            .where(jobs.Job.owner_id == user_id)
        ).one()
    return int(mark[0]), int(mark[1])


def online_workers(settings: Settings) -> tuple[list[dict[str, Any]], str]:
    """The workers online, or none and why (the broker is down)."""
    import redis

    from kernelcrew.worker.inventory import list_workers

    try:
        return [w.to_dict() for w in list_workers(settings)], ""
    except redis.RedisError as exc:
        return [], f"the broker is not reachable: {exc}"


def target_choices(workers: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Targets a job can name: each GPU model and architecture online, any GPU, and the CPU.

    The first choice is the default: the first GPU online, else the CPU when only CPU workers are.
    """
    gpus: dict[str, str] = {}
    for w in workers:
        if w.get("device") == "cuda" and w.get("gpu"):
            gpus.setdefault(
                f"cuda:{w['model']}", f"{(w['gpu'] or {}).get('name') or w['model']} ({w['model']})"
            )
            gpus.setdefault(f"cuda:{w['arch']}", f"any {w['arch']} GPU")
    cpu = ("cpu", "CPU (Triton interpreter: verifies; timings are CPU timings)")
    any_gpu = ("cuda:", "any GPU")
    if gpus:
        return [*gpus.items(), any_gpu, cpu]
    return [cpu, any_gpu]


async def form_source(form: Any, name: str, kind: str, errors: dict[str, str], max_bytes: int) -> str | None:
    """The uploaded file ``name`` or, when none was chosen, the pasted ``name_text``; checked as the API does."""
    upload = form.get(f"{name}_file")
    raw: bytes | str | None = None
    if isinstance(upload, UploadFile) and upload.filename:
        raw = await upload.read()
    elif str(form.get(f"{name}_text") or "").strip():
        raw = str(form.get(f"{name}_text"))
    try:
        return read_source(raw, name, kind, max_bytes)
    except HTTPException as exc:
        errors[name] = str(exc.detail)
        return None


def form_options(values: dict[str, str], errors: dict[str, str]) -> dict[str, Any]:
    """The job's options from the form, checked by the API's own model (backend, compile modes, GPU
    against device...); errors keyed by input name."""
    raw: dict[str, Any] = {k: values[k] for k in FORM_OPTION_FIELDS if values.get(k, "") != ""}
    target = values.get("target", "cpu")
    device, _, gpu = target.partition(":")
    raw["device"] = "cpu" if device == "cpu" else "cuda"
    if gpu:
        raw["gpu"] = gpu
    raw["quick"] = values.get("quick") == "on"
    raw["use_kb"] = values.get("use_kb") == "on"
    try:
        return JobOptions.model_validate(raw).model_dump(mode="json")
    except ValidationError as exc:
        for e in exc.errors():
            key = str(e["loc"][0]) if e["loc"] else "form"
            key = "target" if key in ("device", "gpu") else key
            errors.setdefault(key, e["msg"])
        return {}


def job_events(session: Any, job_id: str) -> list[tuple[int, str, dict[str, Any]]]:
    rows = session.scalars(
        select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id).order_by(jobs.JobEvent.seq)
    ).all()
    return [(r.seq, r.type, r.data) for r in rows]


def job_context(job: jobs.Job, events: list[tuple[int, str, dict[str, Any]]]) -> dict[str, Any]:
    """Everything the job page shows, live parts from the events and the evidence from the report.

    The answer is an optimize job's best source, or a verify job's candidate (shown with its verdict).
    """
    outcome = job.outcome()
    report = views.public_result(outcome)
    progress = views.progress_of(events)
    row = views.job_row(job)
    if job.mode == "verify":
        answer = job.candidate_source
    else:
        answer = outcome.best_source if outcome is not None else None
    return {
        "job": job,
        "row": row,
        "ended": job.status in jobs.ENDED,
        "report": report,
        "progress": progress,
        "evidence": views.evidence(report, progress, job.mode),
        "speedup": row.speedup,
        "cpu_timing": row.cpu_timing,
        "answer_note": views.answer_note(row, report),
        "task_code": highlight_python(job.task_source),
        "best_code": highlight_python(answer) if answer else None,
        "replaced": replaced_part(job.task_source, answer) if answer else None,
        "diff": unified_diff(job.task_source, answer, ("reference (task.py)", "answer.py")) if answer else [],
        "has_best_py": bool(job.mode == "optimize" and answer),
        "has_report_md": bool(outcome is not None and outcome.report_md),
    }


def download(body: str, filename: str, media_type: str) -> Response:
    return Response(
        body, media_type=media_type, headers={"content-disposition": f'attachment; filename="{filename}"'}
    )


API_PATHS = ("/api/", "/docs", "/redoc", "/openapi.json", "/healthz", "/readyz")


def install_error_pages(app: Any) -> None:
    """Errors of the UI's pages as HTML pages (sign-in redirects included); the API keeps its JSON."""
    from fastapi.exception_handlers import http_exception_handler
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def error_page(request: Request, exc: StarletteHTTPException) -> Response:
        if request.url.path.startswith(API_PATHS):
            return await http_exception_handler(request, exc)
        if exc.status_code in (301, 302, 303, 307) and exc.headers and "location" in exc.headers:
            return RedirectResponse(exc.headers["location"], status_code=exc.status_code)
        viewer = viewer_of(request, app.state.web_engine) if exc.status_code != 401 else None
        return TEMPLATES.TemplateResponse(
            request,
            "error.html",
            {"viewer": viewer, "path": request.url.path, "status": exc.status_code, "detail": exc.detail},
            status_code=exc.status_code,
        )
