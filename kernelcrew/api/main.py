"""The REST API's app: jobs, their events (SSE) and chat, the knowledge base, the workers; ``/api/v1``.

The API only stores and reads: jobs are run by orchestrators (``kernelcrew orchestrator``), never in
this process. Every route but the health checks needs a bearer token (``kernelcrew token create``)
with the right scope; a job is visible to its owner only (404 to anyone else, admins aside).
:func:`create_app` builds the app, its shared state and middleware, and includes one router per
noun (``kernelcrew/api/routes/``); the browser UI is mounted on the same app.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline

from kernelcrew.api.deps import RateLimiter
from kernelcrew.api.inputs import bounded_validation_error, reject_nul
from kernelcrew.api.routes import health, jobs, kb, workers
from kernelcrew.config import Settings, get_settings
from kernelcrew.knowledge_base.db import get_engine

PREFIX = "/api/v1"


def create_app(settings: Settings | None = None) -> FastAPI:
    """The API (and the web UI) for ``settings`` (default: the environment's)."""
    s = settings or get_settings()
    engine = get_engine(s)
    app = FastAPIOffline(  # /docs and /redoc with their assets served from here, not from a CDN
        title="kernelcrew",
        version="1",
        docs_url="/docs",
        redoc_url="/redoc",
        static_url="/docs/assets",
        openapi_url="/openapi.json",
        dependencies=[Depends(reject_nul)],
    )
    app.state.settings = s
    app.state.engine = engine
    app.state.limiter = RateLimiter(s.api_rate_per_minute)
    app.state.kb_seeded = False
    app.add_exception_handler(RequestValidationError, bounded_validation_error)  # type: ignore[arg-type]

    api = APIRouter(prefix=PREFIX)
    for module in (jobs, kb, workers):
        api.include_router(module.router)
    app.include_router(health.router)
    app.include_router(api)

    from kernelcrew.web import mount_web

    mount_web(app, s, engine)
    return app


__all__ = ["PREFIX", "create_app"]
