"""The box holds: a hostile corpus run from a task file and from a candidate, under bubblewrap.

``tests/fixtures/hostile/box_battery.py`` tries about sixty escapes at import (sockets by path, by
abstract name and over TCP, other processes' environments and memory, the data dir, home, other
jobs' folders, writes to site-packages, the bytecode and build caches, rlimits, namespaces, memory,
processes, disk, symlinks, a daemon) and reports each outcome. It runs once as a task and once as a
candidate, the way the service and a worker import user code, and once more each through the
verification flows the command line uses. Each attack is its own test case, asserted from the
battery's report and, where the attack could leave a trace on the host, from the host's side too.
After the corpus, an honest task and candidate still verify, with every guarantee held.

The battery must never run unisolated (it would be the attack it describes): every child here
runs with ``sandbox="bwrap"``, and a machine without bubblewrap skips the file unless
``KERNELCREW_TEST_REQUIRE_BWRAP=1`` (CI) turns the skip into a failure.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kernelcrew
from kernelcrew.config import Settings, get_settings
from kernelcrew.task import TaskError
from kernelcrew.tools import correctness, pycache, sandbox
from kernelcrew.tools.build import build_env, cache_dirs
from kernelcrew.tools.sandbox import SandboxLimits
from tests.conftest import FIXTURES

BATTERY = (FIXTURES / "hostile" / "box_battery.py").read_text()
SECRET = f"sk-box-{uuid.uuid4().hex}"
MEMORY = 768 * 1024**2
LIMITS = SandboxLimits(
    wall_s=90, cpu_s=120, memory_bytes=MEMORY, max_procs=32, max_output_bytes=1 << 20, max_file_bytes=8 << 20
)
TMP_MB = 64
ROLES = ("task", "candidate")


def _require_bwrap() -> None:
    ok, reason = sandbox.bwrap_status(Settings(sandbox="bwrap"))
    if not ok:
        if os.environ.get("KERNELCREW_TEST_REQUIRE_BWRAP") == "1":
            pytest.fail(f"bubblewrap is required here: {reason}")
        pytest.skip(f"no bubblewrap here: {reason}")


@pytest.fixture(scope="module")
def box_settings() -> Settings:
    _require_bwrap()
    return get_settings().model_copy(update={"sandbox": "bwrap", "sandbox_tmp_mb": TMP_MB})


@pytest.fixture(scope="module")
def host(box_settings: Settings) -> Iterator[dict[str, Any]]:
    """What the attacks aim at, made real on the host: secrets, sockets, another job, caches."""
    nonce = uuid.uuid4().hex[:12]
    base = Path(tempfile.mkdtemp(prefix="kc-box-host-"))
    home = base / "home"
    home.mkdir()
    (home / "secret.txt").write_text(SECRET)
    data_dir = base / "data"
    data_dir.mkdir()
    with sqlite3.connect(data_dir / "kernelcrew.db") as db:
        db.execute("create table tokens (secret text)")
        db.execute("insert into tokens values (?)", (SECRET,))
    other_job = sandbox.make_workdir("kc-cand-")
    (other_job / "child").mkdir()
    (other_job / "child" / "golden.pt").write_text(SECRET)
    other_tmp = Path(tempfile.gettempdir()) / f"kc-box-other-{nonce}"
    other_tmp.write_text("untouched")
    unix_path = base / "service.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(unix_path))
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind("\0kc-box-" + nonce)
    abstract.listen()
    tcp = socket.create_server(("127.0.0.1", 0))
    other_cache = cache_dirs("another job's candidate source")["root"]
    config = {
        "secret_parts": [SECRET[:10], SECRET[10:]],
        "host_pid": os.getpid(),
        "nonce": nonce,
        "unix_socket": str(unix_path),
        "abstract_socket": "kc-box-" + nonce,
        "tcp_port": tcp.getsockname()[1],
        "data_db": str(data_dir / "kernelcrew.db"),
        "data_dir": str(data_dir),
        "home_secret": str(home / "secret.txt"),
        "other_job_file": str(other_job / "child" / "golden.pt"),
        "other_tmp_name": other_tmp.name,
        "other_tmp_file": str(other_tmp),
        "site_packages": sysconfig.get_paths()["purelib"],
        "pycache_dir": str(pycache.cache_root(box_settings)),
        "package_dir": str(Path(kernelcrew.__file__).parent),
        "other_build_cache": str(other_cache),
        "max_procs": LIMITS.max_procs,
        "memory_bytes": MEMORY,
        "tmp_mb": TMP_MB,
        "max_file_bytes": LIMITS.max_file_bytes,
    }
    listeners = (unix, abstract, tcp)
    for listener in listeners:
        listener.setblocking(False)
    yield {
        "config": config,
        "listeners": listeners,
        "other_tmp": other_tmp,
        "data_dir": data_dir,
        "other_cache": other_cache,
    }
    for listener in listeners:
        listener.close()
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(other_job, ignore_errors=True)
    other_tmp.unlink(missing_ok=True)


def _battery(role: str, host: dict[str, Any], settings: Settings, **extra: Any) -> sandbox.SandboxResult:
    config = {**host["config"], **extra}
    env = {"KC_BOX_CONFIG": json.dumps(config)}
    writable: tuple[Path, ...] = ()
    if role == "candidate":  # as a verifier hands a candidate its build caches
        env.update(build_env(BATTERY))
        writable = (cache_dirs(BATTERY)["root"],)
    payload = {"source": BATTERY, "kind": role, "path": f"hostile_{role}.py"}
    with pytest.MonkeyPatch.context() as mp:  # the worker's secrets, which must stay out of reach
        mp.setenv("OPENAI_API_KEY", SECRET)
        mp.setenv("KERNELCREW_DATABASE_URL", f"postgresql://kc:{SECRET}@127.0.0.1/kc")
        return sandbox.run(
            "kernelcrew.tools.taskcheck:import_child",
            payload,
            limits=LIMITS,
            env=env,
            settings=settings,
            writable=writable,
        )


def _report(res: sandbox.SandboxResult) -> dict[str, str]:
    line = next((ln for ln in res.output_tail.splitlines() if ln.startswith("BOX-RESULTS ")), None)
    assert line is not None, (
        f"the battery did not report: {res.status} {res.message} {res.output_tail[-2000:]}"
    )
    return json.loads(line.split(" ", 1)[1])


@pytest.fixture(scope="module")
def reports(host: dict[str, Any], box_settings: Settings) -> dict[str, dict[str, str]]:
    out = {}
    for role in ROLES:
        res = _battery(role, host, box_settings)
        assert res.status == "error" and "HOSTILE:" in res.message, res
        assert res.isolation["mode"] == "bwrap"
        out[role] = _report(res)
    return out


#: Each attack and how it must be stopped (a regular expression on the battery's outcome).
EXPECTED = {
    "postgres_unix_socket": "ENOENT",
    "redis_unix_socket": "ENOENT",
    "host_unix_socket": "ENOENT",
    "host_abstract_socket": "ECONNREFUSED",
    "docker_socket": "ENOENT",
    "tcp_postgres": "ECONNREFUSED",
    "tcp_redis": "ECONNREFUSED",
    "tcp_host_listener": "ECONNREFUSED",
    "udp_out": "ENETUNREACH",
    "proc_1_environ": "scrubbed",
    "proc_ppid_environ": "scrubbed",
    "every_environ": "scrubbed",
    "proc_listing": r"own namespace \([1-4] processes\)",
    "signal_host_parent": "ESRCH",
    "ptrace_host_parent": "EPERM|ESRCH",
    "ptrace_init": "EPERM",
    "etc_shadow": "ENOENT",
    "data_dir_database": "ENOENT",
    "home_file": "ENOENT",
    "root_listing": r"/root holds \[('\.pyenv')?\]",
    "ssh_key": "ENOENT",
    "other_job_folder": "ENOENT",
    "tmp_listing": "private /tmp",
    "run_listing": "absent",
    "read_other_tmp_file": "ENOENT",
    "write_other_tmp_file": "private copy",
    "write_site_packages_pth": "EROFS",
    "write_bytecode_tree": "EROFS|ENOENT",
    "write_package_pycache": "EROFS",
    "write_package_source": "EROFS",
    "write_other_build_cache": "EROFS|ENOENT",
    "write_data_dir": "ENOENT",
    "write_parent_spec": "EROFS",
    "write_etc_passwd": "EROFS",
    "write_root": "EROFS",
    "symlink_to_shadow": "ENOENT",
    "symlink_to_home_file": "ENOENT",
    "hardlink_parent_spec": "EXDEV|EROFS",
    "proc_1_root": "ENOENT",
    "device_node": "ENOENT",
    "mknod": "EPERM",
    "setuid_root": "EINVAL|EPERM",
    "setgid_root": "EINVAL|EPERM",
    "no_new_privs": "no_new_privs, no capabilities",
    "user_namespace": "EINVAL|EPERM|ENOSPC",
    "mount_tmpfs": "EPERM",
    "sethostname": "EPERM",
    "lower_oom_score": "EACCES|EPERM",
    "cgroup_escape": "ENOENT|EROFS",
    "nice_up": "EPERM|EACCES",
    "raise_rlimit_data": "ValueError|EPERM",
    "raise_rlimit_fsize": "ValueError|EPERM",
    "raise_rlimit_cpu": "ValueError|EPERM",
    "raise_rlimit_nofile": "ValueError|EPERM",
    "memory_private": "MemoryError",
    "memory_bomb": "killed by SIGKILL",
    "tmp_fill": r"ENOSPC after \d+ MiB",
    "file_size": "EFBIG",
    "fork_bomb": r"EAGAIN after \d+ forks",
    "daemon": "spawned",
}


def test_the_corpus_covers_every_attack_of_the_battery(reports):
    for role in ROLES:
        assert set(reports[role]) == set(EXPECTED), role
    assert len(EXPECTED) * len(ROLES) >= 80


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("attack", sorted(EXPECTED))
def test_attack_is_blocked(reports, role, attack):
    outcome = reports[role][attack]
    assert outcome.startswith("blocked: "), f"{role}: {attack} got through: {outcome}"
    assert re.search(EXPECTED[attack], outcome), f"{role}: {attack}: {outcome}"
    if attack == "tmp_fill":
        assert int(re.search(r"after (\d+)", outcome).group(1)) <= TMP_MB
    if attack == "fork_bomb":
        assert int(re.search(r"after (\d+)", outcome).group(1)) < LIMITS.max_procs


def test_the_host_is_as_it_was(reports, host):
    """What the writes aimed at is unchanged on the host, and no socket of it was reached."""
    cfg = host["config"]
    assert host["other_tmp"].read_text() == "untouched"
    assert sorted(p.name for p in host["data_dir"].iterdir()) == ["kernelcrew.db"]
    assert not Path(cfg["site_packages"], "kc_box_owned.pth").exists()
    assert not Path(cfg["pycache_dir"], "kc_box_owned.pyc").exists()
    assert not Path(cfg["package_dir"], "__pycache__", "kc_box.pyc").exists()
    assert not Path("/planted").exists()
    assert not (host["other_cache"] / "triton" / "poison").exists()
    for listener in host["listeners"]:
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_no_daemon_outlives_its_evaluation(reports, host):
    marker = f"BOX-DAEMON-{host['config']['nonce']}".encode()
    for _ in range(50):
        alive = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "cmdline").read_bytes():
                        alive.append(entry.name)
                except OSError:
                    continue
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"the battery's daemon still runs: {alive}")


def test_a_failed_candidate_seals_no_cache(reports):
    """The battery (a candidate that fails) had its own build cache: nothing of it is kept."""
    root = cache_dirs(BATTERY)["root"]
    assert [p.name for p in root.iterdir() if p.name.startswith(("sealed-", ".staging-"))] == []


def test_through_the_verification_flows_nothing_gets_through(host, box_settings):
    """The same battery as the task of make_golden and as the candidate of verify (the CLI's path).

    A candidate this blatant never passes the static rules; the box must hold for one that evades
    them, so they are set aside here."""
    config = json.dumps({**host["config"], "light": True})
    settings = box_settings.model_copy(update={"sandbox_memory_mb": MEMORY // 1024**2})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KC_BOX_CONFIG", config)
        mp.setattr(sandbox, "ENV_ALLOW", (*sandbox.ENV_ALLOW, "KC_BOX_CONFIG"))
        mp.setenv("OPENAI_API_KEY", SECRET)
        mp.setattr(correctness, "static_check", lambda source, path: [])
        with pytest.raises(correctness.TaskError) as refused:
            correctness.make_golden(BATTERY, task_path="hostile_task.py", settings=settings)
        task = (FIXTURES / "tasks" / "relu.py").read_text()
        verdict = correctness.verify(task, BATTERY, candidate_path="hostile_candidate.py", settings=settings)
    assert "HOSTILE: 0 attacks got through" in str(refused.value)
    assert verdict.verdict == "fail" and "HOSTILE: 0 attacks got through" in verdict.message, verdict
    assert SECRET not in str(refused.value) + verdict.message


@pytest.mark.parametrize("role", ROLES)
def test_an_output_flood_is_stopped(role, box_settings):
    source = (FIXTURES / "hostile" / "print_gigabytes.py").read_text()
    res = sandbox.run(
        "kernelcrew.tools.taskcheck:import_child",
        {"source": source, "kind": role, "path": "flood.py"},
        limits=LIMITS,
        settings=box_settings,
    )
    assert res.status == "output_limit" and res.output_bytes > LIMITS.max_output_bytes
    assert res.wall_s < 30


def test_an_honest_evaluation_still_verifies_with_every_guarantee(reports, box_settings):
    task = (FIXTURES / "tasks" / "relu.py").read_text()
    candidate = (FIXTURES / "candidates" / "relu_triton.py").read_text()
    verdict = correctness.verify(task, candidate, settings=box_settings)
    assert verdict.passed, verdict
    guarantees = verdict.isolation["guarantees"]
    assert set(guarantees) == set(sandbox.GUARANTEES)
    must = set(sandbox.GUARANTEES) - {"memory_cgroup", "pids_limit", "syscall_filter"}
    assert all(guarantees[g] for g in must), guarantees
    # the candidate's Triton cache was private to its child, then sealed for this same code only
    scope = sandbox.code_digest({"task_source": task, "candidate_source": candidate})
    assert (cache_dirs(candidate)["root"] / f"sealed-{scope}" / "triton").is_dir()


# ----------------------------------------------------------------------------------------------
# Caches: private per evaluation, sealed only for the same code
# ----------------------------------------------------------------------------------------------

T = "tests.unit.sandbox_targets"


def _cache_run(settings: Settings, root: Path, task: str, text: str | None) -> sandbox.SandboxResult:
    payload = {
        "task_source": task,
        "candidate_source": "the same candidate",
        "cache": str(root),
        "text": text,
    }
    return sandbox.run(f"{T}:cache_probe", payload, limits=LIMITS, settings=settings, writable=(root,))


def test_a_cache_written_by_one_task_is_never_seen_by_another(box_settings, tmp_path):
    """A task file shares a candidate's child: keyed by both, its writes reach no other task's job."""
    root = tmp_path / "cache" / "abc"
    (root / "triton").mkdir(parents=True)
    first = _cache_run(box_settings, root, "attacker's task", "planted kernel")
    assert first.ok, first
    assert first.value["seen"] == []
    other = _cache_run(box_settings, root, "victim's task", None)
    assert other.ok and other.value["seen"] == [], other.value  # another task: an empty cache
    same = _cache_run(box_settings, root, "attacker's task", "second write")
    assert same.ok and same.value["seen"] == ["planted kernel"]  # its own code's sealed build
    sealed = [p for p in root.iterdir() if p.name.startswith("sealed-")]
    assert len(sealed) == 2  # one per code; the second write went nowhere
    texts = sorted(p.read_text() for s in sealed for p in (s / "triton").iterdir())
    assert texts == ["planted kernel"]


def test_the_parent_never_follows_what_the_child_left(box_settings):
    """Symlinks and FIFOs in the child's folder are gone before the parent reads anything there."""
    workdir = sandbox.make_workdir("kc-box-links-")
    try:
        res = sandbox.run(
            f"{T}:leave_links",
            {"targets": ["/etc/shadow", str(workdir / "spec.json")]},
            workdir=workdir,
            limits=LIMITS,
            settings=box_settings,
        )
        assert res.ok, res
        left = sorted(p.name for p in (workdir / "child").iterdir())
        assert "link-0" not in left and "link-1" not in left and "fifo" not in left
        assert "plain.txt" in left
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _leave_links(workdir: Path, settings: Settings, keep: tuple[str, ...]) -> sandbox.SandboxResult:
    """A boxed child that leaves a link to the host's /etc/hostname, a FIFO and a plain file."""
    return sandbox.run(
        f"{T}:leave_links",
        {"targets": ["/etc/hostname"]},
        workdir=workdir,
        limits=LIMITS,
        settings=settings,
        keep=keep,
    )


def test_files_kept_in_the_box_are_read_in_place_and_links_are_never_offered(box_settings, tmp_path):
    """A large task's golden and a candidate's outputs stay in the box's memory for the parent's
    judge instead of being copied to the disk; a link or FIFO named like a kept file is not offered
    (the parent would follow it on the host), and nothing kept is copied out."""
    workdir = sandbox.make_workdir("kc-box-kept-")
    try:
        res = _leave_links(workdir, box_settings, ("plain.txt", "link-0", "fifo", "absent.txt"))
        assert res.ok, res
        child = workdir / "child"
        assert res.kept is not None and res.kept.names == ("plain.txt",)
        assert not (child / "plain.txt").exists(), "a kept file is not copied out"
        assert sandbox.child_file(res, child, "plain.txt").read_text() == "ok"
        assert "link-0" not in res.kept and not sandbox.child_file(res, child, "link-0").exists()
        assert res.to_dict()["kept"] is None
        res.kept.close()
        assert (
            "plain.txt" not in res.kept and sandbox.child_file(res, child, "plain.txt") == child / "plain.txt"
        )
        again = sandbox.run(
            f"{T}:write_file", {}, workdir=workdir, limits=LIMITS, settings=box_settings, keep=("inside.txt",)
        )
        assert again.ok and again.kept is not None
        again.kept.move_to(tmp_path)
        assert (tmp_path / "inside.txt").read_text() == "ok" and "inside.txt" not in again.kept
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_golden_outputs_too_large_to_keep_go_to_the_disk_or_fail_with_the_reason(box_settings, monkeypatch):
    task = (FIXTURES / "tasks" / "linear_relu.py").read_text()
    monkeypatch.setattr(correctness, "kept_golden_bytes", lambda: 0)  # nothing fits in memory
    golden = correctness.make_golden(task, task_path="linear_relu.py", settings=box_settings)
    try:
        assert golden.kept is None and golden.file("golden.pt") == golden.path / "golden.pt"
        assert (golden.path / "native.pt").stat().st_mode & 0o777 == 0o600
    finally:
        golden.cleanup()

    def disk_full(self: sandbox.BoxFiles, dest: Path) -> None:
        self.close()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sandbox.BoxFiles, "move_to", disk_full)
    with pytest.raises(TaskError, match=r"golden outputs could not be copied into .*No space left"):
        correctness.make_golden(task, task_path="linear_relu.py", settings=box_settings)


def test_a_child_whose_files_cannot_be_copied_out_fails_with_the_reason(box_settings, monkeypatch):
    """A host whose temp dir is full loses the child's files: the result is an error that says so
    (it once read as ok, and the golden's parent died on a missing file)."""

    def disk_full(fin: Any, fout: Any, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sandbox, "_copy_file", disk_full)
    res = sandbox.run(f"{T}:write_file", {}, limits=LIMITS, settings=box_settings)
    assert res.status == "error" and res.value is None
    assert "could not be copied out of its box" in res.message and "No space left on device" in res.message
    assert "TMPDIR" in res.message
    task = (FIXTURES / "tasks" / "linear_relu.py").read_text()
    with pytest.raises(TaskError, match="could not be copied out of its box"):
        correctness.make_golden(task, task_path="linear_relu.py", settings=box_settings)


# ----------------------------------------------------------------------------------------------
# Fail closed
# ----------------------------------------------------------------------------------------------


def test_without_bubblewrap_nothing_runs(tmp_path):
    settings = Settings(sandbox="bwrap", sandbox_bwrap="no-such-bwrap")
    marker = tmp_path / "ran"
    with pytest.raises(sandbox.SandboxUnavailable) as refused:
        sandbox.run(f"{T}:touch", {"path": str(marker)}, limits=LIMITS, settings=settings)
    assert "not installed" in str(refused.value) and "--unsafe-no-sandbox" in str(refused.value)
    assert not marker.exists()
    assert sandbox.readiness(settings)["ready"] is False
    assert "not installed" in sandbox.service_refusal(settings)
    assert "unsafe-none" in sandbox.service_refusal(Settings(sandbox="unsafe-none"))


def test_the_command_line_refuses_without_the_flag_and_warns_with_it(tmp_path):
    env = {**os.environ, "KERNELCREW_SANDBOX_BWRAP": "no-such-bwrap"}
    task = str(FIXTURES / "tasks" / "relu.py")
    cand = str(FIXTURES / "candidates" / "relu_triton.py")
    cmd = [sys.executable, "-m", "kernelcrew"]
    refused = subprocess.run([*cmd, "verify", task, cand, "--json"], env=env, capture_output=True, text=True)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2
    assert "refuses to run task files and candidates unisolated" in said
    assert "--unsafe-no-sandbox" in said and refused.stdout == ""
    helped = subprocess.run([*cmd, "--unsafe-no-sandbox", "--help"], env=env, capture_output=True, text=True)
    assert helped.returncode == 0  # the flag itself is accepted; the warning comes with a command


def test_the_unsafe_flag_warns_loudly_and_says_so_in_the_record(monkeypatch):
    from typer.testing import CliRunner

    from kernelcrew import cli

    seen = {}

    def fake_verify(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen["mode"] = get_settings().sandbox
        return {"verdict": "pass"}

    monkeypatch.setattr(cli, "run_verify", fake_verify)
    monkeypatch.setenv("KERNELCREW_SANDBOX_BWRAP", "no-such-bwrap")
    monkeypatch.setenv("KERNELCREW_SANDBOX", "bwrap")  # the flag changes it: restored after the test
    task = str(FIXTURES / "tasks" / "relu.py")
    result = CliRunner().invoke(cli.app, ["--unsafe-no-sandbox", "verify", task, task, "--json"])
    assert os.environ.get("KERNELCREW_SANDBOX") == "unsafe-none"  # for this CLI process only
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "WARNING" in said and "WITHOUT isolation" in said
    assert seen["mode"] == "unsafe-none"


def test_the_service_refuses_jobs_it_cannot_isolate(monkeypatch):
    import asyncio

    from fastapi import HTTPException

    from kernelcrew.service.submissions import check_task_imports

    settings = Settings(sandbox="bwrap", sandbox_bwrap="no-such-bwrap")
    with pytest.raises(HTTPException) as refused:
        asyncio.run(check_task_imports("print('hi')", settings))
    assert refused.value.status_code == 503 and "cannot isolate user code" in refused.value.detail
    unsafe = Settings(sandbox="unsafe-none")
    with pytest.raises(HTTPException) as refused_unsafe:
        asyncio.run(check_task_imports("print('hi')", unsafe))
    assert refused_unsafe.value.status_code == 503


def test_the_records_name_every_guarantee(box_settings):
    boxed = sandbox.run(f"{T}:echo", {}, limits=LIMITS, settings=box_settings)
    assert boxed.ok and boxed.value["uid"] == sandbox.SANDBOX_ID
    assert set(boxed.isolation["guarantees"]) == set(sandbox.GUARANTEES)
    assert boxed.isolation["mode"] == "bwrap"
    unsafe = sandbox.run(f"{T}:echo", {}, limits=LIMITS, settings=Settings(sandbox="unsafe-none"))
    assert unsafe.ok and unsafe.isolation["mode"] == "unsafe-none"
    held = unsafe.isolation["guarantees"]
    assert not held["filesystem"] and not held["pid_namespace"] and not held["unix_sockets"]


def test_verifying_timing_and_profiling_one_candidate_share_one_build():
    """The cache key is the set of code a child runs, whatever the payload's layout."""
    verify = {"task_source": "task", "candidate_source": "cand", "seed": 1}
    bench = {"task_source": "task", "candidates": {"candidate": {"source": "cand", "path": "c.py"}}}
    other_task = {"task_source": "another task", "candidate_source": "cand"}
    assert sandbox.code_digest(verify) == sandbox.code_digest(bench)
    assert sandbox.code_digest(verify) != sandbox.code_digest(other_task)


def test_a_box_where_the_cuda_driver_cannot_start_fails_its_probe_with_the_reason(monkeypatch):
    """On a host with NVIDIA devices the probe also starts the CUDA driver inside the view: a box in
    which every GPU evaluation would fail is refused up front, saying why."""
    import ctypes

    class Driver:
        def __init__(self, status: int) -> None:
            self.status = status

        def cuInit(self, flags: int) -> int:
            return self.status

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert "does not load" in sandbox.cuda_problems()[0]
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver(999))
    assert "cuInit: 999" in sandbox.cuda_problems()[0]
    for fine in sandbox.CUDA_FINE:  # success, or no device visible to this worker
        monkeypatch.setattr(ctypes, "CDLL", lambda name, fine=fine: Driver(fine))
        assert sandbox.cuda_problems() == []


# ------------------------------------------------------------------------------------------------
# Secrets out of reach: each service holds only the secrets its role needs
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_secrets(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    from kernelcrew.config import SECRET_ENV

    for name in SECRET_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _start_worker() -> Any:
    from typer.testing import CliRunner

    from kernelcrew import cli

    return CliRunner().invoke(cli.app, ["worker", "--broker", "redis://127.0.0.1:1/0", "--name", "kcsecret"])


@pytest.mark.parametrize(
    "name",
    [
        "OPENAI_API_KEY",
        "KERNELCREW_OPENAI_API_KEY",
        "ANTHROPIC_API_KEY",
        "KERNELCREW_ANTHROPIC_API_KEY",
        "KERNELCREW_LLM_API_KEY",
        "KERNELCREW_DATABASE_URL",
        "PGPASSWORD",
    ],
)
def test_a_worker_handed_a_secret_it_does_not_need_refuses_to_start(no_secrets, name):
    no_secrets.setenv(name, SECRET)
    result = _start_worker()
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "kernelcrew worker refuses to start" in said and name in said and f"-u {name}" in said
    assert SECRET not in result.output, "the value itself is never printed"
    assert "cannot reach the broker" not in said, "refused before it connected to anything"


def test_a_worker_with_only_the_broker_url_starts(no_secrets):
    """Empty variables (compose's ``${OPENAI_API_KEY:-}``) hold no secret: the worker goes on to
    its broker (here, one that does not answer)."""
    no_secrets.setenv("OPENAI_API_KEY", "")
    result = _start_worker()
    assert result.exit_code == 2
    assert "refuses to start" not in result.output


def test_the_compose_file_gives_each_service_only_the_secrets_of_its_role():
    import yaml

    from kernelcrew.config import ROLE_SECRETS, SECRET_ENV

    compose = yaml.safe_load((Path(kernelcrew.__file__).parents[1] / "docker-compose.yml").read_text())
    services = compose["services"]
    env = {name: set(services[name].get("environment") or {}) for name in ("api", "orchestrator", "worker")}
    for role, names in env.items():
        held = names & set(SECRET_ENV)
        assert held <= ROLE_SECRETS[role], f"{role} holds {sorted(held - ROLE_SECRETS[role])}"
    assert {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"} <= env["orchestrator"]
    assert "KERNELCREW_DATABASE_URL" in env["api"] and "KERNELCREW_DATABASE_URL" in env["orchestrator"]
    assert env["worker"] == {"KERNELCREW_BROKER_URL"}
    assert services["api"]["command"][-2:] == ["--orchestrators", "0"], "no orchestrator (and key) in the API"


# ------------------------------------------------------------------------------------------------
# Disk: the child's folder is a tmpfs of KERNELCREW_SANDBOX_DISK_MB
# ------------------------------------------------------------------------------------------------

FILL_DISK = """
import os
kept = []
written = 0
try:
    for i in range(10_000):  # files under RLIMIT_FSIZE each, and unlinked ones held open
        f = open(f"fill-{i}", "wb")
        for _ in range(4):
            f.write(b"x" * (1 << 20))
            written += 1 << 20
        if i % 2:
            os.unlink(f"fill-{i}")
            kept.append(f)
        else:
            f.close()
except OSError as exc:
    raise SystemExit(f"stopped after {written >> 20} MiB: {exc}")


class Model:
    pass


ModelNew = Model


def get_inputs():
    return []


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("role", ROLES)
def test_a_child_writing_past_its_disk_limit_is_stopped_and_the_host_keeps_its_disk(
    role, box_settings, tmp_path
):
    limits = SandboxLimits(**{**LIMITS.__dict__, "disk_bytes": 32 << 20})
    workdir = tmp_path / "work"
    workdir.mkdir()
    res = sandbox.run(
        "kernelcrew.tools.taskcheck:import_child",
        {"source": FILL_DISK, "kind": role, "path": "fill.py"},
        limits=limits,
        settings=box_settings,
        workdir=workdir,
        keep_workdir=True,
    )
    said = f"{res.message} {res.output_tail}"
    assert not res.ok and "wrote past its disk limit (32 MiB" in res.message, said
    assert "No space left on device" in said
    assert int(re.search(r"stopped after (\d+) MiB", said).group(1)) <= 32
    on_host = sum(p.stat().st_size for p in (workdir / "child").rglob("*") if p.is_file())
    assert on_host <= 32 << 20, "what came out of the box is bounded by its folder"
    assert res.isolation["guarantees"]["filesystem"]


def test_an_honest_child_still_hands_its_files_back(box_settings, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    res = sandbox.run(
        f"{T}:write_file", {}, limits=LIMITS, settings=box_settings, workdir=workdir, keep_workdir=True
    )
    assert res.ok, res.message
    assert "inside.txt" in res.value["files"]
    assert (workdir / "child" / "inside.txt").read_text() == "ok", "copied out of the box's folder"


def test_a_box_keeps_only_its_kept_files_and_they_come_out_of_the_next_child_s_memory(
    box_settings, monkeypatch
):
    """A kept box held every file its child wrote (a golden's inputs as well as its outputs) until
    closed; now only the kept files stay, and while they are held the next child's default memory
    limit is the machine's share less their bytes."""
    workdir = sandbox.make_workdir("kc-box-trim-")
    try:
        res = _leave_links(workdir, box_settings, ("plain.txt",))
        assert res.ok and res.kept is not None
        assert os.listdir(res.kept.path("plain.txt").parent) == ["plain.txt"]
        monkeypatch.setattr(sandbox, "machine_memory_limit", lambda: 8 * 1024**3)
        held = res.kept.nbytes()
        assert held > 0 and sandbox.kept_bytes() >= held
        limit = sandbox.SandboxLimits.from_settings(Settings(sandbox_memory_mb=0)).memory_bytes
        assert limit == 8 * 1024**3 - sandbox.kept_bytes()
        res.kept.close()
        assert sandbox.kept_bytes() == 0
        assert sandbox.SandboxLimits.from_settings(Settings(sandbox_memory_mb=0)).memory_bytes == 8 * 1024**3
        assert sandbox.SandboxLimits.from_settings(Settings(sandbox_memory_mb=1024)).memory_bytes == 1024**3
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
