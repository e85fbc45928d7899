"""A job's webhook (service.webhooks): signed with the submitting token's secret, retried, bounded."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from kernelcrew.service.webhooks import send_webhook


@pytest.fixture
def ended_job(tmp_path):
    """Settings, engine, an ended job submitted with a token, and that token's webhook secret."""
    s = Settings(data_dir=tmp_path, webhook_attempts=3)
    engine = get_engine(s)
    with transaction(engine) as session:
        tok = jobs.create_token(session, "ann", ["submit"])[0]
        job = jobs.Job(
            id=jobs.new_job_id(),
            owner_id=tok.user_id,
            token_id=tok.id,
            status="succeeded",
            mode="verify",
            task_source="x",
            options={},
            created_at=jobs.now(),
        )
        session.add(job)
        secret = tok.webhook_secret
    return s, engine, job.id, secret


def test_a_webhook_is_signed_and_retried_until_delivered(ended_job):
    s, engine, job_id, secret = ended_job
    got: list[tuple[bytes, str]] = []

    class Flaky(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(
                (self.rfile.read(int(self.headers["content-length"])), self.headers["x-kernelcrew-signature"])
            )
            self.send_response(503 if len(got) == 1 else 204)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/hook"
    assert send_webhook(s, engine, job_id, url, "succeeded", None)
    server.shutdown()
    assert len(got) == 2 and got[0] == got[1]
    body, signature = got[1]
    assert json.loads(body) == {"id": job_id, "status": "succeeded", "error": None}
    assert signature == "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def test_an_unreachable_webhook_gives_up_after_its_attempts(ended_job):
    s, engine, job_id, _ = ended_job
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = s.model_copy(update={"webhook_attempts": 1})
    assert not send_webhook(s, engine, job_id, f"http://127.0.0.1:{port}/hook", "failed", "boom")


def test_the_orchestrator_sends_the_service_webhook():
    from kernelcrew.service import webhooks
    from kernelcrew.worker import orchestrator

    assert orchestrator.send_webhook is webhooks.send_webhook
    assert not hasattr(webhooks, "Orchestrator")
