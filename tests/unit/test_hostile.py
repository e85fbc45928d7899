"""Hostile files (``tests/fixtures/hostile``) imported the way a worker or the API imports user code.

Each file does its harm at import, then defines a valid task and candidate, so the same file serves
as either. Every test asserts the specific outcome, that no process of the child survives, and that
the caller is unharmed. Checks that only hold for a child running as another user skip, with the
reason, where the privilege drop is unavailable (a Python installed under ``/root``, for instance).
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelcrew.tools import sandbox
from kernelcrew.tools.sandbox import SandboxLimits, SandboxResult
from tests.conftest import FIXTURES

HOSTILE = FIXTURES / "hostile"
LIMITS = SandboxLimits(wall_s=30, cpu_s=60, memory_bytes=2 * 1024**3, max_procs=32, max_output_bytes=1 << 20)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = sandbox.make_workdir("kc-hostile-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def parent_dir() -> Iterator[Path]:
    """A directory of the caller's user that others may enter but not write (like a worker's data)."""
    path = Path(tempfile.mkdtemp(prefix="kc-parent-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def caller_unharmed() -> Iterator[None]:
    """After every hostile file, the caller's limits and directory are as before and a child still runs."""
    before = (
        os.getcwd(),
        resource.getrlimit(resource.RLIMIT_NPROC),
        resource.getrlimit(resource.RLIMIT_DATA),
    )
    yield
    assert (
        os.getcwd(),
        resource.getrlimit(resource.RLIMIT_NPROC),
        resource.getrlimit(resource.RLIMIT_DATA),
    ) == before
    assert sandbox.run("tests.unit.sandbox_targets:echo", {}, limits=LIMITS).ok


def run_hostile(
    name: str, workdir: Path, limits: SandboxLimits = LIMITS, wrapper: tuple[str, ...] = (), **env: str
) -> SandboxResult:
    payload = {"source": (HOSTILE / name).read_text(), "kind": "candidate", "path": name}
    return sandbox.run(
        "kernelcrew.tools.taskcheck:import_child",
        payload,
        limits=limits,
        workdir=workdir,
        env=env,
        wrapper=wrapper,
    )


def survivors(workdir: Path) -> list[int]:
    """Processes still running this child's command line (its spec file), forks included."""
    spec = str(workdir / "spec.json").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if spec in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def boxed(res: SandboxResult) -> bool:
    """Under bubblewrap: what lies outside the child's view does not exist for it."""
    return res.isolation.get("mode") == "bwrap"


def require_other_user(res: SandboxResult) -> None:
    if boxed(res):
        return
    if res.isolation["user"] == "root" or "children run as" not in res.isolation["privilege_drop"]:
        pytest.skip(f"the child runs as the caller's user here: {res.isolation['privilege_drop']}")


def test_an_import_that_never_ends_times_out_and_its_whole_group_is_killed(workdir):
    started = time.monotonic()
    res = run_hostile("import_loop.py", workdir, SandboxLimits(**{**LIMITS.__dict__, "wall_s": 4}))
    assert res.status == "timeout" and "process group killed" in res.message
    assert time.monotonic() - started < 15
    assert survivors(workdir) == []  # the sleeping child it forked went with it


def test_a_fork_bomb_stops_at_the_process_limit_and_nothing_survives(workdir):
    """Runs only where the limit is enforced (pids cgroup, or RLIMIT_NPROC of an unprivileged user)."""
    probe = sandbox.run("tests.unit.sandbox_targets:echo", {}, limits=LIMITS)
    limit = probe.isolation["pids_limit"]
    if "cgroup" not in limit and limit != "RLIMIT_NPROC":
        pytest.skip(f"no process limit can be enforced here ({limit}); an unbounded fork bomb never runs")
    res = run_hostile("fork_bomb.py", workdir, SandboxLimits(**{**LIMITS.__dict__, "wall_s": 4}))
    assert res.status == "timeout", res
    assert survivors(workdir) == []


def test_a_100_gb_allocation_is_a_clear_memory_error(workdir):
    res = run_hostile("allocate_100gb.py", workdir)
    assert res.status == "error" and "MemoryError" in res.message, res
    assert survivors(workdir) == []


def test_the_workers_secrets_are_not_in_reach(workdir, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-hostile-test-secret")
    monkeypatch.setenv("KERNELCREW_BROKER_URL", "redis://:hostile-test-secret@127.0.0.1:6379/0")
    res = run_hostile("read_environment.py", workdir)
    assert res.status == "error" and "HOSTILE env:" in res.message, res  # it reports what it found
    assert "hostile-test-secret" not in res.message
    assert "OPENAI_API_KEY" not in res.message and "KERNELCREW_BROKER_URL" not in res.message
    require_other_user(res)
    if boxed(res):  # its parent is the box's init, whose environment is the scrubbed one
        assert "parent environ: " in res.message and "PYTHONPATH=" in res.message
    else:
        assert "parent environ: refused ([Errno 13] Permission denied" in res.message


def test_a_file_readable_only_by_the_worker_cannot_be_read(workdir, parent_dir):
    secret = parent_dir / "token.txt"
    secret.write_text("TOP-SECRET")
    secret.chmod(0o600)
    res = run_hostile("read_outside.py", workdir, KC_HOSTILE_PATH=str(secret))
    require_other_user(res)
    refusal = "FileNotFoundError" if boxed(res) else "PermissionError"
    assert res.status == "error" and refusal in res.message, res
    assert "TOP-SECRET" not in res.output_tail


def test_nothing_can_be_written_outside_the_childs_directory(workdir, parent_dir):
    res = run_hostile("write_outside.py", workdir, KC_HOSTILE_DIR=str(parent_dir))
    require_other_user(res)
    refusal = "FileNotFoundError" if boxed(res) else "PermissionError"
    assert res.status == "error" and refusal in res.message, res
    assert list(parent_dir.iterdir()) == []


def test_no_socket_reaches_the_workers_loopback(workdir):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        res = run_hostile("open_socket.py", workdir, KC_HOSTILE_PORT=str(listener.getsockname()[1]))
        if not res.isolation["network"].startswith("isolated"):
            pytest.skip(f"no network namespace here: {res.isolation['network']}")
        # no route out of its own namespace; under bubblewrap its own loopback holds no listener
        refusal = "Connection refused" if boxed(res) else "Network is unreachable"
        assert res.status == "error" and refusal in res.message, res
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_under_a_wrapper_the_namespace_holds_both_and_still_reaches_nothing_outside(workdir):
    """compute-sanitizer talks to its target: it shares the namespace, whose own loopback is up."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = str(listener.getsockname()[1])
        res = run_hostile("open_socket.py", workdir, wrapper=("env",), KC_HOSTILE_PORT=port)
        if not res.isolation["network"].startswith("isolated"):
            pytest.skip(f"no network namespace here: {res.isolation['network']}")
        assert "loopback up for the wrapper" in res.isolation["network"]
        assert res.status == "error" and "Connection refused" in res.message, res
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_printing_gigabytes_is_stopped_quickly(workdir):
    res = run_hostile("print_gigabytes.py", workdir)
    assert res.status == "output_limit" and res.output_bytes > LIMITS.max_output_bytes
    assert res.wall_s < 15
    assert survivors(workdir) == []
