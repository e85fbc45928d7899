"""GPU evidence for the service: Redis, the API with an orchestrator, a GPU worker; jobs over HTTP.

On a GPU host with nothing else running, in one command:

    python bench/service_gpu.py OUT_DIR [--redis-debs DIR] [--task bench/suite/absmax_scales_bf16.py]

It starts ``redis-server`` (from the Debian packages in ``--redis-debs``, unpacked with ``dpkg -x``,
when none is on the PATH), ``kernelcrew serve`` (API + one orchestrator, SQLite database) and
``kernelcrew worker`` (one worker per GPU it detects), creates a token with ``kernelcrew token
create``, then, as a CI bot would, over HTTP only:

1. reads ``/api/v1/workers`` (GPU model, architecture, queues, ncu capability);
2. submits an optimize job for the task on the GPU, streams its Server-Sent Events to the end and
   fetches the result (best source, report);
3. submits a verify-only job with the optimize job's best source as the candidate and fetches its
   verdict and timings against eager and ``torch.compile``.

Writes ``service_h100.json`` (every event with its arrival time, the worker inventory, the results)
and ``service_h100.md`` (the transcript summary and timings) to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server(debs: Path | None, workdir: Path) -> list[str]:
    """The command that runs redis-server: the PATH's, else unpacked from the Debian packages."""
    found = shutil.which("redis-server")
    if found:
        return [found]
    if debs is None:
        raise SystemExit("no redis-server on the PATH: pass --redis-debs with the Debian packages")
    root = workdir / "redis"
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    libs = [str(p) for p in root.glob("usr/lib/*-linux-gnu")]
    os.environ["LD_LIBRARY_PATH"] = ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")])
    return [str(root / "usr" / "bin" / "redis-server")]


def wait_for(check: Any, timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for {what}")


class Stack:
    """The service's processes, their logs under ``logs``, all stopped by :meth:`stop`."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        self.procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = (self.logs / f"{name}.log").read_text()[-3000:]
            raise SystemExit(f"{name} exited with {proc.returncode}:\n{tail}")
        return True

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def stream_events(client: httpx.Client, job_id: str, t0: float) -> list[dict[str, Any]]:
    """Every Server-Sent Event of the job until the stream ends, with its arrival time."""
    events, current = [], {}
    with client.stream("GET", f"/api/v1/jobs/{job_id}/events", timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line:
                if "id" in current:
                    data = json.loads(current["data"])
                    events.append(
                        {
                            "id": int(current["id"]),
                            "event": current.get("event"),
                            "t_s": round(time.monotonic() - t0, 2),
                            "data": data,
                        }
                    )
                current = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                current[key] = value
    return events


def submit(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    resp = client.post("/api/v1/jobs", json=body)
    if resp.status_code != 201:
        raise SystemExit(f"submit answered {resp.status_code}: {resp.text}")
    return resp.json(), t0


def run_job(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    job, t0 = submit(client, body)
    accepted = round(time.monotonic() - t0, 2)
    events = stream_events(client, job["id"], t0)
    final = client.get(f"/api/v1/jobs/{job['id']}").json()
    result = client.get(f"/api/v1/jobs/{job['id']}/result")
    statuses = [(e["data"].get("status"), e["t_s"]) for e in events if e["event"] == "status"]
    return {
        "id": job["id"],
        "mode": body["mode"],
        "accepted_s": accepted,
        "status": final["status"],
        "statuses": statuses,
        "events": events,
        "event_kinds": sorted({e["event"] for e in events}),
        "wall_s": round(time.monotonic() - t0, 2),
        "result_http": result.status_code,
        "result": result.json() if result.status_code == 200 else result.text,
    }


def summary(job: dict[str, Any]) -> dict[str, Any]:
    """The few numbers of a job's result the markdown shows."""
    body = job["result"] if isinstance(job["result"], dict) else {}
    report = body.get("result") or {}
    if job["mode"] == "verify":
        timing = report.get("timing") or {}
        results = timing.get("results") or {}
        return {
            "verdict": report.get("verdict"),
            "speedup_eager": report.get("speedup"),
            "candidate_ms": (results.get("candidate") or {}).get("median_ms"),
            "eager_ms": (results.get("eager") or {}).get("median_ms"),
            "compile_ms": {k: v.get("median_ms") for k, v in results.items() if k.startswith("compile")},
            "clock": timing.get("clock"),
        }
    best = report.get("best") or {}
    return {
        "status": report.get("status"),
        "best_strategy": best.get("strategy"),
        "best_ms": best.get("best_ms"),
        "speedup_eager": best.get("speedup_eager"),
        "speedup_compile": best.get("speedup_compile"),
        "sol_fraction": ((report.get("roofline") or {}).get("sol_fraction") or {}).get("best"),
        "gpu": report.get("gpu_name"),
    }


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# The service on the H100: API, orchestrator and a GPU worker over Redis",
        "",
        f"Command: `{data['command']}`. Database: SQLite; broker: Redis {data['redis']}. "
        f"Versions: {json.dumps(data['versions'])}.",
        "",
        "## Workers online (`GET /api/v1/workers`)",
        "",
        "```json",
        json.dumps(data["workers"], indent=1)[:1500],
        "```",
        "",
        "## Jobs over HTTP",
        "",
        "| job | mode | accepted in s | statuses (s after submit) | events | wall s | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for job in data["jobs"]:
        statuses = ", ".join(f"{s} {t}" for s, t in job["statuses"])
        lines.append(
            f"| {job['id'][:8]} | {job['mode']} | {job['accepted_s']} | {statuses} | {len(job['events'])} "
            f"({', '.join(job['event_kinds'])}) | {job['wall_s']} | {json.dumps(job['summary'])} |"
        )
    lines += ["", "## Transcript of the optimize job's events", "", "| s | event | what |", "|---|---|---|"]
    for e in data["jobs"][0]["events"]:
        what = {k: v for k, v in e["data"].items() if k not in ("time",)}
        lines.append(f"| {e['t_s']} | {e['event']} | {json.dumps(what)[:160]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--redis-debs", type=Path)
    parser.add_argument("--task", default="bench/suite/absmax_scales_bf16.py")
    parser.add_argument("--max-iters", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script, not evidence")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kc-service-"))
    redis_port, api_port = free_port(), free_port()
    broker = f"redis://127.0.0.1:{redis_port}/0"
    redis_cmd = redis_server(args.redis_debs, work)  # sets LD_LIBRARY_PATH for unpacked libraries
    env = {
        **os.environ,
        "KERNELCREW_DATABASE_URL": f"sqlite:///{work}/kernelcrew.db",
        "KERNELCREW_BROKER_URL": broker,
        "KERNELCREW_DATA_DIR": str(work / "data"),
    }
    stack = Stack(env, args.out)
    try:
        stack.start("redis", [*redis_cmd, "--port", str(redis_port), "--save", ""])
        wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", redis_port)) == 0, 30, "redis")
        token = (
            subprocess.run(
                [sys.executable, "-m", "kernelcrew", "token", "create", "--user", "ci-bot"],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        stack.start("worker", [sys.executable, "-m", "kernelcrew", "worker", "--broker", broker])
        stack.start("api", [sys.executable, "-m", "kernelcrew", "serve", "--port", str(api_port)])
        url = f"http://127.0.0.1:{api_port}"
        headers = {"authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=120) as client:

            def ready() -> bool:
                stack.alive("api")
                try:
                    return client.get("/readyz").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(ready, 120, "the API")
            workers = wait_for(
                lambda: stack.alive("worker") and client.get("/api/v1/workers").json().get("items"),
                180,
                "a worker online",
            )
            task = (ROOT / args.task).read_text()
            options = {"device": args.device, "backend": "playbook", "max_iters": args.max_iters}
            optimize = run_job(client, {"task": task, "mode": "optimize", "options": options})
            best = optimize["result"].get("best_source") if isinstance(optimize["result"], dict) else None
            jobs = [optimize]
            if best:
                jobs.append(
                    run_job(
                        client,
                        {
                            "task": task,
                            "candidate": best,
                            "mode": "verify",
                            "options": {"device": args.device},
                        },
                    )
                )
            workers_after = client.get("/api/v1/workers").json()
    finally:
        stack.stop()
    for job in jobs:
        job["summary"] = summary(job)
    import torch

    data = {
        "command": f"python bench/service_gpu.py OUT --task {args.task} --max-iters {args.max_iters}"
        + (" --redis-debs DIR" if args.redis_debs else ""),
        "redis": subprocess.run([*redis_cmd, "--version"], capture_output=True, text=True).stdout.strip()[
            :60
        ],
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "workers": workers,
        "workers_after": workers_after,
        "jobs": jobs,
    }
    (args.out / "service_h100.json").write_text(json.dumps(data, indent=1, default=str))
    (args.out / "service_h100.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
