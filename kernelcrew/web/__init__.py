"""The browser UI, served by the API's app: server-rendered pages, vendored static files, no CDN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from kernelcrew.config import Settings

STATIC_DIR = Path(__file__).parent / "static"


def mount_web(app: FastAPI, settings: Settings, engine: Any) -> None:
    """Add the UI's pages and its static files to the API's app (one process serves both)."""
    from kernelcrew.web.routes import build_router, install_error_pages

    app.include_router(build_router(settings, engine))  # before the mount: it serves /static/code.css
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.state.web_engine = engine  # the error pages show who is signed in
    install_error_pages(app)


__all__ = ["mount_web"]
