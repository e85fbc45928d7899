"""The workers' own bookkeeping in Redis: key names, the client, and each task's delivery record.

Celery keeps the queues and results; kernelcrew keeps, beside them, under ``kernelcrew:``:

* ``kernelcrew:task:<task id>`` (hash): how many times the task was delivered (``attempts``, incremented
  when a worker starts it), and who started the last attempt, when and in which process; the caller
  reads it to follow a call, the task reads it to refuse to run again after too many lost workers;
* ``kernelcrew:worker:<hostname>`` (JSON, expires): one worker's inventory record, refreshed by its
  heartbeat; ``kernelcrew:workers`` (sorted set) indexes the hostnames;
* ``kernelcrew:worker:<hostname>:current`` (JSON, expires): the task that worker is running.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import redis

PREFIX = "kernelcrew:"
WORKERS_INDEX = f"{PREFIX}workers"


def task_key(task_id: str) -> str:
    return f"{PREFIX}task:{task_id}"


def worker_key(hostname: str) -> str:
    return f"{PREFIX}worker:{hostname}"


def current_key(hostname: str) -> str:
    return f"{PREFIX}worker:{hostname}:current"


@lru_cache(maxsize=8)
def _client(url: str, pid: int) -> redis.Redis:
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5, health_check_interval=30
    )


def client(url: str) -> redis.Redis:
    """A Redis client for ``url``, one per process (a forked worker process makes its own)."""
    return _client(url, os.getpid())


def safe_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url))


@dataclass(frozen=True)
class Attempt:
    """The last delivery of a task: its number (1 for the first) and where it runs."""

    number: int
    hostname: str
    pid: int
    started_at: float
    op: str
    job_id: str | None


def start_attempt(
    r: redis.Redis,
    task_id: str,
    *,
    hostname: str,
    op: str,
    job_id: str | None,
    ttl_s: int,
) -> Attempt:
    """Count one more delivery of ``task_id`` (atomically) and record who runs it."""
    now = time.time()
    fields = {"hostname": hostname, "pid": os.getpid(), "started_at": now, "op": op, "job_id": job_id or ""}
    pipe = r.pipeline(transaction=True)
    pipe.hincrby(task_key(task_id), "attempts", 1)
    pipe.hset(task_key(task_id), mapping=fields)
    pipe.expire(task_key(task_id), ttl_s)
    number = int(pipe.execute()[0])
    return Attempt(number, hostname, os.getpid(), now, op, job_id)


def read_attempt(r: redis.Redis, task_id: str) -> Attempt | None:
    """The last delivery of ``task_id``, or None when no worker has started it."""
    data = r.hgetall(task_key(task_id))
    if not data or "attempts" not in data:
        return None
    return Attempt(
        number=int(data["attempts"]),
        hostname=data.get("hostname", ""),
        pid=int(data.get("pid") or 0),
        started_at=float(data.get("started_at") or 0.0),
        op=data.get("op", ""),
        job_id=data.get("job_id") or None,
    )


def set_current(r: redis.Redis, hostname: str, record: dict[str, Any], ttl_s: int) -> None:
    r.set(current_key(hostname), json.dumps(record), ex=ttl_s)


def clear_current(r: redis.Redis, hostname: str, task_id: str) -> None:
    """Forget the worker's current task, unless another task has replaced it meanwhile."""
    raw = r.get(current_key(hostname))
    if raw is not None and json.loads(raw).get("task_id") == task_id:
        r.delete(current_key(hostname))
