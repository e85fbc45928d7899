"""Liveness and readiness: ``/healthz`` (the process answers) and ``/readyz`` (database and broker)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text

from kernelcrew.api.deps import EngineDep, SettingsDep
from kernelcrew.api.schemas import Health, Readiness, errors

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
    least one runs: 200 when all hold, 503 naming what failed."""
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
    answer = Readiness(ok=ready and checks["database"] == checks["broker"] == "ok", **checks)
    return JSONResponse(answer.model_dump(), status_code=200 if answer.ok else 503)
