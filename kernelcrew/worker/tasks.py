"""The Celery tasks ``verify``, ``benchmark`` and ``profile``: thin wrappers over this worker's LocalExecutor.

Each worker process keeps one :class:`~kernelcrew.tools.executor.LocalExecutor` (with a bounded
golden cache), so the calls of one job reuse its golden; every candidate still runs in its own
sandboxed child, so a crashing kernel never takes the worker down.

A task returns an envelope, never raises for an expected failure (JSON carries no exceptions)::

    {"ok": true,  "result": {...}, "attempt": 1, "hostname": "kc-gpu0@host"}   (the result record's JSON)
    {"ok": false, "error": {"type": "task_error" | "timeout" | "worker_lost" | "bad_request"
                            | "misrouted" | "internal", "message": ..., ...}, "attempt": ..., ...}

which :class:`~kernelcrew.worker.executor.CeleryExecutor` turns back into ``TaskError`` or a
:class:`~kernelcrew.worker.errors.WorkerError`.

Deliveries are counted in Redis when a task starts (``store.start_attempt``). Messages are
acknowledged late and requeued when a worker is lost, so the task of a worker that died runs again
elsewhere; once it has started ``task_max_attempts`` times, the next delivery fails at once with a
"worker lost" error instead of killing yet another worker: no message loops forever.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from kernelcrew.config import Settings, get_settings
from kernelcrew.records import BenchmarkRequest, ExecutorRequest, ProfileRequest, VerifyRequest
from kernelcrew.task import TaskError
from kernelcrew.tools.executor import LocalExecutor
from kernelcrew.worker import store
from kernelcrew.worker.inventory import INFO_ENV

log = logging.getLogger(__name__)


class TaskName(StrEnum):
    """The registered Celery tasks, one per Executor operation."""

    VERIFY = "kernelcrew.verify"
    BENCHMARK = "kernelcrew.benchmark"
    PROFILE = "kernelcrew.profile"

    @property
    def op(self) -> str:
        return self.value.rsplit(".", 1)[1]

    @classmethod
    def for_op(cls, op: str) -> TaskName:
        for name in cls:
            if name.op == op:
                return name
        raise ValueError(f"unknown operation {op!r}: expected one of {', '.join(n.op for n in cls)}")


#: The request record of each operation (see the Executor protocol).
REQUESTS: dict[str, type[ExecutorRequest]] = {
    "verify": VerifyRequest,
    "benchmark": BenchmarkRequest,
    "profile": ProfileRequest,
}


def problems(exc: ValidationError) -> str:
    """A validation error in one line: what is missing or wrong, field by field."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "the record"
        parts.append(f"lacks {where}" if err["type"] == "missing" else f"{where}: {err['msg']}")
    return "; ".join(parts)


def check_request(op: str, request: Any) -> ExecutorRequest:
    """``request`` (a record or its JSON) as the request record of ``op``; ``ValueError`` unless it
    is a complete, well-typed request."""
    if op not in REQUESTS:
        raise ValueError(f"unknown operation {op!r}: expected one of {', '.join(REQUESTS)}")
    kind = REQUESTS[op]
    if isinstance(request, kind):
        return request
    if not isinstance(request, dict):
        raise ValueError(f"a {op} request must be a dict or a {kind.__name__}, got {type(request).__name__}")
    try:
        return kind.model_validate(request)
    except ValidationError as exc:
        raise ValueError(f"the {op} request is malformed: {problems(exc)}") from None


_executor: LocalExecutor | None = None


def worker_executor(settings: Settings | None = None) -> LocalExecutor:
    """This process's executor (made on first use, after the fork)."""
    global _executor
    if _executor is None:
        s = settings or get_settings()
        _executor = LocalExecutor(s, max_goldens=s.worker_max_goldens)
    return _executor


def close_executor() -> None:
    """Delete the goldens this process made (the worker process is exiting)."""
    global _executor
    if _executor is not None:
        _executor.close()
        _executor = None


def _worker_device() -> str | None:
    raw = os.environ.get(INFO_ENV)
    return json.loads(raw).get("device") if raw else None


def _error(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": {"type": kind, "message": message, **extra}}


def run_operation(
    op: str, request: dict[str, Any], *, task_id: str, hostname: str, job_id: str | None = None
) -> dict[str, Any]:
    """Run one Executor operation for a Celery task and return its envelope (see the module doc)."""
    from celery.exceptions import SoftTimeLimitExceeded

    s = get_settings()
    r = store.client(s.broker_url)
    attempt = store.start_attempt(
        r, task_id, hostname=hostname, op=op, job_id=job_id, ttl_s=int(s.result_expires_s)
    )
    where = {"attempt": attempt.number, "hostname": hostname}
    if attempt.number > s.task_max_attempts:
        lost = attempt.number - 1
        log.error("%s task %s: delivered %d times, refusing to run again", op, task_id, attempt.number)
        return {
            **_error(
                "worker_lost",
                f"the {op} task {task_id} was given up: its worker was lost {lost} times "
                f"(killed, out of memory or its machine went down) and a task may start at most "
                f"{s.task_max_attempts} times (KERNELCREW_TASK_MAX_ATTEMPTS)",
                lost=lost,
            ),
            **where,
        }
    current = {"task_id": task_id, "op": op, "job_id": job_id, "attempt": attempt.number}
    current.update(pid=attempt.pid, started_at=attempt.started_at)
    store.set_current(r, hostname, current, ttl_s=int(s.visibility_timeout_s))
    try:
        try:
            typed = check_request(op, request)
        except ValueError as exc:
            return {**_error("bad_request", str(exc)), **where}
        if typed.device == "cuda" and _worker_device() == "cpu":
            return {**_error("misrouted", f"{hostname} has no GPU but the {op} request is for cuda"), **where}
        from kernelcrew.tools import sandbox

        if (refusal := sandbox.service_refusal(s)) is not None:
            return {**_error("no_isolation", f"{hostname} cannot isolate user code: {refusal}"), **where}
        result = getattr(worker_executor(s), op)(typed)
        return {"ok": True, "result": result.model_dump(mode="json"), **where}
    except TaskError as exc:
        return {**_error("task_error", exc.message, path=exc.path, line=exc.line), **where}
    except SoftTimeLimitExceeded:
        log.warning("%s task %s hit the soft time limit on %s", op, task_id, hostname)
        return {
            **_error(
                "timeout",
                f"the {op} task ran past the soft time limit of {s.task_soft_time_limit_s:g} s on "
                f"{hostname} (KERNELCREW_TASK_SOFT_TIME_LIMIT_S); its sandboxed children were killed",
            ),
            **where,
        }
    except Exception as exc:  # a bug, reported to the caller with its traceback (and logged here)
        log.exception("%s task %s failed on %s", op, task_id, hostname)
        return {
            **_error("internal", f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:]),
            **where,
        }
    finally:
        store.clear_current(r, hostname, task_id)


def register(app: Any) -> None:
    """Register the three tasks on a Celery app."""
    for name in TaskName:
        app.task(name=name.value, bind=True, shared=False)(_make_task(name.op))


def _make_task(op: str) -> Any:
    def task(self: Any, request: dict[str, Any], job_id: str | None = None) -> dict[str, Any]:
        return run_operation(
            op, request, task_id=self.request.id, hostname=self.request.hostname or "", job_id=job_id
        )

    task.__name__ = task.__qualname__ = op
    task.__doc__ = f"The Executor's {op} operation on this worker (returns an envelope)."
    return task
