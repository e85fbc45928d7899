"""Unit tests of kernelcrew.worker without a broker: routing, worker planning, Celery config, envelopes."""

from __future__ import annotations

import json

import pytest

from kernelcrew.config import Settings
from kernelcrew.records import BenchmarkResult, ProfileRequest, ProfileResult, Verdict
from kernelcrew.task import TaskError
from kernelcrew.tools.executor import ExecutorError, LocalExecutor
from kernelcrew.tools.hardware import GpuRequest
from kernelcrew.worker.errors import NoWorkerOnline, WorkerError, WorkerLost, WorkerTimeout
from kernelcrew.worker.executor import _failure, _unwrap
from kernelcrew.worker.inventory import INFO_ENV, WorkerInfo, probe_ncu
from kernelcrew.worker.routing import pick_queue
from kernelcrew.worker.supervisor import WorkerSpec, backoff_s, plan_workers
from kernelcrew.worker.tasks import TaskName, check_request

GIB = 1024**3


def gpu(model: str, arch: str, index: int = 0, name: str = "") -> dict:
    return {
        "device": "cuda",
        "name": name or model,
        "model": model,
        "arch": arch,
        "compute_capability": [int(arch[3]), int(arch[4:])],
        "sm_count": 132,
        "memory_bytes": 80 * GIB,
        "l2_bytes": 50 * 1024**2,
        "cpu_count": 16,
        "index": index,
    }


def worker(hostname: str, queues: list[str], model: str | None = None, arch: str | None = None) -> WorkerInfo:
    return WorkerInfo(
        hostname=hostname,
        host="h",
        pid=1,
        queues=queues,
        device="cuda" if model else "cpu",
        gpu=gpu(model, arch) if model and arch else None,
    )


H100 = worker("kc-gpu0@a", ["gpu.h100-sxm", "gpu.sm_90"], "h100-sxm", "sm_90")
H100_B = worker("kc-gpu1@a", ["gpu.h100-sxm", "gpu.sm_90"], "h100-sxm", "sm_90")
H200 = worker("kc-gpu0@b", ["gpu.h200", "gpu.sm_90"], "h200", "sm_90")
A100 = worker("kc-gpu0@c", ["gpu.a100-sxm", "gpu.sm_80"], "a100-sxm", "sm_80")
CPU = worker("kc-cpu@d", ["cpu"])


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "kind", "value"),
    [
        (None, "any", None),
        ("", "any", None),
        ("any", "any", None),
        ("h100-sxm", "model", "h100-sxm"),
        ("gpu.h100-sxm", "model", "h100-sxm"),
        ("NVIDIA H100 80GB HBM3", "model", "h100-sxm"),
        ("sm_90", "arch", "sm_90"),
        ("SM90", "arch", "sm_90"),
        ("gpu.sm_90a", "arch", "sm_90a"),
        ("cpu", "cpu", "cpu"),
    ],
)
def test_gpu_request_parse(spec, kind, value):
    assert GpuRequest.parse(spec) == GpuRequest(kind, value)


def test_exact_model_queue_when_a_worker_serves_it():
    assert pick_queue([H200, H100, A100], "h100-sxm") == "gpu.h100-sxm"
    assert pick_queue([H200, H100, A100], "NVIDIA H100 80GB HBM3") == "gpu.h100-sxm"


def test_model_falls_back_to_its_architecture():
    # No H100 online: an H200 (same sm_90) takes the work through the architecture queue.
    assert pick_queue([H200, A100], "h100-sxm") == "gpu.sm_90"
    assert pick_queue([H200], "h100-sxm-mig-1g-10gb") == "gpu.sm_90"


def test_architecture_request():
    assert pick_queue([H200, A100], "sm_80") == "gpu.sm_80"
    with pytest.raises(NoWorkerOnline, match=r"architecture sm_89: nothing serves gpu.sm_89"):
        pick_queue([H200, A100], "sm_89")


def test_no_worker_for_model_or_its_architecture_names_what_is_online():
    with pytest.raises(NoWorkerOnline) as info:
        pick_queue([A100, CPU], "h100-sxm")
    message = str(info.value)
    assert "no worker online for GPU model h100-sxm" in message
    assert "gpu.h100-sxm or gpu.sm_90" in message
    assert "gpu.a100-sxm (1 worker)" in message and "cpu (1 worker)" in message


def test_unknown_model_without_architecture_says_so():
    with pytest.raises(NoWorkerOnline, match="architecture is unknown"):
        pick_queue([H100], "mystery-9000")


def test_unknown_model_uses_the_architecture_a_worker_reported():
    odd = worker("kc-gpu0@e", ["gpu.mystery-9000", "gpu.sm_90"], "mystery-9000", "sm_90")
    assert pick_queue([odd], "mystery-9000") == "gpu.mystery-9000"


def test_any_gpu_prefers_the_model_with_most_workers():
    assert pick_queue([H200, H100, H100_B, A100]) == "gpu.h100-sxm"
    assert pick_queue([H200, A100]) == "gpu.a100-sxm"  # a tie goes by name
    custom = worker("kc-gpu0@f", ["gpu.team-a"], None, None)
    custom.device = "cuda"
    assert pick_queue([custom, CPU]) == "gpu.team-a"


def test_cpu_requests_go_to_the_cpu_queue():
    assert pick_queue([H100, CPU], None, device="cpu") == "cpu"
    assert pick_queue([H100, CPU], "cpu", device="cpu") == "cpu"
    with pytest.raises(NoWorkerOnline, match="the CPU: nothing serves cpu"):
        pick_queue([H100], None, device="cpu")


def test_no_workers_at_all():
    with pytest.raises(NoWorkerOnline, match="no workers at all"):
        pick_queue([], None)
    with pytest.raises(NoWorkerOnline, match="a GPU"):
        pick_queue([CPU], None)


def test_contradictory_requests_are_value_errors():
    with pytest.raises(ValueError, match="asks for GPU h100-sxm"):
        pick_queue([H100, CPU], "h100-sxm", device="cpu")
    with pytest.raises(ValueError, match="device is cuda"):
        pick_queue([H100, CPU], "cpu", device="cuda")
    with pytest.raises(ValueError, match="unknown device"):
        pick_queue([H100], None, device="tpu")


def test_no_worker_online_is_an_executor_error():
    assert issubclass(NoWorkerOnline, ExecutorError)
    assert issubclass(WorkerLost, WorkerError) and issubclass(WorkerTimeout, WorkerError)


# ----------------------------------------------------------------------------------------------
# Planning the workers of a machine
# ----------------------------------------------------------------------------------------------


def test_one_pinned_worker_per_gpu():
    machine = {
        "devices": [gpu("h100-sxm", "sm_90", 0), gpu("h100-sxm", "sm_90", 1)],
        "versions": {"torch": "2.11"},
    }
    ncu = {0: {"counters": True, "detail": "ok", "version": "2025.1"}, 1: {"counters": False, "detail": "no"}}
    specs = plan_workers(machine, name="kc", host="node1", broker_url="redis://r:6379/0", ncu=ncu)
    assert [s.hostname for s in specs] == ["kc-gpu0@node1", "kc-gpu1@node1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1"]
    assert all(s.queues == ["gpu.h100-sxm", "gpu.sm_90"] for s in specs)
    assert all(s.env["KERNELCREW_BROKER_URL"] == "redis://r:6379/0" for s in specs)
    report = json.loads(specs[1].env[INFO_ENV])
    assert report["device"] == "cuda" and report["gpu"]["model"] == "h100-sxm"
    assert report["ncu"]["counters"] is False and report["versions"] == {"torch": "2.11"}
    cmd = specs[0].command()
    assert cmd[cmd.index("--concurrency") + 1] == "1"
    assert cmd[cmd.index("--pool") + 1] == "prefork"
    assert cmd[cmd.index("--queues") + 1] == "gpu.h100-sxm,gpu.sm_90"
    assert cmd[cmd.index("--hostname") + 1] == "kc-gpu0@node1"


def test_pinning_follows_the_supervisors_visible_devices():
    machine = {"devices": [gpu("a100-sxm", "sm_80", 0), gpu("a100-sxm", "sm_80", 1)]}
    specs = plan_workers(machine, name="kc", host="n", broker_url="redis://x", visible_devices="3, 5")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["3", "5"]


def test_cpu_machine_serves_the_cpu_queue_and_queues_override():
    cpu = {"device": "cpu", "name": "Xeon", "model": "cpu", "arch": "cpu", "compute_capability": None}
    cpu.update(sm_count=None, memory_bytes=None, l2_bytes=None, cpu_count=2, index=None)
    (spec,) = plan_workers({"devices": [cpu]}, name="w", host="n", broker_url="redis://x")
    assert spec.hostname == "w-cpu@n" and spec.queues == ["cpu"] and "CUDA_VISIBLE_DEVICES" not in spec.env
    assert json.loads(spec.env[INFO_ENV])["ncu"]["counters"] is False
    (spec,) = plan_workers({"devices": [cpu]}, name="w", host="n", broker_url="redis://x", queues=["a", "b"])
    assert spec.queues == ["a", "b"]


def test_restart_backoff_doubles_up_to_a_ceiling():
    assert [backoff_s(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff_s(30) == 60.0
    assert backoff_s(3, initial_s=0.5, max_s=1.5) == 1.5


def test_worker_spec_runs_the_kernelcrew_app():
    cmd = WorkerSpec("x@y", ["cpu"]).command("debug")
    assert "kernelcrew.worker.app:app" in cmd and cmd[-1] == "DEBUG"
    assert {"--without-gossip", "--without-mingle"} <= set(cmd)


# ----------------------------------------------------------------------------------------------
# The Celery app and the tasks
# ----------------------------------------------------------------------------------------------


def test_celery_configuration_follows_the_settings():
    from kernelcrew.worker.app import make_app

    settings = Settings(
        broker_url="redis://127.0.0.1:6379/7",
        task_soft_time_limit_s=100,
        task_time_limit_s=120,
        visibility_margin_s=30,
        worker_restore_interval_s=5,
    )
    conf = make_app(settings).conf
    assert conf.broker_url == conf.result_backend == "redis://127.0.0.1:6379/7"
    assert conf.task_serializer == conf.result_serializer == "json"
    assert list(conf.accept_content) == ["json"] and list(conf.result_accept_content) == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert (conf.task_soft_time_limit, conf.task_time_limit) == (100, 120)
    assert conf.broker_transport_options["visibility_timeout"] == 150 == settings.visibility_timeout_s
    assert conf.broker_transport_options["unacked_restore_interval"] == 5
    assert conf.result_backend_transport_options["visibility_timeout"] == 150
    assert conf.result_expires == settings.result_expires_s
    assert conf.worker_max_tasks_per_child == settings.worker_max_tasks_per_child


def test_module_app_reads_the_environment_lazily(monkeypatch):
    from kernelcrew.config import get_settings
    from kernelcrew.worker.app import make_app

    monkeypatch.setenv("KERNELCREW_BROKER_URL", "redis://example.invalid:6379/3")
    get_settings.cache_clear()
    try:
        lazy = make_app()
        assert lazy.conf.broker_url == "redis://example.invalid:6379/3"
    finally:
        get_settings.cache_clear()


def test_exactly_the_three_tasks_are_registered():
    from kernelcrew.worker.app import make_app

    app = make_app(Settings())
    ours = {name for name in app.tasks if not name.startswith("celery.")}
    assert ours == {"kernelcrew.verify", "kernelcrew.benchmark", "kernelcrew.profile"}
    assert {t.value for t in TaskName} == ours
    assert TaskName.for_op("benchmark") is TaskName.BENCHMARK


def test_hard_limit_must_exceed_soft_limit():
    with pytest.raises(ValueError, match="must be above"):
        Settings(task_soft_time_limit_s=60, task_time_limit_s=60)


@pytest.mark.parametrize(
    ("op", "request_", "error"),
    [
        (
            "verify",
            {"task_source": "x", "device": "cpu", "precision": "strict", "seed": 1},
            "lacks candidate_source",
        ),
        (
            "profile",
            {"task_source": "x", "device": "gpu", "precision": "strict", "seed": 1},
            "device: Input should be 'cuda' or 'cpu'",
        ),
        (
            "profile",
            {"task_source": "x", "device": "cpu", "precision": "strict", "seed": None},
            "seed: .*integer",
        ),
        ("profile", {"task_source": "x", "device": "cpu", "precision": "strict", "seed": "7"}, "integer"),
        (
            "benchmark",
            {"task_source": "x", "candidates": [], "device": "cpu", "precision": "strict", "seed": 1},
            "dict",
        ),
        ("compile", {}, "unknown operation"),
        ("profile", ["not", "a", "dict"], "must be a dict"),
    ],
)
def test_incomplete_requests_are_refused_before_sending(op, request_, error):
    with pytest.raises(ValueError, match=error):
        check_request(op, request_)


def test_envelopes_become_results_or_the_right_errors():
    verdict = Verdict(verdict="pass", stage="done", message="ok", seed=1, device="cpu", precision="strict")
    ok = {"ok": True, "result": verdict.model_dump(mode="json")}
    assert _unwrap("verify", ok, Verdict) == verdict
    with pytest.raises(TaskError, match=r"task.py:3: bad thing") as info:
        _unwrap(
            "verify",
            {
                "ok": False,
                "error": {"type": "task_error", "message": "bad thing", "path": "task.py", "line": 3},
            },
            Verdict,
        )
    assert info.value.message == "bad thing"
    with pytest.raises(WorkerTimeout, match="soft time limit"):
        _unwrap(
            "profile",
            {"ok": False, "error": {"type": "timeout", "message": "ran past the soft time limit"}},
            ProfileResult,
        )
    with pytest.raises(WorkerLost, match="lost 3 times"):
        _unwrap("verify", {"ok": False, "error": {"type": "worker_lost", "message": "lost 3 times"}}, Verdict)
    with pytest.raises(WorkerError, match=r"failed on w@h: KeyError: 'x'\nTraceback"):
        _unwrap(
            "verify",
            {
                "ok": False,
                "hostname": "w@h",
                "error": {"type": "internal", "message": "KeyError: 'x'", "traceback": "Traceback"},
            },
            Verdict,
        )
    with pytest.raises(WorkerError, match=r"refused on w@h \(misrouted\)"):
        _unwrap(
            "verify",
            {"ok": False, "hostname": "w@h", "error": {"type": "misrouted", "message": "no GPU"}},
            Verdict,
        )
    with pytest.raises(WorkerError, match="not a kernelcrew envelope"):
        _unwrap("verify", [1, 2], Verdict)


def test_a_malformed_result_is_a_clear_worker_error():
    """A result that is not its operation's record names the fields that are wrong, not a KeyError later."""
    with pytest.raises(
        WorkerError, match=r"verify task on w@h returned a malformed Verdict: lacks stage;.*seed"
    ):
        _unwrap(
            "verify",
            {"ok": True, "hostname": "w@h", "result": {"verdict": "pass", "message": "", "seed": "x"}},
            Verdict,
        )
    with pytest.raises(WorkerError, match=r"malformed BenchmarkResult: results\.eager\.median_ms"):
        _unwrap(
            "benchmark",
            {"ok": True, "result": {"results": {"eager": {"median_ms": "fast"}}}},
            BenchmarkResult,
        )
    with pytest.raises(WorkerError, match=r"malformed ProfileResult: surprise: Extra inputs"):
        _unwrap("profile", {"ok": True, "result": {"surprise": 1}}, ProfileResult)


# ----------------------------------------------------------------------------------------------
# ncu probe, golden cache
# ----------------------------------------------------------------------------------------------


def test_ncu_probe_on_a_cpu_and_without_ncu(monkeypatch):
    from kernelcrew.tools import ncu

    assert probe_ncu("cpu")["counters"] is False
    ncu.capability.cache_clear()
    monkeypatch.setattr(ncu, "ncu_version", lambda: None)
    verdict = probe_ncu("cuda", visible_device="0")
    assert verdict["counters"] is False and "not installed" in verdict["detail"]
    ncu.capability.cache_clear()


def test_local_executor_keeps_at_most_max_goldens(monkeypatch):
    made, cleaned, spilled = [], [], []

    class FakeGolden:
        def __init__(self, seed: int) -> None:
            self.seed = seed

        def cleanup(self) -> None:
            cleaned.append(self.seed)

        def spill(self) -> None:
            spilled.append(self.seed)

    def make_golden(task_source, *, device, precision, seed, task_path, settings):
        made.append(seed)
        return FakeGolden(seed)

    monkeypatch.setattr("kernelcrew.tools.correctness.make_golden", make_golden)
    ex = LocalExecutor(Settings(), max_goldens=2)
    for seed in (1, 2, 1, 3, 1, 2):
        ex.golden(ProfileRequest(task_source="t", device="cpu", precision="strict", seed=seed))
    # 1 stays (used again before 3 came); 2 is evicted by 3, then 3 by 2.
    assert made == [1, 2, 3, 2]
    assert cleaned == [2, 3]
    assert spilled == [1, 1, 1], "each new golden moves the others' outputs out of memory"
    ex.close()
    assert sorted(cleaned) == [1, 2, 2, 3]
    with pytest.raises(ValueError):
        LocalExecutor(Settings(), max_goldens=0)


def test_celery_failures_become_worker_errors():
    from billiard.exceptions import TimeLimitExceeded, WorkerLostError

    settings = Settings(task_soft_time_limit_s=10, task_time_limit_s=12)
    timeout = _failure("benchmark", TimeLimitExceeded(12), settings)
    assert isinstance(timeout, WorkerTimeout) and "hard time limit of 12 s" in str(timeout)
    lost = _failure("verify", WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)"), settings)
    assert isinstance(lost, WorkerLost) and "SIGKILL" in str(lost)
    other = _failure("profile", RuntimeError("boom"), settings)
    assert type(other) is WorkerError and "RuntimeError: boom" in str(other)


def test_the_graph_and_the_cli_never_import_celery():
    import subprocess
    import sys

    code = (
        "import sys, kernelcrew.cli, kernelcrew.agents.graph, kernelcrew.agents.run; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'redis')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_serves_orchestrators_are_restarted_when_killed_and_readiness_says_so():
    """``serve``'s pool: a child killed with SIGKILL is started again after its backoff; while none
    runs the pool is not ready and says why; stopping ends the children and restarts nothing."""
    import os
    import signal
    import sys
    import time

    from kernelcrew.worker.supervisor import OrchestratorPool

    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    pool = OrchestratorPool(cmd, 1, initial_backoff_s=1.5, poll_s=0.05)
    with pool:
        assert pool.status() == (True, "1 of 1 running, 0 restarted")
        first = pool.procs[0]
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        ready, how = pool.status()
        assert not ready and how == "error: 0 of 1 running, 0 restarted"
        deadline = time.monotonic() + 20
        while pool.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.status() == (True, "1 of 1 running, 1 restarted")
        second = pool.procs[0]
        assert second is not None and second.pid != first.pid
    assert second.poll() is not None, "stopping the pool ends its orchestrators"
    time.sleep(0.2)
    assert pool.restarts == 1 and pool.procs[0] is second
