"""Who a request acts for: the principal behind an API token, shared by the REST API and the web UI.

Tokens are checked by :func:`kernelcrew.service.jobs.authenticate`; a principal holds what the
check found and answers whether it may act with a scope (``admin`` may do anything).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Principal:
    """Who a request acts for: the token's user (and team), the token, and the token's scopes."""

    user_id: int
    user: str
    team: str | None
    token_id: int
    scopes: list[str]

    def can(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def principal_for_token(session: Any, token: str) -> Principal | None:
    """The principal of a live ``token``, or None when it is unknown or revoked."""
    from kernelcrew.service import jobs

    found = jobs.authenticate(session, token)
    if found is None:
        return None
    tok, user = found
    return Principal(user.id, user.name, user.team, tok.id, list(tok.scopes))


__all__ = ["Principal", "principal_for_token"]
