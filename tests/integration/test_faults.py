"""Faults under a running service: Redis and PostgreSQL restarted mid-job, a candidate that hangs;
then a short load on the same service (the smoke version of ``bench/load.py``).

The service (API, orchestrator, cpu worker; :func:`running_service`) runs on a private Redis
(``redis-server`` on a free port, append-only file fsynced on every write, as a deployment should
run it) and a private PostgreSQL cluster (``initdb`` + ``pg_ctl`` as the ``postgres`` user, on a
free port, in a temporary directory), so restarting them touches nothing shared. Each test says
what it checks; all of them check that nothing submitted is lost and that the knowledge base holds
no unverified record.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kernelcrew.knowledge_base.db import transaction
from kernelcrew.service import jobs
from tests.conftest import FIXTURES
from tests.integration.test_service import (
    CANDIDATE,
    FAST,
    TASK,
    Service,
    free_port,
    running_service,
    unverified_wins,
    wait_status,
)
from tests.integration.test_worker import wait_for

SANDBOX_S = 30  # long enough for a loaded 2-core CI host to run a timing child, short for the hang
#: How long Redis stays down mid-job: the minute issue 33 names. The orchestrator waits out a broker
#: outage for ``KERNELCREW_TASK_QUEUE_TIMEOUT_S`` (an hour by default); the other service tests set
#: it to 60 s, which a 60 s outage plus Redis's restart just exceeded, so here it is longer.
REDIS_DOWN_S = 60
BROKER_PATIENCE_S = 180
SOFTMAX = (FIXTURES / "tasks" / "softmax.py").read_text()
HANGS = (FIXTURES / "candidates" / "hangs.py").read_text()  # forward never returns


class PrivateRedis:
    """A redis-server of our own; ``restart`` kills it outright and starts it on the same files."""

    def __init__(self, root: Path) -> None:
        self.dir, self.port = root / "redis", free_port()
        self.dir.mkdir()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL)
        wait_for(self._up, 20, "the private redis-server")

    def _up(self) -> bool:
        try:
            return redis.Redis(port=self.port, socket_timeout=1).ping()
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


class PrivateCluster:
    """A PostgreSQL cluster of our own, run as ``postgres`` (initdb refuses root)."""

    def __init__(self, root: Path) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        if not found or shutil.which("runuser") is None:
            pytest.skip("no PostgreSQL server binaries (/usr/lib/postgresql/*/bin) or runuser here")
        self.bin = Path(found[-1]).parent
        self.dir, self.port = root / "pg", free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.dir.mkdir(mode=0o700)
        shutil.chown(self.dir, "postgres", "postgres")
        self._as_postgres(
            "initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres", "--no-sync"
        )

    def _as_postgres(self, tool: str, *args: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def ctl(self, action: str, *extra: str) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} -c fsync=off"
        self._as_postgres(
            "pg_ctl",
            action,
            "-D",
            str(self.dir / "data"),
            "-w",
            "-o",
            options,
            "-l",
            str(self.dir / "log"),
            *extra,
        )


@pytest.fixture(scope="module")
def faulty() -> Iterator[tuple[Service, PrivateRedis, PrivateCluster]]:
    root = Path(tempfile.mkdtemp(prefix="kc-faults-"))
    root.chmod(0o755)
    store, cluster = PrivateRedis(root), PrivateCluster(root)
    store.start()
    cluster.ctl("start")
    try:
        overrides = {
            "KERNELCREW_SANDBOX_TIMEOUT_S": str(SANDBOX_S),
            "KERNELCREW_TASK_QUEUE_TIMEOUT_S": str(BROKER_PATIENCE_S),
        }
        with running_service(cluster.url, store.url, root, f"kcfault{store.port}", **overrides) as svc:
            with transaction(svc.engine) as s:
                svc.tokens["alice"] = jobs.create_token(s, "alice", ["submit", "read"])[1]
            yield svc, store, cluster
    finally:
        store.stop()
        cluster.ctl("stop", "-m", "immediate")
        shutil.rmtree(root, ignore_errors=True)


def submit(svc: Service, candidate: str = CANDIDATE, task: str = TASK) -> str:
    with svc.client("alice") as c:
        r = c.post(
            "/api/v1/jobs", json={"task": task, "candidate": candidate, "mode": "verify", "options": FAST}
        )
        assert r.status_code == 201, r.text
        return r.json()["id"]


def wait_running(svc: Service, job_id: str) -> None:
    wait_for(lambda: job_field(svc, job_id, "status") == "running", 60, f"job {job_id} running", poll_s=0.2)


def job_field(svc: Service, job_id: str, name: str):
    with svc.client("alice") as c:
        return c.get(f"/api/v1/jobs/{job_id}").json()[name]


def verdict(svc: Service, job_id: str) -> dict:
    with svc.client("alice") as c:
        return c.get(f"/api/v1/jobs/{job_id}/result").json()["result"]


def finished(svc: Service, job_id: str) -> dict:
    return wait_status(svc, job_id, ("succeeded", "failed", "cancelled"), timeout_s=240)


def test_a_candidate_that_hangs_past_its_time_limit_is_a_clear_timeout_and_the_job_finishes(faulty):
    """A candidate whose forward never returns is stopped at the sandbox's wall-clock limit: the
    verify job ends (succeeded: it ran to the end) with verdict fail at stage timeout. (The worker
    going on to verify other candidates is what the next tests show.)"""
    svc, _, _ = faulty
    hung = submit(svc, HANGS, SOFTMAX)
    job = finished(svc, hung)
    result = verdict(svc, hung)
    assert job["status"] == "succeeded" and result["verdict"] == "fail", result
    check = result["verify"]
    assert check["stage"] == "timeout" and f"timed out after {SANDBOX_S} s" in check["message"], check
    assert unverified_wins(svc.engine) == []


def test_redis_restarted_mid_job_loses_nothing(faulty):
    """Redis killed outright while a verify job's task runs on the worker, kept down for
    ``REDIS_DOWN_S`` and started again on its append-only file: the job still ends with a verdict,
    and a job submitted while Redis was down (the API needs only PostgreSQL to take it) runs too."""
    svc, store, _ = faulty
    first = submit(svc)
    wait_running(svc, first)
    store.stop()
    second = submit(svc)
    time.sleep(REDIS_DOWN_S)
    store.start()
    for job_id in (first, second):
        job = finished(svc, job_id)
        assert job["status"] == "succeeded", (job_id == first, job["error"])
        assert (result := verdict(svc, job_id))["verdict"] == "pass", result
    assert unverified_wins(svc.engine) == []


def test_postgres_restarted_mid_job_loses_nothing(faulty):
    """PostgreSQL restarted (fast shutdown: every connection cut) while a verify job runs: the
    orchestrator's lease and events survive the outage and the job ends with its verdict; the API
    answers again once the database is back."""
    svc, _, cluster = faulty
    job_id = submit(svc)
    wait_running(svc, job_id)
    cluster.ctl("restart", "-m", "fast")
    job = finished(svc, job_id)
    assert job["status"] == "succeeded", job
    assert (result := verdict(svc, job_id))["verdict"] == "pass", result
    assert job["attempts"] >= 1
    assert unverified_wins(svc.engine) == []


def test_a_short_load_loses_no_job_and_gets_no_error(faulty):
    """The smoke version of ``bench/load.py`` on the same service, after the restarts: two clients
    at once create a verify job each, poll it and stream its events to the end; every request
    succeeds and every job reaches a terminal state."""
    from bench.load import Recorder, client_run, job_outcomes

    svc, _, _ = faulty
    with transaction(svc.engine) as s:
        tokens = [jobs.create_token(s, f"smoke{i}", ["submit", "read"])[1] for i in range(2)]
    rec, created = Recorder(), []
    deadline = time.monotonic() + 120
    clients = [
        threading.Thread(target=client_run, args=(svc.url, t, 1, rec, created, deadline, 0.3)) for t in tokens
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    assert dict(rec.errors) == {}
    outcome = job_outcomes(svc.engine, created)
    assert outcome["created"] == 2 and outcome["lost"] == [] and outcome["statuses"] == {"succeeded": 2}
    assert len(rec.latency["GET /jobs/{id}/events (first line)"]) == 2


def test_serve_restarts_an_orchestrator_killed_mid_job_and_readiness_tells(faulty):
    """``kernelcrew serve --orchestrators 1`` beside the service: its orchestrator, killed with
    SIGKILL while a job runs (on it or on the service's other orchestrator), is started again and
    ``/readyz`` says so; the job ends once, with its verdict."""
    import os
    import signal

    import httpx

    from tests.integration.test_service import free_port
    from tests.integration.test_worker import alive, descendants

    svc, _, _ = faulty
    port = free_port()
    serve = svc.start("serve-supervising", ["serve", "--port", str(port), "--orchestrators", "1"])
    ready_url = f"http://127.0.0.1:{port}/readyz"

    def readiness() -> dict | None:
        try:
            return httpx.get(ready_url, timeout=2).json()
        except httpx.HTTPError:
            return None

    def orchestrators() -> list[int]:
        return [
            pid
            for pid in descendants(serve.proc.pid)
            if alive(pid) and b"orchestrator" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]

    try:
        wait_for(lambda: (r := readiness()) and r["ok"], 90, "serve ready", poll_s=0.3)
        assert readiness()["orchestrators"] == "1 of 1 running, 0 restarted"
        [first] = wait_for(orchestrators, 30, "serve's orchestrator")
        job_id = submit(svc)
        wait_running(svc, job_id)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: readiness()["orchestrators"] == "1 of 1 running, 1 restarted", 60, "a restart")
        assert first not in orchestrators()
        job = finished(svc, job_id)
        assert job["status"] == "succeeded", job
        assert (result := verdict(svc, job_id))["verdict"] == "pass", result
    finally:
        serve.kill(signal.SIGTERM)
        svc.procs.pop("serve-supervising", None)
    assert unverified_wins(svc.engine) == []
