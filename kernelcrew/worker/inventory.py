"""The worker inventory: which workers are online, their GPU, queues, ncu capability and current task.

Each worker publishes a record (:class:`WorkerInfo`) to Redis under a key that expires after three
missed heartbeats, so a worker that dies (SIGKILL, power loss) drops out by itself and one that
shuts down cleanly removes its record at once. The task a worker is running is written by the
process running it, when it starts, so :func:`list_workers` shows it without waiting for a beat.

What a worker reports is probed once, before it starts, by ``kernelcrew worker`` (its supervisor):
:func:`describe_machine` detects GPUs and versions in a child interpreter (the supervisor and the
Celery worker never create a CUDA context themselves: a forked worker process must not inherit one),
and :func:`probe_ncu` runs Nsight Compute on a tiny kernel to learn whether hardware counters can be
read (``ncu --query-metrics`` succeeds without that permission, so only a real profile tells).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from kernelcrew.config import Settings, get_settings
from kernelcrew.worker import store

log = logging.getLogger(__name__)

#: Environment variable by which the supervisor hands a worker what it probed (JSON).
INFO_ENV = "KERNELCREW_WORKER_INFO"

#: A record expires after this many missed heartbeats.
MISSED_BEATS = 3


@dataclass
class WorkerInfo:
    """One worker process (one GPU, or the CPU) as the API lists it."""

    hostname: str
    """Celery node name, unique per GPU: ``kc-gpu0@host``."""
    host: str
    """The machine."""
    pid: int
    """The worker's main process."""
    queues: list[str]
    device: str
    """``cuda`` or ``cpu``."""
    gpu: dict[str, Any] | None = None
    """``HardwareInfo.to_dict()`` of its GPU (name, model, arch, memory, ...); None on a CPU worker."""
    ncu: dict[str, Any] = field(default_factory=dict)
    """``{"counters": True | False | None, "detail": ..., "version": ...}``: None is unknown."""
    versions: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    current: dict[str, Any] | None = None
    """The task it runs: ``{task_id, op, job_id, attempt, pid, started_at}``; None when idle."""

    @property
    def model(self) -> str:
        return self.gpu["model"] if self.gpu else "cpu"

    @property
    def arch(self) -> str:
        return self.gpu["arch"] if self.gpu else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model": self.model, "arch": self.arch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerInfo:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})


# ----------------------------------------------------------------------------------------------
# Publishing and listing
# ----------------------------------------------------------------------------------------------


def publish(r: redis.Redis, info: WorkerInfo, ttl_s: float) -> None:
    """Write (or refresh) a worker's record; it expires after ``ttl_s`` without a refresh."""
    info.heartbeat_at = time.time()
    record = info.to_dict()
    record.pop("current", None)  # written by the process running the task, not the heartbeat
    pipe = r.pipeline(transaction=True)
    pipe.set(store.worker_key(info.hostname), json.dumps(record), px=max(1, int(ttl_s * 1000)))
    pipe.zadd(store.WORKERS_INDEX, {info.hostname: info.heartbeat_at})
    pipe.execute()


def remove(r: redis.Redis, hostname: str) -> None:
    """Take a worker off the inventory (clean shutdown)."""
    pipe = r.pipeline(transaction=True)
    pipe.delete(store.worker_key(hostname), store.current_key(hostname))
    pipe.zrem(store.WORKERS_INDEX, hostname)
    pipe.execute()


def list_workers(settings: Settings | None = None, *, client: redis.Redis | None = None) -> list[WorkerInfo]:
    """The workers online now, sorted by hostname; hostnames whose record expired are pruned."""
    r = client or store.client((settings or get_settings()).broker_url)
    hostnames = r.zrange(store.WORKERS_INDEX, 0, -1)
    if not hostnames:
        return []
    pipe = r.pipeline(transaction=False)
    for hostname in hostnames:
        pipe.get(store.worker_key(hostname))
        pipe.get(store.current_key(hostname))
    values = pipe.execute()
    workers, gone = [], []
    for i, hostname in enumerate(hostnames):
        raw, current = values[2 * i], values[2 * i + 1]
        if raw is None:
            gone.append(hostname)
            continue
        info = WorkerInfo.from_dict(json.loads(raw))
        info.current = json.loads(current) if current else None
        workers.append(info)
    if gone:
        # Only drop names that are still expired now: a worker may have come back meanwhile.
        for hostname in gone:
            if not r.exists(store.worker_key(hostname)):
                r.zrem(store.WORKERS_INDEX, hostname)
    return sorted(workers, key=lambda w: w.hostname)


def device_counts(workers: list[WorkerInfo]) -> dict[str, int]:
    """How many workers serve each device, labelled ``<model> (<arch>)`` (``h100-sxm (sm_90)``) or
    ``cpu``, most served first (then by label)."""
    counts: dict[str, int] = {}
    for w in workers:
        label = f"{w.model} ({w.arch})" if w.gpu else "cpu"
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


class Heartbeat:
    """Publishes one worker's record now and every ``interval_s`` until stopped.

    ``beat`` is meant to be called from the worker's own event loop (a Celery timer), so no extra
    thread runs in a process that forks; :meth:`start_thread` exists for processes that do not fork.
    """

    def __init__(self, r: redis.Redis, info: WorkerInfo, interval_s: float) -> None:
        self.r = r
        self.info = info
        self.interval_s = interval_s
        self.ttl_s = interval_s * MISSED_BEATS
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Refresh the record and drop a current task whose process died (it was killed mid-task);
        a Redis error is logged and the next beat tries again."""
        try:
            publish(self.r, self.info, self.ttl_s)
            raw = self.r.get(store.current_key(self.info.hostname))
            pid = json.loads(raw).get("pid") if raw else None
            if pid and not _pid_alive(int(pid)):
                self.r.delete(store.current_key(self.info.hostname))
        except redis.RedisError as exc:
            log.warning("inventory heartbeat of %s failed: %s", self.info.hostname, exc)

    def start_thread(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                self.beat()
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=loop, name=f"heartbeat-{self.info.hostname}", daemon=True)
        self._thread.start()

    def stop(self, *, remove_record: bool = True) -> None:
        """Stop beating; with ``remove_record`` the worker leaves the inventory at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if remove_record:
            try:
                remove(self.r, self.info.hostname)
            except redis.RedisError as exc:
                log.warning("could not remove %s from the inventory: %s", self.info.hostname, exc)


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ----------------------------------------------------------------------------------------------
# What a worker reports: machine probe, ncu probe
# ----------------------------------------------------------------------------------------------


def _probe_main() -> None:
    """Child side of :func:`describe_machine`: print the devices and versions as JSON."""
    from importlib.metadata import PackageNotFoundError, version

    from kernelcrew.tools import hardware

    versions = hardware.versions()
    for package in ("kernelcrew", "celery"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    print(json.dumps({"devices": [info.to_dict() for info in hardware.detect_all()], "versions": versions}))


def describe_machine(timeout_s: float = 120.0) -> dict[str, Any]:
    """``{"devices": [HardwareInfo dicts], "versions": {...}}`` of this machine, probed in a child
    interpreter so this process never creates a CUDA context. ``devices`` is the visible GPUs in
    index order, or the CPU alone. Raises ``RuntimeError`` when the probe fails."""
    cmd = [sys.executable, "-c", "from kernelcrew.worker.inventory import _probe_main; _probe_main()"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"detecting the GPUs took longer than {timeout_s:g} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"detecting the GPUs failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return json.loads(lines[-1])


def probe_ncu(device: str, *, visible_device: str | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """Whether Nsight Compute can read hardware counters on this GPU, as candidates are profiled (in
    the sandbox, as its user): ``{"counters": True | False | None, "detail": str, "version": str |
    None}`` (None: could not tell). See :func:`kernelcrew.tools.ncu.capability`."""
    from kernelcrew.tools import ncu

    if device != "cuda":
        return {"counters": False, "detail": "no GPU: nothing to profile", "version": None}
    probe = ncu.capability(timeout_s, visible_device)
    return {"counters": probe["available"], "detail": probe["reason"], "version": probe["version"]}


def own_info(hostname: str, queues: list[str], settings: Settings | None = None) -> WorkerInfo:
    """This worker's record: what its supervisor probed (``KERNELCREW_WORKER_INFO``), else probed now."""
    raw = os.environ.get(INFO_ENV)
    if raw:
        probed = json.loads(raw)
    else:
        s = settings or get_settings()
        machine = describe_machine(timeout_s=s.ncu_probe_timeout_s)
        device = machine["devices"][0]
        probed = {
            "device": device["device"],
            "gpu": device if device["device"] == "cuda" else None,
            "ncu": probe_ncu(
                device["device"],
                visible_device=os.environ.get("CUDA_VISIBLE_DEVICES"),
                timeout_s=s.ncu_probe_timeout_s,
            ),
            "versions": machine["versions"],
        }
    return WorkerInfo(
        hostname=hostname,
        host=socket.gethostname(),
        pid=os.getpid(),
        queues=list(queues),
        device=probed["device"],
        gpu=probed.get("gpu"),
        ncu=probed.get("ncu", {}),
        versions=probed.get("versions", {}),
        started_at=time.time(),
    )
