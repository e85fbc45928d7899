"""A service job's crew on CPU (SQLite, the playbook): cancel keeps the verified best; chat stays a list.

The orchestrator runs the playbook with a LocalExecutor; the owner cancels as the API does (the
job's ``cancel_requested``) once a step has verified a new best, and the job ends cancelled with
that candidate as its result, its report and its ``best.py``.
"""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient
from sqlalchemy import select

from kernelcrew.api.app import create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from kernelcrew.worker.orchestrator import Orchestrator
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
OPTIONS = {"device": "cpu", "backend": "playbook", "max_iters": 4, "quick": True, "compile_modes": "none",
           "use_kb": False, "precision": "strict", "time_budget_s": 900}  # fmt: skip


def cancel_after_a_new_best(engine, job_id: str, stop: threading.Event) -> None:
    """What the owner does: cancel (as ``POST /jobs/{id}/cancel``) once a step made a new best."""
    while not stop.wait(0.05):
        with transaction(engine) as s:
            data = s.scalars(
                select(jobs.JobEvent.data).where(
                    jobs.JobEvent.job_id == job_id, jobs.JobEvent.type == "decide"
                )
            ).all()
            if any(d.get("new_best") for d in data):
                s.get(jobs.Job, job_id).cancel_requested = True
                return


def test_a_cancelled_optimize_job_keeps_and_returns_its_verified_best(tmp_path):
    settings = Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0")
    engine = get_engine(settings)
    with transaction(engine) as s:
        token = jobs.create_token(s, "ann", ["submit", "read"])[1]
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == "ann"))
        job = jobs.Job(id=jobs.new_job_id(), owner_id=owner, status="queued", mode="optimize",
                       task_source=TASK, options=OPTIONS)  # fmt: skip
        s.add(job)
        job_id = job.id
    stop = threading.Event()
    owner_thread = threading.Thread(target=cancel_after_a_new_best, args=(engine, job_id, stop), daemon=True)
    owner_thread.start()
    started = time.time()
    try:
        Orchestrator(settings, local=True).run_forever(once=True)
    finally:
        stop.set()
        owner_thread.join(timeout=5)

    with transaction(engine) as s:
        job = s.get(jobs.Job, job_id)
        assert job.status == "cancelled", (job.status, job.error)
        outcome = job.outcome()
        events = [e.type for e in s.scalars(select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id))]
    assert outcome is not None, f"the cancelled job kept nothing ({time.time() - started:.0f} s)"
    report = outcome.report
    assert report.best is not None and report.stop_reason == "cancelled by its owner"
    assert len(report.iterations) < OPTIONS["max_iters"]  # it stopped early, at the cancel
    assert "ModelNew" in outcome.best_source and outcome.report_md
    assert events.count("plan") == len(report.iterations)

    client = TestClient(create_app(settings))  # what the owner gets back
    client.headers["authorization"] = f"Bearer {token}"
    body = client.get(f"/api/v1/jobs/{job_id}/result").json()
    assert body["status"] == "cancelled" and body["verdict"] == "pass"
    assert body["best_source"] == outcome.best_source
    assert body["result"]["best"]["id"] == report.best.id


def test_chat_messages_taken_between_steps_stay_one_per_message(tmp_path):
    """Two messages posted before a step reach the crew as two messages, not one joined with a newline."""
    from kernelcrew.agents.graph import compile_graph, sqlite_checkpointer
    from kernelcrew.agents.run import OptimizeRequest, run_optimize

    settings = Settings(data_dir=tmp_path / "data")
    (tmp_path / "task.py").write_text(TASK)
    req = OptimizeRequest(task=tmp_path / "task.py", device="cpu", max_iters=1, quick=True,
                          compile_modes="none", backend="playbook", use_kb=False, out=tmp_path / "out")  # fmt: skip
    asked: list[int] = []

    def between_steps(step: int) -> list[str]:
        asked.append(step)
        return ["keep fp32", "only triton"] if step == 1 else []

    report = run_optimize(req, ask=between_steps, settings=settings, thread_id="chat-list")
    assert report is not None and asked == [1]
    saver = sqlite_checkpointer(settings.data_dir / "checkpoints.sqlite")
    values = compile_graph(saver).get_state({"configurable": {"thread_id": "chat-list"}}).values
    assert values["user_messages"] == ["keep fp32", "only triton"]


def test_a_jobs_knowledge_base_win_belongs_to_the_user_who_submitted_it(tmp_path):
    """The win is recorded as the job's owner (private to them), not as the orchestrator's OS user."""
    from kernelcrew.knowledge_base import KnowledgeBase, Reader

    # the orchestrator's own knowledge-base identity (its OS user, or KERNELCREW_KB_OWNER)
    settings = Settings(
        data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0", kb_owner="orchestrator-os-user"
    )
    engine = get_engine(settings)
    with transaction(engine) as s:
        jobs.create_token(s, "ann", ["submit", "read"])
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == "ann"))
        job = jobs.Job(id=jobs.new_job_id(), owner_id=owner, status="queued", mode="optimize", task_source=TASK,
                       options={**OPTIONS, "max_iters": 1, "use_kb": True})  # fmt: skip
        s.add(job)
        job_id = job.id
    Orchestrator(settings, local=True).run_forever(once=True)
    with transaction(engine) as s:
        job = s.get(jobs.Job, job_id)
        assert job.status == "succeeded", job.error
        recorded = job.outcome().report.knowledge_base["recorded"]
    assert recorded and recorded.get("id"), recorded

    def win_for(user: str):
        return KnowledgeBase(engine, Reader(user)).get(recorded["id"])

    win = win_for("ann")
    assert win is not None and win["owner"] == "ann" and win["visibility"] == "private"
    assert win_for("orchestrator-os-user") is None and win_for("bob") is None
