"""The API's limits and job handling on SQLite, in-process (no orchestrator: jobs stay queued)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kernelcrew.api.app import create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()


@pytest.fixture
def api(tmp_path):
    # No broker: the worker inventory cannot tell, so jobs are accepted whatever their device.
    s = Settings(
        data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0", api_rate_per_minute=8, api_max_active_jobs=1
    )
    with transaction(get_engine(s)) as session:
        token = jobs.create_token(session, "ann", ["submit", "read"])[1]
    client = TestClient(create_app(s))
    client.headers["authorization"] = f"Bearer {token}"
    return client


def test_multipart_upload_cancel_and_the_active_jobs_limit(api):
    r = api.post(
        "/api/v1/jobs", files={"task": ("task.py", TASK.encode())}, data={"options": '{"max_iters": 1}'}
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["mode"] == "optimize"
    assert job["options"]["max_iters"] == 1 and job["options"]["device"] == "cuda"
    r = api.post("/api/v1/jobs", json={"task": TASK})
    assert r.status_code == 429 and "at most 1" in r.json()["detail"]
    assert api.post(f"/api/v1/jobs/{job['id']}/messages", json={"text": "only triton"}).status_code == 202
    assert api.post(f"/api/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert api.post(f"/api/v1/jobs/{job['id']}/cancel").status_code == 409
    assert api.get(f"/api/v1/jobs/{job['id']}/result").json()["status"] == "cancelled"
    assert api.post("/api/v1/jobs", json={"task": TASK}).status_code == 201  # the slot is free again


def test_the_request_rate_per_token_is_limited(api):
    codes = [api.get("/api/v1/jobs").status_code for _ in range(10)]
    assert codes[:8] == [200] * 8 and codes[8:] == [429, 429]


def test_unknown_or_bad_options_are_refused(api):
    r = api.post("/api/v1/jobs", json={"task": TASK, "options": {"max_iter": 3}})
    assert r.status_code == 422 and "max_iter" in r.json()["detail"]
    r = api.post("/api/v1/jobs", json={"task": TASK, "options": {"device": "tpu"}})
    assert r.status_code == 422 and "device" in r.json()["detail"]
