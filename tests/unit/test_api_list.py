"""The API's job list (``GET /api/v1/jobs``): filters by status, mode, verdict, answer kind and task
name over all of the caller's jobs, then pages; bad filter values are refused by name.

In-process on SQLite, no orchestrator: the jobs are stored with the results an orchestrator writes.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from kernelcrew.api.app import create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
H100_REPORT = json.loads((FIXTURES / "reports" / "h100_swish_residual.json").read_text())
SOFTMAX = '"""Row softmax of a wide matrix."""\nimport torch\n'


def verify_result(verdict: str) -> dict:
    check = {"verdict": verdict, "stage": "done" if verdict == "pass" else "correctness", "message": "m",
             "seed": 1, "device": "cpu", "precision": "strict", "kind": "kernel"}  # fmt: skip
    return {"verify": check, "verdict": verdict, "timing": None, "speedup": None}


def no_gain_result(compile_ms: dict[str, float]) -> dict:
    """An optimize run that verified candidates and kept none: none was faster than eager."""
    baseline = {"eager_ms": 2.0, "compile_ms": compile_ms}
    return {"status": "no_significant_gain", "device": "cuda", "clock": "cuda-event", "baseline": baseline,
            "best": None, "iterations": [{"step": 1, "verdict": "pass"}]}  # fmt: skip


class Jobs:
    """ann's jobs, stored oldest first one second apart, and a client with her token."""

    def __init__(self, tmp_path) -> None:
        self.settings = Settings(
            data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0", api_rate_per_minute=1000
        )
        self.engine = get_engine(self.settings)
        with transaction(self.engine) as s:
            self.token = jobs.create_token(s, "ann", ["submit", "read"])[1]
            self.bob_token = jobs.create_token(s, "bob", ["submit", "read"])[1]
        self.t0 = jobs.now() - timedelta(days=1)
        self.count = 0
        self.client = TestClient(create_app(self.settings))
        self.client.headers["authorization"] = f"Bearer {self.token}"

    def add(
        self,
        status: str,
        mode: str = "verify",
        result: dict | None = None,
        task: str = TASK,
        user: str = "ann",
    ) -> str:
        self.count += 1
        with transaction(self.engine) as s:
            owner = s.scalar(select(jobs.User.id).where(jobs.User.name == user))
            when = self.t0 + timedelta(seconds=self.count)
            job = jobs.Job(id=jobs.new_job_id(), owner_id=owner, status=status, mode=mode, task_source=task,
                           options={}, result=result, created_at=when, updated_at=when,
                           finished_at=when if status in jobs.ENDED else None)  # fmt: skip
            s.add(job)
            return job.id

    def ids(self, query: str, **expect) -> list[str]:
        r = self.client.get(f"/api/v1/jobs?limit=100&{query}")
        assert r.status_code == 200, r.text
        body = r.json()
        for key, value in expect.items():
            assert body[key] == value, (key, body[key])
        return [j["id"] for j in body["items"]]


@pytest.fixture
def ann(tmp_path) -> Jobs:
    return Jobs(tmp_path)


def test_filters_apply_to_all_jobs_not_only_the_newest_page(ann):
    old_pass = ann.add("succeeded", result=verify_result("pass"))
    queued = [ann.add("queued", mode="optimize") for _ in range(120)]
    assert ann.ids("verdict=pass", total=1) == [old_pass]  # 120 newer jobs: beyond any one page
    assert ann.ids("verdict=none&limit=5&offset=115", total=120) == queued[4::-1]
    assert ann.ids("kind=kernel") == [old_pass]
    assert ann.ids("mode=verify") == [old_pass]
    assert ann.ids("mode=optimize&status=queued", total=120)[:2] == [queued[-1], queued[-2]]
    assert ann.ids("verdict=fail", total=0) == []


def test_each_filter_and_their_combination(ann):
    passed = ann.add("succeeded", result=verify_result("pass"))
    failed = ann.add("succeeded", result=verify_result("fail"))
    improved = ann.add("succeeded", mode="optimize", result=H100_REPORT)
    no_gain = ann.add("succeeded", mode="optimize", result=no_gain_result({"default": 2.5}), task=SOFTMAX)
    compiled = ann.add("succeeded", mode="optimize", result=no_gain_result({"default": 1.0}), task=SOFTMAX)
    cancelled = ann.add("cancelled", mode="optimize", result=H100_REPORT)
    queued = ann.add("queued", mode="optimize", task=SOFTMAX)
    ann.add("succeeded", result=verify_result("pass"), user="bob")  # never in ann's list

    assert ann.ids("", total=7) == [queued, cancelled, compiled, no_gain, improved, failed, passed]
    assert ann.ids("verdict=pass") == [cancelled, improved, passed]
    assert ann.ids("verdict=no_gain") == [compiled, no_gain]
    assert ann.ids("verdict=fail") == [failed]
    assert ann.ids("verdict=none") == [queued]
    assert ann.ids("kind=reference") == [no_gain]
    assert ann.ids("kind=compiler") == [compiled]
    assert ann.ids("mode=optimize&verdict=pass") == [cancelled, improved]
    assert ann.ids("status=succeeded&mode=optimize&verdict=pass") == [improved]
    assert ann.ids("q=SOFTMAX") == [queued, compiled, no_gain]  # any case
    assert ann.ids("q=softmax&verdict=no_gain&kind=compiler") == [compiled]
    assert ann.ids("q=pointwise%20chain&mode=verify") == [failed, passed]
    assert ann.ids("q=no%20such%20task", total=0) == []
    assert ann.ids("verdict=pass&limit=2&offset=1", total=3, limit=2, offset=1) == [improved, passed]


def test_no_gain_and_a_cancelled_best_say_what_their_speedup_is(ann):
    no_gain = ann.add("succeeded", mode="optimize", result=no_gain_result({"default": 2.5}))
    compiled = ann.add("succeeded", mode="optimize", result=no_gain_result({"default": 1.0}))
    improved = ann.add("succeeded", mode="optimize", result=H100_REPORT)
    cancelled = ann.add("cancelled", mode="optimize", result=H100_REPORT)
    items = {j["id"]: j for j in ann.client.get("/api/v1/jobs").json()["items"]}
    assert items[no_gain]["verdict"] == "no_gain" and items[no_gain]["answer_kind"] == "reference"
    assert items[no_gain]["speedup"] is None and items[no_gain]["speedup_timing"] is None
    assert items[compiled]["answer_kind"] == "compiler" and items[compiled]["speedup"] == 2.0
    assert items[compiled]["speedup_timing"] == "baseline" and items[compiled]["speedup_ci"] is None
    assert items[improved]["speedup_timing"] == "final"
    assert items[cancelled]["verdict"] == "pass" and items[cancelled]["speedup_timing"] == "step"
    assert items[cancelled]["speedup"] == H100_REPORT["best"]["speedup_eager"]


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("verdict=passed", "verdict"),
        ("kind=triton", "kind"),
        ("mode=tune", "mode"),
        ("status=done", "status"),
        ("q=", "q"),
        ("q=" + "x" * 201, "q"),
        ("limit=0", "limit"),
        ("offset=-1", "offset"),
    ],
)
def test_a_bad_filter_value_is_a_422_that_names_it(ann, query, name):
    r = ann.client.get(f"/api/v1/jobs?{query}")
    assert r.status_code == 422, r.text
    assert [p["loc"] for p in r.json()["detail"]] == [["query", name]]
    assert len(r.text) < 2000


def test_the_filters_are_documented_in_openapi(ann):
    op = ann.client.get("/openapi.json").json()["paths"]["/api/v1/jobs"]["get"]
    params = {p["name"]: p for p in op["parameters"]}
    assert {"status", "mode", "verdict", "kind", "q", "limit", "offset"} <= set(params)

    def enum(name: str) -> set[str]:
        schema = params[name]["schema"]
        return {v for s in schema.get("anyOf", [schema]) for v in s.get("enum", [])}

    assert enum("verdict") == {"pass", "no_gain", "fail", "none"}
    assert enum("kind") == {"kernel", "hybrid", "library", "compiler", "reference"}
    assert enum("mode") == {"optimize", "verify"}
    assert all(params[n].get("description") for n in ("status", "mode", "verdict", "kind", "q"))
    assert {"200", "401", "403", "422", "429"} <= set(op["responses"])
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobsPublic")
