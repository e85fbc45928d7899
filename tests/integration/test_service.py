"""The service end to end with real parts: PostgreSQL, Redis, the API over HTTP, orchestrator and worker.

One module-scoped service: a fresh PostgreSQL database, Redis DB 10 (flushed before and after),
``kernelcrew serve --orchestrators 0`` (uvicorn), one ``kernelcrew orchestrator`` process (short
lease so the kill test is quick) and one ``kernelcrew worker`` on the cpu queue.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import func, select

from kernelcrew.config import SECRET_ENV, Settings, resolve_database_url
from kernelcrew.knowledge_base.db import make_engine, transaction, upgrade
from kernelcrew.service import jobs
from tests.conftest import FIXTURES
from tests.integration.test_worker import alive, descendants, wait_for
from tests.unit.test_knowledge_base import Postgres

REDIS_URL = os.environ.get("KERNELCREW_TEST_SERVICE_REDIS_URL", "redis://127.0.0.1:6379/10")
#: The browser tests' service: its own database, since pytest-xdist (``--dist loadfile``) may run
#: them beside this file, and each service flushes its database when it starts and stops.
BROWSER_REDIS_URL = os.environ.get("KERNELCREW_TEST_BROWSER_REDIS_URL", "redis://127.0.0.1:6379/12")
TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
CANDIDATE = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()
FAST = {"device": "cpu", "compile_modes": "none", "quick": True, "seed": 7}
MAX_UPLOAD = 20_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Proc:
    """A ``kernelcrew`` child process (own session) whose whole tree is killed at the end."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelcrew", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


class Service:
    def __init__(self, url: str, env: dict[str, str], engine: Any, logs: Path) -> None:
        self.url, self.env, self.engine, self.logs = url, env, engine, logs
        self.procs: dict[str, Proc] = {}
        self.tokens: dict[str, str] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        self.procs[name] = Proc(args, self.env if env is None else env, self.logs / f"{name}.log")
        return self.procs[name]

    def client(self, user: str | None) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.tokens[user]}"} if user else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def job_count(self) -> int:
        with transaction(self.engine) as s:
            return s.scalar(select(func.count()).select_from(jobs.Job))


SERVICE_ENV = dict(
    KERNELCREW_JOB_LEASE_S="3",
    KERNELCREW_ORCHESTRATOR_POLL_S="0.3",
    KERNELCREW_API_MAX_UPLOAD_BYTES=str(MAX_UPLOAD),
    KERNELCREW_WORKER_HEARTBEAT_S="1",
    KERNELCREW_WORKER_RESTORE_INTERVAL_S="1",
    KERNELCREW_TASK_QUEUE_TIMEOUT_S="60",
    KERNELCREW_SANDBOX_TIMEOUT_S="60",
    KERNELCREW_TASK_SOFT_TIME_LIMIT_S="90",
    KERNELCREW_TASK_TIME_LIMIT_S="100",
    KERNELCREW_VISIBILITY_MARGIN_S="5",
)


@contextlib.contextmanager
def running_service(
    db_url: str, redis_url: str, logs: Path, worker: str = "", **overrides: str
) -> Iterator[Service]:
    """``kernelcrew serve --orchestrators 0``, one orchestrator and one cpu worker on these stores.

    ``worker`` names the worker (and its temporary directory), by default after this process: two
    services with one name on a machine would delete each other's files.
    Tokens: ``bob`` (submit, read), ``reader`` (carol, read), ``revoked`` (dave; revoked by a test).
    Shared by the fault and load tests, which point it at private Redis and PostgreSQL instances.
    """
    worker = worker or f"kcsvc{os.getpid()}"
    r = redis.Redis.from_url(redis_url)
    env = dict(os.environ)
    env.update(
        KERNELCREW_DATABASE_URL=db_url,
        KERNELCREW_BROKER_URL=redis_url,
        KERNELCREW_DATA_DIR=str(logs / "data"),
        **{**SERVICE_ENV, **overrides},
    )
    engine = make_engine(resolve_database_url(Settings(database_url=db_url)))
    upgrade(engine)
    port = free_port()
    svc = Service(f"http://127.0.0.1:{port}", env, engine, logs)
    try:
        worker_env = {k: v for k, v in env.items() if k not in SECRET_ENV}  # it refuses them
        svc.start("worker", ["worker", "--broker", redis_url, "--name", worker], worker_env)
        svc.start("api", ["serve", "--port", str(port), "--orchestrators", "0"])
        svc.start("orch1", ["orchestrator"])
        with transaction(engine) as s:
            svc.tokens["bob"] = jobs.create_token(s, "bob", ["submit", "read"])[1]
            svc.tokens["reader"] = jobs.create_token(s, "carol", ["read"])[1]
            svc.tokens["revoked"] = jobs.create_token(s, "dave", ["submit", "read"])[1]

        def up() -> bool:
            if svc.procs["api"].proc.poll() is not None:
                raise AssertionError(f"the API exited:\n{svc.procs['api'].log()}")
            try:
                return httpx.get(f"{svc.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 90, "the API", poll_s=0.3)
        wait_for(lambda: r.keys(f"*{worker}*") or r.keys("*worker*"), 90, "the worker online", poll_s=0.5)
        yield svc
    finally:
        for proc in svc.procs.values():
            proc.kill(signal.SIGTERM)
        engine.dispose()
        r.close()


def service_fixture(redis_url: str):
    """A module-scoped ``service`` fixture: the running service (PostgreSQL, ``kernelcrew serve``,
    an orchestrator, a cpu worker) on the Redis database ``redis_url``, flushed before and after."""

    @pytest.fixture(scope="module")
    def service(tmp_path_factory) -> Iterator[Service]:
        r = redis.Redis.from_url(redis_url)
        try:
            r.ping()
        except redis.RedisError as exc:
            pytest.fail(f"the service tests need Redis at {redis_url}: {exc}")
        r.flushdb()
        pg = Postgres()
        db_url = pg.create()
        try:
            with running_service(db_url, redis_url, tmp_path_factory.mktemp("service")) as svc:
                # alice's token through the CLI (printed alone on its last line)
                out = subprocess.run(
                    [sys.executable, "-m", "kernelcrew", "token", "create", "--user", "alice"],
                    env=svc.env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                )
                svc.tokens["alice"] = out.stdout.strip().splitlines()[-1]
                yield svc
        finally:
            pg.drop(db_url)
            pg.admin.close()
            r.flushdb()

    return service


service = service_fixture(REDIS_URL)


def test_the_browser_tests_service_has_its_own_redis_database():
    """The browser tests once shared this file's Redis database: when both files ran at once, one
    service's flush took the other's worker off the inventory (the workers page showed none)."""
    assert redis.connection.parse_url(BROWSER_REDIS_URL) != redis.connection.parse_url(REDIS_URL)


def unverified_wins(engine: Any) -> list[str]:
    """Knowledge-base rows that are neither seeds nor wins of a job that ended verified."""
    from kernelcrew.knowledge_base.models import Win

    bad = []
    with transaction(engine) as s:
        for win in s.scalars(select(Win).where(Win.source != "seed")):
            job = s.get(jobs.Job, win.job_id) if win.job_id else None
            if win.source != "verified" or job is None or job.status != "succeeded":
                bad.append(f"{win.id} ({win.source}, job {win.job_id})")
    return bad


def wait_status(
    svc: Service, job_id: str, statuses: tuple[str, ...], timeout_s: float = 150
) -> dict[str, Any]:
    with svc.client("alice") as c:

        def check() -> dict[str, Any] | None:
            job = c.get(f"/api/v1/jobs/{job_id}").json()
            return job if job["status"] in statuses else None

        try:
            return wait_for(check, timeout_s, f"job {job_id} to be {'/'.join(statuses)}", poll_s=0.3)
        except AssertionError:
            details = "\n".join(f"--- {n}\n{p.log()}" for n, p in svc.procs.items())
            raise AssertionError(
                f"job {job_id}: {c.get(f'/api/v1/jobs/{job_id}').json()}\n{details}"
            ) from None


def sse(c: httpx.Client, job_id: str, last_id: int | None = None) -> list[tuple[int, str, dict]]:
    headers = {"last-event-id": str(last_id)} if last_id is not None else {}
    events, current = [], {}
    with c.stream("GET", f"/api/v1/jobs/{job_id}/events", headers=headers, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line:
                if "id" in current:
                    events.append((int(current["id"]), current["event"], json.loads(current["data"])))
                current = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                current[key] = value
    return events


class Hooks(BaseHTTPRequestHandler):
    received: list[tuple[bytes, str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        Hooks.received.append((body, self.headers.get("x-kernelcrew-signature", "")))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_verify_job_runs_to_the_end_and_its_events_stream_and_resume(service):
    hooks = HTTPServer(("127.0.0.1", 0), Hooks)
    threading.Thread(target=hooks.serve_forever, daemon=True).start()
    options = {**FAST, "webhook_url": f"http://127.0.0.1:{hooks.server_port}/hook"}
    task, candidate = FIXTURES / "tasks" / "pointwise.py", FIXTURES / "candidates" / "pointwise_triton.py"
    out = subprocess.run(
        [
            *(sys.executable, "-m", "kernelcrew", "submit", str(task), "--candidate", str(candidate)),
            *("--server", service.url, "--token", service.tokens["alice"]),
            *("--options", json.dumps(options), "--wait"),
        ],
        env=service.env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, (out.stdout, out.stderr, service.procs["orch1"].log())
    job = {"id": out.stdout.splitlines()[0]}
    with service.client("alice") as c:
        assert c.get(f"/api/v1/jobs/{job['id']}").json()["status"] == "succeeded"
        res = c.get(f"/api/v1/jobs/{job['id']}/result").json()
        assert res["result"]["verdict"] == "pass", res
        assert res["result"]["timing"] is not None
        events = sse(c, job["id"])
        statuses = [e[2]["status"] for e in events if e[1] == "status"]
        assert statuses == ["queued", "running", "succeeded"]
        assert [e[0] for e in events] == list(range(1, len(events) + 1))
        assert sse(c, job["id"], last_id=2) == events[2:]
        listed = c.get("/api/v1/jobs", params={"status": "succeeded"}).json()
        assert job["id"] in [j["id"] for j in listed["items"]]
    with service.client("bob") as other:
        assert other.get(f"/api/v1/jobs/{job['id']}").status_code == 404
        assert other.get(f"/api/v1/jobs/{job['id']}/events").status_code == 404
        assert job["id"] not in [j["id"] for j in other.get("/api/v1/jobs").json()["items"]]
    # the webhook arrives signed with the submitting token's secret
    wait_for(lambda: Hooks.received, 30, "the webhook")
    hooks.shutdown()
    body, signature = Hooks.received[0]
    assert json.loads(body) == {"id": job["id"], "status": "succeeded", "error": None}
    with transaction(service.engine) as s:
        secret = s.scalar(
            select(jobs.ApiToken.webhook_secret).where(
                jobs.ApiToken.id == s.get(jobs.Job, job["id"]).token_id
            )
        )
    assert signature == "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def test_auth_is_enforced(service):
    body = {"task": TASK, "candidate": CANDIDATE, "mode": "verify", "options": FAST}
    with service.client(None) as anon:
        assert anon.get("/api/v1/jobs").status_code == 401
        assert anon.get("/api/v1/jobs", headers={"authorization": "Bearer kc_nope_nope"}).status_code == 401
    with service.client("reader") as reader:
        assert reader.get("/api/v1/jobs").status_code == 200
        r = reader.post("/api/v1/jobs", json=body)
        assert r.status_code == 403 and "submit" in r.json()["detail"]
    with service.client("revoked") as c:
        assert c.get("/api/v1/jobs").status_code == 200
        prefix = service.tokens["revoked"].split("_")[1]
        subprocess.run(
            [sys.executable, "-m", "kernelcrew", "token", "revoke", prefix],
            env=service.env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        assert c.get("/api/v1/jobs").status_code == 401


def test_bad_uploads_are_refused_and_nothing_is_stored(service):
    before = service.job_count()
    with service.client("alice") as c:
        r = c.post("/api/v1/jobs", files={"task": ("t.py", b"\xff\xfe\x00bad")}, data={"mode": "optimize"})
        assert r.status_code == 422 and "UTF-8" in r.json()["detail"]
        r = c.post("/api/v1/jobs", json={"task": "def (:\n", "mode": "optimize"})
        assert r.status_code == 422 and "task" in r.json()["detail"]
        r = c.post("/api/v1/jobs", json={"task": TASK + "#" * MAX_UPLOAD, "mode": "optimize"})
        assert r.status_code == 413
        r = c.post("/api/v1/jobs", json={"task": TASK, "mode": "verify"})
        assert r.status_code == 422 and "candidate" in r.json()["detail"]
    assert service.job_count() == before


def test_health_workers_and_kb(service):
    assert httpx.get(f"{service.url}/readyz").json()["ok"] is True
    with service.client("alice") as c:
        workers = c.get("/api/v1/workers").json()["items"]
        assert any("cpu" in w.get("queues", []) for w in workers), workers
        assert c.get("/api/v1/kb", params={"q": "softmax"}).status_code == 200
        assert c.get("/docs").status_code == 200


def test_an_orchestrator_killed_mid_job_and_chat_messages_resume_from_the_checkpoint(service):
    """A message posted to a running job stops it at its next plan (it had budget for 2 steps), even
    though its orchestrator is killed right after: another one resumes the job from its checkpoint
    once the lease expires. A message to the finished job queues it again; it resumes, not restarts.
    The knowledge base holds no record that a verified, finished job did not produce."""
    options = {"device": "cpu", "compile_modes": "none", "quick": True, "backend": "playbook", "max_iters": 2}
    with service.client("alice") as c:
        r = c.post("/api/v1/jobs", json={"task": TASK, "mode": "optimize", "options": options})
        assert r.status_code == 201, r.text
        job = r.json()

        def planned() -> bool:
            with transaction(service.engine) as s:
                kinds = s.scalars(select(jobs.JobEvent.type).where(jobs.JobEvent.job_id == job["id"])).all()
            return "plan" in kinds

        wait_for(planned, 120, "the first plan", poll_s=0.2)
        r = c.post(f"/api/v1/jobs/{job['id']}/messages", json={"text": "stop"})
        assert r.status_code == 202 and r.json()["status"] == "running"
        service.procs["orch1"].kill(signal.SIGKILL)
        service.start("orch2", ["orchestrator"])
        first = wait_status(service, job["id"], ("succeeded", "failed"))
        assert first["status"] == "succeeded" and first["attempts"] == 2, first
        res = c.get(f"/api/v1/jobs/{job['id']}/result").json()
        assert res["result"]["stop_reason"] == "stopped by the user", res["result"]
        running = [e[2] for e in sse(c, job["id"]) if e[1] == "status" and e[2]["status"] == "running"]
        assert [e["resumed"] for e in running] == [False, True]

        r = c.post(f"/api/v1/jobs/{job['id']}/messages", json={"text": "stop"})
        assert r.status_code == 202 and r.json()["status"] == "queued"
        again = wait_status(service, job["id"], ("succeeded", "failed"))
        assert again["status"] == "succeeded" and again["attempts"] == 3
        res = c.get(f"/api/v1/jobs/{job['id']}/result").json()
        assert res["best_source"] and res["report_md"]
        events = sse(c, job["id"])
    kinds = [e[1] for e in events]
    assert kinds.count("baseline") == 1  # never started over: resumed from its checkpoints
    assert unverified_wins(service.engine) == []
    replies = [e[2]["message"] for e in events if e[1] == "reply"]
    assert sum("Stopping" in m for m in replies) == 2, replies
