"""The API's doors: authorization on every route, upload limits and knowledge-base imports.

In-process (FastAPI's test client) on SQLite, no orchestrator: jobs stay queued. The route table
below must name every route under ``/api/v1``; a route added without an entry fails
:func:`test_every_api_route_is_in_the_table`, so none goes untested.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from kernelcrew.api.app import PREFIX, create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
MAX_UPLOAD = 20_000
VALIDATE_S = 10.0  # a task that allocates 100 GB at import must get there under two test processes

KB_SOURCE = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    pass\n"


def kb_file(**changes: object) -> dict:
    """A `kernelcrew kb export` file with one record (its fields changed by ``changes``)."""
    record = {
        "id": "8a3c1d52-4b8e-4c55-9a34-3f1f4c2b9e10",
        "gpu_model": "h100-sxm",
        "arch": "sm_90",
        "signature": "ops=relu | dtypes=float32 | shapes=large",
        "pattern_kinds": ["pointwise"],
        "strategy": "fused_pointwise",
        "candidate_source": KB_SOURCE,
        "clock": "cuda-event",
        "before_ms": 1.0,
        "after_ms": 0.5,
        "speedup_eager": 2.0,
        "owner": "mallory",
        "visibility": "public",
        "created_at": "2026-01-01T00:00:00Z",
        **changes,
    }
    return {
        "format": "kernelcrew-kb",
        "version": 1,
        "exported_at": "2026-01-02T00:00:00Z",
        "records": [record],
    }


#: (method, path) -> the scope it needs, and the body a valid request sends.
ROUTES: dict[tuple[str, str], tuple[str, dict | None]] = {
    ("POST", f"{PREFIX}/jobs"): ("submit", {"task": TASK, "mode": "optimize"}),
    ("GET", f"{PREFIX}/jobs"): ("read", None),
    ("GET", f"{PREFIX}/jobs/{{job_id}}"): ("read", None),
    ("POST", f"{PREFIX}/jobs/{{job_id}}/cancel"): ("submit", None),
    ("GET", f"{PREFIX}/jobs/{{job_id}}/result"): ("read", None),
    ("GET", f"{PREFIX}/jobs/{{job_id}}/events"): ("read", None),
    ("POST", f"{PREFIX}/jobs/{{job_id}}/messages"): ("submit", {"text": "keep it in fp32"}),
    ("GET", f"{PREFIX}/kb"): ("read", None),
    ("POST", f"{PREFIX}/kb/import"): ("submit", kb_file()),
    ("GET", f"{PREFIX}/workers"): ("read", None),
}
JOB_ROUTES = [route for route in ROUTES if "{job_id}" in route[1]]


@dataclass
class Api:
    client: TestClient
    tokens: dict[str, str]
    job_id: str
    ended_id: str
    engine: object

    def call(self, route: tuple[str, str], token: str | None, job_id: str | None = None):
        method, path = route
        headers = {"authorization": f"Bearer {token}"} if token else {}
        body = ROUTES[route][1]
        return self.client.request(
            method, path.replace("{job_id}", job_id or self.job_id), json=body, headers=headers
        )

    def job_count(self) -> int:
        with transaction(self.engine) as session:
            return session.query(jobs.Job).count()


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[Api]:
    s = Settings(
        data_dir=tmp_path_factory.mktemp("api"),
        broker_url="redis://127.0.0.1:6379/11",
        api_rate_per_minute=100_000,
        api_max_active_jobs=1000,
        api_max_upload_bytes=MAX_UPLOAD,
        api_validate_timeout_s=VALIDATE_S,
        api_max_kb_import_bytes=MAX_UPLOAD,
    )
    engine = get_engine(s)
    tokens = {}
    with transaction(engine) as session:
        for name, user, scopes in (
            ("alice", "alice", ["submit", "read"]),
            ("bob", "bob", ["submit", "read"]),
            ("reader", "alice", ["read"]),
            ("submitter", "alice", ["submit"]),
            ("revoked", "alice", ["submit", "read"]),
        ):
            tokens[name] = jobs.create_token(session, user, scopes)[1]
        jobs.revoke_token(session, tokens["revoked"])
        owner = jobs.authenticate(session, tokens["alice"])[0]
        made = [
            jobs.Job(
                id=jobs.new_job_id(),
                owner_id=owner.user_id,
                token_id=owner.id,
                status=status,
                mode="optimize",
                task_source=TASK,
                options={},
                created_at=jobs.now(),
            )
            for status in ("queued", "succeeded")
        ]
        session.add_all(made)
    with TestClient(create_app(s)) as client:
        yield Api(client, tokens, made[0].id, made[1].id, engine)


def test_every_api_route_is_in_the_table(api):
    """Read from the OpenAPI document: included routers are not flat in ``app.routes``."""
    served = {
        (method.upper(), path)
        for path, operations in api.client.app.openapi()["paths"].items()
        if path.startswith(PREFIX)
        for method in operations
    }
    assert served == set(ROUTES)


@pytest.mark.parametrize("route", list(ROUTES), ids=" ".join)
@pytest.mark.parametrize(
    "token", [None, "kc_deadbeef_not-a-token", "revoked"], ids=["no-token", "wrong", "revoked"]
)
def test_a_request_without_a_live_token_is_refused(api, route, token):
    r = api.call(route, api.tokens.get(token, token))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text


@pytest.mark.parametrize("route", list(ROUTES), ids=" ".join)
def test_a_token_without_the_scope_is_forbidden(api, route):
    scope = ROUTES[route][0]
    r = api.call(route, api.tokens["reader" if scope == "submit" else "submitter"])
    assert r.status_code == 403 and scope in r.json()["detail"], r.text


@pytest.mark.parametrize("route", JOB_ROUTES, ids=" ".join)
def test_another_users_job_does_not_exist_for_them(api, route):
    r = api.call(route, api.tokens["bob"])
    assert r.status_code == 404 and api.job_id in r.json()["detail"], r.text
    with transaction(api.engine) as session:
        job = session.get(jobs.Job, api.job_id)
        assert (job.status, job.cancel_requested) == ("queued", False)
        assert session.query(jobs.JobMessage).filter_by(job_id=api.job_id).count() == 0


@pytest.mark.parametrize(
    "last_id",
    ["\u00b2", "9" * 5000, "-1", "abc", "12"],
    ids=["superscript", "5000-digits", "neg", "abc", "12"],
)
def test_any_last_event_id_header_resumes_a_stream_without_a_server_error(api, last_id):
    """Headers are the client's: 5000 digits once made int() raise (Python's digit limit): a 500."""
    headers = {"authorization": f"Bearer {api.tokens['alice']}", "last-event-id": last_id.encode("latin-1")}
    r = api.client.get(f"{PREFIX}/jobs/{api.ended_id}/events", headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")


# -- uploads ------------------------------------------------------------------------------------


def post_task(api: Api, source: bytes, multipart: bool):
    headers = {"authorization": f"Bearer {api.tokens['alice']}"}
    if multipart:
        return api.client.post(f"{PREFIX}/jobs", files={"task": ("task.py", source)}, headers=headers)
    return api.client.post(f"{PREFIX}/jobs", json={"task": source.decode(errors="replace")}, headers=headers)


@pytest.mark.parametrize("multipart", [False, True], ids=["json", "multipart"])
@pytest.mark.parametrize(
    ("source", "status", "says"),
    [
        (TASK.encode() + b"#" * MAX_UPLOAD, 413, "at most"),
        (b"#!/bin/sh\necho pwned > /tmp/pwned\n", 422, "syntax"),
        (b"class Model:\n    def forward(self, x) return x\n", 422, "syntax"),
        (TASK.encode() + b"\nimport kernelcrew_no_such_module\n", 422, "kernelcrew_no_such_module"),
        ((FIXTURES / "hostile" / "allocate_100gb.py").read_bytes(), 422, "MemoryError"),
    ],
    ids=["too-large", "shell-script", "syntax-error", "missing-module", "100gb-at-import"],
)
def test_bad_uploads_are_refused_with_a_clear_status_and_nothing_is_stored(
    api, source, status, says, multipart
):
    before = api.job_count()
    r = post_task(api, source, multipart)
    assert r.status_code == status and says in r.json()["detail"], r.text
    assert api.job_count() == before


def test_a_task_that_is_not_utf8_is_refused(api):
    r = post_task(api, b"\xff\xfe\x00" + TASK.encode(), multipart=True)
    assert r.status_code == 422 and "UTF-8" in r.json()["detail"]


def test_a_task_that_never_finishes_importing_is_refused_within_the_bound(api):
    before = api.job_count()
    started = time.monotonic()
    r = post_task(api, (FIXTURES / "hostile" / "import_loop.py").read_bytes(), multipart=False)
    assert r.status_code == 422 and f"did not finish within {VALIDATE_S:g} s" in r.json()["detail"]
    assert time.monotonic() - started < VALIDATE_S + 10
    assert api.job_count() == before


# -- knowledge-base imports ----------------------------------------------------------------------


def kb_records(api: Api) -> list[tuple[str, str, str]]:
    from sqlalchemy import select

    from kernelcrew.knowledge_base.models import Win

    with transaction(api.engine) as session:
        rows = session.scalars(select(Win).where(Win.source == "verified").order_by(Win.owner, Win.strategy))
        return [(w.owner, w.visibility, w.strategy) for w in rows]


def import_kb(api: Api, body: object, token: str = "bob", **params: str):
    headers = {"authorization": f"Bearer {api.tokens[token]}"}
    return api.client.post(f"{PREFIX}/kb/import", json=body, params=params, headers=headers)


def test_an_import_is_stored_as_the_callers_private_records(api):
    r = import_kb(api, kb_file(strategy="import_private"))
    assert r.status_code == 200, r.text
    assert r.json()["inserted"] == 1 and r.json()["visibility"] == "private"
    assert ("bob", "private", "import_private") in kb_records(api)
    assert not [rec for rec in kb_records(api) if rec[0] == "mallory"], "the file's owner is not taken"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (kb_file(candidate_source="import socket\nclass ModelNew: ...\n"), 422, "static rules"),
        (kb_file(candidate_source="rm -rf /\n"), 422, "syntax error"),
        (kb_file(description="\x00"), 422, "control character"),
        (kb_file(params={"x": [[[[[[[[[[1]]]]]]]]]]}), 422, "nested deeper"),
        ({"records": "all of them"}, 422, "not a valid kernelcrew knowledge-base file"),
        (kb_file(description="x" * MAX_UPLOAD), 413, "at most"),
    ],
    ids=["hostile-source", "not-python", "nul", "deep-json", "not-a-file", "too-large"],
)
def test_a_bad_import_is_refused_clearly_and_nothing_is_stored(api, body, status, says):
    before = kb_records(api)
    r = import_kb(api, body)
    assert r.status_code == status and says in r.json()["detail"], r.text
    assert kb_records(api) == before


def test_public_imports_need_the_admin_scope(api):
    before = kb_records(api)
    r = import_kb(api, kb_file(strategy="import_public"), visibility="public")
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    assert kb_records(api) == before
