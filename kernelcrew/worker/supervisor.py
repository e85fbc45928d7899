"""``kernelcrew worker``'s process tree: one Celery worker per GPU, pinned, restarted when it dies.

:func:`plan_workers` turns what the machine probe found into one :class:`WorkerSpec` per GPU
(``CUDA_VISIBLE_DEVICES`` pinned, concurrency 1, its model's and architecture's queues, a hostname
unique per GPU), or one CPU worker on the ``cpu`` queue. :class:`Supervisor` runs them: a worker
that exits is restarted after a backoff that doubles while it keeps failing; the first SIGTERM or
SIGINT asks every worker for a warm shutdown (the task running finishes), a second one for a cold
shutdown (running tasks go back to the queue, their messages unacknowledged). Each worker is a
session of its own, so a terminal's Ctrl+C reaches it only through the supervisor, and it gets
SIGTERM if the supervisor dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("kernelcrew.worker")

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() == 1:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)


@dataclass
class WorkerSpec:
    """One Celery worker process to run: its name, queues and extra environment."""

    hostname: str
    queues: list[str]
    env: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"

    def command(self, loglevel: str = "INFO") -> list[str]:
        return [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "kernelcrew.worker.app:app",
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            "1",
            "--queues",
            ",".join(self.queues),
            "--hostname",
            self.hostname,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            loglevel.upper(),
        ]


def plan_workers(
    machine: dict[str, Any],
    *,
    name: str,
    host: str,
    broker_url: str,
    ncu: dict[int, dict[str, Any]] | None = None,
    queues: Sequence[str] | None = None,
    visible_devices: str | None = None,
) -> list[WorkerSpec]:
    """One spec per GPU of ``machine`` (``inventory.describe_machine()``), or one CPU worker.

    ``queues`` replaces the detected queues of every worker; ``visible_devices`` is the supervisor's
    own CUDA_VISIBLE_DEVICES, so GPU ``i`` of the probe is pinned to the i-th device it lists.
    """
    from kernelcrew.tools.hardware import HardwareInfo, queue_names
    from kernelcrew.worker.inventory import INFO_ENV

    parent = [d.strip() for d in visible_devices.split(",")] if visible_devices else None
    specs = []
    for data in machine["devices"]:
        info = HardwareInfo.from_dict(data)
        probe = (ncu or {}).get(info.index or 0) if info.is_cuda else None
        report = {
            "device": info.device,
            "gpu": info.to_dict() if info.is_cuda else None,
            "ncu": probe or {"counters": False, "detail": "no GPU: nothing to profile", "version": None},
            "versions": machine.get("versions", {}),
        }
        env = {INFO_ENV: json.dumps(report), "KERNELCREW_BROKER_URL": broker_url}
        if info.is_cuda:
            index = info.index or 0
            env["CUDA_VISIBLE_DEVICES"] = parent[index] if parent and index < len(parent) else str(index)
            hostname = f"{name}-gpu{index}@{host}"
        else:
            hostname = f"{name}-cpu@{host}"
        specs.append(WorkerSpec(hostname, list(queues or queue_names(info)), env, info.device))
    return specs


def backoff_s(failures: int, *, initial_s: float = 1.0, max_s: float = 60.0) -> float:
    """Delay before restarting a worker after its ``failures``-th exit in a row."""
    return min(max_s, initial_s * 2 ** max(0, failures - 1))


@dataclass
class _Slot:
    spec: WorkerSpec
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Runs the workers of ``specs`` until told to stop (see the module doc)."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        loglevel: str = "INFO",
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        stable_s: float = 60.0,
        shutdown_timeout_s: float = 600.0,
        poll_s: float = 0.2,
    ) -> None:
        if not specs:
            raise ValueError("no workers to supervise")
        self.slots = [_Slot(spec) for spec in specs]
        self.loglevel = loglevel
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_s = stable_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.poll_s = poll_s
        self._signals = 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1

    def _start(self, slot: _Slot) -> None:
        # The worker's temporary files (goldens) live in a directory of its own, emptied before each
        # start: the previous process is dead by then, so what a killed worker left goes away.
        tmp = Path(tempfile.gettempdir()) / f"kernelcrew-{slot.spec.hostname}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        env = {**os.environ, **slot.spec.env, "TMPDIR": str(tmp)}
        slot.proc = subprocess.Popen(
            slot.spec.command(self.loglevel),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM),
        )
        slot.started = time.monotonic()
        log.info(
            "started %s (pid %d) on %s",
            slot.spec.hostname,
            slot.proc.pid,
            ", ".join(slot.spec.queues),
        )

    def _signal_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.proc.pid, sig)

    def _kill_all(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(slot.proc.pid, signal.SIGKILL)
                slot.proc.wait()

    def run(self) -> int:
        """Start the workers and supervise them; returns the exit code once all have stopped."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._loop()
        finally:
            self._kill_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        for slot in self.slots:
            self._start(slot)
        sent = 0
        deadline = float("inf")
        while True:
            now = time.monotonic()
            if self._signals > sent:
                if sent == 0:
                    log.info("warm shutdown: the tasks running finish first (signal again to stop at once)")
                    self._signal_all(signal.SIGTERM)
                    deadline = now + self.shutdown_timeout_s
                elif sent == 1:
                    log.info("cold shutdown: running tasks go back to their queues")
                    self._signal_all(signal.SIGQUIT)
                sent = self._signals
            stopping = sent > 0
            for slot in self.slots:
                if slot.proc is not None and (code := slot.proc.poll()) is not None:
                    slot.proc = None
                    if stopping:
                        log.info("%s stopped (exit %s)", slot.spec.hostname, code)
                        continue
                    ran = now - slot.started
                    slot.failures = 1 if ran >= self.stable_s else slot.failures + 1
                    delay = backoff_s(
                        slot.failures, initial_s=self.initial_backoff_s, max_s=self.max_backoff_s
                    )
                    slot.restart_at = now + delay
                    log.warning(
                        "%s exited (%s) after %.1f s; restarting in %.1f s",
                        slot.spec.hostname,
                        _describe_exit(code),
                        ran,
                        delay,
                    )
                if not stopping and slot.proc is None and now >= slot.restart_at:
                    self._start(slot)
            if stopping and all(slot.proc is None for slot in self.slots):
                for slot in self.slots:
                    shutil.rmtree(
                        Path(tempfile.gettempdir()) / f"kernelcrew-{slot.spec.hostname}", ignore_errors=True
                    )
                return 0
            if now > deadline:
                log.warning(
                    "workers still running %g s after the shutdown request: killing them",
                    self.shutdown_timeout_s,
                )
                self._kill_all()
                return 1
            time.sleep(self.poll_s)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class OrchestratorPool:
    """``kernelcrew serve``'s orchestrator children, restarted when one dies, on a thread of its own.

    An orchestrator that exits while the pool runs is started again after :func:`backoff_s` (doubling
    while it keeps failing within ``stable_s``); the job it held is leased again once its lease
    expires and resumes from its checkpoint. :meth:`status` is what ``/readyz`` reports.
    """

    def __init__(
        self,
        command: Sequence[str],
        count: int,
        *,
        initial_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        stable_s: float = 60.0,
        poll_s: float = 0.5,
    ) -> None:
        self.command = list(command)
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.started = [0.0] * count
        self.failures = [0] * count
        self.restart_at = [0.0] * count
        self.restarts = 0
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self.stable_s, self.poll_s = stable_s, poll_s
        # Looked up now: a restart forks from a process with threads (uvicorn's), where the child may
        # only make the prctl call before it execs, nothing that takes a lock or starts a process.
        self._libc: Any = None
        with contextlib.suppress(OSError):
            self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="orchestrator-pool", daemon=True)

    def __enter__(self) -> OrchestratorPool:
        for i in range(len(self.procs)):
            self._start(i)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, i: int) -> None:
        libc = self._libc
        proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            preexec_fn=None if libc is None else lambda: libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM)),
        )
        with self._lock:
            self.procs[i], self.started[i] = proc, time.monotonic()
        log.info("started orchestrator %d (pid %d)", i, proc.pid)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if proc is not None and (code := proc.poll()) is not None:
                    ran = now - self.started[i]
                    self.failures[i] = 1 if ran >= self.stable_s else self.failures[i] + 1
                    delay = backoff_s(
                        self.failures[i], initial_s=self.initial_backoff_s, max_s=self.max_backoff_s
                    )
                    with self._lock:
                        self.procs[i], self.restart_at[i] = None, now + delay
                    log.warning(
                        "orchestrator %d exited (%s) after %.1f s; restarting in %.1f s",
                        i,
                        _describe_exit(code),
                        ran,
                        delay,
                    )
                elif proc is None and now >= self.restart_at[i] and not self._stop.is_set():
                    self._start(i)
                    self.restarts += 1

    def status(self) -> tuple[bool, str]:
        """``(ready, how)``: ready while at least one orchestrator runs (jobs make progress)."""
        with self._lock:
            alive = sum(p is not None and p.poll() is None for p in self.procs)
        how = f"{alive} of {len(self.procs)} running, {self.restarts} restarted"
        return alive > 0, how if alive else f"error: {how}"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop supervising, then SIGTERM the orchestrators (SIGKILL after ``timeout_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for proc in live:
            proc.terminate()
        for proc in live:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
