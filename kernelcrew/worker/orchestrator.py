"""Orchestrators: run whole jobs (the crew's graph, or a verify-only check) outside the API and Celery.

Each orchestrator loops: lease one job (:func:`kernelcrew.service.jobs.lease_job`), renew the lease
from a heartbeat thread, run the job, store its result. GPU work goes to the workers through a
:class:`~kernelcrew.worker.executor.CeleryExecutor` (``--local``: a LocalExecutor on this machine).
Optimize jobs checkpoint every step with thread id = job id -- LangGraph's Postgres saver when the
database is PostgreSQL, the SQLite saver in the data directory otherwise -- so a job whose
orchestrator died is leased again once its lease expires and resumed from its last checkpoint.
Between steps (before each plan) the orchestrator hands the crew the chat messages posted since,
and stops when the job was cancelled. Every crew event is stored as a job event (the SSE stream).
"""

from __future__ import annotations

import io
import logging
import os
import socket
import threading
import uuid
from contextlib import ExitStack
from typing import Any

from rich.console import Console

from kernelcrew.config import Settings, get_settings, resolve_database_url
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.records import BenchmarkRequest, JobResult, VerifyOutcome, VerifyRequest
from kernelcrew.service import jobs
from kernelcrew.service.webhooks import send_webhook

log = logging.getLogger(__name__)


class JobCancelled(Exception):
    """The job's owner cancelled it; raised between steps, carrying what the job keeps (its best
    verified candidate so far, when it has one)."""

    def __init__(self, job_id: str, result: JobResult | None = None) -> None:
        super().__init__(job_id)
        self.result = result


class LeaseLost(Exception):
    """Another orchestrator holds the job now (our lease expired)."""


def checkpointer_for(settings: Settings, stack: ExitStack) -> Any:
    """The graph's checkpointer: PostgresSaver on PostgreSQL, the SQLite saver otherwise."""
    from kernelcrew.agents.graph import serializer, sqlite_checkpointer

    url = resolve_database_url(settings)
    if url.startswith("postgresql"):
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver
        from psycopg.rows import dict_row

        conninfo = "postgresql://" + url.split("://", 1)[1]
        conn = stack.enter_context(
            psycopg.connect(conninfo, autocommit=True, prepare_threshold=0, row_factory=dict_row)
        )
        saver = PostgresSaver(conn, serde=serializer())
        saver.setup()
        return saver
    return sqlite_checkpointer(settings.data_dir / "checkpoints.sqlite")


class Orchestrator:
    def __init__(self, settings: Settings | None = None, *, local: bool = False, name: str | None = None):
        self.settings = settings or get_settings()
        self.local = local
        self.name = name or f"orch-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.engine = get_engine(self.settings)
        self.stopping = threading.Event()

    # --------------------------------------------------------------------------------------------

    def run_forever(self, *, once: bool = False) -> None:
        log.info(
            "orchestrator %s polling %s", self.name, self.engine.url.render_as_string(hide_password=True)
        )
        while not self.stopping.is_set():
            job = jobs.lease_job(
                self.engine, self.name, self.settings.job_lease_s, self.settings.job_max_attempts
            )
            if job is None:
                if once:
                    return
                self.stopping.wait(self.settings.orchestrator_poll_s)
                continue
            self.run_job(job)
            if once:
                return

    def run_job(self, job: jobs.Job) -> None:
        log.info("job %s (%s), attempt %d", job.id, job.mode, job.attempts)
        lost = threading.Event()
        done = threading.Event()

        def heartbeat() -> None:
            interval = max(self.settings.job_lease_s / 3, 0.2)
            while not done.wait(interval):
                try:
                    if not jobs.renew_lease(self.engine, job.id, self.name, self.settings.job_lease_s):
                        lost.set()
                        return
                except Exception as exc:  # a database hiccup: try again next beat
                    log.warning("lease renewal of %s failed: %s", job.id, exc)

        beat = threading.Thread(target=heartbeat, name=f"lease-{job.id}", daemon=True)
        beat.start()
        status, result, error = "failed", None, None
        try:
            result = self._verify(job, lost) if job.mode == "verify" else self._optimize(job, lost)
            status = "succeeded"
        except JobCancelled as exc:
            status, result, error = "cancelled", exc.result, "cancelled by its owner"
        except LeaseLost:
            log.warning("job %s: lease lost, another orchestrator resumes it", job.id)
            return
        except Exception as exc:
            log.exception("job %s failed", job.id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            done.set()
            beat.join(timeout=5)
        if lost.is_set():
            return
        if jobs.finish_job(self.engine, job.id, self.name, status, result=result, error=error):
            self._webhook(job, status, result, error)

    # --------------------------------------------------------------------------------------------

    def _event(self, job_id: str, kind: str, data: dict[str, Any]) -> None:
        import json

        data = json.loads(json.dumps(data, default=str))
        try:
            with transaction(self.engine) as s:
                jobs.add_event(s, job_id, kind, data)
        except Exception as exc:
            log.warning("cannot store an event of job %s: %s", job_id, exc)

    def _check(self, job_id: str, lost: threading.Event) -> None:
        if lost.is_set():
            raise LeaseLost(job_id)
        if jobs.cancel_requested(self.engine, job_id):
            raise JobCancelled(job_id)

    def _executor(self, job: jobs.Job) -> Any:
        if self.local:
            from kernelcrew.tools.executor import LocalExecutor, slots_for

            device = job.options.get("device") or "cpu"
            return LocalExecutor(
                self.settings, slots=slots_for(device, int(job.options.get("parallel") or 1))
            )
        from kernelcrew.worker.executor import CeleryExecutor

        return CeleryExecutor(self.settings, gpu=job.options.get("gpu"), job_id=job.id)

    def _verify(self, job: jobs.Job, lost: threading.Event) -> JobResult:
        import secrets

        from kernelcrew.tools.timing import parse_compile_modes

        opts = job.options
        device = opts.get("device") or "cpu"
        common: dict[str, Any] = {
            "task_source": job.task_source,
            "task_path": "task.py",
            "device": device,
            "precision": opts.get("precision") or "strict",
            "seed": int(opts.get("seed") or secrets.randbits(31)),
        }
        candidate = job.candidate_source or ""
        executor = self._executor(job)
        try:
            self._check(job.id, lost)
            self._event(job.id, "verify_started", {"device": device})
            verdict = executor.verify(
                VerifyRequest(**common, candidate_source=candidate, candidate_path="candidate.py")
            )
            self._event(job.id, "verify", {"verdict": verdict.verdict, "stage": verdict.stage})
            outcome = VerifyOutcome(verify=verdict, verdict=verdict.verdict, timing=None)
            if verdict.passed and opts.get("timing", True):
                self._check(job.id, lost)
                modes = parse_compile_modes(str(opts.get("compile_modes") or "auto"), device)
                bench = executor.benchmark(
                    BenchmarkRequest(
                        **common,
                        candidates={"candidate": candidate},
                        compile_modes=modes,
                        quick=bool(opts.get("quick", False)),
                    )
                )
                outcome.timing = bench
                ratio = bench.ratios.get("candidate")
                outcome.speedup = ratio.median if ratio else None
                if bench.failure is not None:
                    outcome.verdict = "fail"
                self._event(job.id, "benchmark", {"speedup": outcome.speedup, "clock": bench.clock})
            return JobResult(report=outcome)
        finally:
            executor.close()

    def _optimize(self, job: jobs.Job, lost: threading.Event) -> JobResult | None:
        from kernelcrew.agents.run import OptimizeRequest, report_so_far, run_optimize
        from kernelcrew.task import TaskError

        opts = job.options
        job_dir = self.settings.data_dir / "jobs" / job.id
        job_dir.mkdir(parents=True, exist_ok=True)
        task_path = job_dir / "task.py"
        task_path.write_text(job.task_source)
        start = None
        if job.candidate_source:
            start = job_dir / "start.py"
            start.write_text(job.candidate_source)
        req = OptimizeRequest(
            task=task_path,
            backend=opts.get("backend") or "auto",
            model=opts.get("model") or "",
            max_iters=int(opts.get("max_iters") or 6),
            time_budget_s=float(opts.get("time_budget_s") or 900.0),
            device=opts.get("device") or "cpu",
            precision=opts.get("precision") or "strict",
            start=start,
            out=job_dir,
            messages=jobs.take_messages(self.engine, job.id),
            local_only=bool(opts.get("local_only", False)),
            quick=bool(opts.get("quick", False)),
            compile_modes=str(opts.get("compile_modes") or "auto"),
            use_kb=bool(opts.get("use_kb", False)),
            parallel=int(opts.get("parallel") or 1),
        )

        def between_steps(step: int) -> list[str]:
            self._check(job.id, lost)
            messages = jobs.take_messages(self.engine, job.id)
            if messages:
                self._event(job.id, "message_taken", {"step": step, "messages": messages})
            return messages

        buffer = io.StringIO()
        with ExitStack() as stack:
            checkpointer = checkpointer_for(self.settings, stack)
            try:
                report = run_optimize(
                    req,
                    console=Console(file=buffer, width=120),
                    ask=between_steps,
                    settings=self.settings,
                    executor=self._executor(job),
                    on_event=lambda e: self._event(job.id, str(e.get("kind", "event")), e),
                    thread_id=job.id,
                    checkpointer=checkpointer,
                    kb=self._knowledge_base(job) if req.use_kb else None,
                )
            except TaskError as exc:
                raise RuntimeError(str(exc)) from exc
            except JobCancelled:
                # the run stopped between steps: it keeps the best it verified so far
                kept = report_so_far(job.id, checkpointer, job_dir, "cancelled by its owner")
                if kept is None:
                    raise
                report, best_py = kept
                markdown = job_dir / "report.md"
                result = JobResult(
                    report=report,
                    best_source=best_py,
                    report_md=markdown.read_text() if markdown.exists() else None,
                )
                raise JobCancelled(job.id, result) from None
        if report is None:
            return None
        best, markdown = job_dir / "best.py", job_dir / "report.md"
        return JobResult(
            report=report,
            best_source=best.read_text() if best.exists() else None,
            report_md=markdown.read_text() if markdown.exists() else None,
        )

    def _knowledge_base(self, job: jobs.Job) -> Any:
        """The knowledge base as the job's owner: the hits are what they may see, and the win the job
        records is theirs (private to them), not the orchestrator's OS user's."""
        from kernelcrew.knowledge_base import KnowledgeBase

        with transaction(self.engine) as s:
            user = s.get(jobs.User, job.owner_id)
            name, team = user.name, user.team
        return KnowledgeBase.open(self.settings, owner=name, team=team or "")

    def _webhook(self, job: jobs.Job, status: str, result: JobResult | None, error: str | None) -> None:
        url = (job.options or {}).get("webhook_url")
        if not url:
            return
        threading.Thread(
            target=send_webhook, args=(self.settings, self.engine, job.id, url, status, error), daemon=True
        ).start()
