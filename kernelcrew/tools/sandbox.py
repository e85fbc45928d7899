"""Run one evaluation in an isolated child process and turn whatever happens to it into a record.

The parent starts a fresh interpreter (spawn semantics, never fork of a process that holds CUDA)
running ``python -m kernelcrew.tools.sandbox SPEC``; the child runs ``package.module:function`` on
the spec's payload and writes a JSON result record. Task files and candidates are untrusted code, so
with ``KERNELCREW_SANDBOX=bwrap`` (the default) the child runs under bubblewrap and is isolated by
construction, not by convention:

* its own user, PID, network, IPC, UTS and (where the kernel has it) cgroup namespaces; uid and gid
  65534 inside, no capabilities, no new privileges, no further user namespaces;
* a filesystem view built from read-only binds of only what the interpreter needs (system dirs, a few
  files of /etc, the Python prefix and environment, kernelcrew and the target's package, the CUDA
  devices when present), its work dir read-only with a fresh writable ``child/`` inside, a private
  size-limited ``/tmp`` and ``/dev/shm``, a fresh ``/proc`` and a minimal ``/dev``. The data dir,
  the database, home, other jobs' folders, ``/run`` and every unix socket path are absent; abstract
  sockets belong to the network namespace, so none of the host's is reachable either;
* memory and processes limited by a cgroup (v1 or v2) that every process of the child is in before it
  starts, plus rlimits (memory, CPU, open files, file size, no core dumps) set before any user code
  runs, which it cannot raise without capabilities;
* its own session and ``--die-with-parent``: when its main process ends or the parent kills it
  (timeout, too much output), the PID namespace and everything in it dies, and whatever is left in
  its cgroup is killed;
* build caches it writes are private to the evaluation (see :func:`run`'s ``writable``); the parent
  only ever reads JSON and ``torch.load(weights_only=True)`` files back, after removing symlinks and
  special files the child left.

Where bubblewrap is missing or fails its probe, :func:`run` raises :class:`SandboxUnavailable`
(fail closed): the service refuses the job, the command line refuses unless ``--unsafe-no-sandbox``.
``KERNELCREW_SANDBOX=unsafe-none`` runs a plain child process with a scrubbed environment, rlimits,
a pids cgroup, a network namespace and a drop to ``KERNELCREW_SANDBOX_USER`` where each is
available; its record says which guarantees did not hold.

A segfault, a CUDA error, an infinite loop, ``sys.exit`` or ``os._exit`` inside user code becomes a
:class:`SandboxResult` with a status and a message; the caller keeps running. The record's
``isolation`` says how the child was isolated and, under ``guarantees``, which guarantee held.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import glob
import importlib
import importlib.util
import json
import os
import pwd
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
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

#: uid and gid of the child inside its user namespace (``nobody``).
SANDBOX_ID = 65534
#: The guarantees a record reports (``isolation["guarantees"]``), each true only where it held.
GUARANTEES = (
    "network",
    "unix_sockets",
    "pid_namespace",
    "filesystem",
    "unprivileged_uid",
    "memory_cgroup",
    "pids_limit",
    "rlimits",
    "no_survivors",
    "private_caches",
    "syscall_filter",
)
#: Files and folders of /etc the child sees (read-only): the dynamic loader's, the compilers'
#: alternatives, time zone and name-service basics. ``passwd`` and ``group`` are made up per child.
ETC_ALLOW = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "timezone",
    "nsswitch.conf",
    "host.conf",
    "hosts",
    "gai.conf",
    "protocols",
    "services",
    "os-release",
    "debian_version",
    "lsb-release",
    "OpenCL",
)
#: System calls a child never needs and an attacker wants (other processes' memory, the kernel's
#: keyring, BPF, modules, mounts, io_uring's unfiltered paths), refused with EPERM by a seccomp
#: filter: their numbers on x86_64 and on aarch64.
DENIED_SYSCALLS = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "init_module": (175, 105),
    "delete_module": (176, 106),
    "finit_module": (313, 273),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "setns": (308, 268),
    "syslog": (103, 116),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "pivot_root": (155, 41),
    "mount": (165, 40),
    "umount2": (166, 39),
    "lookup_dcookie": (212, 18),
    "quotactl": (179, 60),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
}
#: Largest build cache a child may hand on to later evaluations of the same code (bytes).
MAX_SEALED_CACHE_BYTES = 4 * 1024**3

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


#: Seconds a session's child that closed its channel gets to exit before the caller looks at it.
EXIT_GRACE_S = 5.0

#: CPU-seconds past the soft RLIMIT_CPU (SIGXCPU) before the hard one (SIGKILL).
CPU_LIMIT_GRACE_S = 5

#: The share of the machine's memory one child may use when no limit is configured.
MACHINE_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class Slot:
    """Where the children a thread starts run when several evaluations share this process: the
    GPUs they see (a ``CUDA_VISIBLE_DEVICES`` value; None: the caller's), the share of the
    children's memory limit each gets (1/n for n evaluations side by side) and the cores the thread
    and its children run on (None: the caller's)."""

    visible_devices: str | None = None
    memory_share: float = 1.0
    cpus: frozenset[int] | None = None


_slot: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("kernelcrew_sandbox_slot", default=None)


@contextlib.contextmanager
def in_slot(slot: Slot) -> Iterator[None]:
    """Children started by this thread (and by what it runs in ``contextvars.copy_context()``)
    inside the block run in ``slot``. With ``slot.cpus`` the thread itself runs on those cores
    for the block: what it starts (children, their compilers, its own thread pools) inherits them,
    so one slot's compiles never take the cores another slot's timing launches kernels from."""
    token = _slot.set(slot)
    before = os.sched_getaffinity(0) if slot.cpus else None
    try:
        if slot.cpus:
            os.sched_setaffinity(0, slot.cpus)  # this thread only
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
        _slot.reset(token)


_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "kernelcrew_sandbox_deadline", default=None
)


@contextlib.contextmanager
def within(seconds: float | None) -> Iterator[None]:
    """Children this thread starts inside the block end within ``seconds`` from now, together: each
    one's wall limit is cut to what is left (at least one second), and one stopped at that point
    says so. None lifts an outer block's bound for the block (work that must finish, such as a
    golden a later call needs too)."""
    token = _deadline.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def current_slot() -> Slot | None:
    """The slot of this thread's children (None: none set, the caller's GPUs and all the memory)."""
    return _slot.get()


@functools.cache
def machine_memory_limit(meminfo: Path = Path("/proc/meminfo")) -> int:
    """A child's default memory limit: :data:`MACHINE_MEMORY_SHARE` of the machine's memory (at least
    4 GiB; 32 GiB where the machine's memory cannot be read), so inputs of many GB fit where the
    machine can hold them."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                return max(4 * 1024**3, int(total * MACHINE_MEMORY_SHARE))
    except (OSError, ValueError, IndexError):
        pass
    return 32 * 1024**3


#: A child's memory limit never falls below this for what boxes keep (:func:`kept_bytes`).
MIN_CHILD_MEMORY = 4 * 1024**3


def default_cpu_seconds(wall_s: float) -> int:
    """A child's CPU-time limit when none is configured: every core this process may use, busy for
    the whole wall-clock limit (at least 1800 s), so the wall clock is what binds. A fixed figure
    would kill a child on a many-core machine that PyTorch's thread pools keep busy in a fraction of
    its wall time."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1800, int(wall_s * cores))


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
    disk_bytes: int = 8 * 1024**3
    """Size of the child's own folder (a tmpfs under bubblewrap): all it may write there."""

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **overrides: Any) -> SandboxLimits:
        """The configured limits; where no memory limit is configured, the machine's share
        (:func:`machine_memory_limit`) less what boxes of this process still keep in memory
        (:func:`kept_bytes`): those bytes come out of the children's share, not the host's."""
        s = settings or get_settings()
        values = dict(
            wall_s=s.sandbox_timeout_s,
            cpu_s=s.sandbox_cpu_s,
            memory_bytes=s.sandbox_memory_mb * 1024**2
            or max(
                MIN_CHILD_MEMORY,
                int((machine_memory_limit() - kept_bytes()) * (current_slot() or Slot()).memory_share),
            ),
            max_procs=s.sandbox_max_procs,
            max_open_files=s.sandbox_max_open_files,
            max_output_bytes=s.sandbox_max_output_bytes,
            disk_bytes=s.sandbox_disk_mb * 1024**2 or machine_memory_limit(),
        )
        values["max_file_bytes"] = s.sandbox_max_file_bytes or values["disk_bytes"]
        values.update(overrides)
        if not values["cpu_s"]:
            values["cpu_s"] = default_cpu_seconds(float(values["wall_s"]))
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
    #: seconds spent after the child ended copying its folder out of the box (not in ``wall_s``)
    copy_out_s: float = 0.0
    #: the files the caller asked to keep in the box (``run(keep=...)``) instead of copied out;
    #: None where the child had no box (its files are in its folder). The caller closes it.
    kept: BoxFiles | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(replace(self, kept=None))


class SandboxUnavailable(RuntimeError):
    """The isolation this child needs cannot be set up here; nothing of the user's ran."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"untrusted code cannot be isolated here: {reason}. Install bubblewrap (Debian/Ubuntu: "
            "apt-get install bubblewrap) where user namespaces are allowed; the command line can run "
            "your own code without isolation with --unsafe-no-sandbox"
        )
        self.reason = reason


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

    Under bubblewrap every child runs as uid 65534 of its own user namespace, in a view where the
    work dir is read-only. Otherwise probed once per process: the sandbox user must be able to start
    this interpreter and import kernelcrew (a Python installed under a private home directory makes
    that impossible).
    """
    s = settings or get_settings()
    if s.sandbox == "bwrap":
        return True, f"children run as uid {SANDBOX_ID} in their own user namespace (bubblewrap)"
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
    slot = current_slot()
    if slot is not None and slot.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot.visible_devices
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


class _Cgroups:
    """Throw-away cgroups (v2, or v1 pids and memory) for one child; absent where we may not make them.

    ``procs`` are the ``cgroup.procs`` files the child's first process joins before it starts anything.
    """

    def __init__(self, max_procs: int, memory_bytes: int | None) -> None:
        self.dirs: list[Path] = []
        self.pids = ""
        self.memory = ""
        self.reasons: list[str] = []
        name = f"kernelcrew-{uuid.uuid4().hex[:12]}"
        root = Path("/sys/fs/cgroup")
        if (root / "cgroup.controllers").exists():  # unified hierarchy
            self._make(root / name, {"pids.max": max_procs}, "pids")
            if memory_bytes and self.dirs:
                self._limit(self.dirs[0], {"memory.max": memory_bytes, "memory.swap.max": 0}, "memory")
        else:
            self._make(root / "pids" / name, {"pids.max": max_procs}, "pids")
            if memory_bytes:
                limits = {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}
                self._make(root / "memory" / name, limits, "memory")

    def _make(self, path: Path, values: dict[str, int], what: str) -> None:
        try:
            path.mkdir()
        except OSError as exc:
            self.reasons.append(f"cannot create {path}: {exc.strerror}")
            return
        self.dirs.append(path)
        self._limit(path, values, what)

    def _limit(self, path: Path, values: dict[str, int], what: str) -> None:
        written = []
        for key, value in values.items():
            try:
                (path / key).write_text(str(value))
                written.append(key)
            except OSError as exc:
                if key.startswith(("memory.memsw", "memory.swap")):  # no swap accounting: no swap limit
                    continue
                self.reasons.append(f"cannot write {path / key}: {exc.strerror}")
        if written:
            setattr(self, what, f"{what} cgroup {path} ({', '.join(f'{k}={values[k]}' for k in written)})")

    @property
    def procs(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @property
    def reason(self) -> str:
        return self.pids or "; ".join(self.reasons)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this child for the memory limit."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                with contextlib.suppress(OSError):
                    for line in (d / name).read_text().splitlines():
                        key, _, count = line.partition(" ")
                        if key == "oom_kill" and count.strip() not in ("", "0"):
                            return True
        return False

    def kill_all(self) -> None:
        for d in self.dirs:
            for _ in range(50):
                try:
                    pids = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.02)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


# ----------------------------------------------------------------------------------------------
# Bubblewrap: the filesystem view and the probe
# ----------------------------------------------------------------------------------------------

_bwrap_cache: dict[tuple[str, str], tuple[bool, str]] = {}


def _bwrap_path(settings: Settings) -> str | None:
    return shutil.which(settings.sandbox_bwrap)


def _module_roots(*modules: str, search: tuple[str, ...] = ()) -> list[Path]:
    """The folders holding these modules' top-level packages (what must be importable in the child),
    found by this interpreter or in the child's ``search`` path."""
    roots = []
    for name in modules:
        top = name.split(".")[0]
        for entry in search:
            for candidate in (Path(entry) / top, Path(entry) / f"{top}.py"):
                if candidate.exists():
                    roots.append(candidate)
        with contextlib.suppress(ImportError, ValueError, AttributeError):
            spec = importlib.util.find_spec(top)
            if spec is None:
                continue
            if spec.submodule_search_locations:
                roots.extend(Path(p) for p in spec.submodule_search_locations)
            elif spec.origin and spec.origin not in ("built-in", "frozen"):
                roots.append(Path(spec.origin))
    return roots


def _interpreter_paths() -> list[Path]:
    """What the interpreter and its packages need, read-only: prefixes, environment, site-packages."""
    import site
    import sysconfig

    paths = [Path(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}]
    paths.append(Path(sys.executable).parent)
    paths.append(Path(os.path.realpath(sys.executable)).parent.parent)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        with contextlib.suppress(KeyError):
            paths.append(Path(sysconfig.get_paths()[key]))
    with contextlib.suppress(AttributeError):
        paths.extend(Path(p) for p in site.getsitepackages())
    return paths


def _outermost(paths: list[Path]) -> list[Path]:
    """Existing absolute paths, without those inside another one of the list, shortest first."""
    real = sorted({Path(os.path.realpath(p)) for p in paths if os.path.isabs(p) and os.path.exists(p)})
    kept: list[Path] = []
    for path in real:
        if path == Path("/") or any(path.is_relative_to(k) for k in kept):
            continue
        kept.append(path)
    return kept


def _nvidia_devices() -> list[str]:
    return sorted(glob.glob("/dev/nvidia*"))


def _view_args(
    workdir: Path,
    child_dir: Path,
    caches: list[tuple[Path, Path]],
    readonly: list[Path],
    tmp_bytes: int,
    seccomp_fd: int | None = None,
    child_bytes: int = 16 * 1024**2,
) -> list[str]:
    """bwrap's options: namespaces, identity, the syscall filter read from ``seccomp_fd``, and the
    filesystem view (see the module docstring). The child's own folder is a tmpfs of
    ``child_bytes`` (with its ``tmp/``), not the host's folder: the kernel bounds what it writes."""
    args = ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    args += [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(SANDBOX_ID),
        "--gid",
        str(SANDBOX_ID),
        "--hostname",
        "sandbox",
        "--tmpfs",
        "/",
    ]
    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ETC_ALLOW:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    etc = workdir / "etc"
    for name in ("passwd", "group"):
        args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    gpu = _nvidia_devices()
    for dev in gpu:  # the driver's devices (nvidia0.., nvidiactl, nvidia-uvm, nvidia-caps/)
        args += ["--dev-bind", dev, dev]
    sys_paths = ["/sys/devices/system/cpu", "/sys/devices/system/node"]
    if gpu:  # the CUDA driver and NVML walk the PCI tree and read the module's parameters
        sys_paths = ["/sys/devices", "/sys/bus", "/sys/class", "/sys/dev", "/sys/module"]
    for path in sys_paths:
        args += ["--ro-bind-try", path, path]
    args += ["--size", str(tmp_bytes), "--tmpfs", "/dev/shm", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    for path in _outermost(readonly):
        args += ["--ro-bind", str(path), str(path)]
    args += ["--ro-bind", str(workdir), str(workdir)]
    args += ["--size", str(child_bytes), "--tmpfs", str(child_dir), "--dir", str(child_dir / "tmp")]
    for private, mount in caches:
        args += ["--bind", str(private), str(mount)]
    args += ["--remount-ro", "/", "--chdir", str(child_dir)]
    return args


def seccomp_program() -> bytes | None:
    """A classic-BPF seccomp filter (bwrap ``--seccomp``) refusing :data:`DENIED_SYSCALLS` with
    EPERM, and any call of another ABI (x32, 32-bit); None on an architecture without a table."""
    import platform
    import struct

    machine = platform.machine()
    if machine in ("x86_64", "amd64"):
        arch, column = 0xC000003E, 0  # AUDIT_ARCH_X86_64
    elif machine in ("aarch64", "arm64"):
        arch, column = 0xC00000B7, 1  # AUDIT_ARCH_AARCH64
    else:
        return None
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    numbers = sorted({row[column] for row in DENIED_SYSCALLS.values()})
    n = len(numbers)
    # 0 ld arch; 1 jeq arch; 2 ld nr; 3 jge x32 bit; 4.. jeq each; then allow, deny
    code = [(ld, 0, 0, 4), (jeq, 0, n + 3, arch), (ld, 0, 0, 0), (jge, n + 1, 0, 0x40000000)]
    for i, number in enumerate(numbers):
        code.append((jeq, n - i, 0, number))  # to deny, past the remaining checks and allow
    code += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("HBBI", *op) for op in code)


@contextlib.contextmanager
def _seccomp_file(workdir: Path) -> Iterator[int | None]:
    """An open file holding :func:`seccomp_program` for bwrap to read (None where there is none)."""
    program = seccomp_program()
    if program is None:
        yield None
        return
    path = workdir / "seccomp.bpf"
    path.write_bytes(program)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield fd
    finally:
        os.close(fd)


def _write_identity(workdir: Path, child_dir: Path) -> None:
    """The child's /etc/passwd and /etc/group: only root and its own user (getpass, Inductor)."""
    etc = workdir / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(
        "root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
        f"nobody:x:{SANDBOX_ID}:{SANDBOX_ID}:nobody:{child_dir}:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\nnogroup:x:{SANDBOX_ID}:\n")


def _readonly_paths(target: str, wrapper: tuple[str, ...], pycache_prefix: Path | None) -> list[Path]:
    import kernelcrew

    paths = _interpreter_paths()
    paths.append(Path(kernelcrew.__file__).resolve().parent)
    search = _base_env(Path("/nonexistent"))["PYTHONPATH"].split(os.pathsep)
    paths.extend(_module_roots(target.split(":")[0], search=tuple(search)))
    paths.extend(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    for var in ("CUDA_HOME", "CUDA_PATH", "TRITON_PTXAS_PATH"):
        if os.environ.get(var):
            paths.append(Path(os.environ[var]))
    if wrapper and (tool := shutil.which(wrapper[0])):
        real = Path(os.path.realpath(tool))
        paths.append(real.parent)  # e.g. an Nsight Compute install in /opt
        # A toolkit's launcher script (bin/ncu) runs the tool from its own install: beside the
        # toolkit (nsight-compute-*) or under /opt/nvidia.
        for pattern in (str(real.parent.parent / "nsight-compute*"), "/opt/nvidia/nsight-compute*"):
            paths.extend(Path(os.path.realpath(found)) for found in glob.glob(pattern))
    if pycache_prefix is not None:
        paths.append(pycache_prefix)
    return paths


def bwrap_status(settings: Settings | None = None) -> tuple[bool, str]:
    """Whether children can be isolated with bubblewrap here, and the version or why not.

    Probed once per process: a child is started in the full view and checks, from inside, its uid,
    that no network interface but the loopback exists and that the root is read-only and holds no
    /etc/shadow. Containers and kernels differ: Docker's default seccomp profile refuses the user
    namespace bubblewrap needs, some kernels refuse unprivileged user namespaces.
    """
    s = settings or get_settings()
    tool = _bwrap_path(s)
    if tool is None:
        return False, f"bubblewrap ({s.sandbox_bwrap!r}) is not installed"
    key = (tool, sys.executable)
    if key in _bwrap_cache:
        return _bwrap_cache[key]
    workdir = make_workdir("kc-probe-")
    try:
        child_dir = workdir / "child"
        child_dir.mkdir()
        _write_identity(workdir, child_dir)
        with _seccomp_file(workdir) as fd:
            paths = _readonly_paths(__name__ + ":_", (), None)
            args = _view_args(workdir, child_dir, [], paths, 16 * 1024**2, fd)
            cmd = [tool, *args, sys.executable, "-m", "kernelcrew.tools.sandbox", "--probe-inside"]
            probe = subprocess.run(
                cmd,
                env=_base_env(child_dir),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                pass_fds=() if fd is None else (fd,),
            )
        lines = (probe.stdout + probe.stderr).strip().splitlines() or ["no answer"]
        version = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=10).stdout
        if probe.returncode == 0 and lines[-1] == "isolated":
            verdict = (True, version.strip() or "bubblewrap")
        else:
            verdict = (False, f"bubblewrap failed its probe: {lines[-1][:300]}")
    except (OSError, subprocess.SubprocessError) as exc:
        verdict = (False, f"bubblewrap failed its probe: {exc}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _bwrap_cache[key] = verdict
    return verdict


def readiness(settings: Settings | None = None) -> dict[str, Any]:
    """What isolation children get here: ``{"mode", "ready", "reason"}`` (``ready`` False: refused)."""
    s = settings or get_settings()
    if s.sandbox == "unsafe-none":
        return {"mode": s.sandbox, "ready": True, "reason": "isolation turned off (unsafe-none)"}
    ok, reason = bwrap_status(s)
    return {"mode": s.sandbox, "ready": ok, "reason": reason}


def service_refusal(settings: Settings | None = None) -> str | None:
    """Why the service must refuse jobs here (it runs other people's code only isolated), or None."""
    s = settings or get_settings()
    if s.sandbox != "bwrap":
        return f"KERNELCREW_SANDBOX={s.sandbox}: the service runs user code only under bubblewrap"
    ok, reason = bwrap_status(s)
    return None if ok else reason


# ----------------------------------------------------------------------------------------------
# Build caches: private to each evaluation, sealed by the first one that ran only their own code
# ----------------------------------------------------------------------------------------------


def code_digest(payload: dict[str, Any]) -> str:
    """A digest of the untrusted code a payload runs: the set of its task and candidate sources,
    however the payload lays them out (``candidate_source``, or ``candidates`` of a benchmark), so
    verifying, timing and profiling one candidate of one task share a build."""
    import hashlib

    code = {v for k, v in payload.items() if k.endswith("source") and isinstance(v, str)}
    for entry in (payload.get("candidates") or {}).values():
        if isinstance(entry, dict) and isinstance(entry.get("source"), str):
            code.add(entry["source"])
    digest = hashlib.sha256()
    for text in sorted(code):
        digest.update(hashlib.sha256(text.encode()).digest())
    return digest.hexdigest()[:16]


def _seed_caches(writable: tuple[Path, ...], workdir: Path, scope: str) -> list[tuple[Path, Path]]:
    """A private copy of each cache for this child: the sealed entry of the same code, else empty,
    with the same empty sub-folders the caller made (``triton/``, ...)."""
    pairs = []
    for i, mount in enumerate(writable):
        mount = Path(mount)
        mount.mkdir(parents=True, exist_ok=True)
        private = workdir / "caches" / str(i)
        sealed = mount / f"sealed-{scope}"
        if sealed.is_dir():
            shutil.copytree(sealed, private, symlinks=True)
        else:
            private.mkdir(parents=True)
        for sub in mount.iterdir():
            if sub.is_dir() and not sub.name.startswith(("sealed-", ".staging-")):
                (private / sub.name).mkdir(exist_ok=True)
        pairs.append((private, mount))
    return pairs


def _seal(private: Path, mount: Path, scope: str) -> bool:
    """Keep what the child built for later evaluations of the same code (first writer only):
    regular files and folders only, no set-id bits, at most :data:`MAX_SEALED_CACHE_BYTES`."""
    sealed = mount / f"sealed-{scope}"
    if sealed.exists():
        return False
    total = 0
    staging = mount / f".staging-{uuid.uuid4().hex[:12]}"
    try:
        for root, dirs, files in os.walk(private):
            rel = Path(root).relative_to(private)
            (staging / rel).mkdir(mode=0o755, parents=True, exist_ok=True)
            for name in files:
                source = Path(root) / name
                info = source.lstat()
                if not stat.S_ISREG(info.st_mode):
                    continue
                total += info.st_size
                if total > MAX_SEALED_CACHE_BYTES:
                    raise OSError("cache too large to keep")
                shutil.copyfile(source, staging / rel / name, follow_symlinks=False)
                os.chmod(staging / rel / name, 0o755 if info.st_mode & 0o100 else 0o644)
            dirs[:] = [d for d in dirs if stat.S_ISDIR((Path(root) / d).lstat().st_mode)]
        os.rename(staging, sealed)
        return True
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        return False


def _sanitize(child_dir: Path) -> None:
    """Remove what the parent must never follow or open from the child's folder: symlinks, FIFOs,
    sockets and device nodes (a symlink named like a result could point anywhere on the host)."""
    for root, dirs, files in os.walk(child_dir):
        for name in [*dirs, *files]:
            path = Path(root) / name
            with contextlib.suppress(OSError):
                mode = path.lstat().st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    path.unlink()


#: Most files and folders the parent copies out of a child's folder (the rest stay behind).
MAX_CHILD_ENTRIES = 10_000


def _pin_child_dir(info_fd: int, child_dir: Path, timeout_s: float = 30.0) -> int:
    """A directory descriptor of the box's tmpfs at ``child_dir``, opened through the box's root
    while its first process waits on bwrap's ``--block-fd``: it keeps the tmpfs after the box ends,
    so the parent copies results out of it. ``OSError`` when it cannot be had."""
    import select

    deadline = time.monotonic() + timeout_s
    info = b""
    while not info.rstrip().endswith(b"}"):
        if not select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise OSError("bubblewrap did not say which process it started")
        chunk = os.read(info_fd, 4096)
        if not chunk:
            raise OSError("bubblewrap exited before the box was set up")
        info += chunk
    pid = int(json.loads(info)["child-pid"])
    host = os.stat(child_dir).st_dev
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            fd = os.open(f"/proc/{pid}/root{child_dir}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            if os.fstat(fd).st_dev != host:  # the box's view is in place (before: the host's)
                return fd
            os.close(fd)
        time.sleep(0.002)
    raise OSError(f"cannot open the box's folder through /proc/{pid}/root")


def _copy_out(
    box_fd: int, dest: Path, budget: list[int], depth: int = 0, skip: frozenset[str] = frozenset()
) -> None:
    """Copy the regular files and folders under ``box_fd`` into ``dest`` without following any
    link, at most :data:`MAX_CHILD_ENTRIES` entries and 16 levels (the size is the tmpfs's);
    ``skip``: names at the top level left in the box."""
    dest.mkdir(exist_ok=True)
    for entry in os.scandir(box_fd):
        if budget[0] <= 0 or depth > 16:
            return
        if depth == 0 and entry.name in skip:
            continue
        budget[0] -= 1
        info = os.stat(entry.name, dir_fd=box_fd, follow_symlinks=False)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        if stat.S_ISDIR(info.st_mode) and not (depth == 0 and entry.name == "tmp"):
            sub = os.open(entry.name, flags | os.O_DIRECTORY, dir_fd=box_fd)
            try:
                _copy_out(sub, dest / entry.name, budget, depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISREG(info.st_mode):
            src = os.open(entry.name, flags, dir_fd=box_fd)
            with open(src, "rb") as fin, open(dest / entry.name, "wb") as fout:
                _copy_file(fin, fout, info.st_size)


class BoxFiles:
    """Files a child wrote that stay in its box's memory folder instead of being copied out: a
    large task's golden outputs and a candidate's outputs are gigabytes, and copying children's
    folders to the host's disk took 9 % of the H100 KernelBench sample's wall time. Readable
    through this process's descriptor of that folder (:meth:`path`) until :meth:`close`; the
    folder's memory goes with the last descriptor. Only names that were regular files at its top
    level are offered, checked once the box had ended: no process can reach the folder any more,
    so nothing changes them after."""

    def __init__(self, box_fd: int, names: tuple[str, ...]) -> None:
        regular = tuple(
            n for n in names if stat.S_ISREG(os.stat(n, dir_fd=box_fd, follow_symlinks=False).st_mode)
        )
        self._fd = box_fd  # owned from here on (a failed check above leaves it to the caller)
        self.names = regular
        _open_boxes.add(self)

    def trim(self) -> None:
        """Remove everything else from the box's folder (copied out already): a golden's box held
        its inputs in memory besides their copy on the disk, as large as the outputs it keeps."""
        for entry in os.scandir(self._fd):
            if entry.name in self.names:
                continue
            with contextlib.suppress(OSError):  # what cannot go stays held until close, as before
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.name, dir_fd=self._fd)
                else:
                    os.unlink(entry.name, dir_fd=self._fd)

    def __contains__(self, name: object) -> bool:
        return self._fd >= 0 and name in self.names

    def path(self, name: str) -> Path:
        """A path to the kept file ``name`` that this process (and only it) can open."""
        if name not in self:
            raise FileNotFoundError(f"{name} is not kept in the box")
        return Path(f"/proc/self/fd/{self._fd}/{name}")

    def nbytes(self) -> int:
        return sum(os.stat(n, dir_fd=self._fd, follow_symlinks=False).st_size for n in self.names)

    def move_to(self, dest: Path) -> None:
        """Copy the kept files into ``dest`` (a folder on the host) and let the box's folder go."""
        try:
            for name in self.names:
                src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._fd)
                with open(src, "rb") as fin, open(dest / name, "wb") as fout:
                    _copy_file(fin, fout, os.fstat(fin.fileno()).st_size)
        finally:
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        _open_boxes.discard(self)

    def __del__(self) -> None:  # a caller that forgot: the box's memory is not held forever
        with contextlib.suppress(Exception):
            self.close()


_open_boxes: weakref.WeakSet[BoxFiles] = weakref.WeakSet()


def kept_bytes() -> int:
    """Bytes this process's boxes keep in memory now (their files, :class:`BoxFiles`)."""
    total = 0
    for box in list(_open_boxes):  # a box leaves the set when it is closed
        with contextlib.suppress(OSError):
            total += box.nbytes()
    return total


def child_file(res: SandboxResult, child_dir: Path, name: str) -> Path:
    """Where a child's file ``name`` is: kept in its box (``run(keep=...)``), else its folder."""
    return res.kept.path(name) if res.kept is not None and name in res.kept else child_dir / name


def _copy_file(fin: Any, fout: Any, size: int) -> None:
    """Copy an open file in the kernel (``sendfile``): a large task's golden is tens of GB, which
    a read-write loop in Python copied at about 1 GB/s. A file that grows while it is copied (a
    child still writing) is cut at the size it had."""
    left = size
    try:
        while left > 0:
            sent = os.sendfile(fout.fileno(), fin.fileno(), size - left, min(left, 1 << 30))
            if sent == 0:
                break
            left -= sent
    except OSError:
        if left != size:
            raise
        shutil.copyfileobj(fin, fout, 1 << 20)  # a file system without sendfile


def _tree_bytes(box_fd: int, depth: int = 0) -> int:
    """Bytes of the regular files under ``box_fd`` (links not followed, 16 levels at most)."""
    total = 0
    for entry in os.scandir(box_fd):
        info = os.stat(entry.name, dir_fd=box_fd, follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            total += info.st_size
        elif stat.S_ISDIR(info.st_mode) and depth < 16:
            sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=box_fd)
            try:
                total += _tree_bytes(sub, depth + 1)
            finally:
                os.close(sub)
    return total


def _copy_out_error(exc: OSError, box_fd: int, dest: Path) -> str:
    """Why the child's folder could not be copied out, with the room it needed on the host."""
    try:
        needed = f"{_tree_bytes(box_fd) / 1e9:.1f} GB"
    except OSError:
        needed = "an unknown size"
    try:
        free = f"{shutil.disk_usage(dest).free / 1e9:.1f} GB free"
    except OSError:
        free = "free space unknown"
    return (
        f"the child's files ({needed}) could not be copied out of its box into {dest.parent} "
        f"({free}): {exc.strerror or exc}; point TMPDIR at a file system with room for them"
    )


def _child_dir_full(box_fd: int) -> bool:
    """Whether the child's folder ran out of space (less than 1 MiB or 1 % of it left)."""
    st = os.fstatvfs(box_fd)
    return st.f_bavail * st.f_frsize < max(1 << 20, st.f_blocks * st.f_frsize // 100)


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
    keep: tuple[str, ...] = (),
) -> SandboxResult:
    """Run ``target`` (``"package.module:function"``) on ``payload`` in a sandboxed child.

    The function is called as ``function(payload, workdir)`` and must return a JSON-serializable
    dict. Files the parent wants the child to read go into ``workdir`` before the call (read-only to
    the child); the child's own directory is ``workdir / "child"``. ``env`` adds variables to the
    scrubbed environment (never secrets). ``wrapper`` prefixes the child's command line (a tool such
    as ``compute-sanitizer`` that runs the interpreter); it shares the child's box.

    ``writable`` are build caches (Triton, C++ extensions, Inductor). Under bubblewrap the child
    sees, at each path, a private copy: the sealed entry made by an earlier evaluation of the same
    code (the payload's task and candidate sources), or an empty folder. After a successful child
    that had exactly one cache, and where no sealed entry exists yet, the parent seals the copy for
    later evaluations of that same code. So a child never writes a cache another child reads unless
    that child runs exactly the code that wrote it, and nothing it wrote is imported by the parent.

    ``keep`` names files of the child's folder that, under bubblewrap, stay in the box's memory
    instead of being copied out (``SandboxResult.kept``; :func:`child_file` finds a file either way).

    Raises :class:`SandboxUnavailable` where ``KERNELCREW_SANDBOX=bwrap`` and bubblewrap cannot
    isolate the child: no user code runs then.
    """
    child = _Child.launch(target, payload, limits, workdir, env, settings, keep_workdir, writable, wrapper)
    if isinstance(child, _Child):
        child.keep = keep
    if isinstance(child, SandboxResult):
        return child
    status = None
    try:
        while child.proc.poll() is None:
            status = child.over_limit()
            if status:
                break
            time.sleep(0.01)
    except BaseException:  # interrupted (a worker's time limit): nothing of the child outlives it
        child.reap("error")
        raise
    return child.reap(status)


class ChannelError(RuntimeError):
    """A session's child broke the request/reply protocol, died, or ran past its deadline."""


class Session:
    """A sandboxed child that serves requests (see :func:`start`); ``close()`` gives its record."""

    def __init__(self, child: _Child) -> None:
        self._child = child
        self._replies = child.reply_read
        self._buffer = b""
        self._sequence = 0
        self.result: SandboxResult | None = None

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request, wait for its reply; :class:`ChannelError` when none comes.

        Each request carries a sequence number the reply must repeat, so a reply the child's user
        code wrote out of turn is a protocol error, never an answer.
        """
        import select

        if self.result is not None:
            raise ChannelError("the session is closed")
        self._sequence += 1
        line = json.dumps({**message, "seq": self._sequence}).encode() + b"\n"
        stdin = self._child.proc.stdin
        try:
            assert stdin is not None
            stdin.write(line)
            stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self._let_exit()
            raise ChannelError(f"the child stopped reading requests: {exc}") from exc
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._child.limits.wall_s)
        deadline = min(deadline, self._child.started + self._child.limits.wall_s)
        while b"\n" not in self._buffer:
            status = self._child.over_limit()
            if status:
                raise ChannelError(status)
            if time.monotonic() > deadline:
                raise ChannelError("timeout")
            ready, _, _ = select.select([self._replies], [], [], 0.05)
            if ready:
                chunk = os.read(self._replies, 65536)
                if not chunk:
                    self._let_exit()
                    raise ChannelError("the child closed its reply channel (it died or exited)")
                self._buffer += chunk
                if len(self._buffer) > 16 * 1024**2:
                    raise ChannelError("a reply larger than 16 MiB")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise ChannelError(f"an unreadable reply: {exc}") from exc
        if not isinstance(reply, dict) or reply.get("seq") != self._sequence:
            raise ChannelError("a reply out of turn (not the answer to the last request)")
        if reply.get("error"):
            raise ChannelError(str(reply["error"])[:4000])
        reply.pop("seq")
        return reply

    def _let_exit(self) -> None:
        """A child whose channel closed is dying: give it a moment to exit, so whoever reads its
        record next (``close()``) sees how it ended (a signal, a limit) instead of a live process."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._child.proc.wait(timeout=EXIT_GRACE_S)

    def close(self, timeout_s: float = 60.0) -> SandboxResult:
        """Tell the child to finish (end of requests), wait for it, and return its record."""
        if self.result is not None:
            return self.result
        status = None
        with contextlib.suppress(OSError):
            assert self._child.proc.stdin is not None
            self._child.proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        while self._child.proc.poll() is None:
            status = self._child.over_limit()
            if status:
                break
            if time.monotonic() > deadline:
                status = "timeout"
                break
            time.sleep(0.01)
        self.result = self._child.reap(status)
        return self.result

    def kill(self, message: str) -> SandboxResult:
        """End the child now (it broke the protocol); its record carries ``message``."""
        if self.result is None:
            _kill_group(self._child.proc)
            self.result = self._child.reap("error")
            self.result.message = message
        return self.result

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.result is None:
            self.kill("the caller stopped the session")


def start(
    target: str,
    payload: dict[str, Any],
    *,
    limits: SandboxLimits | None = None,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    settings: Settings | None = None,
    writable: tuple[Path, ...] = (),
) -> Session | SandboxResult:
    """Start ``target`` as a long-lived sandboxed child that serves requests.

    The same box as :func:`run`; the function is called as ``function(payload, workdir, channel)``,
    reads requests with ``channel.receive()`` (None once the parent closes the session) and answers
    each with ``channel.reply(dict)``; it returns its record as :func:`run`'s targets do. The
    requests travel on the child's stdin, the replies on a pipe of their own; the child's output
    stays its merged stdout/stderr, limited as in :func:`run`. Returns a :class:`SandboxResult`
    instead where the child could not start.
    """
    child = _Child.launch(target, payload, limits, workdir, env, settings, False, writable, (), channel=True)
    return child if isinstance(child, SandboxResult) else Session(child)


class Channel:
    """The child's end of a :class:`Session`: JSON-line requests on stdin, replies on their own pipe."""

    def __init__(self, reply_fd: int) -> None:
        self._reply_fd = reply_fd
        self._buffer = b""
        self._seq: int | None = None

    def receive(self) -> dict[str, Any] | None:
        while b"\n" not in self._buffer:
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        self._seq = message.pop("seq")
        return message

    def reply(self, message: dict[str, Any]) -> None:
        data = json.dumps({**message, "seq": self._seq}, default=str).encode() + b"\n"
        while data:
            data = data[os.write(self._reply_fd, data) :]


@dataclass
class _Child:
    """One started sandbox child and what the parent must clean up after it."""

    proc: subprocess.Popen
    output: _OutputReader
    cgroups: _Cgroups
    limits: SandboxLimits
    isolation: dict[str, Any]
    ident: tuple[int, int] | None
    writable: tuple[Path, ...]
    caches: list[tuple[Path, Path]]
    scope: str
    workdir: Path
    child_dir: Path
    result_path: Path
    boxed: bool
    remove_workdir: bool
    started: float
    reply_read: int = -1
    box_dir: int | None = None  # the box's tmpfs at child_dir, held open by the parent
    disk_full: bool = False
    keep: tuple[str, ...] = ()  # files left in the box for the caller (:class:`BoxFiles`)
    cut: bool = False  # its wall limit is what its caller had left (:func:`within`)

    @classmethod
    def launch(
        cls,
        target: str,
        payload: dict[str, Any],
        limits: SandboxLimits | None,
        workdir: Path | None,
        env: dict[str, str] | None,
        settings: Settings | None,
        keep_workdir: bool,
        writable: tuple[Path, ...],
        wrapper: tuple[str, ...],
        channel: bool = False,
    ) -> _Child | SandboxResult:
        s = settings or get_settings()
        limits = limits or SandboxLimits.from_settings(s)
        deadline = _deadline.get()
        left = None if deadline is None else deadline - time.monotonic()
        cut = left is not None and left < limits.wall_s
        if cut:
            limits = replace(limits, wall_s=round(max(1.0, left), 1))
        boxed = s.sandbox == "bwrap"
        if boxed:
            ready, box_reason = bwrap_status(s)
            if not ready:
                raise SandboxUnavailable(box_reason)
        own_workdir = workdir is None
        workdir = workdir or make_workdir()
        child_dir = workdir / "child"
        (child_dir / "tmp").mkdir(parents=True, exist_ok=True)
        writable = tuple(Path(p) for p in writable)

        if boxed:
            ident = None
            cgroups = _Cgroups(limits.max_procs, limits.memory_bytes)
            isolation = _boxed_isolation(box_reason, cgroups, limits, s, wrapper)
            own_net = False
        else:
            can_drop, drop_reason = privilege_drop(s)
            ident = _sandbox_identity(s.sandbox_user) if can_drop else None
            cgroups = _Cgroups(limits.max_procs, None)
            own_net, net_reason = network_isolation()
            isolation = _unsafe_isolation(
                ident, drop_reason, cgroups, own_net, net_reason, limits, s, wrapper
            )

        reply_read, reply_write = os.pipe() if channel else (-1, -1)
        spec = {
            "target": target,
            "payload": payload,
            "workdir": str(workdir),
            "child_dir": str(child_dir),
            "result_path": str(child_dir / f"result-{uuid.uuid4().hex}.json"),
            "limits": asdict(limits),
            "cgroup_procs": None if boxed or not cgroups.procs else cgroups.procs[0],
            "drop_nproc": ident is not None or os.geteuid() != 0,
            "drop_to": list(ident) if ident is not None else None,
            "isolate_network": own_net and not wrapper,  # else the launcher below made the namespace
            "boxed": boxed,
            "reply_fd": reply_write if channel else None,
        }
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(spec))

        child_env = _base_env(child_dir)
        prefix = pycache.child_prefix(s)  # read-only bytecode: a fresh interpreter imports torch fast
        if prefix is not None:
            child_env["PYTHONPYCACHEPREFIX"] = str(prefix)
        if env:
            child_env.update(env)

        scope = code_digest(payload)
        caches: list[tuple[Path, Path]] = []
        seccomp = _seccomp_file(workdir) if boxed else contextlib.nullcontext(None)
        seccomp_fd = seccomp.__enter__()
        box_fds: tuple[int, ...] = ()
        info_r = block_w = -1
        if boxed:
            _write_identity(workdir, child_dir)
            caches = _seed_caches(writable, workdir, scope)
            view = _view_args(
                workdir,
                child_dir,
                caches,
                _readonly_paths(target, wrapper, prefix),
                s.sandbox_tmp_mb * 1024**2,
                seccomp_fd,
                limits.disk_bytes,
            )
            info_r, info_w = os.pipe()  # bwrap says which process it started ...
            block_r, block_w = os.pipe()  # ... which waits, its view set up, until the parent has its folder
            box_fds = (info_w, block_r)
            command = [
                *_join_cgroups(cgroups.procs),
                _bwrap_path(s) or s.sandbox_bwrap,
                "--info-fd",
                str(info_w),
                "--block-fd",
                str(block_r),
                *view,
                *wrapper,
                sys.executable,
                "-m",
                "kernelcrew.tools.sandbox",
                str(spec_path),
            ]
        else:
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
            command = [
                *_launcher(own_net and bool(wrapper)),
                *wrapper,
                sys.executable,
                "-m",
                "kernelcrew.tools.sandbox",
                str(spec_path),
            ]

        started = time.monotonic()
        pass_fds = tuple(fd for fd in (seccomp_fd, reply_write, *box_fds) if fd is not None and fd >= 0)
        try:
            proc = subprocess.Popen(
                command,
                cwd=child_dir,
                env=child_env,  # bwrap passes its own environment on: the scrubbed one
                stdin=subprocess.PIPE if channel else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        except OSError as exc:
            seccomp.__exit__(None, None, None)
            cgroups.remove()
            for fd in (reply_read, reply_write, info_r, block_w, *box_fds):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            return SandboxResult(
                status="error", message=f"could not start the sandbox: {exc}", isolation=isolation
            )
        finally:
            if reply_write >= 0:
                with contextlib.suppress(OSError):
                    os.close(reply_write)  # the child holds its own copy

        seccomp.__exit__(None, None, None)  # bwrap has its own descriptor of the program now
        output = _OutputReader(proc, limits.max_output_bytes)
        output.start()
        box_dir = None
        if box_fds:
            for fd in box_fds:
                os.close(fd)
            try:
                box_dir = _pin_child_dir(info_r, child_dir)
            except (OSError, ValueError, KeyError) as exc:
                _kill_group(proc)
                cgroups.remove()
                output.join(timeout=5)
                if reply_read >= 0:
                    os.close(reply_read)
                return SandboxResult(
                    status="error", message=f"could not start the sandbox: {exc}", isolation=isolation
                )
            finally:
                os.close(info_r)
                with contextlib.suppress(OSError):
                    os.write(block_w, b"x")  # the box may go on (or, killed, finds no one to wait for)
                os.close(block_w)
        return cls(
            proc=proc,
            output=output,
            cgroups=cgroups,
            limits=limits,
            isolation=isolation,
            ident=ident,
            writable=writable,
            caches=caches,
            scope=scope,
            workdir=workdir,
            child_dir=child_dir,
            result_path=Path(spec["result_path"]),
            boxed=boxed,
            remove_workdir=own_workdir and not keep_workdir,
            started=started,
            reply_read=reply_read,
            box_dir=box_dir,
            cut=cut,
        )

    def over_limit(self) -> str | None:
        """``output_limit`` or ``timeout`` once the child passed one of them, else None (and notes a
        full folder: the kernel enforces its size, this is to say so)."""
        if self.box_dir is not None and not self.disk_full:
            self.disk_full = _child_dir_full(self.box_dir)
        if self.output.exceeded:
            return "output_limit"
        if time.monotonic() > self.started + self.limits.wall_s:
            return "timeout"
        return None

    def reap(self, status: str | None) -> SandboxResult:
        """Kill what is left of the child, clean up, and turn what happened into its record."""
        limits = self.limits
        try:
            _kill_group(self.proc)
            oom = self.cgroups.oom_killed()
            self.cgroups.remove()
            self.output.join(timeout=5)
            if self.ident is not None:  # hand the caches back: no later child may write into this one's
                for path in self.writable:
                    _chown_tree(path, os.geteuid(), os.getegid())
        finally:
            if self.reply_read >= 0:
                with contextlib.suppress(OSError):
                    os.close(self.reply_read)
                self.reply_read = -1
        wall = time.monotonic() - self.started
        if self.output.exceeded:
            status = "output_limit"
        copying = time.monotonic()
        copy_error = ""
        kept = None
        if self.box_dir is not None:
            try:
                self.disk_full = self.disk_full or _child_dir_full(self.box_dir)
                _copy_out(self.box_dir, self.child_dir, [MAX_CHILD_ENTRIES], skip=frozenset(self.keep))
                if self.keep:
                    present = set(os.listdir(self.box_dir))
                    kept = BoxFiles(self.box_dir, tuple(n for n in self.keep if n in present))
                    kept.trim()
            except OSError as exc:  # the host's side ran out of room (or files): the result is lost
                copy_error = _copy_out_error(exc, self.box_dir, self.child_dir)
            finally:
                if kept is None:
                    os.close(self.box_dir)  # the last reference: the tmpfs goes
                elif not kept.names:
                    kept.close()  # (the descriptor is the kept files' now: closed once, by them)
                    kept = None
                self.box_dir = None
        _sanitize(self.child_dir)

        returncode = self.proc.returncode
        if self.boxed and returncode is not None and 128 < returncode < 128 + signal.NSIG:
            returncode = 128 - returncode  # bwrap exits 128+N for a child killed by signal N
        result = SandboxResult(
            status=status or "ok",
            returncode=returncode,
            wall_s=round(wall, 3),
            output_tail=self.output.tail(),
            output_bytes=self.output.total,
            isolation=self.isolation,
            copy_out_s=round(time.monotonic() - copying, 2),
            kept=kept,
        )
        if status == "timeout":
            result.message = f"timed out after {limits.wall_s:g} s wall-clock; process group killed" + (
                " (the time its caller had left)" if self.cut else ""
            )
        elif status == "output_limit":
            result.message = f"printed more than {limits.max_output_bytes} bytes; process group killed"
        elif self.boxed and returncode == 125 and self.cgroups.procs and not self.output.total:
            result.status = "error"
            result.message = "could not start the sandbox: the child could not join its cgroups"
        else:
            _read_child_result(result, self.result_path, returncode)
            if oom and result.status == "crashed":
                result.message += (
                    f"; the memory cgroup's limit ({limits.memory_bytes // 1024**2} MiB) was hit"
                )
        said = f"{result.message} {result.output_tail}"
        if self.boxed and not result.ok and ("File too large" in said or "unexpected pos" in said):
            result.message = (
                f"the child wrote a file past its size limit ({limits.max_file_bytes // 1024**2} MiB, "
                f"KERNELCREW_SANDBOX_MAX_FILE_BYTES): {result.message}"
            )
        enospc = "No space left on device" in said
        if self.boxed and not result.ok and (self.disk_full or enospc):
            result.message = (
                f"the child wrote past its disk limit ({limits.disk_bytes // 1024**2} MiB in its folder, "
                "KERNELCREW_SANDBOX_DISK_MB; /tmp and /dev/shm have KERNELCREW_SANDBOX_TMP_MB each): "
                f"{result.message}"
            )
        if copy_error:  # the result (or what it names) is lost with the copy: say why
            lost = result.ok or result.message.startswith("unreadable result")
            result.message = copy_error if lost else f"{result.message}; {copy_error}"
            if result.ok:
                result.status, result.value = "error", None
        if self.boxed and result.ok and len(self.caches) == 1:
            _seal(*self.caches[0], self.scope)
        if self.remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.caches:
            shutil.rmtree(self.workdir / "caches", ignore_errors=True)
        return result


def _join_cgroups(procs: list[str]) -> list[str]:
    """A shell that moves itself into the child's cgroups, then becomes bwrap (same pid): every
    process of the child starts inside them."""
    if not procs:
        return []
    script = 'for f in $1; do echo $$ > "$f" || exit 125; done; shift; exec "$@"'
    return ["/bin/sh", "-c", script, "kernelcrew-sandbox", " ".join(procs)]


def _boxed_isolation(
    reason: str, cgroups: _Cgroups, limits: SandboxLimits, s: Settings, wrapper: tuple[str, ...]
) -> dict[str, Any]:
    host_root = os.geteuid() == 0
    memory = bool(cgroups.memory)
    return {
        "mode": "bwrap",
        "sandbox": reason,
        "user": f"uid {SANDBOX_ID} in its own user namespace, no capabilities"
        + ("; root outside it" if host_root else f"; uid {os.geteuid()} outside it"),
        "privilege_drop": f"children run as uid {SANDBOX_ID} in their own user namespace (bubblewrap)",
        "pids_limit": cgroups.pids or ("RLIMIT_NPROC" if not host_root else "none: " + cgroups.reason),
        "memory_limit": (cgroups.memory + "; " if memory else "no memory cgroup: " + cgroups.reason + "; ")
        + f"RLIMIT_DATA {limits.memory_bytes // 1024**2} MiB",
        "network": "isolated: own network namespace, loopback only (bubblewrap)"
        + (", loopback up for the wrapper" if wrapper else ""),
        "filesystem": "read-only view of the interpreter and system files; writes: own directory, private "
        f"/tmp and /dev/shm ({s.sandbox_tmp_mb} MiB each), private build caches",
        "guarantees": {
            "network": True,
            "unix_sockets": True,
            "pid_namespace": True,
            "filesystem": True,
            "unprivileged_uid": True,
            "memory_cgroup": memory,
            "pids_limit": bool(cgroups.pids) or not host_root,
            "rlimits": True,
            "no_survivors": True,
            "private_caches": True,
            "syscall_filter": seccomp_program() is not None,
        },
    }


def _unsafe_isolation(
    ident: tuple[int, int] | None,
    drop_reason: str,
    cgroups: _Cgroups,
    own_net: bool,
    net_reason: str,
    limits: SandboxLimits,
    s: Settings,
    wrapper: tuple[str, ...],
) -> dict[str, Any]:
    dropped = ident is not None
    return {
        "mode": "unsafe-none",
        "sandbox": "none: a plain child process (KERNELCREW_SANDBOX=unsafe-none)",
        "user": s.sandbox_user if ident else pwd.getpwuid(os.geteuid()).pw_name,
        "privilege_drop": drop_reason,
        "pids_limit": cgroups.reason
        or ("RLIMIT_NPROC" if ident or os.geteuid() != 0 else "none: root without a cgroup"),
        "memory_limit": f"RLIMIT_DATA {limits.memory_bytes // 1024**2} MiB",
        "network": (f"isolated: {net_reason}" + (", loopback up for the wrapper" if wrapper else ""))
        if own_net
        else f"not isolated: {net_reason}",
        "filesystem": "writes: own directory and build caches, plus world-writable paths (/tmp, /dev/shm)"
        if ident
        else "writes: wherever the caller's user may (no privilege drop)",
        "guarantees": {
            "network": own_net,
            "unix_sockets": False,
            "pid_namespace": False,
            "filesystem": False,
            "unprivileged_uid": dropped,
            "memory_cgroup": False,
            "pids_limit": bool(cgroups.pids) or dropped or os.geteuid() != 0,
            "rlimits": dropped or os.geteuid() != 0,
            "no_survivors": bool(cgroups.pids),
            "private_caches": False,
            "syscall_filter": False,
        },
    }


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
                "SIGXCPU": "its CPU-time limit was hit (KERNELCREW_SANDBOX_CPU_S)",
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
    def lower(which: int, value: int, grace: int = 0) -> None:
        _soft, hard = resource.getrlimit(which)
        top = value + grace if hard == resource.RLIM_INFINITY else min(value + grace, hard)
        resource.setrlimit(which, (min(value, top), top))

    lower(resource.RLIMIT_DATA, int(limits["memory_bytes"]))
    # A soft limit below the hard one: the child gets SIGXCPU (reported as the CPU limit) rather
    # than a bare SIGKILL that reads like an out-of-memory kill.
    lower(resource.RLIMIT_CPU, int(limits["cpu_s"]), grace=CPU_LIMIT_GRACE_S)
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

    Called after the privilege drop, which clears the request. (Under bubblewrap the parent is the
    box's init, pid 1, and ``--die-with-parent`` already asked for this.)
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
    if not spec.get("boxed"):
        _die_with_parent()
    _apply_limits(spec["limits"], spec["drop_nproc"])
    os.umask(0o077)
    result_path = Path(spec["result_path"])
    try:
        module_name, func_name = spec["target"].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        if spec.get("reply_fd") is not None:
            channel = Channel(int(spec["reply_fd"]))
            value = func(spec["payload"], Path(spec["workdir"]), channel)
        else:
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


def _probe_inside() -> None:
    """Run inside a fresh box by :func:`bwrap_status`: say ``isolated`` only if the box holds."""
    import errno
    import socket

    problems = []
    if os.getuid() != SANDBOX_ID or os.getgid() != SANDBOX_ID:
        problems.append(f"uid {os.getuid()} gid {os.getgid()}")
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        problems.append(f"network interfaces {names}")
    if os.path.exists("/etc/shadow"):
        problems.append("/etc/shadow is visible")
    try:
        Path("/kernelcrew-probe").write_text("")
        problems.append("the root is writable")
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            problems.append(f"writing the root: {exc}")
    if os.path.exists("/dev/nvidiactl"):
        problems += cuda_problems()
    print("; ".join(problems) or "isolated")
    sys.exit(1 if problems else 0)


#: cuInit's answers that mean the driver works: success, and no device visible (CUDA_VISIBLE_DEVICES)
CUDA_FINE = (0, 100)


def cuda_problems() -> list[str]:
    """Why the CUDA driver cannot start in this view, on a host with NVIDIA devices ([] when it can),
    so that a box that would fail every GPU evaluation is refused at its probe, with the reason."""
    import ctypes

    try:
        status = ctypes.CDLL("libcuda.so.1").cuInit(0)
    except OSError as exc:
        return [f"the CUDA driver does not load inside the box ({exc})"]
    return (
        [] if status in CUDA_FINE else [f"the CUDA driver does not start inside the box (cuInit: {status})"]
    )


if __name__ == "__main__":
    if sys.argv[1] == "--probe-inside":
        _probe_inside()
    elif sys.argv[1] == "--probe-network":
        _probe_network()
    elif sys.argv[1] == "--netns-exec":
        _netns_exec(sys.argv[2:])
    else:
        _child_main(sys.argv[1])
