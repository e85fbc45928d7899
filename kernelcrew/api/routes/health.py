"""Liveness and readiness: ``/healthz`` (the process answers) and ``/readyz`` (database and broker,
with the workers the inventory shows)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from kernelcrew.api.deps import EngineDep, SettingsDep
from kernelcrew.api.schemas import Health, Readiness, WorkersSeen, errors
from kernelcrew.config import Settings

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses=errors(422))
def read_health() -> Health:
    """The API process answers (no dependency is checked)."""
    return Health(ok=True)


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={
        **errors(422),
        503: {
            "model": Readiness,
            "description": "The database or the broker does not answer, or no orchestrator runs.",
        },
    },
)
def read_readiness(request: Request, engine: EngineDep, settings: SettingsDep) -> JSONResponse:
    """Whether the database and the broker answer and, where ``serve`` supervises orchestrators, at
    least one runs: 200 when all hold, 503 naming what failed. The workers online are reported, not
    required: with none, jobs wait in their queue until one comes, so the service is still ready."""
    from kernelcrew.worker import store

    checks: dict[str, str] = {}
    pool = getattr(request.app.state, "orchestrators", None)
    ready = True
    if pool is not None:
        ready, checks["orchestrators"] = pool.status()
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # any failure is the answer: not ready, and why
        checks["database"] = f"error: {exc}"
    try:
        store.client(settings.broker_url).ping()
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {exc}"
    ok = ready and checks["database"] == checks["broker"] == "ok"
    answer = Readiness(ok=ok, **checks, workers=workers_seen(settings, checks["broker"] == "ok"))
    return JSONResponse(answer.model_dump(), status_code=200 if answer.ok else 503)


def workers_seen(settings: Settings, broker_ok: bool) -> WorkersSeen:
    """The worker inventory as ``/readyz`` reports it (read only when the broker answered)."""
    import redis

    from kernelcrew.worker.inventory import device_counts, list_workers

    if not broker_ok:
        return WorkersSeen(count=None, detail="unknown: the broker does not answer")
    try:
        online = list_workers(settings)
    except (redis.RedisError, ValueError, TypeError) as exc:  # a record this version cannot read
        return WorkersSeen(count=None, detail=f"error: {exc}")
    if not online:
        return WorkersSeen(count=0, detail="none online: jobs wait in their queue until a worker comes")
    devices = device_counts(online)
    listed = ", ".join(f"{n} x {label}" for label, n in devices.items())
    return WorkersSeen(count=len(online), devices=devices, detail=f"{len(online)} online: {listed}")
