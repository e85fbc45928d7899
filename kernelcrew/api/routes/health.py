"""Liveness and readiness: ``/healthz`` (the process answers) and ``/readyz`` (database and broker)."""

from __future__ import annotations

from fastapi import APIRouter
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
        503: {"model": Readiness, "description": "The database or the broker does not answer."},
    },
)
def read_readiness(engine: EngineDep, settings: SettingsDep) -> JSONResponse:
    """Whether the database and the broker answer: 200 when both do, 503 naming what failed."""
    from kernelcrew.worker import store

    checks: dict[str, str] = {}
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
    ready = Readiness(ok=all(v == "ok" for v in checks.values()), **checks)
    return JSONResponse(ready.model_dump(), status_code=200 if ready.ok else 503)
