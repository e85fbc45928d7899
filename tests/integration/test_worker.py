"""GPU workers end to end on this CPU machine: real Redis, real ``kernelcrew worker`` processes.

Two supervised workers run for the whole module: ``w1`` serves the ``cpu`` queue with roomy time
limits; ``w2`` serves ``kctest.short`` (through ``--queues``) with short ones, so that a task of a
worker killed outright comes back after a visibility timeout of 34 s rather than 22 minutes.
Redis DB 9 (``KERNELCREW_TEST_REDIS_URL`` to change it) is flushed before and after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kernelcrew.config import SECRET_ENV, Settings, get_settings
from kernelcrew.records import ProfileRequest, VerifyRequest
from kernelcrew.task import TaskError
from kernelcrew.worker import store
from kernelcrew.worker.errors import NoWorkerOnline, WorkerError, WorkerLost
from kernelcrew.worker.executor import CeleryExecutor
from kernelcrew.worker.inventory import Heartbeat, WorkerInfo, list_workers
from kernelcrew.worker.routing import pick_queue
from tests.conftest import FIXTURES

REDIS_URL = os.environ.get("KERNELCREW_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
SHORT_QUEUE = "kctest.short"

COMMON = {
    "broker_url": REDIS_URL,
    "worker_heartbeat_s": 1.0,
    "worker_restore_interval_s": 1.0,
    "task_max_attempts": 2,
    "task_queue_timeout_s": 60.0,
    "sandbox_timeout_s": 60.0,
}
W1 = Settings(**COMMON, task_soft_time_limit_s=90, task_time_limit_s=100, visibility_margin_s=5)
W2 = Settings(**COMMON, task_soft_time_limit_s=30, task_time_limit_s=32, visibility_margin_s=2)


# ----------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children of children included)."""
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                kids = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                found.append(kid)
                stack.append(kid)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def env_for(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}  # a worker refuses them
    for name in (
        "broker_url",
        "worker_heartbeat_s",
        "worker_restore_interval_s",
        "task_max_attempts",
        "task_queue_timeout_s",
        "sandbox_timeout_s",
        "task_soft_time_limit_s",
        "task_time_limit_s",
        "visibility_margin_s",
    ):
        env[f"KERNELCREW_{name.upper()}"] = str(getattr(settings, name))
    return env


@dataclass
class Supervised:
    """One ``kernelcrew worker`` process tree started by the tests."""

    name: str
    settings: Settings
    log_path: Path
    queues: str | None = None
    proc: subprocess.Popen | None = None
    seen: set[int] = field(default_factory=set)

    @property
    def hostname(self) -> str:
        return f"{self.name}-cpu@{socket.gethostname()}"

    @property
    def tmpdir(self) -> Path:
        return Path(tempfile.gettempdir()) / f"kernelcrew-{self.hostname}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "kernelcrew", "worker", "--broker", REDIS_URL, "--name", self.name]
        if self.queues:
            cmd += ["--queues", self.queues]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                env=env_for(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def info(self) -> WorkerInfo | None:
        return next((w for w in list_workers(self.settings) if w.hostname == self.hostname), None)

    def wait_online(self, timeout_s: float = 90.0, *, not_pid: int | None = None) -> WorkerInfo:
        def online() -> WorkerInfo | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{self.log()}")
            info = self.info()
            return info if info is not None and info.pid != not_pid else None

        return wait_for(online, timeout_s, f"{self.hostname} in the inventory")

    def remember_processes(self) -> None:
        if self.proc is not None:
            self.seen.update(descendants(self.proc.pid))

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Warm shutdown through the supervisor; anything left afterwards is killed."""
        if self.proc is None:
            return None
        self.remember_processes()
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            code = self.proc.returncode
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        return code


@pytest.fixture(scope="module")
def redis_client() -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        r.ping()
    except redis.RedisError as exc:
        pytest.fail(f"the integration tests need Redis at {REDIS_URL} (KERNELCREW_TEST_REDIS_URL): {exc}")
    r.flushdb()
    yield r
    r.flushdb()


@pytest.fixture(scope="module")
def workers(redis_client, tmp_path_factory) -> Iterator[dict[str, Supervised]]:
    logs = tmp_path_factory.mktemp("workers")
    started = {
        "w1": Supervised("w1", W1, logs / "w1.log"),
        "w2": Supervised("w2", W2, logs / "w2.log", queues=SHORT_QUEUE),
    }
    try:
        for w in started.values():
            w.start()
        for w in started.values():
            w.wait_online()
        yield started
    finally:
        for w in started.values():
            w.stop()


def request(task: str, candidate: str, *, seed: int = 11, device: str = "cpu") -> VerifyRequest:
    return VerifyRequest(
        task_source=(FIXTURES / "tasks" / f"{task}.py").read_text(),
        task_path=f"{task}.py",
        device=device,
        precision="strict",
        seed=seed,
        candidate_source=(FIXTURES / "candidates" / f"{candidate}.py").read_text(),
        candidate_path=f"{candidate}.py",
    )


class Call(threading.Thread):
    """One executor call in the background, so the test can watch (and kill) the worker running it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout_s: float) -> Any:
        self.join(timeout_s)
        assert not self.is_alive(), f"the call did not return within {timeout_s:g} s"
        if self.error is not None:
            raise self.error
        return self.value


def running(worker: Supervised, attempt: int) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        info = worker.info()
        current = info.current if info else None
        return current if current and current["attempt"] == attempt else None

    return check


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_workers_report_to_the_inventory(workers):
    import torch

    by_name = {w.hostname: w for w in list_workers(W1)}
    w1, w2 = by_name[workers["w1"].hostname], by_name[workers["w2"].hostname]
    assert w1.queues == ["cpu"] and w2.queues == [SHORT_QUEUE]
    for info in (w1, w2):
        assert info.device == "cpu" and info.model == "cpu" and info.gpu is None
        assert info.ncu["counters"] is False
        assert info.versions["torch"] == torch.__version__
        assert time.time() - info.heartbeat_at < 5 and alive(info.pid)
        assert info.current is None
    assert json.loads(json.dumps(w1.to_dict()))["queues"] == ["cpu"]
    assert pick_queue(list_workers(W1), None, device="cpu") == "cpu"


def test_verify_a_correct_and_a_wrong_candidate(workers):
    executor = CeleryExecutor(W1, job_id="job-verify")
    call = Call(lambda: executor.verify(request("softmax", "softmax_triton")))
    call.start()
    current = wait_for(running(workers["w1"], 1), 60, "w1 to report the verify it runs")
    assert current["job_id"] == "job-verify" and current["op"] == "verify"
    good = call.result(120)
    assert good.verdict == "pass" and good.stage == "done", good.message
    assert good.kind == "kernel" and good.device == "cpu" and good.seed == 11
    assert executor.last_call["queue"] == "cpu" and executor.last_call["hostname"] == workers["w1"].hostname

    wrong = executor.verify(request("softmax", "zeros"))
    assert wrong.verdict == "fail" and wrong.stage == "correctness"
    assert wrong.failures[0]["stage"] == "correctness"
    executor.close()
    assert workers["w1"].info().current is None


def test_a_rounds_calls_from_two_threads_each_get_their_own_result(workers):
    from kernelcrew.tools.executor import branch

    executor = CeleryExecutor(W1, job_id="job-round")
    other = branch(executor, 1)
    assert other is not executor and other is executor.branch(1) and branch(executor, 0) is executor
    assert executor.capacity("cpu") == 1  # w1 alone serves the cpu queue: a round of one there
    good = Call(lambda: executor.verify(request("softmax", "softmax_triton")))
    wrong = Call(lambda: other.verify(request("softmax", "zeros")))
    good.start()
    wrong.start()
    assert good.result(240).verdict == "pass"
    assert wrong.result(240).stage == "correctness"  # each thread its own answer, not the other's
    executor.close()
    assert executor._branches == {}


def test_a_bad_task_comes_back_as_task_error(workers):
    executor = CeleryExecutor(W1)
    bad = request("softmax", "softmax_triton").model_copy(
        update={
            "task_source": (FIXTURES / "tasks" / "bad" / "no_model.py").read_text(),
            "task_path": "bad/no_model.py",
        }
    )
    with pytest.raises(TaskError, match=r"bad/no_model.py: missing top-level definition\(s\): Model"):
        executor.verify(bad)
    syntax = ProfileRequest(
        task_source=(FIXTURES / "tasks" / "bad" / "syntax_error.py").read_text(),
        device=bad.device,
        precision=bad.precision,
        seed=bad.seed,
    )
    with pytest.raises(TaskError, match="syntax error"):
        executor.profile(syntax)
    executor.close()


def test_requests_no_worker_can_take_fail_clearly(workers):
    with pytest.raises(NoWorkerOnline, match="no worker online for GPU model h100-sxm"):
        CeleryExecutor(W1, gpu="h100-sxm").verify(request("softmax", "zeros", device="cuda"))
    misrouted = CeleryExecutor(W1, queue="cpu")
    with pytest.raises(WorkerError, match=r"has no GPU but the verify request is for cuda"):
        misrouted.verify(request("softmax", "zeros", device="cuda"))
    misrouted.close()


def test_a_task_whose_worker_dies_too_often_fails_instead_of_looping(workers, redis_client):
    w1 = workers["w1"]
    main_pid = w1.info().pid
    executor = CeleryExecutor(W1, job_id="job-doomed")
    call = Call(lambda: executor.verify(request("linear_relu", "flips_tf32", seed=21)))
    call.start()
    for attempt in (1, 2):  # W1 allows 2 attempts: kill the worker process running each
        current = wait_for(running(w1, attempt), 60, f"attempt {attempt} to start")
        time.sleep(0.5)
        below = descendants(current["pid"])
        os.kill(current["pid"], signal.SIGKILL)
        wait_for(lambda pids=below: not any(alive(p) for p in pids), 10, "the sandbox children to die too")
    with pytest.raises(WorkerLost, match=r"worker was lost 2 times .* at most 2 times") as info:
        call.result(60)
    assert "KERNELCREW_TASK_MAX_ATTEMPTS" in str(info.value)
    task_id = executor.last_call["task_id"]
    time.sleep(2)  # nothing runs it again: the message is gone and the count stands
    assert store.read_attempt(redis_client, task_id).number == 3
    assert redis_client.llen("cpu") == 0
    assert all(task_id not in payload for payload in redis_client.hvals("unacked"))
    assert w1.info().pid == main_pid  # only the pool processes died; the worker replaced them
    executor.close()


def test_a_killed_worker_s_task_is_redelivered_to_its_restart_and_completes(workers):
    w2 = workers["w2"]
    executor = CeleryExecutor(W2, queue=SHORT_QUEUE, job_id="job-survivor")
    call = Call(lambda: executor.verify(request("linear_relu", "flips_tf32", seed=31)))
    call.start()
    wait_for(running(w2, 1), 60, "the task to start on w2")
    golden = wait_for(lambda: list(w2.tmpdir.glob("kc-golden-*")), 30, "the golden's directory")
    old_pid = w2.info().pid
    w2.remember_processes()
    os.killpg(old_pid, signal.SIGKILL)  # the whole worker: main process, pool process and sandbox
    restarted = w2.wait_online(60, not_pid=old_pid)
    assert restarted.pid != old_pid
    assert not any(path.exists() for path in golden)  # the dead worker's files went with it
    verdict = call.result(W2.visibility_timeout_s + 60)
    assert verdict.verdict == "fail" and verdict.stage == "static", verdict.message
    assert executor.last_call["attempt"] == 2 and executor.last_call["hostname"] == w2.hostname
    assert "exited (killed by SIGKILL)" in w2.log()
    executor.close()


def test_soft_time_limit_is_a_clear_timeout_and_kills_the_sandbox(redis_client, monkeypatch):
    from celery.exceptions import SoftTimeLimitExceeded

    from kernelcrew.worker.tasks import close_executor, run_operation

    monkeypatch.setenv("KERNELCREW_BROKER_URL", REDIS_URL)
    monkeypatch.setenv("KERNELCREW_TASK_SOFT_TIME_LIMIT_S", "1.5")
    monkeypatch.setenv("KERNELCREW_TASK_TIME_LIMIT_S", "5")
    get_settings.cache_clear()

    def soft_limit(signum: int, frame: Any) -> None:  # what Celery's pool does at the soft limit
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGALRM, soft_limit)
    signal.setitimer(signal.ITIMER_REAL, 1.5)
    try:
        envelope = run_operation(
            "verify", request("softmax", "hangs"), task_id="soft-limit-test", hostname="kctest@here"
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        close_executor()
        get_settings.cache_clear()
    assert envelope["ok"] is False and envelope["error"]["type"] == "timeout"
    assert "soft time limit of 1.5 s" in envelope["error"]["message"]
    sandboxes = [
        pid
        for pid in descendants(os.getpid())
        if alive(pid) and b"kernelcrew.tools.sandbox" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert sandboxes == []
    assert redis_client.get(store.current_key("kctest@here")) is None


def test_inventory_heartbeat_appears_and_expires(redis_client):
    info = WorkerInfo(
        hostname="ghost@test", host="test", pid=os.getpid(), queues=["gpu.h100-sxm"], device="cuda"
    )
    beat = Heartbeat(redis_client, info, interval_s=0.4)
    beat.start_thread()
    listed = wait_for(
        lambda: [w for w in list_workers(client=redis_client) if w.hostname == "ghost@test"], 3, "ghost"
    )
    assert listed[0].queues == ["gpu.h100-sxm"]
    beat.stop(remove_record=False)  # as if the worker died: its record is left to expire
    assert any(w.hostname == "ghost@test" for w in list_workers(client=redis_client))
    wait_for(lambda: all(w.hostname != "ghost@test" for w in list_workers(client=redis_client)), 5, "expiry")
    assert redis_client.zscore(store.WORKERS_INDEX, "ghost@test") is None  # pruned from the index

    beat = Heartbeat(redis_client, info, interval_s=5)
    dead = subprocess.Popen(["true"])
    dead.wait()
    store.set_current(redis_client, "ghost@test", {"task_id": "t1", "pid": os.getpid()}, ttl_s=60)
    beat.beat()
    (ghost,) = [w for w in list_workers(client=redis_client) if w.hostname == "ghost@test"]
    assert ghost.current == {"task_id": "t1", "pid": os.getpid()}  # its process runs: kept
    store.set_current(redis_client, "ghost@test", {"task_id": "t2", "pid": dead.pid}, ttl_s=60)
    beat.beat()  # the process running it was killed: the heartbeat drops the stale record
    (ghost,) = [w for w in list_workers(client=redis_client) if w.hostname == "ghost@test"]
    assert ghost.current is None
    beat.stop()  # a clean shutdown leaves at once
    assert all(w.hostname != "ghost@test" for w in list_workers(client=redis_client))


def test_shutdown_is_warm_and_leaves_no_process(workers):
    w2 = workers["w2"]
    w2.remember_processes()
    assert w2.seen, "the supervisor should have worker processes"
    assert w2.stop(timeout_s=60) == 0
    assert w2.info() is None  # left the inventory at once, not after its heartbeat expired
    assert not [pid for pid in w2.seen if alive(pid)]
    assert not w2.tmpdir.exists()
