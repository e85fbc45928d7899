"""CeleryExecutor: the crew's Executor over Celery, so the same graph runs against remote GPU workers.

Each call is validated, routed (:func:`~kernelcrew.worker.routing.pick_queue` over the workers
online), sent to its queue, and waited for. How long it may take is bounded at each step, never by
one fixed timeout, because a call may wait in a busy queue and a lost worker's task comes back only
after the visibility timeout:

* until a worker starts it: ``task_queue_timeout_s`` (else :class:`NoWorkerOnline`);
* once an attempt starts: its result within the hard time limit, or, if its worker died, the next
  attempt within the visibility timeout + the restore interval + ``task_queue_timeout_s`` (else
  :class:`WorkerLost`); the task itself gives up after ``task_max_attempts`` lost workers.

The message expires after the whole horizon, so no worker runs a task its caller stopped waiting
for. A broker that cannot be reached (Redis restarting) is waited for, up to
``task_queue_timeout_s``, and the request sent again. A worker that loses the broker stops what it
runs and marks it revoked; its message would come back only after the visibility timeout, so the
call revokes it for good and sends the request again at once, at most ``task_max_attempts`` times.
Requests travel as their records' JSON and results come back validated into the records
``LocalExecutor`` returns (a malformed result is a ``WorkerError``); a bad task or candidate raises
``TaskError`` as it does locally, and everything else raises a
:class:`~kernelcrew.worker.errors.WorkerError` (an ``ExecutorError``) that says what happened.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import redis
from pydantic import BaseModel, ValidationError

from kernelcrew.config import Settings, get_settings
from kernelcrew.records import (
    BenchmarkRequest,
    BenchmarkResult,
    ProfileRequest,
    ProfileResult,
    Verdict,
    VerifyRequest,
)
from kernelcrew.task import TaskError
from kernelcrew.worker import store
from kernelcrew.worker.errors import NoWorkerOnline, WorkerError, WorkerLost, WorkerTimeout
from kernelcrew.worker.inventory import list_workers
from kernelcrew.worker.routing import pick_queue, served_queues
from kernelcrew.worker.tasks import TaskName, check_request, problems

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)


class CeleryExecutor:
    """Runs ``verify``, ``benchmark`` and ``profile`` on the workers (see the module doc).

    ``gpu`` is what the job asks for (a model slug such as ``h100-sxm``, an architecture such as
    ``sm_90``, or None for any GPU); ``queue`` pins every call to one queue instead of routing;
    ``job_id`` is shown in the inventory as the job a worker is running.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        gpu: str | None = None,
        queue: str | None = None,
        job_id: str | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.settings = settings or get_settings()
        self.gpu = gpu
        self.pinned_queue = queue
        self.job_id = job_id
        self.poll_s = poll_s
        self.queue: str | None = queue
        """The queue of the last call (routing keeps it while a worker serves it)."""
        self.last_call: dict[str, Any] = {}
        """Where the last call ran: op, task_id, queue, attempt, hostname, wall_s."""
        self._app: Any = None
        self._redis = store.client(self.settings.broker_url)
        self._branches: dict[int, CeleryExecutor] = {}
        self._branch_lock = threading.Lock()

    @property
    def app(self) -> Any:
        if self._app is None:
            from kernelcrew.worker.app import make_app

            self._app = make_app(self.settings)
        return self._app

    def verify(self, request: VerifyRequest) -> Verdict:
        return self._call("verify", request, Verdict)

    def benchmark(self, request: BenchmarkRequest) -> BenchmarkResult:
        return self._call("benchmark", request, BenchmarkResult)

    def profile(self, request: ProfileRequest) -> ProfileResult:
        return self._call("profile", request, ProfileResult)

    def capacity(self, device: str) -> int:
        """How many calls on ``device`` can run at once: the workers online that serve its queue (at
        least one: with none, the first call says so)."""
        try:
            return max(1, served_queues(list_workers(client=self._redis))[self.route(device)])
        except (WorkerError, redis.RedisError):
            return 1

    def branch(self, index: int) -> CeleryExecutor:
        """An executor for the crew's ``index``-th evaluation side by side with this one's: the same
        job, GPU and routing, its own Celery app and result listener (a listener is not shared across
        threads). Kept until :meth:`close`, so each round reuses its connections."""
        with self._branch_lock:
            if index not in self._branches:
                self._branches[index] = CeleryExecutor(
                    self.settings,
                    gpu=self.gpu,
                    queue=self.pinned_queue,
                    job_id=self.job_id,
                    poll_s=self.poll_s,
                )
            other = self._branches[index]
            other.queue = other.queue or self.queue  # the job's GPU model, as long as one serves it
            return other

    def close(self) -> None:
        """Release the broker connections (the workers keep their goldens until they are recycled)."""
        for other in self._branches.values():
            other.close()
        self._branches.clear()
        if self._app is not None:
            self._app.close()
            self._app = None

    # ------------------------------------------------------------------------------------------

    def route(self, device: str) -> str:
        """The queue the next call on ``device`` goes to."""
        if self.pinned_queue:
            return self.pinned_queue
        workers = list_workers(client=self._redis)
        if self.queue and served_queues(workers)[self.queue]:
            return self.queue  # the same GPU model for every call of a job while one serves it
        self.queue = pick_queue(workers, self.gpu, device=device)
        return self.queue

    def _call(self, op: str, request: BaseModel, result_type: type[R]) -> R:
        from kombu.exceptions import OperationalError

        typed = check_request(op, request)
        payload = typed.model_dump(mode="json")
        s = self.settings
        started = time.monotonic()
        stopped, result, outage_ends = 0, None, None
        try:
            while True:
                try:
                    queue = self.route(typed.device)
                    result = self._send(op, payload, queue)
                    return _unwrap(op, self._wait(result, op, queue), result_type)
                except _Stopped as exc:
                    stopped += 1
                    if stopped >= s.task_max_attempts:
                        raise WorkerLost(
                            f"the {op} task was stopped {stopped} times by workers that lost the "
                            f"broker (KERNELCREW_TASK_MAX_ATTEMPTS)"
                        ) from exc
                    log.warning("%s task %s: %s; sending it again", op, self.last_call["task_id"], exc)
                except (redis.RedisError, OperationalError) as exc:
                    outage_ends = outage_ends or time.monotonic() + s.task_queue_timeout_s
                    if time.monotonic() > outage_ends:
                        raise WorkerError(
                            f"the broker at {store.safe_url(s.broker_url)} stayed unreachable for "
                            f"{s.task_queue_timeout_s:g} s (KERNELCREW_TASK_QUEUE_TIMEOUT_S): {exc}"
                        ) from exc
                    log.warning("%s call: the broker is unreachable (%s); trying again", op, exc)
                    time.sleep(self.poll_s)
                except NoWorkerOnline:
                    if outage_ends is None or time.monotonic() > outage_ends:
                        raise
                    time.sleep(self.poll_s)  # a restarted broker is empty until workers beat again
                if result is not None:  # abandoned: its redelivery after the visibility timeout is dropped
                    with contextlib.suppress(redis.RedisError, OperationalError):
                        result.revoke()
                    result = None
        finally:
            self.last_call["wall_s"] = round(time.monotonic() - started, 3)

    def _send(self, op: str, request: dict[str, Any], queue: str) -> Any:
        """Send the request's JSON to ``queue``."""
        s = self.settings
        task_id = str(uuid.uuid4())
        one_attempt = s.visibility_timeout_s + s.worker_restore_interval_s + s.task_queue_timeout_s
        expires = datetime.now(UTC) + timedelta(seconds=(s.task_max_attempts + 1) * one_attempt)
        self.last_call = {"op": op, "task_id": task_id, "queue": queue, "attempt": 0, "hostname": None}
        return self.app.send_task(
            TaskName.for_op(op).value,
            args=[request],
            kwargs={"job_id": self.job_id},
            queue=queue,
            task_id=task_id,
            expires=expires,
        )

    def _wait(self, result: Any, op: str, queue: str) -> Any:
        from celery import states
        from celery.exceptions import TimeoutError as ResultTimeout

        s = self.settings
        start_by = time.monotonic() + s.task_queue_timeout_s
        seen = 0
        while True:
            try:
                result.get(timeout=self.poll_s, propagate=False)
            except ResultTimeout:
                pass
            if result.ready():
                break
            attempt = store.read_attempt(self._redis, result.id)
            now = time.monotonic()
            if attempt is not None and attempt.number > seen:
                seen = attempt.number
                self.last_call.update(attempt=seen, hostname=attempt.hostname)
                start_by = now + s.visibility_timeout_s + s.worker_restore_interval_s + s.task_queue_timeout_s
                if seen > 1:
                    log.warning(
                        "%s task %s: attempt %d on %s (a worker was lost)",
                        op,
                        result.id,
                        seen,
                        attempt.hostname,
                    )
            if now > start_by:
                result.revoke()
                if seen == 0:
                    raise NoWorkerOnline(
                        f"no worker started the {op} task within {s.task_queue_timeout_s:g} s on queue "
                        f"{queue} (KERNELCREW_TASK_QUEUE_TIMEOUT_S): its workers are gone or busy"
                    )
                raise WorkerLost(
                    f"the {op} task {result.id} gave no result: attempt {seen} on "
                    f"{self.last_call['hostname']} stopped (its worker was lost) and the task was not "
                    f"started again within {s.visibility_timeout_s + s.worker_restore_interval_s:g} s "
                    f"+ the queue timeout"
                )
        state, value = result.state, result.result
        if state == states.SUCCESS and isinstance(value, dict):
            self.last_call.update(attempt=value.get("attempt", seen), hostname=value.get("hostname"))
        result.forget()
        if state == states.SUCCESS:
            return value
        if state == states.FAILURE:
            raise _failure(op, value, s)
        if state == states.REVOKED:
            raise _Stopped(f"revoked on its worker ({value})")
        raise WorkerError(f"the {op} task {result.id} ended as {state}: {value}")


class _Stopped(WorkerError):
    """A worker stopped the task without running it to the end (it lost the broker)."""


def _failure(op: str, exc: Any, s: Settings) -> WorkerError:
    """The error for a task that Celery itself failed (hard time limit, lost worker, a crash)."""
    name = type(exc).__name__
    if name == "TimeLimitExceeded":
        return WorkerTimeout(
            f"the {op} task was killed at the hard time limit of {s.task_time_limit_s:g} s "
            f"(KERNELCREW_TASK_TIME_LIMIT_S)"
        )
    if name == "WorkerLostError":
        return WorkerLost(f"the {op} task's worker process died: {exc}")
    return WorkerError(f"the {op} task failed on the worker: {name}: {exc}")


def _unwrap(op: str, envelope: Any, result_type: type[R]) -> R:
    """The result record of a task's envelope, or the error it carries, raised."""
    if not isinstance(envelope, dict) or "ok" not in envelope:
        raise WorkerError(
            f"the {op} task returned something that is not a kernelcrew envelope: {envelope!r:.200}"
        )
    where = f" on {envelope.get('hostname')}" if envelope.get("hostname") else ""
    if envelope["ok"]:
        try:
            return result_type.model_validate(envelope.get("result"))
        except ValidationError as exc:
            raise WorkerError(
                f"the {op} task{where} returned a malformed {result_type.__name__}: {problems(exc)}"
            ) from None
    error = envelope["error"]
    kind, message = error.get("type"), error.get("message", "")
    if kind == "task_error":
        raise TaskError(message, path=error.get("path"), line=error.get("line"))
    if kind == "timeout":
        raise WorkerTimeout(message)
    if kind == "worker_lost":
        raise WorkerLost(message)
    if kind == "internal":
        raise WorkerError(f"the {op} task failed{where}: {message}\n{error.get('traceback', '')}".rstrip())
    raise WorkerError(f"the {op} task was refused{where} ({kind}): {message}")
