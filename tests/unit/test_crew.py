"""The crew end to end on CPU: playbook and replayed-LLM runs, repairs, resume, continuation, chat."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from kernelcrew.agents.decide import answer, at_parity, decide, is_better
from kernelcrew.agents.llm import ReplayChat
from kernelcrew.agents.planner import parse_guidance
from kernelcrew.agents.run import OptimizeRequest, run_optimize
from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep
from kernelcrew.config import Settings
from kernelcrew.records import Report
from kernelcrew.tools.correctness import verify
from kernelcrew.tools.executor import LocalExecutor
from kernelcrew.tools.packaging import MARKER, custom_op_name, unpack
from tests.conftest import FIXTURES

POINTWISE = FIXTURES / "tasks" / "pointwise.py"
GOOD = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()


def report_json(report: Report | None) -> dict | None:
    """A run's report as report.json has it."""
    return None if report is None else report.model_dump(mode="json")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path / "data")


def request(**kw) -> OptimizeRequest:
    base = dict(
        task=POINTWISE, device="cpu", max_iters=2, quick=True, compile_modes="none", backend="playbook"
    )
    return OptimizeRequest(**{**base, **kw})


class SideBySide(LocalExecutor):
    """A LocalExecutor of two slots whose verify calls must meet: a round that verified one step
    after the other would leave the first call waiting until its barrier breaks."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, slots=[None, None])
        self.met = threading.Barrier(2, timeout=300)
        self.threads: set[str] = set()
        self.events: list[dict] = []

    def verify(self, request):
        self.threads.add(threading.current_thread().name)
        self.met.wait()
        return super().verify(request)


@pytest.fixture(scope="module")
def playbook_run(tmp_path_factory):
    """One playbook run shared by the tests that read its outputs: its two steps are one round,
    evaluated side by side (``test_the_two_steps_of_a_round_ran_side_by_side``)."""
    root = tmp_path_factory.mktemp("crew")
    s = Settings(data_dir=root / "data")
    executor = SideBySide(s)
    report = report_json(
        run_optimize(
            request(out=root / "out", parallel=2),
            settings=s,
            executor=executor,
            on_event=executor.events.append,
        )
    )
    return report, root / "out", s, executor


def test_playbook_run_returns_a_verified_own_kernel(playbook_run):
    report, out, _, _ = playbook_run
    assert report["status"] == "verified_cpu_only"
    assert report["best"]["strategy"] == "fused_pointwise" and report["best"]["kind"] == "kernel"
    strategies = [it["strategy"] for it in report["iterations"]]
    assert strategies[0] == "fused_pointwise" and len(strategies) == 2
    assert len(set(strategies)) == 2, "the planner never repeats a step"
    assert all(it["verdict"] == "pass" for it in report["iterations"])
    seconds = [it["elapsed_s"] for it in report["iterations"]]
    assert 0 < seconds[0] <= seconds[1] <= report["elapsed_s"], "each step says when it ended"
    compiled = [it for it in report["iterations"] if it["strategy"].startswith("torch_compile")]
    assert compiled and compiled[0]["kind"] == "compiler"
    assert "CPU wall-clock" in report["timings_note"]
    assert report["reproduce"].startswith("kernelcrew optimize")
    for name in ("best.py", "report.md", "report.json"):
        assert (out / name).exists()
    assert json.loads((out / "report.json").read_text())["run_id"] == report["run_id"]
    assert "fused_pointwise" in (out / "report.md").read_text()


def test_the_two_steps_of_a_round_ran_side_by_side(playbook_run):
    report, _, _, executor = playbook_run
    assert [e["steps"] for e in executor.events if e["kind"] == "round"] == [2]
    assert len(executor.threads) == 2  # each step verified from its own thread, both at once
    rows = report["iterations"]
    assert [(r["step"], r["id"], r["round"]) for r in rows] == [(1, "c1", 1), (2, "c2", 1)]


def test_the_baseline_ranks_kernels_in_its_timing_child_and_says_where_its_time_went(playbook_run):
    report, out, _, _ = playbook_run
    base = report["baseline"]
    assert base["hotspots"] and base["hotspots"][0]["name"].startswith("aten::")
    phases = base["phase_s"]
    assert set(phases) == {"golden", "benchmark", "analysis_wait"}, "no hotspot child, no ncu on a CPU"
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= report["elapsed_s"]
    assert "baseline: golden" in (out / "report.md").read_text()
    run = base["timing_run"]
    assert run["rounds"] >= 1 and run["stop_reason"] in ("max_reps", "stable", "time_budget")


def test_best_py_passes_the_verifier_again(playbook_run):
    _, out, _, _ = playbook_run
    verdict = verify(POINTWISE.read_text(), (out / "best.py").read_text())
    assert verdict.passed and verdict.kind == "kernel"
    assert "packaging" in [c["name"] for c in verdict.checks], "best.py carries its torch.compile packaging"


def test_best_py_of_an_own_kernel_is_a_custom_op(playbook_run):
    report, out, _, _ = playbook_run
    op = report["best"]["packaging"]["custom_op"]
    assert op and op.startswith("kernelcrew_") and op.endswith("::forward")
    assert custom_op_name((out / "best.py").read_text()) == op
    assert f"`{op}`" in (out / "report.md").read_text()


def test_a_run_starts_from_an_earlier_best_py_without_its_packaging(playbook_run, tmp_path):
    """--start with a packaged best.py: the kernels are the start, the block is not carried along."""
    _, out, s, _ = playbook_run
    report = report_json(
        run_optimize(request(start=out / "best.py", max_iters=1, out=tmp_path / "again"), settings=s)
    )
    first = report["iterations"][0]
    assert first["verdict"] == "pass", first
    best_py = (tmp_path / "again" / "best.py").read_text()
    assert best_py.count(MARKER) == 1 and unpack(best_py)[0] == unpack((out / "best.py").read_text())[0]
    assert report["best"]["packaging"]["custom_op"] == custom_op_name(best_py), "packaged by this run"


def test_finished_run_continues_with_a_message(playbook_run):
    report, out, s, _ = playbook_run
    again = report_json(
        run_optimize(
            request(
                task=None,
                resume=report["run_id"],
                messages=["skip torch_compile_max_autotune"],
                max_iters=1,
                out=out,
            ),
            settings=s,
        )
    )
    assert again["run_id"] == report["run_id"]
    assert any("torch_compile_max_autotune will not be tried" in r for r in again["replies"])
    assert again["stop_reason"] == "no strategy left to try"
    assert len(again["iterations"]) == 2, "no step was repeated"


def test_unknown_guidance_is_answered_with_what_the_playbook_can_do(settings, tmp_path):
    report = report_json(
        run_optimize(
            request(messages=["make it go brrr"], max_iters=1, out=tmp_path / "o"), settings=settings
        )
    )
    reply = report["replies"][0]
    assert "make it go brrr" in reply and "fused_pointwise" in reply and "skip <strategy>" in reply


def test_chat_stop_ends_the_run_before_any_step(settings, tmp_path):
    asked = []

    def ask(step: int) -> str:
        asked.append(step)
        return "stop"

    report = report_json(run_optimize(request(out=tmp_path / "o"), settings=settings, ask=ask))
    assert asked == [1]
    assert report["stop_reason"] == "stopped by the user" and report["best"] is None
    assert report["status"] == "no_verified_candidate"


def test_replayed_llm_plan_is_reasked_and_a_failing_candidate_is_repaired(settings, tmp_path):
    zeros = GOOD.replace("return out", "return torch.zeros_like(out)")
    assert zeros != GOOD
    wrong_shape = GOOD.replace("return out", "return out[..., :-1]")
    plan = {"strategy": "custom:fused_tanh", "rationale": "one pass", "expected_gain": 2.0, "params": {}}
    chat = ReplayChat(
        [
            "Let me think about it.",  # not JSON: re-asked
            json.dumps(plan),
            f"```python\n{zeros}\n```",
            f"```python\n{wrong_shape}\n```",
            f"```python\n{GOOD}\n```",
        ]
    )
    report = report_json(run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=chat))
    step = report["iterations"][0]
    assert step["strategy"] == "custom:fused_tanh"
    assert step["verdict"] == "pass" and step["repairs"] == 2
    assert report["best"]["kind"] == "kernel"
    # The repair prompts carried the verifier's structured failures.
    repair_prompts = [m[-1].content for m in chat.sent[3:]]
    assert '"stage": "correctness"' in repair_prompts[0]
    assert '"stage": "shape"' in repair_prompts[1]
    assert report["usage"]["calls"] == 5


PLAN = {"strategy": "custom:fused_tanh", "rationale": "one pass", "expected_gain": 2.0, "params": {}}


def _failure_in(coder_prompt: str) -> dict:
    """The verifier's failure that a repair prompt carries."""
    return json.loads(coder_prompt.split("if there was none):\n")[1].split("\n")[0])


def test_a_candidate_that_does_not_parse_or_lacks_model_new_goes_to_repair(settings, tmp_path):
    broken = GOOD.replace("class ModelNew", "def broken(:\n    pass\n\n\nclass ModelNew", 1)
    line = broken.splitlines().index("def broken(:") + 1
    nameless = GOOD.replace("ModelNew", "ModelOld")
    chat = ReplayChat(
        [
            json.dumps(PLAN),
            f"```python\n{broken}\n```",
            f"```python\n{nameless}\n```",
            f"```python\n{GOOD}\n```",
        ]
    )
    report = report_json(run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=chat))
    step = report["iterations"][0]
    assert step["verdict"] == "pass" and step["repairs"] == 2, step
    syntax, missing = (_failure_in(sent[-1].content) for sent in chat.sent[2:])
    assert syntax["stage"] == "build" and f"c1.py:{line}: syntax error" in syntax["message"]
    assert syntax["failures"][0]["details"]["line"] == line
    assert missing["stage"] == "input" and "ModelNew" in missing["message"]


def test_a_run_that_crashed_on_an_unparsable_candidate_resumes_into_repair(settings, tmp_path, monkeypatch):
    """A checkpoint left at verify with a broken draft (as an older kernelcrew crashed) resumes."""
    from kernelcrew.agents import verifier
    from kernelcrew.task import TaskError

    monkeypatch.setattr(verifier, "_unusable", lambda source, path: None, raising=False)
    first = ReplayChat([json.dumps(PLAN), "```python\nclass ModelNew(:\n    pass\n```"])
    with pytest.raises(TaskError, match="syntax error"):
        run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=first, thread_id="r1")
    monkeypatch.undo()

    again = ReplayChat([f"```python\n{GOOD}\n```"])
    report = report_json(
        run_optimize(request(task=None, resume="r1", out=tmp_path / "o"), settings=settings, chat=again)
    )
    step = report["iterations"][0]
    assert step["verdict"] == "pass" and step["repairs"] == 1, step
    assert _failure_in(again.sent[0][-1].content)["stage"] == "build"


def test_killed_run_resumes_from_its_checkpoint(tmp_path):
    env = {**os.environ, "KERNELCREW_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "kernelcrew",
        "optimize",
        str(POINTWISE),
        "--device",
        "cpu",
        "--max-iters",
        "2",
    ]
    cmd += ["--quick", "--compile-modes", "none", "--backend", "playbook", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    run_id, seen = None, []
    deadline = time.monotonic() + 300
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if m := re.search(r"run (\S+) on cpu", line):
            run_id = m.group(1)
        if "verify c1" in line:
            os.killpg(proc.pid, signal.SIGKILL)  # mid-run: after the first verification
            break
        assert time.monotonic() < deadline, "".join(seen)
    proc.wait(timeout=60)
    assert run_id and proc.returncode == -signal.SIGKILL, "".join(seen)
    assert not (tmp_path / "out" / "report.json").exists()

    report = report_json(
        run_optimize(
            request(task=None, resume=run_id, device=None, out=tmp_path / "out"),
            settings=Settings(data_dir=tmp_path / "data"),
        )
    )
    assert report["run_id"] == run_id
    assert [it["step"] for it in report["iterations"]] == [1, 2]
    assert report["iterations"][0]["verdict"] == "pass"


def test_a_terminated_run_removes_its_golden_and_says_how_to_resume(tmp_path):
    """SIGTERM (a scheduler's stop, the bench's deadline) ends a run as Ctrl-C does: its temporary
    files go. Python's default exit left a large task's golden (tens of GB) in the temp dir."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "KERNELCREW_DATA_DIR": str(tmp_path / "data"), "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "kernelcrew", "optimize", str(POINTWISE), "--device", "cpu"]
    cmd += ["--max-iters", "2", "--quick", "--compile-modes", "none", "--backend", "playbook"]
    cmd += ["--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    seen, goldens = [], []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if "plan:" in line:  # the baseline is done: the golden is on disk
            goldens = list(tmp.glob("kc-golden-*"))
            proc.send_signal(signal.SIGTERM)
            break
    _, rest = proc.communicate(timeout=120)
    said = "".join(seen) + (rest or "")
    assert goldens and proc.returncode == 130, said
    assert "continue it with --resume" in said
    assert not list(tmp.glob("kc-golden-*")), sorted(p.name for p in tmp.iterdir())


def test_resume_of_an_unknown_run_is_a_clear_error(settings):
    from kernelcrew.task import TaskError

    with pytest.raises(TaskError, match="no run with id"):
        report_json(run_optimize(request(task=None, resume="nope"), settings=settings))


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("only triton", ("only_kernels", "")),
        ("Keep FP32", ("keep_fp32", "")),
        ("try torch_compile", ("try", "torch_compile")),
        ("skip fused_pointwise.", ("skip", "fused_pointwise")),
        ("more iterations", ("more", "")),
        ("stop", ("stop", "")),
        ("please be fast", ("unknown", "please be fast")),
    ],
)
def test_guidance_grammar(message, expected):
    assert parse_guidance(message) == expected


def _cand(**kw) -> Candidate:
    return Candidate(
        **{"id": "c", "strategy": "s", "source_kind": "kernel", "source": "", "verdict": "pass", **kw}
    )


def test_a_gain_counts_only_when_significant_and_beyond_noise():
    best = _cand(time_ms=1.0, significant=True)
    assert not is_better(_cand(time_ms=0.5, significant=False), None, "cuda")
    assert is_better(_cand(time_ms=0.5, significant=True), None, "cuda")
    assert not is_better(_cand(time_ms=0.99, significant=True), best, "cuda"), "1% is within noise"
    assert is_better(_cand(time_ms=0.9, significant=True), best, "cuda")
    assert not is_better(_cand(verdict="fail", time_ms=0.1, significant=True), best, "cuda")
    # On a CPU, timings never decide: the first verified candidate stays unless an own kernel comes.
    assert is_better(_cand(kind="compiler"), None, "cpu")
    assert not is_better(_cand(kind="compiler", time_ms=0.001), _cand(kind="kernel", time_ms=9.0), "cpu")
    assert is_better(_cand(kind="kernel"), _cand(kind="compiler"), "cpu")


def test_a_verified_candidate_as_fast_as_eager_is_the_runner_up_and_the_answer_without_a_best():
    """Not significantly faster, not significantly slower: kept as the runner-up (the fastest
    such), never the best; with no best at the end it is the answer, labelled as what it is."""
    even = _cand(id="c1", time_ms=1.0, speedup_eager=1.0, speedup_eager_ci=[0.97, 1.03])
    assert at_parity(even, None)
    assert not at_parity(_cand(time_ms=1.3, speedup_eager=0.77, speedup_eager_ci=[0.75, 0.79]), None)
    assert not at_parity(_cand(time_ms=1.1, speedup_eager=0.99, speedup_eager_ci=[0.95, 1.02]), even)
    assert not at_parity(_cand(verdict="fail", time_ms=0.9, speedup_eager=1.1), None)
    # On an H100 a conv3d's max-autotune candidate timed 0.999x eager with an interval just short
    # of 1 (CUDA events are that precise): slower by less than the noise a better answer must beat
    # is parity too.
    assert at_parity(_cand(time_ms=2.704, speedup_eager=0.999, speedup_eager_ci=[0.998, 0.9995]), None)
    assert not at_parity(_cand(time_ms=1.03, speedup_eager=0.97, speedup_eager_ci=[0.968, 0.972]), None)

    runtime = SimpleNamespace(context=SimpleNamespace(emit=lambda *a, **k: None, meter=None))
    plan = PlanStep(strategy="s", rationale="r", expected_gain=1.5)
    state = CrewState(task_source="", plan=plan, draft=even, options=Options(device="cuda"))
    update = decide(state, runtime)
    assert "best" not in update and update["runner_up"] is even
    assert "runner_up" not in decide(CrewState(task_source="", plan=plan, draft=even), runtime), "CPU"

    state = CrewState(task_source="", best=even, runner_up=even, options=Options(device="cuda"))
    got = answer(state, Report(status="no_significant_gain", best={"id": "c1", "strategy": "s"}))
    assert got["answer"] == "candidate" and "not significantly slower than eager" in got["why"]


def test_status_says_verified_but_not_faster_apart_from_nothing_verified():
    from types import SimpleNamespace

    from kernelcrew.agents.report import build_report
    from kernelcrew.agents.state import CrewState, Options

    ctx = SimpleNamespace(run_id="r")
    opts = Options(device="cuda")
    slower = CrewState(
        task_source="", options=opts, iterations=[{"step": 1, "verdict": "pass", "new_best": False}]
    )
    assert build_report(slower, None, ctx).status == "no_significant_gain"
    failed = CrewState(task_source="", options=opts, iterations=[{"step": 1, "verdict": "fail"}])
    assert build_report(failed, None, ctx).status == "no_verified_candidate"


def test_a_plan_the_model_fails_twice_counts_as_one_failed_step(settings, tmp_path):
    chat = ReplayChat(["no json here", "still none", "nor here", "nothing"])
    report = report_json(run_optimize(request(max_iters=2, out=tmp_path / "o"), settings=settings, chat=chat))
    steps = report["iterations"]
    assert [s["stage"] for s in steps] == ["plan", "plan"]
    assert [s["step"] for s in steps] == [1, 2]
    assert report["stop_reason"] == "iteration budget reached (2)"
    assert report["usage"]["calls"] == 4


def test_local_only_keeps_sources_off_external_providers(monkeypatch):
    from kernelcrew.agents.run import resolve_chat

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    external = Settings()
    chat, backend, note = resolve_chat("openai", "", True, external)
    assert chat is None and backend == "playbook" and "external" in note
    chat, backend, _ = resolve_chat("openai", "", False, external)
    assert chat is not None and backend == "openai"
    local = Settings(llm_base_url="http://127.0.0.1:8000/v1")
    chat, backend, note = resolve_chat("openai", "", True, local)
    assert chat is not None and backend == "openai" and not note


def test_report_table_takes_eager_and_compile_from_the_final_measurement():
    from kernelcrew.agents.report import render_markdown

    report = Report.model_validate(
        {
            "task": "t.py",
            "status": "improved",
            "stop_reason": "done",
            "device": "cuda",
            "gpu_name": "H100",
            "arch": "sm_90",
            "precision": "strict",
            "backend": "playbook",
            "scope": "forward only",
            "timings_note": "CUDA events",
            "baseline": {"eager_ms": 9.0, "compile_ms": {"default": 3.0}},
            "best": {
                "id": "c1",
                "strategy": "fused_pointwise",
                "kind": "kernel",
                "eager_ms": 2.0,
                "compile_ms": {"default": 1.0},
                "best_ms": 0.5,
                "speedup_eager": 4.0,
                "speedup_eager_ci": [3.9, 4.1],
                "speedup_compile": 2.0,
            },
            "iterations": [],
            "usage": {},
            "elapsed_s": 1.0,
            "reproduce": "kernelcrew optimize t.py",
        }
    )
    text = render_markdown(report)
    assert "| eager | 2 ms | 1x |" in text
    assert "| torch.compile (default) | 1 ms | 2x |" in text


def test_no_step_starts_that_would_end_past_the_time_budget():
    """64 s of a 120 s budget left after a 31 s first step, 17 s of it kept for the final report
    (1.7x the baseline's 10 s timing phase): another kernel step (about 31 s) starts, a
    max-autotune compile (1.7x: its autotuning runs inside the step) does not. The budget is wall
    time on a CPU as on a GPU. Before any step ended, a step is expected from the baseline: two
    timing runs, and three compiles for a compiler step (10 s each when none was measured)."""
    from kernelcrew.agents.planner import _budget_reason, _fits_budget, step_seconds
    from kernelcrew.agents.state import CrewState, Options, PlanStep

    def state(device: str) -> CrewState:
        return CrewState(
            task_source="",
            options=Options(device=device, time_budget_s=120.0),
            baseline={"phase_s": {"golden": 14.0, "benchmark": 10.0}},
            iterations=[{"step": 1, "elapsed_s": 55.0}],
            started_at=time.time() - 56.0,
        )

    gpu = state("cuda")
    assert step_seconds(gpu) == [31.0]
    kernel = PlanStep(strategy="row_reduction", rationale="r", expected_gain=2.0, params={"num_warps": 4})
    autotune = PlanStep(strategy="torch_compile_max_autotune", rationale="r", expected_gain=1.5)
    assert _fits_budget(gpu, kernel)
    assert not _fits_budget(gpu, autotune)
    assert "47 s of 120 s left after the final report's share" in _budget_reason(gpu, autotune)
    assert "would take about 53 s" in _budget_reason(gpu, autotune)
    short = state("cuda")
    short.options.time_budget_s = 90.0  # 17 s left once the report's share is kept
    assert not _fits_budget(short, kernel)
    assert not _fits_budget(state("cpu"), autotune)
    first = state("cuda")
    first.iterations = []
    assert _fits_budget(first, kernel)  # 2 x 10 s
    assert not _fits_budget(first, autotune)  # 2 x 10 s + 3 x 10 s


def test_the_playbook_takes_the_first_step_that_fits(monkeypatch):
    """A max-autotune step first in the menu that would end past the budget is passed over for
    the kernel step after it; with nothing that fits, the step expected to end first comes back
    (plan() then stops the run with the budget's reason, unless it is an unanswered run's first
    step: that one should overrun the least)."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.state import CrewState, Options, PlanStep

    autotune = PlanStep(strategy="torch_compile_max_autotune", rationale="r", expected_gain=1.5)
    kernel = PlanStep(strategy="row_reduction", rationale="r", expected_gain=2.0, params={"num_warps": 4})
    monkeypatch.setattr(planner, "_menu", lambda state: [autotune, kernel])
    state = CrewState(
        task_source="",
        options=Options(device="cuda", time_budget_s=120.0),
        baseline={"phase_s": {"golden": 14.0, "benchmark": 10.0}},
        iterations=[{"step": 1, "elapsed_s": 55.0}],
        started_at=time.time() - 56.0,
    )
    prefs = {"only_kernels": False, "try": [], "skip": set(), "more": 0, "stop": False}
    assert planner._plan_with_playbook(state, prefs) == kernel
    state.options.time_budget_s = 90.0
    assert planner._plan_with_playbook(state, prefs) == kernel  # not the menu's first
    assert not planner._fits_budget(state, autotune) and not planner._fits_budget(state, kernel)
    assert planner.expected_seconds(state, kernel) < planner.expected_seconds(state, autotune)


def test_a_best_slower_than_the_compiler_sends_the_playbook_to_untried_strategies(monkeypatch):
    """Own kernels come first in the menu, each with every configuration of its tuning space; when
    the best verified so far is clearly slower than torch.compile's baseline (under
    LOSING_TO_COMPILE), the strategies not yet tried (the compiler's own candidates among them) go
    ahead of the tried ones' other configurations, so that a short budget still delivers the
    fastest kind (bench/results/groupnorm_bf16_h100.md: two GroupNorm configurations at 0.71x
    torch.compile filled a two-step run). Nearer the compiler, the next configuration comes next."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep

    rows = [
        PlanStep(strategy="row_reduction", rationale="r", expected_gain=2.0, params={"CHUNK": c})
        for c in (8192, 4096)
    ]
    compiler = PlanStep(strategy="torch_compile", rationale="r", expected_gain=1.5)
    monkeypatch.setattr(planner, "_menu", lambda state: [*rows, compiler])
    best = Candidate(id="c1", strategy="row_reduction", source_kind="kernel", source="", verdict="pass")
    state = CrewState(
        task_source="",
        options=Options(device="cuda", time_budget_s=600.0),
        iterations=[{"step": 1, "elapsed_s": 20.0, "strategy": "row_reduction"}],
        tried=[planner.step_key("row_reduction", {"CHUNK": 8192})],
        best=best,
        started_at=time.time() - 21.0,
    )
    prefs = {"only_kernels": False, "try": [], "skip": set(), "more": 0, "stop": False}
    for speedup, expected in ((0.71, compiler), (0.94, rows[1]), (1.05, rows[1]), (None, rows[1])):
        best.speedup_compile = speedup
        assert planner._plan_with_playbook(state, prefs) == expected
    best.speedup_compile = 0.71
    assert planner._plan_with_playbook(state, {**prefs, "only_kernels": True}) == rows[1]


def _linear_relu_fp16() -> tuple[str, dict]:
    """One fp16 linear layer with ReLU: its source and the playbook's analysis of it."""
    from pathlib import Path

    from kernelcrew.agents.playbook.analysis import analyze_child
    from tests.unit.test_matmul import task

    source = task(
        "self.fc = nn.Linear(64, 32, dtype=torch.float16)",
        "return torch.relu(self.fc(x))",
        "torch.randn(16, 64, dtype=torch.float16)",
        "[]",
    )
    return source, analyze_child({"task_source": source, "task_path": "t.py", "seed": 0}, Path("."))


def test_a_past_win_earns_its_strategy_the_first_step_not_every_step():
    """One fp16 linear layer with ReLU, where an earlier run recorded a Triton matmul win (without
    trying cuBLASLt): that configuration goes first, then each other strategy's first try, then
    the matmul's other configurations."""

    from kernelcrew.agents.planner import _menu
    from kernelcrew.agents.state import CrewState, Options
    from kernelcrew.knowledge_base import from_analysis

    source, analysis = _linear_relu_fp16()
    params = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    hit = {
        "source": "verified",
        "strategy": "matmul_epilogue",
        "params": params,
        "exact_signature": True,
        "signature": from_analysis(analysis).text,
    }
    state = CrewState(
        task_source=source,
        options=Options(device="cuda"),
        baseline={"analysis": analysis, "arch": "sm_90"},
        kb_hits=[hit],
    )
    menu = [(s.strategy, s.params) for s in _menu(state)]
    assert menu[0] == ("matmul_epilogue", params)
    assert [name for name, _ in menu[1:4]] == [
        "cublaslt_epilogue",
        "torch_compile",
        "torch_compile_max_autotune",
    ]
    assert {name for name, _ in menu[4:]} == {"matmul_epilogue"}


def test_a_compile_mode_the_baseline_timed_no_faster_than_eager_is_not_a_step():
    """On an H100 two level-1 convolutions ran slower under torch.compile than eager in the baseline,
    and the first step compiled them again (a minute each, past the budget). A mode the baseline
    timed at no faster than eager is left off the menu; an untimed or faster mode stays."""
    from kernelcrew.agents.planner import _menu
    from kernelcrew.agents.state import CrewState, Options

    source, analysis = _linear_relu_fp16()

    def names(device="cuda", **baseline):
        state = CrewState(
            task_source=source,
            options=Options(device=device),
            baseline={"analysis": analysis, "arch": "sm_90", **baseline},
        )
        return {s.strategy for s in _menu(state)}

    assert {"torch_compile", "torch_compile_max_autotune"} <= names()
    slower = names(eager_ms=14.45, compile_ms={"default": 19.51})
    assert "torch_compile" not in slower and "torch_compile_max_autotune" in slower
    assert "torch_compile" not in names(eager_ms=1.0, compile_ms={"default": 0.99})  # within noise
    assert "torch_compile" in names(eager_ms=1.0, compile_ms={"default": 0.9})
    assert "torch_compile" in names("cpu", eager_ms=1.0, compile_ms={"default": 2.0})


def test_a_strategys_reason_for_a_module_of_a_hundred_parts_is_cut_to_a_steps_rationale(monkeypatch):
    """A reason longer than a step's rationale may be (the parts of a deep CNN listed) is cut, not
    an error that ends the run."""
    from kernelcrew.agents import planner, playbook
    from kernelcrew.agents.state import RATIONALE_CHARS

    strategy = playbook.get_strategy("torch_compile")
    monkeypatch.setattr(playbook, "applicable", lambda analysis: [(strategy, "region; " * 1000)])
    state = CrewState(task_source="", options=Options(device="cpu"), baseline={"analysis": {}})
    (step,) = planner._menu(state)
    assert len(step.rationale) == RATIONALE_CHARS and step.rationale.endswith("...")
