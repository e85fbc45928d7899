"""The web UI in-process (FastAPI TestClient, SQLite): sign-in, cookie flags, CSRF, ownership, forms.

The browser walk against the real service is ``tests/browser``; these are the fast checks of the
rules a browser cannot see directly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from kernelcrew.api.app import create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
ROOT = Path(__file__).parents[2]
H100_REPORT = FIXTURES / "reports" / "h100_swish_residual.json"


class Site:
    def __init__(self, tmp_path: Path) -> None:
        self.settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0")
        self.engine = get_engine(self.settings)
        with transaction(self.engine) as session:
            self.tokens = {
                "ann": jobs.create_token(session, "ann", ["submit", "read"])[1],
                "bob": jobs.create_token(session, "bob", ["submit", "read"])[1],
            }
        self.app = create_app(self.settings)

    def client(self) -> TestClient:
        return TestClient(self.app, follow_redirects=False)

    def signed_in(self, user: str) -> TestClient:
        c = self.client()
        csrf = form_csrf(c.get("/signin").text)
        r = c.post("/signin", data={"csrf": csrf, "token": self.tokens[user], "next": "/jobs"})
        assert r.status_code == 303, r.text
        return c

    def job_count(self) -> int:
        with transaction(self.engine) as s:
            return s.scalar(select(func.count()).select_from(jobs.Job))


def form_csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def store_finished_job(engine, user: str, report: dict, best: str | None) -> str:
    """A finished optimize job of ``user`` whose result is ``report`` (its task file from the repository),
    with the events of its steps."""
    with transaction(engine) as s:
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == user))
        job = jobs.Job(
            id=jobs.new_job_id(), owner_id=owner, status="succeeded", mode="optimize", task_source=(ROOT / report["task"]).read_text(),
            options={"device": report["device"], "max_iters": len(report["iterations"]), "backend": "playbook",
                     "precision": "strict", "time_budget_s": 900},
            result={**report, "_best_py": best, "_report_md": "# report"} if best else report,
        )  # fmt: skip
        s.add(job)
        s.flush()
        jobs.add_event(s, job.id, "baseline", {"clock": report["clock"], **report["baseline"]})
        for it in report["iterations"]:
            jobs.add_event(s, job.id, "plan", {"strategy": it["strategy"], "params": it["params"]})
            jobs.add_event(
                s, job.id, "verify", {"verdict": it["verdict"], "stage": "done", "message": it["message"]}
            )
            jobs.add_event(
                s, job.id, "timing", {"time_ms": it["time_ms"], "speedup_eager": it["speedup_eager"]}
            )
            jobs.add_event(s, job.id, "decide", {"verdict": it["verdict"], "new_best": it["new_best"]})
        return job.id


@pytest.fixture
def site(tmp_path) -> Site:
    return Site(tmp_path)


def test_a_wrong_token_is_refused_and_a_right_one_sets_a_strict_httponly_cookie(site):
    c = site.client()
    assert c.get("/jobs").headers["location"] == "/signin?next=/jobs"
    csrf = form_csrf(c.get("/signin").text)
    r = c.post("/signin", data={"csrf": csrf, "token": "kc_00000000_nope"})
    assert r.status_code == 401 and "unknown or revoked" in r.text
    assert "kc_session" not in r.headers.get("set-cookie", "")
    r = c.post("/signin", data={"csrf": csrf, "token": site.tokens["ann"], "next": "https://evil.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/jobs"  # never off-site
    cookie = next(v for v in r.headers.get_list("set-cookie") if v.startswith("kc_session="))
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= flags
    assert "secure" not in flags  # plain HTTP here; set whenever the page is served over HTTPS
    assert c.get("/jobs").status_code == 200
    with transaction(site.engine) as s:  # revoking the token signs the browser out at once
        jobs.revoke_token(s, site.tokens["ann"])
    assert c.get("/jobs").status_code == 303


def test_forms_without_the_csrf_token_are_refused(site):
    c = site.signed_in("ann")
    assert c.post("/jobs/new", data={"task_text": TASK, "target": "cpu"}).status_code == 403
    assert c.post("/jobs/new", data={"csrf": "0" * 64, "task_text": TASK, "target": "cpu"}).status_code == 403
    assert site.job_count() == 0
    assert c.post("/signout", data={}).status_code == 403
    other = site.client()  # the sign-in form is double-submit: its field must match its cookie
    form_csrf(other.get("/signin").text)
    r = other.post("/signin", data={"csrf": "forged", "token": site.tokens["ann"]})
    assert r.status_code == 403 and "kc_session" not in r.headers.get("set-cookie", "")
    csrf = form_csrf(c.get("/jobs/new").text)
    assert c.post("/signout", data={"csrf": csrf}).headers["location"] == "/signin"


def test_the_new_job_form_shows_errors_next_to_inputs_and_queues_a_valid_job(site):
    c = site.signed_in("ann")
    csrf = form_csrf(c.get("/jobs/new").text)
    fields = {"csrf": csrf, "target": "cpu", "mode": "optimize", "max_iters": "0", "compile_modes": "fast"}
    r = c.post("/jobs/new", data={**fields, "task_text": "def (:\n"})
    assert r.status_code == 422 and site.job_count() == 0
    for name, words in (
        ("task", "not a valid task"),
        ("max_iters", "greater than"),
        ("compile_modes", "fast"),
    ):
        assert re.search(rf'id="{name}-error" class="error">[^<]*{words}', r.text), name
    assert 'aria-describedby="task-error"' in r.text
    r = c.post(
        "/jobs/new",
        data={**fields, "max_iters": "2", "compile_modes": "none", "quick": "on", "backend": "playbook"},
        files={"task_file": ("task.py", TASK.encode())},
    )
    assert r.status_code == 303, r.text
    job_id = r.headers["location"].rsplit("/", 1)[1]
    with transaction(site.engine) as s:
        job = s.get(jobs.Job, job_id)
        assert job.status == "queued" and job.task_source == TASK
        assert job.options["device"] == "cpu" and job.options["max_iters"] == 2 and job.options["quick"]
    assert "tanh(x * 2 + y)" in c.get("/jobs").text


def test_another_users_job_is_not_found(site):
    ann, bob = site.signed_in("ann"), site.signed_in("bob")
    csrf = form_csrf(bob.get("/jobs/new").text)
    r = bob.post("/jobs/new", data={"csrf": csrf, "task_text": TASK, "target": "cpu"})
    job_id = r.headers["location"].rsplit("/", 1)[1]
    assert bob.get(f"/jobs/{job_id}").status_code == 200
    for path in ("", "/best.py", "/report.json", "/events"):
        r = ann.get(f"/jobs/{job_id}{path}")
        assert r.status_code == 404 and "text/html" in r.headers["content-type"], path
    ann_csrf = form_csrf(ann.get("/jobs/new").text)
    assert ann.post(f"/jobs/{job_id}/messages", data={"csrf": ann_csrf, "text": "stop"}).status_code == 404
    assert job_id not in ann.get("/jobs").text


def test_a_gpu_report_shows_its_roofline_ncu_table_diff_and_downloads(site):
    """A real H100 report (tests/fixtures/reports) stored as a finished job's result: the GPU-only evidence."""
    report = json.loads(H100_REPORT.read_text())
    best = "class ModelNew(nn.Module):\n    pass\n"
    job_id = store_finished_job(site.engine, "ann", report, best)
    c = site.signed_in("ann")
    page = c.get(f"/jobs/{job_id}").text
    roofline = page[
        page.index('id="roofline-chart"') : page.index("</figure>", page.index('id="roofline-chart"'))
    ]
    assert "<svg" in roofline and "DRAM 3350 GB/s" in roofline and "fp32 peak 67 TFLOP/s" in roofline
    assert roofline.count('class="dot') == 2 + len(report["iterations"])  # eager, compile, each step
    assert "DRAM throughput" in page and "long_scoreboard" in page  # Nsight Compute, side by side
    assert "14.0%" in page  # the best's fraction of speed of light
    assert 'class="d-add">+class ModelNew(nn.Module):' in page
    assert c.get(f"/jobs/{job_id}/best.py").text == best
    assert json.loads(c.get(f"/jobs/{job_id}/report.json").text)["status"] == report["status"]
    assert "_best_py" not in c.get(f"/jobs/{job_id}/report.json").text


def test_a_verify_job_shows_its_verdict_and_timing(site):
    """A verify job has no steps of the crew: its check is the timeline, its verdict the outcome."""
    c = site.signed_in("ann")
    candidate = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()
    csrf = form_csrf(c.get("/jobs/new").text)
    fields = {"csrf": csrf, "target": "cpu", "mode": "verify", "task_text": TASK, "candidate_text": candidate}
    job_id = c.post("/jobs/new", data=fields).headers["location"].rsplit("/", 1)[1]
    verdict = {"verdict": "pass", "stage": "done", "message": "correct on 7 input sets", "seed": 3,
               "device": "cpu", "precision": "strict"}  # fmt: skip
    with transaction(site.engine) as s:
        job = s.get(jobs.Job, job_id)
        job.status = "succeeded"
        job.result = {"verify": verdict, "verdict": "pass", "timing": {"clock": "cpu-wall"}, "speedup": 0.5}
        jobs.add_event(s, job_id, "verify", {"candidate": "candidate", **verdict})
        jobs.add_event(s, job_id, "benchmark", {"speedup": 0.5, "clock": "cpu-wall"})
    page = c.get(f"/jobs/{job_id}").text
    assert "correct on 7 input sets" in page and "0.5x over eager (CPU timing)" in page
    assert "Not available for a verify job" in page


def test_a_rejected_candidate_shows_its_failure_and_user_text_is_escaped(site):
    c = site.signed_in("ann")
    task = TASK.replace('"""Fixture task:', '"""<script>alert(1)</script> Fixture task:', 1)
    csrf = form_csrf(c.get("/jobs/new").text)
    job_id = c.post("/jobs/new", data={"csrf": csrf, "task_text": task, "target": "cpu"}).headers["location"]
    job_id = job_id.rsplit("/", 1)[1]
    failure = "correctness: output 0 differs at index (3, 1): max abs error 0.5 <b>"
    with transaction(site.engine) as s:
        jobs.add_event(s, job_id, "plan", {"strategy": "fused_pointwise", "params": {"BLOCK_SIZE": 64}})
        jobs.add_event(s, job_id, "verify", {"verdict": "fail", "stage": "correctness", "message": failure})
        jobs.add_event(s, job_id, "decide", {"verdict": "fail", "new_best": False})
        jobs.add_event(s, job_id, "message", {"text": "<img src=x onerror=alert(1)>", "user": "ann"})
    page = c.get(f"/jobs/{job_id}").text
    assert "Rejected candidates" in page and "max abs error 0.5 &lt;b&gt;" in page
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def store_verify_job(engine, user: str, verdict: str, message: str, ci: tuple[float, float] | None) -> str:
    """An ended verify job of ``user`` on the pointwise task and its Triton candidate, with the events
    the orchestrator writes (its verify event carries no message)."""
    candidate = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()
    verdict_json = {"verdict": verdict, "stage": "done" if verdict == "pass" else "correctness",
                    "message": message, "seed": 3, "device": "cpu", "precision": "strict", "kind": "kernel"}  # fmt: skip
    timing = None
    if ci is not None:
        ratio = {"median": 1.5, "ci_low": ci[0], "ci_high": ci[1], "ci_coverage": 0.95, "significant": True,
                 "wall_median": 1.5, "graph_median": None}  # fmt: skip
        timing = {"clock": "cpu-wall", "ratios": {"candidate": ratio}}
    with transaction(engine) as s:
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == user))
        job = jobs.Job(
            id=jobs.new_job_id(), owner_id=owner, status="succeeded", mode="verify", task_source=TASK,
            candidate_source=candidate, options={"device": "cpu"},
            result={"verify": verdict_json, "verdict": verdict, "timing": timing,
                    "speedup": 1.5 if ci is not None else None},
        )  # fmt: skip
        s.add(job)
        s.flush()
        jobs.add_event(s, job.id, "verify_started", {"device": "cpu"})
        jobs.add_event(s, job.id, "verify", {"verdict": verdict, "stage": verdict_json["stage"]})
        return job.id


def list_row(html: str, job_id: str) -> str:
    """The list's row of ``job_id``."""
    at = html.index(f'href="/jobs/{job_id}"')
    return html[html.rindex("<tr>", 0, at) : html.index("</tr>", at)]


def test_a_failed_verify_job_is_not_a_green_success_and_a_passing_one_shows_its_candidate(site):
    failed = store_verify_job(site.engine, "ann", "fail", "output 0 differs at (3, 1)", None)
    passed = store_verify_job(site.engine, "ann", "pass", "correct on 7 input sets", (1.25, 1.75))
    c = site.signed_in("ann")
    listing = c.get("/jobs").text
    row = list_row(listing, failed)
    assert "status-succeeded" not in row and "status-ended" in row and 'class="pill verdict-fail"' in row
    row = list_row(listing, passed)
    assert "status-succeeded" in row and 'class="pill verdict-pass"' in row
    assert "1.5x" in row and "[1.25\u20131.75]" in row and ">kernel<" in row

    page = c.get(f"/jobs/{failed}").text
    assert "status-succeeded" not in page and 'class="pill verdict-fail"' in page
    text = page[: page.index('id="code-h"')]  # the code itself may say None
    assert "None" not in text  # the verify event has no message: its step says only the stage
    assert '<span class="detail">correctness</span>' in text

    page = c.get(f"/jobs/{passed}").text
    assert "No verified candidate" not in page and "None" not in page[: page.index('id="code-h"')]
    assert "The candidate (pass)" in page and "pointwise_kernel" in page
    assert "95% interval 1.25\u20131.75" in page
    assert "Download best.py" not in page  # a verify job has no best.py to download


def test_the_api_job_list_carries_name_verdict_speedup_interval_and_kind(site):
    report = json.loads(H100_REPORT.read_text())
    gpu_job = store_finished_job(site.engine, "ann", report, "class ModelNew(nn.Module):\n    pass\n")
    failed = store_verify_job(site.engine, "ann", "fail", "wrong", None)
    c = site.client()
    c.headers["authorization"] = f"Bearer {site.tokens['ann']}"
    items = {j["id"]: j for j in c.get("/api/v1/jobs").json()["items"]}
    best = report["best"]
    assert items[gpu_job]["verdict"] == "pass" and items[gpu_job]["answer_kind"] == best["kind"]
    assert items[gpu_job]["speedup"] == best["speedup_eager"]
    assert items[gpu_job]["speedup_ci"] == best["speedup_eager_ci"]
    assert items[gpu_job]["cpu_timing"] is False
    assert items[failed]["verdict"] == "fail" and items[failed]["speedup"] is None
    assert items[failed]["task_name"] == "Fixture task: a two-input pointwise chain, tanh(x * 2 + y)."
    assert items[gpu_job]["task_name"] != items[failed]["task_name"]
    assert c.get(f"/api/v1/jobs/{failed}").json()["verdict"] == "fail"


def test_the_job_list_filters_by_status_and_verdict(site):
    failed = store_verify_job(site.engine, "ann", "fail", "wrong", None)
    passed = store_verify_job(site.engine, "ann", "pass", "right", (1.2, 1.8))
    c = site.signed_in("ann")
    csrf = form_csrf(c.get("/jobs/new").text)
    queued = c.post("/jobs/new", data={"csrf": csrf, "task_text": TASK, "target": "cpu"}).headers["location"]
    queued = queued.rsplit("/", 1)[1]

    def shown(query: str) -> set[str]:
        html = c.get(f"/jobs{query}").text
        return {j for j in (failed, passed, queued) if f'href="/jobs/{j}"' in html}

    assert shown("") == {failed, passed, queued}
    assert shown("?verdict=fail") == {failed}
    assert shown("?verdict=pass") == {passed}
    assert shown("?verdict=none") == {queued}
    assert shown("?status=queued") == {queued}
    assert shown("?status=succeeded&verdict=pass") == {passed}
    assert shown("?status=failed") == set()
    assert "No job matches these filters" in c.get("/jobs?status=failed").text
    assert shown("?status=bogus") == {failed, passed, queued}  # an unknown value filters nothing


def test_the_answer_is_shown_as_the_part_it_replaces_with_its_kernels_apart(site):
    candidate = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()
    from kernelcrew.tools.packaging import package
    from kernelcrew.web.code import replaced_part

    replaced = replaced_part(TASK, package(candidate))  # best.py as stored: packaged for torch.compile
    text = "\n".join(d.text for d in replaced.diff)
    assert "-class Model(nn.Module):" in text and "+class ModelNew(nn.Module):" in text
    assert "-        return (x * 2 + y).tanh()" in text
    assert [p.name for p in replaced.parts] == ["pointwise_kernel", "pointwise"]  # not get_inputs, not _kc_*
    assert "_kc_" not in text
    assert replaced_part(TASK, "not python (") is None


def store_optimize_job(engine, user: str, status: str, result: dict | None, task: str = TASK) -> str:
    """An optimize job of ``user`` in ``status`` with ``result`` as the orchestrator stores it."""
    with transaction(engine) as s:
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == user))
        job = jobs.Job(id=jobs.new_job_id(), owner_id=owner, status=status, mode="optimize", task_source=task,
                       options={"device": "cuda"}, result=result, created_at=jobs.now(),
                       finished_at=jobs.now() if status in jobs.ENDED else None)  # fmt: skip
        s.add(job)
        return job.id


def no_gain_report(compile_ms: dict[str, float]) -> dict:
    """An optimize run whose candidates passed, none faster than eager (its report keeps no best)."""
    return {"status": "no_significant_gain", "stop_reason": "no gain in 3 steps", "device": "cuda",
            "clock": "cuda-event", "baseline": {"eager_ms": 2.0, "compile_ms": compile_ms}, "best": None,
            "iterations": [{"step": 1, "strategy": "fused_pointwise", "verdict": "pass", "new_best": False}]}  # fmt: skip


def test_a_run_without_gain_is_not_a_failure_and_names_its_answer(site):
    reference = store_optimize_job(site.engine, "ann", "succeeded", no_gain_report({"default": 2.6}))
    compiled = store_optimize_job(
        site.engine, "ann", "succeeded", no_gain_report({"max-autotune": 1.6, "default": 1.8})
    )
    c = site.signed_in("ann")
    listing = c.get("/jobs").text
    for job_id, kind in ((reference, "reference"), (compiled, "compiler")):
        row = list_row(listing, job_id)
        assert "verdict-fail" not in row and 'class="pill verdict-nogain"' in row and ">no gain<" in row
        assert "status-succeeded" in row and f">{kind}<" in row

    page = c.get(f"/jobs/{reference}").text
    assert "verdict-fail" not in page and "No verified candidate" not in page
    assert "the answer is the reference, your module as it is" in page
    assert "No candidate was faster than eager, so there is no best source" in page
    page = c.get(f"/jobs/{compiled}").text
    assert "the answer is torch.compile (mode max-autotune)" in page
    assert "1.25x" in page  # eager 2.0 ms over compile 1.6 ms, from the baseline timing

    assert set(shown_ids(c, "?verdict=no_gain", reference, compiled)) == {reference, compiled}
    assert shown_ids(c, "?verdict=fail", reference, compiled) == []
    assert shown_ids(c, "?kind=compiler", reference, compiled) == [compiled]


def test_a_cancelled_job_keeps_its_best_and_says_its_timing_is_the_steps(site):
    report = json.loads(H100_REPORT.read_text())
    report["stop_reason"] = "cancelled by its owner"
    cancelled = store_optimize_job(
        site.engine, "ann", "cancelled", {"report": report, "best_source": "class ModelNew: pass\n"}
    )
    finished = store_finished_job(
        site.engine, "ann", json.loads(H100_REPORT.read_text()), "class ModelNew: pass\n"
    )
    c = site.signed_in("ann")
    page = c.get(f"/jobs/{cancelled}").text
    assert 'class="pill verdict-pass"' in page and "Download best.py" in page
    assert "the step's timing (no final timing)" in page
    assert "the job was cancelled before its final timing" in page
    page = c.get(f"/jobs/{finished}").text
    assert "no final timing" not in page and "cancelled before" not in page


def shown_ids(c: TestClient, query: str, *ids: str) -> list[str]:
    html = c.get(f"/jobs{query}").text
    return [j for j in ids if f'href="/jobs/{j}"' in html]


def test_the_web_list_filters_all_jobs_and_pages_through_them(site):
    """The page's filters are the API's query: a match older than the newest 100 jobs is found, and
    the list pages through every job with its filters kept in the links."""
    old_pass = store_verify_job(site.engine, "ann", "pass", "right", (1.2, 1.8))
    softmax = store_optimize_job(
        site.engine, "ann", "queued", None, task='"""Row softmax."""\nimport torch\n'
    )
    with transaction(site.engine) as s:  # 130 newer queued jobs
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == "ann"))
        s.add_all(
            jobs.Job(
                id=jobs.new_job_id(),
                owner_id=owner,
                status="queued",
                mode="optimize",
                task_source=TASK,
                options={},
                created_at=jobs.now(),
            )
            for _ in range(130)
        )
    c = site.signed_in("ann")
    assert shown_ids(c, "?verdict=pass", old_pass) == [old_pass]
    assert shown_ids(c, "?mode=verify", old_pass) == [old_pass]
    assert shown_ids(c, "?kind=kernel", old_pass) == [old_pass]
    assert shown_ids(c, "?q=SOFTMAX", old_pass, softmax) == [softmax]
    assert shown_ids(c, "?mode=optimize&q=softmax&status=queued", softmax) == [softmax]
    assert shown_ids(c, "?q=softmax&verdict=pass", softmax, old_pass) == []

    first = c.get("/jobs").text
    assert "1\u2013100 of 132 jobs" in first and old_pass not in first and 'rel="prev"' not in first
    older = re.search(r'href="([^"]+)" rel="next"', first).group(1)
    assert older == "/jobs?offset=100"
    second = c.get(older).text
    assert "101\u2013132 of 132 jobs" in second and old_pass in second and 'rel="next"' not in second
    assert 'href="/jobs" rel="prev"' in second

    filtered = c.get("/jobs?mode=optimize&status=queued").text
    assert "1\u2013100 of 131 jobs matching" in filtered
    assert 'href="/jobs?status=queued&amp;mode=optimize&amp;offset=100" rel="next"' in filtered
    assert 'value="optimize" selected' in filtered
