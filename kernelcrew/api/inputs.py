"""Refusals that every route shares: NUL bytes in a path or query, and validation errors kept small."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

#: Characters of a refused value, a location part or a message that a 422 body repeats.
ECHO_CHARS = 200
#: Validation errors a 422 body lists (a body of many bad items has as many errors).
MAX_ERRORS = 10


def shorten(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def reject_nul(request: Request) -> None:
    """An app-wide dependency: 422 for a NUL byte in the path or a query parameter (no column stores one)."""
    if "\x00" in request.url.path:
        raise HTTPException(422, "the path contains a NUL byte (\\x00)")
    for name, value in request.query_params.multi_items():
        if "\x00" in name or "\x00" in value:
            shown = shorten(name.replace("\x00", "\\x00"), 40)
            raise HTTPException(422, f"the query parameter {shown!r} contains a NUL byte (\\x00)")


def _bounded(error: dict[str, Any]) -> dict[str, Any]:
    out = dict(error)
    out["loc"] = [shorten(p, 64) if isinstance(p, str) else p for p in error.get("loc", ())]
    out["msg"] = shorten(str(error.get("msg", "")), 4 * ECHO_CHARS)
    if "input" in out:
        given = out["input"]
        text = given if isinstance(given, str) else json.dumps(given, default=str)
        if len(text) > ECHO_CHARS:
            out["input"] = shorten(text)
    if "ctx" in out:
        out["ctx"] = {k: shorten(v) if isinstance(v, str) else v for k, v in out["ctx"].items()}
    return out


async def bounded_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 (``{"detail": [errors]}``) with each refused value cut short and at most
    ``MAX_ERRORS`` errors, so a 5 MB field never comes back in the answer."""
    errors = jsonable_encoder(exc.errors())
    detail = [_bounded(e) for e in errors[:MAX_ERRORS]]
    if len(errors) > MAX_ERRORS:
        detail.append({"loc": [], "msg": f"and {len(errors) - MAX_ERRORS} more errors", "type": "too_many"})
    return JSONResponse({"detail": detail}, status_code=422)


__all__ = ["ECHO_CHARS", "bounded_validation_error", "reject_nul", "shorten"]
