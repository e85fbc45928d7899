"""Run one evaluation in a sandboxed child process and turn whatever happens to it into a record.

The parent starts a fresh interpreter (spawn semantics, never fork of a process that holds CUDA)
running ``python -m kernelcrew.tools.sandbox SPEC``. The child:

* has its own working directory (``HOME`` and ``TMPDIR`` inside it) and a scrubbed environment:
  an allow-list of variables, so API keys, broker and database URLs never reach user code;
* joins a fresh pids cgroup (v1 or v2) when the caller may create one, so a fork bomb stops at the
  limit even for root;
* moves into a new network namespace (no interface up, so no socket reaches anything, loopback
  included) where the kernel lets it: root needs only ``CLONE_NEWNET``; another user needs a user
  namespace around it. Probed once per process; the record says which (``isolation.network``), and a
  child that was promised a namespace and cannot make one runs no user code;
* then drops to an unprivileged user (``KERNELCREW_SANDBOX_USER``, default ``nobody``) when the
  caller is root and that user can run this interpreter; otherwise it stays the caller's user and the
  record says so (``isolation.user``). The drop happens in the child, after the namespace and cgroup,
  which need root;
* sets its own rlimits before any user code runs: RLIMIT_DATA for memory
  (CUDA reserves terabytes of address space, so RLIMIT_AS would kill it; RLIMIT_DATA does not),
  RLIMIT_CPU, RLIMIT_NOFILE, RLIMIT_FSIZE, RLIMIT_NPROC (when not root) and no core dumps;
* is its own process group and session; on timeout or too much output the whole group and every
  process left in its cgroup are killed.

A segfault, a CUDA error, an infinite loop, ``sys.exit`` or ``os._exit`` inside user code becomes a
:class:`SandboxResult` with a status and a message; the caller keeps running.

What this does not enforce (see docs/security.md): a private filesystem view (the sandbox user can still
write world-writable places such as ``/tmp`` and read world-readable files), and, where the privilege
drop is unavailable, a determined process running as root can raise its own limits.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kernelcrew.config import Settings, get_settings
from kernelcrew.tools import pycache

#: Variables copied from the caller's environment into the child; everything else is dropped.
ENV_ALLOW = (
    "LANG",
    "LC_ALL",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "CUDA_PATH",
    "LD_LIBRARY_PATH",
    "TRITON_INTERPRET",
    "TRITON_PTXAS_PATH",
    "NVIDIA_VISIBLE_DEVICES",
    "TORCH_CUDA_ARCH_LIST",
    "OMP_NUM_THREADS",
)

STATUSES = ("ok", "error", "timeout", "crashed", "output_limit")

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one child process."""

    wall_s: float = 300.0
    cpu_s: int = 1800
    memory_bytes: int = 32 * 1024**3
    max_procs: int = 512
    max_open_files: int = 1024
    max_output_bytes: int = 8 * 1024 * 1024
    max_file_bytes: int = 16 * 1024**3

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **overrides: Any) -> SandboxLimits:
        s = settings or get_settings()
        values = dict(
            wall_s=s.sandbox_timeout_s,
            cpu_s=s.sandbox_cpu_s,
            memory_bytes=s.sandbox_memory_mb * 1024**2,
            max_procs=s.sandbox_max_procs,
            max_open_files=s.sandbox_max_open_files,
            max_output_bytes=s.sandbox_max_output_bytes,
            max_file_bytes=s.sandbox_max_file_bytes,
        )
        values.update(overrides)
        return cls(**values)


@dataclass
class SandboxResult:
    """What happened to one child: ``status`` is one of :data:`STATUSES`."""

    status: str
    value: dict[str, Any] | None = None
    message: str = ""
    error_type: str = ""
    traceback: str = ""
    returncode: int | None = None
    signal: str | None = None
    wall_s: float = 0.0
    output_tail: str = ""
    output_bytes: int = 0
    isolation: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StageError(Exception):
    """Raised inside a child by harness code to report a failure with a stage and details."""

    def __init__(self, stage: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.details = details


# ----------------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------------

_drop_cache: dict[str, tuple[bool, str]] = {}


def _sandbox_identity(user: str) -> tuple[int, int] | None:
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    return entry.pw_uid, entry.pw_gid


def privilege_drop(settings: Settings | None = None) -> tuple[bool, str]:
    """Whether children can run as the unprivileged sandbox user here, and why not if they cannot.

    Probed once per process: the sandbox user must be able to start this interpreter and import
    kernelcrew (a Python installed under a private home directory makes that impossible).
    """
    s = settings or get_settings()
    if s.sandbox_user in _drop_cache:
        return _drop_cache[s.sandbox_user]
    if os.geteuid() != 0:
        verdict = (False, "caller is not root: children run as the caller's user")
    elif (ident := _sandbox_identity(s.sandbox_user)) is None:
        verdict = (False, f"sandbox user {s.sandbox_user!r} does not exist")
    else:
        uid, gid = ident
        try:
            probe = subprocess.run(
                [sys.executable, "-c", "import kernelcrew.tools.sandbox"],
                user=uid,
                group=gid,
                extra_groups=[],
                cwd="/",
                env=_base_env(Path("/tmp")),
                capture_output=True,
                timeout=120,
            )
            if probe.returncode == 0:
                verdict = (True, f"children run as {s.sandbox_user!r} (uid {uid})")
            else:
                err = probe.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
                verdict = (False, f"{s.sandbox_user!r} cannot run {sys.executable}: {err[0]}")
        except (OSError, subprocess.SubprocessError) as exc:
            verdict = (False, f"probe as {s.sandbox_user!r} failed: {exc}")
    _drop_cache[s.sandbox_user] = verdict
    return verdict


_net_cache: list[tuple[bool, str]] = []


def network_isolation() -> tuple[bool, str]:
    """Whether children can get their own network namespace here, and how (or why not).

    Probed once per process with a throw-away child, because containers and kernels differ: Docker's
    default seccomp profile refuses ``unshare``, some kernels refuse unprivileged user namespaces.
    """
    if not _net_cache:
        try:
            probe = subprocess.run(
                [sys.executable, "-m", "kernelcrew.tools.sandbox", "--probe-network"],
                cwd="/",
                env=_base_env(Path("/tmp")),
                capture_output=True,
                text=True,
                timeout=60,
            )
            lines = (probe.stdout + probe.stderr).strip().splitlines() or ["no answer"]
            verdict = (probe.returncode == 0, lines[-1])
        except (OSError, subprocess.SubprocessError) as exc:
            verdict = (False, f"probe failed: {exc}")
        _net_cache.append(verdict)
    return _net_cache[0]


def _base_env(workdir: Path) -> dict[str, str]:
    env = {k: os.environ[k] for k in ENV_ALLOW if k in os.environ}
    exe_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([exe_dir, "/usr/local/cuda/bin", "/usr/local/bin", "/usr/bin", "/bin"])
    env["HOME"] = str(workdir)
    env["TMPDIR"] = str(workdir / "tmp")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("LANG", "C.UTF-8")
    # kernelcrew itself must be importable in the child; a source checkout on sys.path is kept.
    import kernelcrew

    pkg_root = str(Path(kernelcrew.__file__).resolve().parent.parent)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([pkg_root, *extra]))
    return env


class _PidsCgroup:
    """A throw-away pids cgroup (v2 or v1) the child joins itself; absent where we may not create one."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = None
        self.reason = ""
        name = f"kernelcrew-{uuid.uuid4().hex[:12]}"
        candidates = []
        root = Path("/sys/fs/cgroup")
        if (root / "cgroup.controllers").exists():
            candidates.append(root / name)  # unified hierarchy
        candidates.append(root / "pids" / name)  # v1
        for path in candidates:
            try:
                path.mkdir()
            except OSError as exc:
                self.reason = f"cannot create {path}: {exc.strerror}"
                continue
            try:
                (path / "pids.max").write_text(str(limit))
            except OSError as exc:
                self.reason = f"cannot limit {path}: {exc.strerror}"
                with contextlib.suppress(OSError):
                    path.rmdir()
                continue
            self.path = path
            self.reason = f"pids cgroup {path} (max {limit})"
            return

    def kill_all(self) -> None:
        if self.path is None:
            return
        for _ in range(50):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def remove(self) -> None:
        if self.path is None:
            return
        self.kill_all()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)


def make_workdir(prefix: str = "kc-") -> Path:
    """A fresh private directory for one evaluation (the parent's files and the child's)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def run(
    target: str,
    payload: dict[str, Any],
    *,
    limits: SandboxLimits | None = None,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    settings: Settings | None = None,
    keep_workdir: bool = False,
    writable: tuple[Path, ...] = (),
    wrapper: tuple[str, ...] = (),
) -> SandboxResult:
    """Run ``target`` (``"package.module:function"``) on ``payload`` in a sandboxed child.

    The function is called as ``function(payload, workdir)`` and must return a JSON-serializable
    dict. Files the parent wants the child to read go into ``workdir`` before the call (the child's
    own directory is ``workdir / "child"``, the only place it may write besides ``writable``, the
    build caches, which are handed to the sandbox user for the run). ``env`` adds variables to the
    scrubbed environment (never secrets). ``wrapper`` prefixes the child's command line (a tool such
    as ``compute-sanitizer`` that runs the interpreter); it shares the child's network namespace,
    with a loopback up so the two can talk, and nothing else.
    """
    s = settings or get_settings()
    limits = limits or SandboxLimits.from_settings(s)
    own_workdir = workdir is None
    workdir = workdir or make_workdir()
    child_dir = workdir / "child"
    (child_dir / "tmp").mkdir(parents=True, exist_ok=True)

    can_drop, drop_reason = privilege_drop(s)
    ident = _sandbox_identity(s.sandbox_user) if can_drop else None
    cgroup = _PidsCgroup(limits.max_procs)
    own_net, net_reason = network_isolation()
    isolation = {
        "user": s.sandbox_user if ident else pwd.getpwuid(os.geteuid()).pw_name,
        "privilege_drop": drop_reason,
        "pids_limit": cgroup.reason
        or ("RLIMIT_NPROC" if ident or os.geteuid() != 0 else "none: root without a cgroup"),
        "memory_limit": f"RLIMIT_DATA {limits.memory_bytes // 1024**2} MiB",
        "network": (f"isolated: {net_reason}" + (", loopback up for the wrapper" if wrapper else ""))
        if own_net
        else f"not isolated: {net_reason}",
        "filesystem": "writes: own directory and build caches, plus world-writable paths (/tmp, /dev/shm)"
        if ident
        else "writes: wherever the caller's user may (no privilege drop)",
    }

    spec = {
        "target": target,
        "payload": payload,
        "workdir": str(workdir),
        "child_dir": str(child_dir),
        "result_path": str(child_dir / f"result-{uuid.uuid4().hex}.json"),
        "limits": asdict(limits),
        "cgroup_procs": str(cgroup.path / "cgroup.procs") if cgroup.path else None,
        "drop_nproc": ident is not None or os.geteuid() != 0,
        "drop_to": list(ident) if ident is not None else None,
        "isolate_network": own_net and not wrapper,  # else the launcher below made the namespace
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))

    child_env = _base_env(child_dir)
    prefix = pycache.child_prefix(s)  # read-only bytecode: a fresh interpreter imports torch fast
    if prefix is not None:
        child_env["PYTHONPYCACHEPREFIX"] = str(prefix)
    if env:
        child_env.update(env)
    if ident is not None:
        uid, gid = ident
        for path in (workdir, spec_path):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        for root, dirs, files in os.walk(child_dir):
            for name in [*dirs, *files]:
                os.chown(os.path.join(root, name), uid, gid)
        os.chown(child_dir, uid, gid)
        for path in writable:
            _chown_tree(path, uid, gid)

    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            [
                *_launcher(own_net and bool(wrapper)),
                *wrapper,
                sys.executable,
                "-m",
                "kernelcrew.tools.sandbox",
                str(spec_path),
            ],
            cwd=child_dir,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        cgroup.remove()
        return SandboxResult(
            status="error", message=f"could not start the sandbox: {exc}", isolation=isolation
        )

    output = _OutputReader(proc, limits.max_output_bytes)
    output.start()
    status = None
    try:
        deadline = started + limits.wall_s
        while proc.poll() is None:
            if output.exceeded:
                status = "output_limit"
                break
            if time.monotonic() > deadline:
                status = "timeout"
                break
            time.sleep(0.01)
    finally:
        _kill_group(proc)
        cgroup.remove()
        output.join(timeout=5)
        if ident is not None:  # hand the caches back: no later child may write into this one's
            for path in writable:
                _chown_tree(path, os.geteuid(), os.getegid())
    wall = time.monotonic() - started
    if output.exceeded:
        status = "output_limit"

    result = SandboxResult(
        status=status or "ok",
        returncode=proc.returncode,
        wall_s=round(wall, 3),
        output_tail=output.tail(),
        output_bytes=output.total,
        isolation=isolation,
    )
    if status == "timeout":
        result.message = f"timed out after {limits.wall_s:g} s wall-clock; process group killed"
    elif status == "output_limit":
        result.message = f"printed more than {limits.max_output_bytes} bytes; process group killed"
    else:
        _read_child_result(result, Path(spec["result_path"]), proc.returncode)
    if own_workdir and not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _launcher(needed: bool) -> tuple[str, ...]:
    """The command that makes a network namespace for a wrapper and its child together."""
    return (sys.executable, "-m", "kernelcrew.tools.sandbox", "--netns-exec") if needed else ()


def _read_child_result(result: SandboxResult, path: Path, returncode: int | None) -> None:
    record = None
    if path.exists() and returncode == 0:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            record = {"ok": False, "error_type": "ProtocolError", "message": f"unreadable result: {exc}"}
    if record is None:
        result.status = "crashed"
        if returncode is not None and returncode < 0:
            sig = signal.Signals(-returncode).name
            result.signal = sig
            hint = {
                "SIGSEGV": "segmentation fault",
                "SIGKILL": "killed (out of memory, or a limit was hit)",
                "SIGXCPU": "CPU time limit exceeded",
                "SIGXFSZ": "file size limit exceeded",
                "SIGABRT": "aborted",
                "SIGBUS": "bus error",
            }.get(sig, "terminated by a signal")
            result.message = f"child died: {sig} ({hint})"
        else:
            result.message = (
                f"child exited with code {returncode} without a result (sys.exit or os._exit in user code?)"
            )
        return
    if record.get("ok"):
        result.value = record.get("value")
        return
    result.status = "error"
    result.error_type = record.get("error_type", "")
    result.message = record.get("message", "")
    result.traceback = record.get("traceback", "")
    if record.get("stage"):
        result.value = {"stage": record["stage"], **record.get("details", {})}


class _OutputReader(threading.Thread):
    """Drains the child's merged stdout/stderr, keeps the tail, and flags too much output."""

    def __init__(self, proc: subprocess.Popen, limit: int) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.limit = limit
        self.total = 0
        self.exceeded = False
        self._chunks: deque[bytes] = deque()
        self._kept = 0

    def run(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        while True:
            chunk = stream.read1(65536)
            if not chunk:
                break
            self.total += len(chunk)
            self._chunks.append(chunk)
            self._kept += len(chunk)
            while self._kept > 65536 and len(self._chunks) > 1:
                self._kept -= len(self._chunks.popleft())
            if self.total > self.limit and not self.exceeded:
                self.exceeded = True
                _kill_group(self.proc)

    def tail(self, size: int = 8192) -> str:
        return b"".join(self._chunks)[-size:].decode(errors="replace")


def _chown_tree(path: Path, uid: int, gid: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            with contextlib.suppress(OSError):
                os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------------------------
# Child side
# ----------------------------------------------------------------------------------------------


def _apply_limits(limits: dict[str, Any], drop_nproc: bool) -> None:
    def lower(which: int, value: int) -> None:
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))

    lower(resource.RLIMIT_DATA, int(limits["memory_bytes"]))
    lower(resource.RLIMIT_CPU, int(limits["cpu_s"]))
    lower(resource.RLIMIT_NOFILE, int(limits["max_open_files"]))
    lower(resource.RLIMIT_FSIZE, int(limits["max_file_bytes"]))
    lower(resource.RLIMIT_CORE, 0)
    if drop_nproc:
        lower(resource.RLIMIT_NPROC, int(limits["max_procs"]))


def _libc() -> ctypes.CDLL:
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def unshare_network() -> str:
    """Move this process into a new network namespace; raise OSError where the kernel refuses.

    ctypes rather than ``os.unshare``, which only exists from Python 3.12 on.
    """
    root = os.geteuid() == 0
    if _libc().unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET) refused: {os.strerror(err)}")
    return "own network namespace, no interface up" + ("" if root else " (inside a user namespace)")


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this child when the parent dies (Linux), so no orphan runs on.

    Called after the privilege drop, which clears the request.
    """
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the request took effect
            os._exit(137)


def _child_main(spec_path: str) -> None:
    # Run as ``python -m``, this file is ``__main__``: take StageError from the real module so
    # harness code raising kernelcrew.tools.sandbox.StageError is recognized.
    from kernelcrew.tools.sandbox import StageError

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("cgroup_procs"):
        with contextlib.suppress(OSError):
            Path(spec["cgroup_procs"]).write_text(str(os.getpid()))
    if spec["isolate_network"]:
        unshare_network()  # raises before any user code when the promise cannot be kept
    if spec["drop_to"]:
        _drop_privileges(*spec["drop_to"])
    _die_with_parent()
    _apply_limits(spec["limits"], spec["drop_nproc"])
    os.umask(0o077)
    result_path = Path(spec["result_path"])
    try:
        module_name, func_name = spec["target"].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        value = func(spec["payload"], Path(spec["workdir"]))
        record: dict[str, Any] = {"ok": True, "value": value}
    except StageError as exc:
        record = {
            "ok": False,
            "error_type": type(exc).__name__,
            "stage": exc.stage,
            "message": exc.message,
            "details": exc.details,
            "traceback": traceback.format_exc()[-6000:],
        }
    except BaseException as exc:  # the record of any failure, SystemExit and KeyboardInterrupt included
        record = {
            "ok": False,
            "error_type": type(exc).__name__,
            "message": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc()[-6000:],
        }
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip atexit hooks and finalizers that user code may have installed


def _loopback_up() -> None:
    """Bring ``lo`` up in this (new) namespace: a wrapper and its child talk over it."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH", fcntl.ioctl(sock, siocgifflags, struct.pack("16sH", b"lo", 0))[:18])[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


def _netns_exec(argv: list[str]) -> None:
    unshare_network()
    _loopback_up()
    os.execvp(argv[0], argv)


def _probe_network() -> None:
    try:
        print(unshare_network())
    except OSError as exc:
        print(exc.strerror)
        sys.exit(1)


if __name__ == "__main__":
    if sys.argv[1] == "--probe-network":
        _probe_network()
    elif sys.argv[1] == "--netns-exec":
        _netns_exec(sys.argv[2:])
    else:
        _child_main(sys.argv[1])
