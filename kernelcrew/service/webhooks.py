"""A job's webhook: the POST that tells the submitter's URL how the job ended, signed with its token's secret.

Part of the job domain because the signing secret is the submitting token's (``ApiToken.webhook_secret``)
and the receiver checks it against that token; the orchestrator only decides when to send it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from typing import Any

from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "x-kernelcrew-signature"


def sign(secret: str, body: bytes) -> str:
    """The signature header's value: ``sha256=`` and the body's HMAC-SHA256 under ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def send_webhook(
    settings: Settings, engine: Any, job_id: str, url: str, status: str, error: str | None
) -> bool:
    """POST ``{"id", "status", "error"}`` signed ``X-Kernelcrew-Signature: sha256=HMAC(secret, body)``,
    retried with a doubling pause up to ``settings.webhook_attempts`` times; True once delivered (2xx)."""
    import httpx

    with transaction(engine) as s:
        job = s.get(jobs.Job, job_id)
        tok = s.get(jobs.ApiToken, job.token_id) if job and job.token_id else None
        secret = tok.webhook_secret if tok else ""
    body = json.dumps({"id": job_id, "status": status, "error": error}, sort_keys=True).encode()
    headers = {"content-type": "application/json", SIGNATURE_HEADER: sign(secret, body)}
    for attempt in range(settings.webhook_attempts):
        try:
            r = httpx.post(url, content=body, headers=headers, timeout=10)
            if r.status_code < 300:
                return True
        except httpx.HTTPError as exc:
            log.info("webhook of %s: %s", job_id, exc)
        time.sleep(2**attempt)
    log.warning("webhook of job %s to %s not delivered", job_id, url)
    return False


__all__ = ["SIGNATURE_HEADER", "send_webhook", "sign"]
