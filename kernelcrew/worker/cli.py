"""The ``kernelcrew worker`` command: detect the GPUs, start one Celery worker per GPU, supervise them."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import typer


def worker(
    queues: Annotated[
        str | None,
        typer.Option(help="Comma list of queues every worker serves, instead of its GPU's (or cpu)."),
    ] = None,
    broker: Annotated[
        str | None, typer.Option(help="Redis URL of the broker (default: KERNELCREW_BROKER_URL).")
    ] = None,
    name: Annotated[
        str, typer.Option(help="Prefix of the worker names: NAME-gpu0@HOST, NAME-cpu@HOST.")
    ] = "kc",
    loglevel: Annotated[str, typer.Option(help="Log level of the workers.")] = "info",
) -> None:
    """Serve GPU work: one Celery worker per GPU (pinned, concurrency 1), the cpu queue without GPUs.

    Refuses to start (exit code 2) while its environment holds a provider key or database
    credentials: a worker needs only the broker URL, and whatever it holds is one escape away from
    the code it runs. Scrubbing them here would not do: ``/proc/<pid>/environ`` keeps a process's
    initial environment whatever it unsets later.
    """
    import redis

    from kernelcrew.config import SECRET_ENV, get_settings, unneeded_secrets

    extra = unneeded_secrets("worker")
    if extra:
        held = ", ".join(f"{name} ({SECRET_ENV[name]})" for name in extra)
        typer.echo(
            f"error: kernelcrew worker refuses to start: its environment holds {held}. A GPU worker runs "
            "other people's code and needs only KERNELCREW_BROKER_URL; start it without them "
            f"(env {' '.join(f'-u {n}' for n in extra)} kernelcrew worker ...). See docs/security.md.",
            err=True,
        )
        raise typer.Exit(2)
    from kernelcrew.worker import store
    from kernelcrew.worker.inventory import INFO_ENV, describe_machine, probe_ncu
    from kernelcrew.worker.supervisor import Supervisor, plan_workers

    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s %(name)s] %(message)s")
    log = logging.getLogger("kernelcrew.worker")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise typer.BadParameter("use letters, digits, '-' and '_' only", param_hint="--name")
    wanted = [q.strip() for q in queues.split(",") if q.strip()] if queues is not None else None
    if queues is not None and not wanted:
        raise typer.BadParameter("name at least one queue", param_hint="--queues")
    settings = get_settings()
    broker_url = broker or settings.broker_url
    try:
        store.client(broker_url).ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        log.error("cannot reach the broker at %s: %s", store.safe_url(broker_url), exc)
        raise typer.Exit(2) from exc
    try:
        machine = describe_machine(timeout_s=settings.ncu_probe_timeout_s)
    except RuntimeError as exc:
        log.error("%s", exc)
        raise typer.Exit(2) from exc

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [d for d in machine["devices"] if d["device"] == "cuda"]
    parent = [d.strip() for d in visible.split(",")] if visible else None

    def probe(index: int) -> dict:
        pinned = parent[index] if parent and index < len(parent) else str(index)
        return probe_ncu("cuda", visible_device=pinned, timeout_s=settings.ncu_probe_timeout_s)

    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        ncu = dict(zip([g["index"] for g in gpus], pool.map(probe, [g["index"] for g in gpus]), strict=True))
    specs = plan_workers(
        machine,
        name=name,
        host=socket.gethostname(),
        broker_url=broker_url,
        ncu=ncu,
        queues=wanted,
        visible_devices=visible,
    )
    for spec in specs:
        report = json.loads(spec.env[INFO_ENV])
        gpu = report["gpu"]
        log.info(
            "%s: %s, queues %s, ncu counters: %s (%s)",
            spec.hostname,
            f"{gpu['name']} ({gpu['model']}, {gpu['arch']})" if gpu else "CPU",
            ",".join(spec.queues),
            report["ncu"]["counters"],
            report["ncu"]["detail"],
        )
    supervisor = Supervisor(specs, loglevel=loglevel, shutdown_timeout_s=settings.task_time_limit_s + 30.0)
    raise typer.Exit(supervisor.run())


def orchestrator(
    local: Annotated[
        bool, typer.Option("--local", help="Run GPU work on this machine (LocalExecutor), not on workers.")
    ] = False,
    once: Annotated[bool, typer.Option(help="Run at most one job, then exit.")] = False,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "info",
) -> None:
    """Run jobs from the database: lease one, run its graph (or verify-only check), store the result."""
    import signal

    from kernelcrew.worker.orchestrator import Orchestrator

    logging.basicConfig(level=loglevel.upper(), format="[%(asctime)s %(name)s] %(message)s")
    orch = Orchestrator(local=local)
    signal.signal(signal.SIGTERM, lambda *_: orch.stopping.set())
    orch.run_forever(once=once)
