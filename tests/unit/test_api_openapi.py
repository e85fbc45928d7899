"""The OpenAPI document tells the truth: every answer of the main routes has a documented status
code, content type and schema, and no request the schema allows gets a server error.

Schemathesis generates requests (with a live token) against the app in-process (ASGI); a second
test sends one valid request per route with real job ids (generated ids never name a job) and
checks each answer against the schema. In-process on SQLite, no orchestrator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kernelcrew.api.app import PREFIX, create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
H100_REPORT = json.loads((FIXTURES / "reports" / "h100_swish_residual.json").read_text())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Service:
    app: FastAPI
    token: str
    queued: str
    ended: str
    done: str
    verify: str


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Service:
    s = Settings(
        data_dir=tmp_path_factory.mktemp("openapi"),
        broker_url="redis://127.0.0.1:6379/11",  # reachable, so /readyz and /workers answer 200
        api_rate_per_minute=1_000_000,
        api_max_active_jobs=1_000_000,
        api_max_upload_bytes=20_000,
        api_max_kb_import_bytes=20_000,
    )
    with transaction(get_engine(s)) as session:
        tok, token = jobs.create_token(session, "alice", ["submit", "read"])

        def job(status: str, mode: str = "optimize", result: dict[str, Any] | None = None) -> str:
            row = jobs.Job(
                id=jobs.new_job_id(),
                owner_id=tok.user_id,
                token_id=tok.id,
                status=status,
                mode=mode,
                task_source=TASK,
                options={},
                result=result,
                created_at=jobs.now(),
            )
            session.add(row)
            session.flush()
            jobs.add_event(session, row.id, "status", {"status": status})
            return row.id

        queued, ended = job("queued"), job("failed")
        done = job(
            "succeeded", result={**H100_REPORT, "_best_py": "class ModelNew: ...", "_report_md": "# r"}
        )
        verify = job("succeeded", "verify")
    return Service(create_app(s), token, queued, ended, done, verify)


@pytest.fixture
def api_schema(service: Service):
    schema = schemathesis.openapi.from_asgi("/openapi.json", service.app)
    schema.config.update(headers={"authorization": f"Bearer {service.token}"})
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_documented_answers_and_no_server_error(case):
    """Generated requests (authenticated with a real token) never get a 5xx, and every answer's
    status code, content type and body are those the OpenAPI document gives for the route."""
    case.call_and_validate(checks=CHECKS)


@pytest.fixture
def client(service: Service) -> Iterator[TestClient]:
    with TestClient(service.app, headers={"authorization": f"Bearer {service.token}"}) as c:
        yield c


def test_valid_requests_on_real_jobs_match_the_documented_schemas(service: Service, client: TestClient):
    spec = schemathesis.openapi.from_asgi("/openapi.json", service.app)
    calls = [
        ("GET", "/healthz", None, 200),
        ("GET", "/readyz", None, 200),
        ("GET", f"{PREFIX}/jobs", None, 200),
        ("GET", f"{PREFIX}/jobs/{service.queued}", None, 200),
        ("GET", f"{PREFIX}/jobs/{service.done}/result", None, 200),
        ("GET", f"{PREFIX}/jobs/{service.verify}/result", None, 200),
        ("GET", f"{PREFIX}/jobs/{service.queued}/result", None, 409),
        ("GET", f"{PREFIX}/jobs/{service.ended}/events", None, 200),
        ("POST", f"{PREFIX}/jobs/{service.verify}/messages", {"text": "fp32"}, 409),
        ("POST", f"{PREFIX}/jobs/{service.ended}/messages", {"text": "fp32"}, 202),
        ("POST", f"{PREFIX}/jobs/{service.queued}/cancel", None, 200),
        ("POST", f"{PREFIX}/jobs/{service.queued}/cancel", None, 409),
        ("GET", f"{PREFIX}/jobs/nope", None, 404),
        ("GET", f"{PREFIX}/kb", None, 200),
        ("GET", f"{PREFIX}/kb?arch=volta", None, 422),
        ("GET", f"{PREFIX}/workers", None, 200),
    ]
    templates = {
        f"{PREFIX}/jobs/{service.queued}": f"{PREFIX}/jobs/{{job_id}}",
        f"{PREFIX}/jobs/nope": f"{PREFIX}/jobs/{{job_id}}",
    }
    for method, url, body, status in calls:
        r = client.request(method, url, json=body)
        assert r.status_code == status, (method, url, r.status_code, r.text[:500])
        path = url.split("?")[0]
        for job_id in (service.queued, service.ended, service.done, service.verify):
            path = path.replace(job_id, "{job_id}")
        path = templates.get(path, path)
        spec[path][method].validate_response(r)
