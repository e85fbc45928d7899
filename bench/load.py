"""Load benchmarks of the service on loopback: the API's scale, and a bounded whole-service run.

Scale (``--scenarios streams,reads``, the default): a real ``kernelcrew serve --orchestrators 0``
on a fresh PostgreSQL database (created on the server at ``KERNELCREW_TEST_POSTGRES_URL``, dropped
afterwards), seeded with users, tokens and jobs (a finished one per user with a real report).

- ``streams``: ``--streams`` SSE streams stay open (one running job each, held by a separate client
  process) while events are written to their jobs, and ``/healthz`` and ``GET /jobs/{id}`` are
  probed one request at a time; every stream must receive every event of its job.
- ``reads``: ``--clients`` concurrent clients (own user and token each, one client process) read
  the job list, a job and a finished job's result in a loop, with ``--think-s`` (uniform 0.5x to
  1.5x) between two requests of one client; a last round with no think time gives the capacity.

Each scenario runs ``--rounds`` times; the result gives each round's p50 / p99 and their median and
range. ``jobs`` (the whole service: orchestrator and a CPU worker too) has ``--job-clients`` clients
create ``--jobs`` small jobs each, poll them, stream their events to the end and list them, and
counts jobs lost (created jobs not ended by ``--max-wall``, or missing from the database).

    python bench/load.py --out bench/results
    python bench/load.py --scenarios jobs --job-clients 8 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
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

from sqlalchemy import select  # noqa: E402

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
            found = job.outcome()
            report = {} if found is None else found.report.model_dump(mode="json")
            outcome = report.get("verdict") or report.get("status") or job.error or "-"
            verdicts[f"{job.mode}: {outcome}"[:80]] += 1
        lost = [j for j in created if j not in rows or rows[j].status not in ENDED]
    return {"created": len(created), "statuses": dict(statuses), "outcomes": dict(verdicts), "lost": lost}


def jobs_markdown(report: dict[str, Any]) -> list[str]:
    load, res = report["load"], report["jobs"]
    lines = [
        "## Jobs: the whole service",
        "",
        "API (uvicorn, 1 process), 1 orchestrator, 1 CPU worker (concurrency 1). "
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
    return lines


def run_jobs(args: argparse.Namespace) -> dict[str, Any]:
    """The whole service: clients create, poll, stream and list small jobs; nothing may be lost."""
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
                for i in range(args.job_clients):
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
            return {
                "clients": args.job_clients,
                "jobs_per_client": args.jobs,
                "wall_s": wall,
                "load": summarize(rec, wall),
                "jobs": job_outcomes(svc.engine, created),
            }
    finally:
        pg.drop(db_url)
        pg.admin.close()
        redis.Redis.from_url(args.redis_url).flushdb()


# ------------------------------------------------------------------------------------------------
# Scale: the API alone, with many streams open or many readers
# ------------------------------------------------------------------------------------------------


def latency_summary(values: list[float]) -> dict[str, Any]:
    """p50 / p90 / p99 / max in ms and the interquartile range (the spread) of one sample."""
    if not values:
        return {"n": 0}
    ms = sorted(1000 * v for v in values)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p90_ms": round(percentile(ms, 0.90), 2),
        "p99_ms": round(percentile(ms, 0.99), 2),
        "max_ms": round(ms[-1], 2),
        "iqr_ms": round(q[2] - q[0], 2),
    }


def over_rounds(rounds: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Median and range over the rounds of one figure (e.g. each round's p99)."""
    values = [r[key] for r in rounds if key in r]
    if not values:
        return {}
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def seed(engine: Any, users: int, stream_jobs: int) -> dict[str, Any]:
    """``users`` users with a token each, 10 queued jobs and one finished job with a real report;
    ``stream_jobs`` running jobs of one more user (``streamer``) for the streams."""
    from tests.unit.test_web import H100_REPORT, store_finished_job

    report = json.loads(H100_REPORT.read_text())
    best = "class ModelNew(nn.Module):\n    pass\n"
    tokens, finished, queued = [], [], []
    with transaction(engine) as s:
        for i in range(users):
            tokens.append(jobs.create_token(s, f"reader{i}", ["submit", "read"])[1])
        streamer = jobs.create_token(s, "streamer", ["submit", "read"])[1]
    for i in range(users):
        finished.append(store_finished_job(engine, f"reader{i}", report, best))
        with transaction(engine) as s:
            owner = s.scalar(select(jobs.User.id).where(jobs.User.name == f"reader{i}"))
            mine = []
            for _ in range(10):
                job = jobs.Job(
                    id=jobs.new_job_id(), owner_id=owner, status="queued", mode="optimize",
                    task_source=TASK, options=dict(OPTIMIZE), created_at=jobs.now(),
                )  # fmt: skip
                s.add(job)
                s.flush()
                jobs.add_event(s, job.id, "status", {"status": "queued"})
                mine.append(job.id)
            queued.append(mine)
    running = []
    with transaction(engine) as s:
        owner = s.scalar(select(jobs.User.id).where(jobs.User.name == "streamer"))
        for _ in range(stream_jobs):
            job = jobs.Job(
                id=jobs.new_job_id(), owner_id=owner, status="running", mode="optimize",
                task_source=TASK, options=dict(OPTIMIZE), created_at=jobs.now(),
            )  # fmt: skip
            s.add(job)
            s.flush()
            jobs.add_event(s, job.id, "status", {"status": "running"})
            running.append(job.id)
    return {
        "tokens": tokens,
        "finished": finished,
        "queued": queued,
        "streamer": streamer,
        "running": running,
    }


def hold_streams(url: str, token: str, job_ids: list[str], conn: Any) -> None:
    """Child process: open one SSE stream per job, tell the parent when all are open, count the
    events each receives until the parent says stop; send back the counts."""
    import asyncio

    async def main() -> dict[str, Any]:
        counts = dict.fromkeys(job_ids, 0)
        opened: list[float] = []
        errors: list[str] = []
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=len(job_ids) + 10, max_keepalive_connections=0)
        headers = {"authorization": f"Bearer {token}"}
        timeout = httpx.Timeout(30, read=None)

        async def one(job_id: str) -> None:
            t = time.perf_counter()
            try:
                async with client.stream("GET", f"/api/v1/jobs/{job_id}/events", headers=headers) as resp:
                    if resp.status_code != 200:
                        errors.append(f"{resp.status_code}")
                        return
                    opened.append(time.perf_counter() - t)
                    async for line in resp.aiter_lines():
                        if line.startswith("id: "):
                            counts[job_id] += 1
            except httpx.HTTPError as exc:
                if not stop.is_set():
                    errors.append(f"{type(exc).__name__}: {exc}")

        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
            tasks = [asyncio.create_task(one(j)) for j in job_ids]
            deadline = time.monotonic() + 120
            while len(opened) + len(errors) < len(job_ids) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            conn.send(("open", len(opened), errors[:5]))
            while not conn.poll():
                await asyncio.sleep(0.1)
            conn.recv()
            await asyncio.sleep(2.0)  # the last events' tick
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return {"counts": counts, "open_s": opened, "errors": errors}

    conn.send(("done", asyncio.run(main())))


def probe(
    url: str, paths: list[str], headers: dict[str, str], seconds: float, every_s: float
) -> dict[str, list]:
    """One request at a time to each path in turn, every ``every_s``; latencies and errors per path."""
    got: dict[str, list] = {p: [] for p in paths}
    errors: list[str] = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for path in paths:
                t = time.perf_counter()
                try:
                    r = c.get(path)
                    if r.status_code != 200:
                        errors.append(f"{path}: {r.status_code}")
                except httpx.HTTPError as exc:
                    errors.append(f"{path}: {exc}")
                got[path].append(time.perf_counter() - t)
            time.sleep(every_s)
    return {"latency": got, "errors": errors}


def streams_round(
    url: str, pid: int, engine: Any, seeded: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """``--streams`` open streams while events are written and the API is probed."""
    import multiprocessing as mp

    job_ids = seeded["running"][: args.streams]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=hold_streams, args=(url, seeded["streamer"], job_ids, child), daemon=True)
    holder.start()
    kind, opened, open_errors = parent.recv()
    assert kind == "open"
    before = {j: 0 for j in job_ids}
    with transaction(engine) as s:
        for j, n in s.execute(select(jobs.Job.id, jobs.Job.event_seq).where(jobs.Job.id.in_(job_ids))):
            before[j] = n
    written = dict.fromkeys(job_ids, 0)
    stop = threading.Event()

    def writer() -> None:  # what orchestrators do: events on running jobs, args.event_rate a second
        i = 0
        while not stop.is_set():
            job_id = job_ids[i % len(job_ids)]
            with transaction(engine) as s:
                jobs.add_event(s, job_id, "plan", {"strategy": "fused_pointwise", "n": i})
            written[job_id] += 1
            i += 1
            time.sleep(1 / args.event_rate)

    idle_cpu0 = cpu_s(pid)
    time.sleep(5.0)  # the streams open, nothing else: what holding them costs the API
    idle_cpu = (cpu_s(pid) - idle_cpu0) / 5.0
    w = threading.Thread(target=writer, daemon=True)
    w.start()
    sample_job = seeded["finished"][0]
    probed = probe(
        url,
        ["/healthz", f"/api/v1/jobs/{sample_job}"],
        {"authorization": f"Bearer {seeded['tokens'][0]}"},
        args.probe_s,
        0.05,
    )
    stop.set()
    w.join()
    parent.send("stop")
    kind, result = parent.recv()
    holder.join(timeout=30)
    # the stream from event_seq 0 replays each job's earlier events too: expect all of them
    missing = sum(max(0, before[j] + written[j] - result["counts"][j]) for j in job_ids)
    health = latency_summary(probed["latency"]["/healthz"])
    job_get = latency_summary(probed["latency"][f"/api/v1/jobs/{sample_job}"])
    return {
        "streams_open": opened,
        "stream_errors": len(result["errors"]) + len(open_errors),
        "stream_error_samples": (open_errors + result["errors"])[:3],
        "stream_open": latency_summary(result["open_s"]),
        "server_cpu_share_idle_streams": round(idle_cpu, 3),
        "events_written": sum(written.values()),
        "events_missing": missing,
        "probe_errors": probed["errors"][:3],
        "healthz": health,
        "job_get": job_get,
        "healthz_p99_ms": health.get("p99_ms"),
        "healthz_p50_ms": health.get("p50_ms"),
        "job_get_p99_ms": job_get.get("p99_ms"),
    }


def read_clients(
    url: str, seeded: dict[str, Any], clients: int, seconds: float, think_s: float, conn: Any
) -> None:
    """Child process: ``clients`` concurrent readers for ``seconds``; sends back latencies per read."""
    import asyncio
    import random

    async def main() -> dict[str, Any]:
        lat: dict[str, list[float]] = {"GET /jobs": [], "GET /jobs/{id}": [], "GET /jobs/{id}/result": []}
        errors: list[str] = []
        limits = httpx.Limits(max_connections=clients + 5)

        async def one(i: int) -> None:
            rng = random.Random(i)
            headers = {"authorization": f"Bearer {seeded['tokens'][i]}"}
            queued, finished = seeded["queued"][i], seeded["finished"][i]
            reads = [
                ("GET /jobs", "/api/v1/jobs", {"limit": 20}),
                ("GET /jobs/{id}", None, None),
                ("GET /jobs/{id}/result", f"/api/v1/jobs/{finished}/result", None),
            ]
            end = time.monotonic() + seconds
            await asyncio.sleep(rng.uniform(0, think_s or 0.01))  # not all at the same instant
            n = 0
            while time.monotonic() < end:
                name, path, params = reads[n % 3]
                path = path or f"/api/v1/jobs/{queued[n % len(queued)]}"
                t = time.perf_counter()
                try:
                    r = await client.get(path, params=params, headers=headers)
                    if r.status_code != 200:
                        errors.append(f"{name}: {r.status_code} {r.text[:100]}")
                except httpx.HTTPError as exc:
                    errors.append(f"{name}: {type(exc).__name__}: {exc}")
                lat[name].append(time.perf_counter() - t)
                n += 1
                if think_s:
                    await asyncio.sleep(rng.uniform(0.5 * think_s, 1.5 * think_s))

        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            await asyncio.gather(*(one(i) for i in range(clients)))
        return {"latency": lat, "errors": errors}

    conn.send(asyncio.run(main()))


def reads_round(
    url: str, pid: int, seeded: dict[str, Any], args: argparse.Namespace, think_s: float
) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    started, cpu0 = time.monotonic(), cpu_s(pid)
    proc = ctx.Process(
        target=read_clients, args=(url, seeded, args.clients, args.read_s, think_s, child), daemon=True
    )
    proc.start()
    got = parent.recv()  # the clients have finished their reads
    wall = time.monotonic() - started
    cpu = cpu_s(pid) - cpu0
    proc.join(timeout=30)
    every = [v for values in got["latency"].values() for v in values]
    total = latency_summary(every)
    return {
        "think_s": think_s,
        "requests": len(every),
        "requests_per_s": round(len(every) / args.read_s, 1),
        "wall_s": round(wall, 1),
        "server_cpu_ms_per_request": round(1000 * cpu / max(1, len(every)), 2),
        "errors": len(got["errors"]),
        "error_samples": got["errors"][:3],
        "all": total,
        "per_read": {name: latency_summary(v) for name, v in got["latency"].items()},
        "p99_ms": total.get("p99_ms"),
        "p50_ms": total.get("p50_ms"),
    }


def run_scale(args: argparse.Namespace, scenarios: list[str]) -> dict[str, Any]:
    """Start ``kernelcrew serve`` (API only) on a fresh database, seed it, run the rounds."""
    from kernelcrew.config import Settings, resolve_database_url
    from kernelcrew.knowledge_base.db import make_engine, upgrade
    from tests.integration.test_service import Proc, free_port
    from tests.integration.test_worker import wait_for

    pg = Postgres()
    db_url = pg.create()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"kc-scale-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    engine = make_engine(resolve_database_url(Settings(database_url=db_url)))
    api = None
    try:
        upgrade(engine)
        seeded = seed(engine, args.clients, args.streams)
        port = free_port()
        env = dict(os.environ)
        env.update(
            KERNELCREW_DATABASE_URL=db_url,
            KERNELCREW_BROKER_URL=args.redis_url,
            KERNELCREW_DATA_DIR=str(logs / "data"),
            KERNELCREW_API_RATE_PER_MINUTE="1000000",
        )
        api = Proc(["serve", "--port", str(port), "--orchestrators", "0"], env, logs / "api.log")
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            if api.proc.poll() is not None:
                raise AssertionError(f"the API exited:\n{api.log()}")
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 90, "the API", poll_s=0.3)
        out: dict[str, Any] = {"server_version": server_version(engine)}
        if "streams" in scenarios:
            rounds = [streams_round(url, api.proc.pid, engine, seeded, args) for _ in range(args.rounds)]
            out["streams"] = {
                "streams": args.streams,
                "event_rate_per_s": args.event_rate,
                "probe_s": args.probe_s,
                "rounds": rounds,
                "healthz_p99_ms": over_rounds(rounds, "healthz_p99_ms"),
                "healthz_p50_ms": over_rounds(rounds, "healthz_p50_ms"),
                "job_get_p99_ms": over_rounds(rounds, "job_get_p99_ms"),
                "target_ms": 100,
            }
        if "reads" in scenarios:
            rounds = [reads_round(url, api.proc.pid, seeded, args, args.think_s) for _ in range(args.rounds)]
            out["reads"] = {
                "clients": args.clients,
                "think_s": args.think_s,
                "seconds": args.read_s,
                "rounds": rounds,
                "p99_ms": over_rounds(rounds, "p99_ms"),
                "p50_ms": over_rounds(rounds, "p50_ms"),
                "target_ms": 100,
                "saturation": reads_round(url, api.proc.pid, seeded, args, 0.0),
            }
        return out
    finally:
        if api is not None:
            api.kill(signal.SIGTERM)
        engine.dispose()
        pg.drop(db_url)
        pg.admin.close()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_version(engine: Any) -> str:
    with engine.connect() as conn:
        return str(conn.exec_driver_sql("SHOW server_version").scalar())


def versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("kernelcrew", "fastapi", "starlette", "uvicorn", "sqlalchemy", "psycopg", "httpx")
    return {n: version(n) for n in names}


def fmt_range(r: dict[str, Any]) -> str:
    return f"{r['median']} ({r['min']} to {r['max']})" if r else "-"


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# Service load on loopback",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['os']}, Python {m['python']}, "
        f"torch {m['torch']}; PostgreSQL {report.get('postgresql', '?')} and Redis on the same machine, "
        "shared with other work. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        "",
    ]
    st = report.get("streams")
    if st:
        lines += [
            "## Open event streams",
            "",
            f"`kernelcrew serve` (the API alone, 1 process). {st['streams']} SSE streams open (one running "
            f"job each, held by one client process) while {st['event_rate_per_s']} events/s are written to "
            f"their jobs; `/healthz` and `GET /jobs/{{id}}` probed one at a time for {st['probe_s']} s per "
            f"round. Figures: median over {len(st['rounds'])} rounds (min to max).",
            "",
            f"- `/healthz` p99: **{fmt_range(st['healthz_p99_ms'])} ms** (target < {st['target_ms']} ms); "
            f"p50 {fmt_range(st['healthz_p50_ms'])} ms",
            f"- `GET /jobs/{{id}}` p99: {fmt_range(st['job_get_p99_ms'])} ms",
            "- the API process's CPU while only holding the streams (the poller's share of one core): "
            + ", ".join(str(r["server_cpu_share_idle_streams"]) for r in st["rounds"]),
            "",
            "| round | streams open | stream errors | events written | missing | healthz p50 / p99 / max ms "
            "| healthz IQR ms | job get p50 / p99 ms |",
            "|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        for i, r in enumerate(st["rounds"], 1):
            h, j = r["healthz"], r["job_get"]
            lines.append(
                f"| {i} | {r['streams_open']} | {r['stream_errors']} | {r['events_written']} | "
                f"{r['events_missing']} | {h['p50_ms']} / {h['p99_ms']} / {h['max_ms']} | {h['iqr_ms']} | "
                f"{j['p50_ms']} / {j['p99_ms']} |"
            )
        lines.append("")
    rd = report.get("reads")
    if rd:
        sat = rd["saturation"]
        lines += [
            "## Concurrent readers",
            "",
            f"{rd['clients']} clients (own user and token each) read the job list, a job and a finished "
            f"job's result in turn for {rd['seconds']} s, {rd['think_s']} s (0.5x to 1.5x) apart; "
            f"median over {len(rd['rounds'])} rounds (min to max).",
            "",
            f"- p99 of all reads: **{fmt_range(rd['p99_ms'])} ms** (target < {rd['target_ms']} ms); "
            f"p50 {fmt_range(rd['p50_ms'])} ms",
            f"- capacity (same clients, no think time): {sat['requests_per_s']} requests/s, "
            f"p50 {sat['all'].get('p50_ms')} ms, p99 {sat['all'].get('p99_ms')} ms, {sat['errors']} errors",
            "- the API process's CPU per read (all rounds; saturation): "
            + ", ".join(str(r["server_cpu_ms_per_request"]) for r in rd["rounds"])
            + f"; {sat['server_cpu_ms_per_request']} ms",
            "",
            "| round | requests/s | errors | p50 ms | p99 ms | max ms | IQR ms | list p99 | get p99 | result p99 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, r in enumerate(rd["rounds"], 1):
            a, pr = r["all"], r["per_read"]
            lines.append(
                f"| {i} | {r['requests_per_s']} | {r['errors']} | {a['p50_ms']} | {a['p99_ms']} | "
                f"{a['max_ms']} | {a['iqr_ms']} | {pr['GET /jobs'].get('p99_ms')} | "
                f"{pr['GET /jobs/{id}'].get('p99_ms')} | {pr['GET /jobs/{id}/result'].get('p99_ms')} |"
            )
        lines.append("")
    if report.get("jobs_run"):
        lines += jobs_markdown(report["jobs_run"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--scenarios", default="streams,reads", help="comma-separated: streams, reads, jobs")
    ap.add_argument("--streams", type=int, default=500, help="open SSE streams (streams)")
    ap.add_argument("--event-rate", type=float, default=20, help="events written a second (streams)")
    ap.add_argument("--probe-s", type=float, default=20, help="seconds of probing per round (streams)")
    ap.add_argument("--clients", type=int, default=50, help="concurrent readers (reads)")
    ap.add_argument("--think-s", type=float, default=0.5, help="mean pause between a reader's requests")
    ap.add_argument("--read-s", type=float, default=20, help="seconds per round (reads)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--job-clients", type=int, default=8, help="clients creating jobs (jobs)")
    ap.add_argument("--jobs", type=int, default=2, help="jobs per client (jobs)")
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--max-wall", type=float, default=900, help="stop waiting for jobs after this")
    ap.add_argument(
        "--redis-url", default="redis://127.0.0.1:6379/12", help="flushed before and after (jobs)"
    )
    ap.add_argument("--out", type=Path, default=None, help="write load_cpu.json and .md here")
    args = ap.parse_args(argv)
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]

    report: dict[str, Any] = {
        "command": "python " + " ".join([str(Path(sys.argv[0])), *(argv or sys.argv[1:])]),
        "machine": machine(),
        "versions": versions(),
    }
    ok = True
    if {"streams", "reads"} & set(scenarios):
        scale = run_scale(args, scenarios)
        report["postgresql"] = scale.pop("server_version")
        report.update(scale)
        for r in report.get("streams", {}).get("rounds", []):
            ok = ok and r["stream_errors"] == 0 and r["events_missing"] == 0 and not r["probe_errors"]
        ok = ok and all(r["errors"] == 0 for r in report.get("reads", {}).get("rounds", []))
    if "jobs" in scenarios:
        report["jobs_run"] = run_jobs(args)
        res = report["jobs_run"]["jobs"]
        ok = ok and not res["lost"] and res["created"] == args.job_clients * args.jobs
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "load_cpu.md").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
