"""The service's tables on SQLite and a real PostgreSQL: migration head, tokens, leases."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from kernelcrew.config import Settings, resolve_database_url
from kernelcrew.knowledge_base.db import (
    Base,
    current_revision,
    head_revision,
    make_engine,
    transaction,
    upgrade,
)
from kernelcrew.records import JobResult, Verdict, VerifyOutcome
from kernelcrew.service import jobs
from tests.unit.test_knowledge_base import databases  # noqa: F401  (fixture)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def engine(request, databases):  # noqa: F811
    eng = make_engine(resolve_database_url(Settings(database_url=databases(request.param))))
    upgrade(eng)
    yield eng
    eng.dispose()


def test_service_models_and_migration_head_agree(engine):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    assert head_revision() == "0003_job_event_seq"
    assert current_revision(engine) == head_revision()
    assert {"users", "api_tokens", "jobs", "job_events", "job_messages"} <= set(Base.metadata.tables)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []


def test_tokens_are_stored_hashed_and_revocable(engine):
    with transaction(engine) as s:
        tok, token = jobs.create_token(s, "ann", ["submit", "read"])
        prefix = tok.prefix
    with transaction(engine) as s:
        stored = s.scalar(select(jobs.ApiToken).where(jobs.ApiToken.prefix == prefix))
        assert token not in (stored.token_hash, stored.prefix) and stored.token_hash == jobs.hash_token(token)
        assert jobs.authenticate(s, token)[1].name == "ann"
        assert jobs.authenticate(s, token + "x") is None
        jobs.revoke_token(s, prefix)
    with transaction(engine) as s:
        assert jobs.authenticate(s, token) is None
    with pytest.raises(ValueError), transaction(engine) as s:
        jobs.create_token(s, "ann", ["root"])


def test_a_job_is_leased_once_and_again_after_its_lease_expires(engine):
    with transaction(engine) as s:
        user = jobs.User(name=f"lease-{time.time_ns()}")
        s.add(user)
        s.flush()
        job = jobs.Job(
            id=jobs.new_job_id(),
            owner_id=user.id,
            status="queued",
            mode="verify",
            task_source="x",
            options={},
            created_at=jobs.now(),
        )
        s.add(job)
        job_id = job.id
    for other in list_queued(engine):
        if other != job_id:
            with transaction(engine) as s:
                s.get(jobs.Job, other).status = "cancelled"
    first = jobs.lease_job(engine, "o1", lease_s=0.5)
    assert first is not None and first.id == job_id and first.attempts == 1
    assert jobs.lease_job(engine, "o2", lease_s=0.5) is None
    assert jobs.renew_lease(engine, job_id, "o1", 0.5)
    time.sleep(0.7)
    second = jobs.lease_job(engine, "o2", lease_s=30)
    assert second is not None and second.id == job_id and second.attempts == 2
    assert not jobs.renew_lease(engine, job_id, "o1", 30)
    assert not jobs.finish_job(engine, job_id, "o1", "failed")
    verdict = Verdict(verdict="pass", stage="done", message="ok", seed=1, device="cpu", precision="strict")
    outcome = JobResult(report=VerifyOutcome(verify=verdict, verdict="pass"))
    assert jobs.finish_job(engine, job_id, "o2", "succeeded", result=outcome)
    with transaction(engine) as s:
        kinds = [
            e.data["status"] for e in s.scalars(select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id))
        ]
    assert kinds == ["running", "running", "succeeded"]
    with transaction(engine) as s:
        stored = s.get(jobs.Job, job_id)
        assert stored.result == outcome.model_dump(mode="json")
        assert stored.outcome() == outcome


def test_a_job_row_stored_with_the_old_file_keys_still_reads(engine):
    """Rows written before JobResult kept best.py and report.md under ``_best_py``/``_report_md``
    beside the report's own keys: they read as a JobResult with nothing lost."""
    job_id = add_job(engine, mode="optimize", status="succeeded")
    old = {
        "run_id": "r1",
        "status": "improved",
        "stop_reason": "iteration budget reached (1)",
        "best": {"id": "c1", "strategy": "fused_rows", "speedup_eager": 1.8, "clock": "cuda-event"},
        "an_older_key": [1, 2],
        "_best_py": "class ModelNew: ...\n",
        "_report_md": "# kernelcrew report\n",
    }
    with transaction(engine) as s:
        s.get(jobs.Job, job_id).result = old
    with transaction(engine) as s:
        outcome = s.get(jobs.Job, job_id).outcome()
    assert outcome is not None
    assert outcome.best_source == "class ModelNew: ...\n"
    assert outcome.report_md == "# kernelcrew report\n"
    assert outcome.report.status == "improved" and outcome.report.best.speedup_eager == 1.8
    public = outcome.report.model_dump(mode="json")
    assert public["an_older_key"] == [1, 2] and "_best_py" not in public and "_report_md" not in public
    again = JobResult.model_validate(outcome.model_dump(mode="json"))
    assert again == outcome


def list_queued(engine) -> list[str]:
    with transaction(engine) as s:
        return list(s.scalars(select(jobs.Job.id).where(jobs.Job.status == "queued")))


def add_job(engine, **kw) -> str:
    with transaction(engine) as s:
        user = jobs.User(name=f"u-{time.time_ns()}")
        s.add(user)
        s.flush()
        fields = {"status": "queued", "mode": "verify", "task_source": "x", "options": {}, **kw}
        job = jobs.Job(id=jobs.new_job_id(), owner_id=user.id, created_at=jobs.now(), **fields)
        s.add(job)
        return job.id


def test_a_job_that_keeps_losing_its_orchestrator_fails_instead_of_looping(engine):
    for other in list_queued(engine):
        with transaction(engine) as s:
            s.get(jobs.Job, other).status = "cancelled"
    job_id = add_job(engine)
    assert jobs.lease_job(engine, "o1", 0.2, max_attempts=2).attempts == 1
    time.sleep(0.3)
    assert jobs.lease_job(engine, "o2", 0.2, max_attempts=2).attempts == 2
    time.sleep(0.3)
    assert jobs.lease_job(engine, "o3", 0.2, max_attempts=2) is None
    with transaction(engine) as s:
        job = s.get(jobs.Job, job_id)
        assert job.status == "failed" and "lost 2 times" in job.error


def test_a_cancelled_job_stops_before_its_next_step(engine, tmp_path):
    from kernelcrew.worker.orchestrator import Orchestrator

    class NoWork:
        def verify(self, request):
            raise AssertionError("a cancelled job must not run")

        def close(self):
            pass

    for other in list_queued(engine):
        with transaction(engine) as s:
            s.get(jobs.Job, other).status = "cancelled"
    job_id = add_job(engine, cancel_requested=True)
    orch = Orchestrator.__new__(Orchestrator)
    orch.settings = Settings(data_dir=tmp_path, job_lease_s=5)
    orch.local, orch.name, orch.engine = True, "o-cancel", engine
    orch._executor = lambda job: NoWork()
    job = jobs.lease_job(engine, orch.name, 5)
    assert job.id == job_id
    orch.run_job(job)
    with transaction(engine) as s:
        job = s.get(jobs.Job, job_id)
        assert job.status == "cancelled" and job.lease_owner is None
