"""Dependencies the API's routes share: settings, engine, a database session, the caller and its scopes.

Used as ``Annotated`` aliases (``SessionDep``, ``CurrentPrincipal``, ``Reader``, ``Submitter``);
:func:`kernelcrew.api.main.create_app` puts the settings, the engine and the rate limiter on
``app.state``, so these read them from the request and no module holds global state.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs
from kernelcrew.service.auth import Principal, principal_for_token


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


def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_app_engine(request: Request) -> Engine:
    return request.app.state.engine


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
EngineDep = Annotated[Engine, Depends(get_app_engine)]


def get_session(engine: EngineDep) -> Iterator[Session]:
    """One transaction around the route: committed when it returns, rolled back when it raises."""
    with transaction(engine) as session:
        yield session


#: Ends with the route function, before the answer is sent: a failed commit is never a sent 2xx.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

bearer = HTTPBearer(auto_error=False)


def get_current_principal(
    request: Request,
    engine: EngineDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    """The caller of a bearer token (401 without a live one; 429 past the token's rate)."""
    challenge = {"WWW-Authenticate": "Bearer"}
    if creds is None or not creds.credentials:
        raise HTTPException(401, "a bearer token is needed", headers=challenge)
    with transaction(engine) as session:
        who = principal_for_token(session, creds.credentials)
    if who is None:
        raise HTTPException(401, "the token is unknown or revoked", headers=challenge)
    limiter: RateLimiter = request.app.state.limiter
    if not limiter.allow(who.token_id):
        raise HTTPException(429, f"more than {limiter.per_minute} requests a minute with this token")
    return who


CurrentPrincipal = Annotated[Principal, Depends(get_current_principal)]


def require_scope(scope: str) -> Callable[[Principal], Principal]:
    """A dependency: the caller, if its token has ``scope`` (403 otherwise)."""

    def dep(who: CurrentPrincipal) -> Principal:
        if not who.can(scope):
            raise HTTPException(403, f"this token lacks the {scope!r} scope")
        return who

    return dep


Reader = Annotated[Principal, Depends(require_scope("read"))]
Submitter = Annotated[Principal, Depends(require_scope("submit"))]


def own_job(session: Session, job_id: str, who: Principal) -> jobs.Job:
    """The job ``job_id`` if ``who`` owns it (or is an admin); 404 otherwise, so others' jobs do not exist."""
    job = session.get(jobs.Job, job_id)
    if job is None or (job.owner_id != who.user_id and "admin" not in who.scopes):
        raise HTTPException(404, f"no job {job_id}")
    return job


__all__ = [
    "CurrentPrincipal",
    "EngineDep",
    "RateLimiter",
    "Reader",
    "SessionDep",
    "SettingsDep",
    "Submitter",
    "own_job",
    "require_scope",
]
