"""A bounded load test of the whole service on loopback, with figures and jobs lost (must be 0).

Starts the real service (``kernelcrew serve`` API, one orchestrator, one CPU ``kernelcrew worker``)
on a fresh PostgreSQL database (created on the server at ``KERNELCREW_TEST_POSTGRES_URL``, dropped
afterwards) and a Redis database (``--redis-url``, flushed before and after). Then ``--clients``
clients, each with its own user and token, create ``--jobs`` small jobs each (verify and 1-step
optimize, alternating), poll them, stream their events (SSE) to the end and list their jobs. It
reports requests/s, p50/p99 latency and errors per endpoint, and jobs lost: created jobs that did not
reach a terminal state by ``--max-wall``, or that the database does not hold.

    python bench/load.py --clients 8 --jobs 2 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernelcrew.knowledge_base.db import transaction  # noqa: E402
from kernelcrew.service import jobs  # noqa: E402
from tests.integration.test_service import CANDIDATE, FAST, TASK, running_service  # noqa: E402
from tests.unit.test_knowledge_base import Postgres  # noqa: E402

ENDED = set(jobs.ENDED)
OPTIMIZE = {**FAST, "backend": "playbook", "max_iters": 1}


class Recorder:
    """Latencies and failures per endpoint, shared by the clients."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, list[str]] = defaultdict(list)

    def call(
        self, client: httpx.Client, name: str, method: str, url: str, **kw: Any
    ) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            resp = client.request(method, url, **kw)
        except httpx.HTTPError as exc:
            self._add(name, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
            return None
        bad = None if resp.status_code < 400 else f"{resp.status_code}: {resp.text[:200]}"
        self._add(name, time.perf_counter() - started, bad)
        return resp

    def _add(self, name: str, seconds: float, error: str | None) -> None:
        with self.lock:
            self.latency[name].append(seconds)
            if error:
                self.errors[name].append(error)


def stream_events(client: httpx.Client, rec: Recorder, job_id: str) -> tuple[int, str | None]:
    """Read the job's SSE stream to its end; returns (events, last status)."""
    started, count, status = time.perf_counter(), 0, None
    first = True
    try:
        with client.stream("GET", f"/api/v1/jobs/{job_id}/events", timeout=600) as resp:
            for line in resp.iter_lines():
                if first:
                    rec._add("GET /jobs/{id}/events (first line)", time.perf_counter() - started, None)
                    first = False
                if line.startswith("event: "):
                    count += 1
                if line.startswith("data: ") and '"status"' in line:
                    status = json.loads(line[6:]).get("status", status)
    except httpx.HTTPError as exc:
        rec._add("GET /jobs/{id}/events (first line)", time.perf_counter() - started, str(exc))
    return count, status


def client_run(
    base: str, token: str, n_jobs: int, rec: Recorder, created: list[str], deadline: float, poll_s: float
) -> None:
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
        for i in range(n_jobs):
            body = (
                {"task": TASK, "candidate": CANDIDATE, "mode": "verify", "options": FAST}
                if i % 2 == 0
                else {"task": TASK, "mode": "optimize", "options": OPTIMIZE}
            )
            resp = rec.call(c, "POST /jobs", "POST", "/api/v1/jobs", json=body)
            if resp is None or resp.status_code != 201:
                continue
            job_id = resp.json()["id"]
            with rec.lock:
                created.append(job_id)
            streamer = threading.Thread(target=stream_events, args=(c, rec, job_id), daemon=True)
            streamer.start()
            while time.monotonic() < deadline:
                r = rec.call(c, "GET /jobs/{id}", "GET", f"/api/v1/jobs/{job_id}")
                if r is not None and r.status_code == 200 and r.json()["status"] in ENDED:
                    break
                rec.call(c, "GET /jobs", "GET", "/api/v1/jobs", params={"limit": 5})
                time.sleep(poll_s)
            rec.call(c, "GET /jobs/{id}/result", "GET", f"/api/v1/jobs/{job_id}/result")
            streamer.join(timeout=max(0.0, deadline - time.monotonic()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine() -> dict[str, Any]:
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_kb = next(int(ln.split()[1]) for ln in meminfo if ln.startswith("MemTotal"))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024**2, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def summarize(rec: Recorder, wall: float) -> dict[str, Any]:
    rows = {}
    for name, values in sorted(rec.latency.items()):
        rows[name] = {
            "requests": len(values),
            "errors": len(rec.errors.get(name, [])),
            "p50_ms": round(1000 * statistics.median(values), 1),
            "p99_ms": round(1000 * percentile(values, 0.99), 1),
            "max_ms": round(1000 * max(values), 1),
            "error_samples": rec.errors.get(name, [])[:3],
        }
    total = sum(r["requests"] for r in rows.values())
    return {"requests": total, "requests_per_s": round(total / wall, 2), "endpoints": rows}


def job_outcomes(engine: Any, created: list[str]) -> dict[str, Any]:
    with transaction(engine) as s:
        rows = {j.id: j for j in s.query(jobs.Job).filter(jobs.Job.id.in_(created))}
        statuses: dict[str, int] = defaultdict(int)
        verdicts: dict[str, int] = defaultdict(int)
        for job in rows.values():
            statuses[job.status] += 1
            result = job.result or {}
            outcome = result.get("verdict") or result.get("status") or job.error or "-"
            verdicts[f"{job.mode}: {outcome}"[:80]] += 1
        lost = [j for j in created if j not in rows or rows[j].status not in ENDED]
    return {"created": len(created), "statuses": dict(statuses), "outcomes": dict(verdicts), "lost": lost}


def markdown(report: dict[str, Any]) -> str:
    m, load, res = report["machine"], report["load"], report["jobs"]
    lines = [
        "# Reliability: load on loopback",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, Python {m['python']}, "
        f"torch {m['torch']}. Service: API (uvicorn, 1 process), 1 orchestrator, 1 CPU worker "
        f"(concurrency 1); PostgreSQL and Redis on the same machine.",
        "",
        f"Clients: {report['clients']} (one user and token each), {report['jobs_per_client']} jobs each "
        f"(verify, 1-step optimize, alternating). Wall: {report['wall_s']} s.",
        "",
        f"**Jobs: {res['created']} created, {len(res['lost'])} lost**; statuses {res['statuses']}; "
        f"outcomes {res['outcomes']}.",
        "",
        f"Requests: {load['requests']} in {report['wall_s']} s = **{load['requests_per_s']} requests/s**.",
        "",
        "| endpoint | requests | errors | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in load["endpoints"].items():
        lines.append(
            f"| {name} | {r['requests']} | {r['errors']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} |"
        )
    errors = {n: r["error_samples"] for n, r in load["endpoints"].items() if r["error_samples"]}
    lines += ["", f"Error samples: {json.dumps(errors) if errors else 'none'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2, help="jobs per client")
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--max-wall", type=float, default=900, help="stop waiting for jobs after this")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/12", help="flushed before and after")
    ap.add_argument("--out", type=Path, default=None, help="write load_cpu.json and .md here")
    args = ap.parse_args(argv)

    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    pg = Postgres()
    db_url = pg.create()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"kc-load-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        with running_service(db_url, args.redis_url, logs, f"kcload{os.getpid()}") as svc:
            tokens = []
            with transaction(svc.engine) as s:
                for i in range(args.clients):
                    tokens.append(jobs.create_token(s, f"load{i}", ["submit", "read"])[1])
            rec, created = Recorder(), []
            started = time.monotonic()
            deadline = started + args.max_wall
            threads = [
                threading.Thread(
                    target=client_run, args=(svc.url, t, args.jobs, rec, created, deadline, args.poll_s)
                )
                for t in tokens
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = round(time.monotonic() - started, 1)
            report = {
                "command": "python " + " ".join([str(Path(sys.argv[0])), *(argv or sys.argv[1:])]),
                "machine": machine(),
                "clients": args.clients,
                "jobs_per_client": args.jobs,
                "wall_s": wall,
                "load": summarize(rec, wall),
                "jobs": job_outcomes(svc.engine, created),
            }
    finally:
        pg.drop(db_url)
        pg.admin.close()
        redis.Redis.from_url(args.redis_url).flushdb()
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "load_cpu.md").write_text(text)
    return 0 if not report["jobs"]["lost"] and report["jobs"]["created"] == args.clients * args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
