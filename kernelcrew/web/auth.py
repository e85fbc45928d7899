"""Sign-in for the browser: the API token in an HttpOnly SameSite=Strict cookie, and CSRF tokens.

The cookie holds the API token itself and every request checks it with
:func:`kernelcrew.service.jobs.authenticate`, the API's bearer check, so a revoked token signs the
browser out at once and there is no second session store to keep in step. Forms of a signed-in user
carry ``HMAC(token, "csrf")``: a page on another origin cannot read the token, so it cannot forge it.
The sign-in form, before there is a session, uses a double-submit cookie instead.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response

from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs
from kernelcrew.service.auth import Principal

SESSION_COOKIE = "kc_session"
SIGNIN_COOKIE = "kc_signin"
SESSION_MAX_AGE_S = 12 * 3600


@dataclass
class Viewer:
    """The signed-in user of a page, and the CSRF token their forms must carry."""

    who: Principal
    csrf: str


def csrf_for(token: str) -> str:
    return hmac.new(token.encode(), b"kernelcrew-web-csrf", hashlib.sha256).hexdigest()


def principal_for(engine: Any, token: str) -> Principal | None:
    """The token's principal when it is live, else None: the same check as the API's bearer auth."""
    with transaction(engine) as session:
        found = jobs.authenticate(session, token)
        if found is None:
            return None
        tok, user = found
        return Principal(user.id, user.name, user.team, tok.id, list(tok.scopes))


def viewer_of(request: Request, engine: Any) -> Viewer | None:
    token = request.cookies.get(SESSION_COOKIE)
    who = principal_for(engine, token) if token else None
    return None if who is None else Viewer(who, csrf_for(token))


def require_viewer(request: Request, engine: Any, scope: str = "read") -> Viewer:
    """The viewer, or a redirect to the sign-in page (303); 403 when the token lacks ``scope``."""
    viewer = viewer_of(request, engine)
    if viewer is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(303, "sign in first", headers={"location": f"/signin?next={target}"})
    if not viewer.who.can(scope):
        raise HTTPException(403, f"this token lacks the {scope!r} scope")
    return viewer


def check_csrf(sent: object, expected: str) -> None:
    """Refuse (403) a form whose CSRF field is missing or wrong."""
    if not isinstance(sent, str) or not sent or not hmac.compare_digest(sent, expected):
        raise HTTPException(403, "the form's CSRF token is missing or wrong; reload the page and try again")


def new_signin_nonce() -> str:
    return secrets.token_urlsafe(24)


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int) -> None:
    """HttpOnly, SameSite=Strict, path /; Secure whenever the page was served over HTTPS."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )


__all__ = [
    "SESSION_COOKIE",
    "SESSION_MAX_AGE_S",
    "SIGNIN_COOKIE",
    "Viewer",
    "check_csrf",
    "csrf_for",
    "new_signin_nonce",
    "principal_for",
    "require_viewer",
    "set_cookie",
    "viewer_of",
]
