"""The time budget: a bounded baseline, steps that fit, the compiler fallback, the budget's account."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kernelcrew.agents.decide import answer, route_after_decide
from kernelcrew.agents.llm import ReplayChat
from kernelcrew.agents.planner import (
    _fits_budget,
    _seconds_left,
    expected_seconds,
    fallback_step,
    modelled_seconds,
)
from kernelcrew.agents.run import OptimizeRequest, _parse_modes, run_optimize
from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep
from kernelcrew.config import Settings
from kernelcrew.records import Report
from kernelcrew.tools.executor import LocalExecutor

#: A pointwise chain on a tensor large enough that Inductor's one fused loop beats eager's dozen
#: passes on a CPU too; small enough for Triton's interpreter.
CHAIN = '''"""A heavy-ish pointwise chain: a dozen elementwise passes over a 128 x 512 tensor."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x * 1.5 + y
        z = torch.sigmoid(z) * z
        z = z - 0.25 * y
        z = torch.tanh(z) + x
        z = z * z + 0.5
        z = torch.exp(-z) * y + x
        return z * 0.75 - y * 0.125


def get_inputs():
    return [torch.randn(128, 512), torch.randn(128, 512)]


def get_init_inputs():
    return []


def get_test_inputs():
    return [[torch.randn(7, 13), torch.randn(7, 13)]]
'''

#: CHAIN on inputs large enough that its fused torch.compile beats eager's dozen passes on any CPU,
#: loaded or not (on 128 x 512 the two are within a loaded CPU's noise).
BIG_CHAIN = CHAIN.replace(
    "torch.randn(128, 512), torch.randn(128, 512)", "torch.randn(512, 1024), torch.randn(512, 1024)"
)
assert BIG_CHAIN != CHAIN

KERNEL = PlanStep(strategy="fused_pointwise", rationale="r", expected_gain=2.0, params={"BLOCK_SIZE": 1024})
COMPILE = PlanStep(strategy="torch_compile", rationale="r", expected_gain=1.5)


def state(device: str = "cuda", **kw) -> CrewState:
    """A run 30 s into a 100 s budget, after a baseline whose timing run took 5 s."""
    base = {
        "eager_ms": 2.0,
        "compile_ms": {"default": 1.0},
        "compile_s": {"default": 4.0},
        "phase_s": {"golden": 5.0, "benchmark": 9.0},
    }
    values = dict(
        task_source="",
        options=Options(device=device, time_budget_s=100.0),
        baseline=base,
        budget={"baseline_s": 15.0},
        started_at=time.time() - 30.0,
    )
    return CrewState(**{**values, **kw})


def test_auto_compile_modes_time_one_mode_and_keep_the_second_for_the_budget():
    assert _parse_modes("auto", "cuda") == (["default"], ["max-autotune-no-cudagraphs"])
    assert _parse_modes("default,max-autotune-no-cudagraphs", "cuda") == (
        ["default", "max-autotune-no-cudagraphs"],
        [],
    )
    assert _parse_modes("auto", "cpu") == ([], [])


def test_the_first_step_is_expected_from_the_baseline_and_a_compile_step_costs_its_compiles():
    """Before any step ended, a step is two of the baseline's timing runs (9 s less the 4 s
    compile), and a torch.compile step adds three compiles of its mode (max-autotune: four times
    the default's), or one where the baseline built that mode (the candidate starts from its build)."""
    s = state()
    assert modelled_seconds(s, KERNEL) == pytest.approx(10.0)
    assert modelled_seconds(s, COMPILE) == pytest.approx(10.0 + 1 * 4.0)
    autotune = PlanStep(strategy="torch_compile_max_autotune", rationale="r", expected_gain=1.5)
    assert modelled_seconds(s, autotune) == pytest.approx(10.0 + 3 * 16.0)
    s.iterations = [{"step": 1, "elapsed_s": 40.0}]  # a 25 s step: the longest so far goes first
    assert expected_seconds(s, KERNEL) == pytest.approx(25.0)


def test_the_budget_holds_on_a_cpu_too_and_keeps_room_for_the_fallback():
    """The budget is wall-clock time on any device. While the run has no answer and the baseline
    measured torch.compile faster than eager, a compiler step's time is kept for the fallback."""
    cpu = state("cpu", iterations=[{"step": 1, "elapsed_s": 29.0, "strategy": "fused_pointwise"}])
    # 100 - 30 used - 15.3 final timing (1.7 x 9 s) - 14 fallback (10 s + one 4 s compile: the
    # baseline compiled its mode, so it starts from that build)
    assert _seconds_left(cpu) == pytest.approx(40.7, abs=0.5)
    assert _fits_budget(cpu, KERNEL)  # 14 s step
    cpu.iterations = [{"step": 1, "elapsed_s": 29.0 - 20.0}, {"step": 2, "elapsed_s": 29.0}]
    cpu.options.time_budget_s = 70.0
    assert not _fits_budget(cpu, KERNEL), "a 20 s step does not fit in 10.7 s"
    cpu.best = Candidate(id="c1", strategy="fused_pointwise", source_kind="kernel", source="", verdict="pass")
    assert _seconds_left(cpu) == pytest.approx(24.7, abs=0.5), "with an answer, no fallback is kept"


def test_the_fallback_is_the_compile_mode_that_beat_eager_unless_a_step_judged_it():
    s = state()
    step = fallback_step(s)
    assert step is not None and step.strategy == "torch_compile" and "2.00x faster" in step.rationale
    s.stop_reason = "no strategy left to try"
    assert route_after_decide(s) == "fall_back"
    s.baseline.compile_ms = {"default": 1.99}  # within noise of eager: nothing beat it
    s.runner_up = Candidate(
        id="c0", strategy="fused_pointwise", source_kind="kernel", source="", verdict="pass"
    )
    assert fallback_step(s) is None and route_after_decide(s) == "finalize", "a parity answer is there"
    s.runner_up = None
    s.baseline.compile_ms = {"default": 1.5, "max-autotune-no-cudagraphs": 1.2, "reduce-overhead": 0.5}
    assert fallback_step(s).strategy == "torch_compile_max_autotune"  # no candidate of reduce-overhead
    s.iterations = [{"step": 1, "strategy": "torch_compile_max_autotune", "verdict": "fail"}]
    assert fallback_step(s) is None, "a step already failed it"
    s.iterations = [
        {"step": 1, "strategy": "torch_compile_max_autotune", "verdict": "pass", "speedup_eager": 0.97}
    ]
    assert fallback_step(s) is None, "its own timing said it is not faster"
    s.iterations[0]["speedup_eager"] = 1.3  # faster, not significantly: returned, not verified again
    assert fallback_step(s) is not None
    s.best = Candidate(id="c1", strategy="fused_pointwise", source_kind="kernel", source="", verdict="pass")
    assert fallback_step(s) is None


def test_the_fallback_obeys_the_users_guidance():
    """A user who asked for own kernels only, or to skip the compiler, gets no compiler candidate
    as the answer; the report says why the answer is the reference."""
    for message in ("only kernels", "skip torch_compile"):
        s = state(user_messages=[message])
        assert fallback_step(s) is None
        why = answer(s, Report(status="no_significant_gain"))["why"]
        assert why.startswith("torch.compile (default) beat eager in the baseline, but the user asked")
        assert repr(message) in why
    assert fallback_step(state(user_messages=["skip fused_pointwise"])) is not None


def test_with_nothing_faster_than_eager_the_answer_is_the_reference():
    s = state(baseline={"eager_ms": 2.0, "compile_ms": {"default": 2.5}})
    got = answer(s, Report(status="no_significant_gain"))
    assert got["answer"] == "reference"
    assert "nothing measured beat eager: torch.compile (default) ran at 0.80x eager" in got["why"]
    assert got["why"].endswith("the answer is the reference, your module as written")


class GoldenCountingExecutor(LocalExecutor):
    """The local executor, counting the goldens it computes."""

    made = 0

    def __init__(self, settings):
        super().__init__(settings)
        self.kind_profiled: list[bool] = []

    def verify(self, request):
        self.kind_profiled.append(request.profile_kind)
        return super().verify(request)

    def golden(self, request):
        before = len(self._goldens)
        golden = super().golden(request)
        self.made += len(self._goldens) > before
        return golden


def optimize(tmp_path, budget: float, compile_modes: str, messages=(), chat=None, source=CHAIN, **kw):
    """A run of ``source`` on the CPU (the playbook's unless ``chat``): (report.json, report.md, wall
    seconds, executor)."""
    task = tmp_path / "chain.py"
    task.write_text(source)
    settings = Settings(data_dir=tmp_path / "data")
    executor = GoldenCountingExecutor(settings)
    req = OptimizeRequest(
        **{"max_iters": 6, **kw},
        task=task,
        device="cpu",
        quick=True,
        compile_modes=compile_modes,
        backend="playbook",
        time_budget_s=budget,
        out=tmp_path / "out",
        use_kb=False,
        messages=list(messages),
    )
    t0 = time.monotonic()
    run_optimize(req, settings=settings, executor=executor, chat=chat)
    wall = time.monotonic() - t0
    out = tmp_path / "out"
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), wall, executor


def test_a_heavy_run_stays_within_its_budget_and_says_what_the_budget_covered(tmp_path):
    """A task whose torch.compile baseline takes about half the budget on this CPU: the baseline
    overruns its 40 % share, the first step still starts, no step starts that would end past the
    budget, the final timing is cut to what is left, and the run ends within its budget plus 20 %.
    report.json accounts for the baseline's phases, each step and the final timing; the golden is
    computed once. The user rules the compiler out: where torch.compile beat eager on this CPU, its
    candidate would otherwise insure the run first and the step would then have to fit."""
    budget = 120.0
    data, md, wall, executor = optimize(tmp_path, budget, "default", ["no torch.compile"])
    b = data["budget"]
    assert wall <= budget * 1.2 and b["total_s"] <= budget * 1.2 and b["within_tolerance"], b
    assert b["baseline_share"] == 0.4 and b["baseline_budget_s"] == 48.0
    assert {"golden", "benchmark"} <= set(b["baseline_phase_s"]) and b["baseline_s"] > 0
    assert len(b["steps"]) >= 1 and all(step["seconds"] > 0 for step in b["steps"])
    assert b["steps"][0]["strategy"] == "fused_pointwise"
    assert 0 < b["steps"][0]["phase_s"]["timing"] < b["steps"][0]["seconds"], "the timing run, then the rest"
    # and the verification's own phases: the candidate child's, and the judging of its outputs
    verify_phases = {k for k in b["steps"][0]["phase_s"] if k.startswith("verify:")}
    assert {"verify:build", "verify:input_sets", "verify:save", "verify:judge"} <= verify_phases
    assert b["final_timing_s"] > 0 and b["steps_s"] > 0
    assert b["total_s"] >= b["baseline_s"] + b["steps_s"]
    assert data["answer"]["answer"] == "candidate" and data["best"]["kind"] == "kernel"
    # the kind is the timing's (a profile of the timed calls), never profiled twice
    assert executor.kind_profiled and not any(executor.kind_profiled)
    if not b["final_timing"]["compile_modes"]:  # cut: the compile times come from the baseline
        assert b["final_timing"]["compile_ms_from_baseline"] == ["default"]
        assert "timed against eager only" in b["final_timing"]["note"]
    assert data["best"]["speedup_compile"] is not None
    assert executor.made == 1, "one golden per run, reused by every child"
    assert "## Answer and budget" in md and f"Budget {budget:g} s, used" in md


def test_nothing_verified_and_no_compile_faster_means_the_reference_is_the_answer(tmp_path):
    """The user leaves the playbook nothing to try and no torch.compile baseline was timed: the
    run ends without a candidate and says plainly that the answer is the module as written."""
    data, md, _, _ = optimize(tmp_path, 300.0, "none", ["only kernels", "skip fused_pointwise"])
    assert data["best"] is None and data["status"] == "no_verified_candidate"
    assert data["stop_reason"] == "no strategy left to try"
    assert data["answer"]["answer"] == "reference"
    assert "the answer is the reference, your module as written" in md
    assert not (tmp_path / "out" / "best.py").exists()
    # continued with a message, the run keeps the seconds it spent and gets the new request's budget
    spent = data["elapsed_s"]
    again = run_optimize(
        OptimizeRequest(
            task=None, resume=data["run_id"], messages=["stop"], time_budget_s=50.0, use_kb=False
        ),
        settings=Settings(data_dir=tmp_path / "data"),
    )
    assert again.stop_reason == "stopped by the user"
    assert again.model_extra["budget"]["time_budget_s"] == pytest.approx(spent + 50.0)
    assert again.elapsed_s >= spent


def test_the_compiler_candidate_the_baseline_measured_faster_is_verified_and_returned(tmp_path, monkeypatch):
    """The baseline measures torch.compile faster than eager: its candidate is verified, timed and
    kept (kind compiler), first as insurance when it fits the budget like a step (on a loaded CPU
    its compiles may not), else when the run ends without an answer; the planner's model answers
    no valid step, so the compiler's candidate is the answer, with the reason in the report. The
    candidate's first evaluation starts from what the baseline's compile built."""
    import uuid

    from kernelcrew.tools import build

    seeded = []
    real_seed = build.seed_from_reference

    def spy(task_source, candidate_source, root=None):
        seeded.append(real_seed(task_source, candidate_source, root))
        return seeded[-1]

    monkeypatch.setattr(build, "seed_from_reference", spy)
    budget = 400.0
    chat = ReplayChat(["no json here", "still none"])
    source = f"{BIG_CHAIN}\n# {uuid.uuid4().hex}: caches of its own\n"
    data, md, wall, _ = optimize(tmp_path, budget, "default", max_iters=2, chat=chat, source=source)
    assert any(seeded), "the compiler candidate's first evaluation started cold"
    base = data["baseline"]
    assert base["compile_ms"]["default"] < base["eager_ms"], "precondition: the compiler beat eager here"
    records = data["iterations"]
    [record] = [r for r in records if r.get("fallback")]
    assert any(r["stage"] == "plan" and r["verdict"] == "fail" for r in records)
    assert record["fallback"] and record["strategy"] == "torch_compile" and record["verdict"] == "pass"
    # its time is the baseline's of the same compile: no timing run of its own
    assert record["time_ms"] == pytest.approx(base["compile_ms"]["default"])
    assert any("timed in the baseline" in flag for flag in record["flags"])
    best = data["best"]
    assert best["strategy"] == "torch_compile" and best["source_kind"] == "compiler"
    # kernelcrew's own torch.compile of the reference: known to be the compiler's, not profiled
    # (a profile read its C++ loops on a CPU as library time, and cost a GPU run about 20 s)
    assert best["kind"] == "compiler"
    assert (
        data["answer"]["answer"] == "compiler"
        and "faster than eager in the baseline" in data["answer"]["why"]
    )
    assert data["budget"]["fallback_s"] > 0 and wall <= budget * 1.2
    assert {"verify:build", "verify:judge"} <= set(data["budget"]["fallback"]["phase_s"])
    best = (tmp_path / "out" / "best.py").read_text()
    assert "torch.compile(self._reference_forward, mode='default'" in best
    assert "Answer: **compiler**" in md


def test_the_baseline_leaves_out_a_second_compile_mode_its_share_cannot_afford(tmp_path):
    """The baseline node on a 5 s budget (a 2 s share, already spent by the golden and the timing
    run): the optional max-autotune mode is not timed, and the budget says why. The first mode's
    compile may take its share of the budget (``COMPILE_SHARE``)."""
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.profiler import COMPILE_SHARE, OPTIONAL_MODE_MIN_S, profile_baseline
    from tests.conftest import FIXTURES

    settings = Settings(data_dir=tmp_path / "data")
    s = CrewState(
        task_source=(FIXTURES / "tasks" / "pointwise.py").read_text(),
        options=Options(
            device="cpu",
            time_budget_s=5.0,
            quick=True,
            optional_compile_modes=["max-autotune-no-cudagraphs"],
        ),
        started_at=time.time(),
    )
    executor = LocalExecutor(settings)
    asked = []
    timed = executor.benchmark
    executor.benchmark = lambda request: asked.append(request) or timed(request)
    try:
        update = profile_baseline(s, SimpleNamespace(context=CrewContext(executor=executor)))
    finally:
        executor.close()
    assert [r.compile_within_s for r in asked] == [5.0 * COMPILE_SHARE]
    budget = update["budget"]
    assert budget["baseline_budget_s"] == 2.0 and budget["baseline_s"] > 2.0
    why = budget["baseline_skipped"]["compile:max-autotune-no-cudagraphs"]
    assert why.startswith("not timed: its compile and timing run would take about")
    assert "of the baseline's 2 s remain (40% of the 5 s budget)" in why
    # nothing compiled yet to estimate from: the expectation is the mode's measured typical cost
    assert float(why.split("about ")[1].split(" s")[0]) >= OPTIONAL_MODE_MIN_S
    assert update["baseline"].compile_ms == {} and update["baseline"].eager_ms > 0


def test_the_compilers_measured_win_goes_first_and_steps_follow_it():
    from kernelcrew.agents.graph import route_after_baseline, route_after_fall_back

    s = state(started_at=time.time() - 70.0)  # 30 s left: less than step, fallback and final timing
    assert route_after_baseline(s) == "fall_back", "torch.compile beat eager: verified first"
    s.steps_used = 1
    assert route_after_fall_back(s) == "plan", "steps follow the insurance"
    s.options.max_iters = 1
    assert route_after_fall_back(s) == "finalize", "it used the last step"
    s.options.max_iters, s.stop_reason = 6, "time budget reached (90 s)"
    assert route_after_fall_back(s) == "finalize", "the fallback at the end of a run"
    s.baseline.compile_ms = {"default": 1.99}  # within noise of eager: nothing to insure with
    s.stop_reason = ""  # right after the baseline: the run has not ended
    assert route_after_baseline(s) == "plan"


def test_with_room_for_a_step_the_steps_go_first_and_the_compilers_win_ends_the_run(monkeypatch):
    """On an H100 a GEMM task's fallback used the room its own kernel needed (1.65x over compile on
    its siblings). With room for a first step, the fallback and the final timing (30 s used of 100:
    a 10 s step, a 14 s fallback, 15.3 s final), the steps go first with the fallback's time kept,
    and the fallback ends the run unless a step beat the compile beyond noise."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.graph import route_after_baseline

    s = state()
    assert planner.step_before_fallback(s) and route_after_baseline(s) == "plan"
    assert planner.fallback_seconds(s) == pytest.approx(14.0)
    runtime = SimpleNamespace(context=CrewContext(executor=None))
    heavy = PlanStep(strategy="anchored_fusion", rationale="r", expected_gain=2.0, source="playbook")
    monkeypatch.setattr(planner, "_plan_with_playbook", lambda state, prefs: heavy)
    monkeypatch.setattr(planner, "expected_seconds", lambda state, step: 45.0)
    update = planner.plan(s, runtime)
    assert update["plan"] is None and "time budget" in update["stop_reason"], "the fallback's time is kept"
    assert route_after_decide(replace(s, stop_reason=update["stop_reason"])) == "fall_back"

    slower = Candidate(id="c1", strategy="anchored_fusion", source_kind="kernel", source="", verdict="pass")
    slower.time_ms = 1.5  # faster than eager (2 ms), slower than the compile (1 ms)
    assert fallback_step(replace(s, best=slower)) is not None, "the compile is still the faster answer"
    slower.time_ms = 1.01  # within noise of the compile: the step's own kernel stays the answer
    assert fallback_step(replace(s, best=slower)) is None
    cpu = state("cpu")
    cpu.best = replace(slower, time_ms=1.5)
    assert fallback_step(cpu) is None, "on a CPU an answer is ranked by its kind, not its time"


def test_the_fallback_at_the_end_replaces_only_a_slower_answer():
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.decide import fall_back
    from kernelcrew.records import Verdict

    class Passing:
        def verify(self, request):
            return Verdict(
                verdict="pass", stage="done", message="ok", seed=0, device="cuda", precision="strict"
            )

    runtime = SimpleNamespace(context=CrewContext(executor=Passing()))
    step_answer = Candidate(
        id="c1", strategy="anchored_fusion", source_kind="kernel", source="", verdict="pass", time_ms=1.5
    )
    s = state(task_source=CHAIN, stop_reason="no strategy left to try", best=step_answer)
    update = fall_back(s, runtime)
    assert update["best"].id == "fallback" and update["best"].time_ms == pytest.approx(1.0)
    # a torch_compile step verified it and timed it slower than the step's answer: that time stands
    timed = {"step": 1, "strategy": "torch_compile", "verdict": "pass", "time_ms": 1.6, "speedup_eager": 1.25}
    update = fall_back(replace(s, iterations=[timed]), runtime)
    assert "best" not in update and "no faster than the answer c1" in update["budget"]["fallback"]["skipped"]


def _compiled_ahead(tmp_path, source: str, **fields):
    """The benchmark of a pointwise task's reference in mode ``default``, its compile made ahead
    (the overlap a GPU has by default) on this CPU."""
    from kernelcrew.records import BenchmarkRequest

    executor = LocalExecutor(Settings(data_dir=tmp_path / "data"))
    assert executor.overlap_compile is None  # auto: on a GPU only
    executor.overlap_compile = True
    request = BenchmarkRequest(
        task_source=source,
        task_path="pointwise.py",
        device="cpu",
        precision="strict",
        seed=3,
        candidates={},
        compile_modes=["default"],
        quick=True,
        **fields,
    )
    try:
        return executor.benchmark(request)
    finally:
        executor.close()


def test_the_reference_compiles_while_the_golden_is_made_and_its_timing_run_loads_that_build(
    tmp_path, monkeypatch
):
    """With the overlap on (a GPU's default), a child compiles the reference into the reference's
    build cache while the golden child works; the timing run then starts from that build."""
    import uuid

    from kernelcrew.tools import timing
    from kernelcrew.tools.build import reference_cache_dirs
    from tests.conftest import FIXTURES

    source = (FIXTURES / "tasks" / "pointwise.py").read_text() + f"\n# {uuid.uuid4().hex}\n"
    root = reference_cache_dirs(source)["root"]
    found_at_start = []
    real_benchmark = timing.benchmark

    def benchmark(*args, **kwargs):
        found_at_start.extend(p for p in root.rglob("*") if p.is_file())
        return real_benchmark(*args, **kwargs)

    monkeypatch.setattr(timing, "benchmark", benchmark)
    result = _compiled_ahead(tmp_path, source)
    assert result.failure is None and result.compile_s["default"] > 0
    assert result.phase_s["compile_ahead"] >= 0 and "golden" in result.phase_s
    assert found_at_start, "the timing run started with no build in the reference's cache"


def test_a_compile_past_its_limit_is_stopped_and_not_timed(tmp_path):
    """A reference whose compile ahead outlasts the run's limit for it (DenseNet201's took 105 s
    of a 90 s budget on an H100) is not compiled again by the timing run: the mode is left out and
    the result says why, and eager is still timed."""
    import uuid

    from tests.conftest import FIXTURES

    source = (FIXTURES / "tasks" / "pointwise.py").read_text() + f"\n# {uuid.uuid4().hex}\n"
    result = _compiled_ahead(tmp_path, source, compile_within_s=0.01)  # no child starts that fast
    assert result.failure is None and "eager" in result.results
    assert "compile:default" not in result.results and "default" not in result.compile_s
    assert "not compiled within 0 s" in result.compile_errors["default"]


def test_a_build_made_ahead_keeps_its_kernels_and_forgets_its_tuning(tmp_path):
    """Autotuning choices timed while the golden shared the device are removed; kernels stay."""
    from kernelcrew.tools.harness import forget_tuning

    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "kernel.py").write_text("kernel")
    (tmp_path / "ab" / "kernel.best_config").write_text('{"XBLOCK": 1024}')
    assert forget_tuning(tmp_path) == 1
    assert [p.name for p in (tmp_path / "ab").iterdir()] == ["kernel.py"]


class _NcuExecutor:
    """Answers a profile request with a made-up Nsight Compute summary; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list = []

    def profile(self, request):
        from kernelcrew.records import ProfileResult

        self.asked.append(request)
        return ProfileResult(ncu={"available": True, "kernels": [{"name": "k", "duration_us": 4.0}]})


def test_a_playbook_run_profiles_its_answer_once_at_the_end_when_the_budget_affords_it():
    """The playbook never reads Nsight Compute's counters: no profile per candidate, one of the
    answer for the report, only when it fits before the final timing; a model that plans gets
    every verified candidate's."""
    from dataclasses import replace

    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.decide import profile_answer
    from kernelcrew.agents.profiler import profiles_each_candidate

    s = state("cuda")
    s.baseline.ncu = {"available": True}
    s.best = Candidate(
        id="c1", strategy="fused_pointwise", source_kind="kernel", source="src", verdict="pass"
    )
    executor = _NcuExecutor()
    ctx = CrewContext(executor=executor)
    assert not profiles_each_candidate(s, ctx)
    assert profiles_each_candidate(s, CrewContext(executor=executor, chat=ReplayChat([])))
    s.started_at = time.time() - 10.0
    profiled, note = profile_answer(s, ctx)
    assert (
        profiled.ncu["available"] and "ncu" in profiled.phase_s and note == {"ncu_s": profiled.phase_s["ncu"]}
    )
    assert [r.candidate_source for r in executor.asked] == ["src"]
    assert profile_answer(replace(s, best=profiled), ctx) == (profiled, {})  # once
    s.started_at = time.time() - s.options.time_budget_s + 5.0  # 5 s left: not before the final timing
    kept, note = profile_answer(s, ctx)
    assert (
        kept is s.best and "Nsight Compute of the answer not run" in note["ncu"] and len(executor.asked) == 1
    )


def test_after_the_fallback_a_step_must_fit_unless_the_run_has_no_answer(monkeypatch):
    """The compiler's fallback runs first as insurance, whatever the budget. With its answer in
    hand a step starts only if it fits (on an H100 a heavy task ran its first step past the budget,
    then had no room left for the fallback and ended with nothing); a run whose fallback gave no
    answer still gets one step of its own."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.context import CrewContext

    kernel = PlanStep(strategy="fused_pointwise", rationale="r", expected_gain=2.0, source="playbook")
    monkeypatch.setattr(planner, "_plan_with_playbook", lambda state, prefs: kernel)
    s = state("cpu", kb_hits=[], started_at=time.time() - 95.0)  # 5 s of 100 left: nothing fits
    s.iterations = [{"step": 1, "strategy": "torch_compile", "fallback": True, "elapsed_s": 60.0}]
    s.steps_used = 1
    runtime = SimpleNamespace(context=CrewContext(executor=None))
    assert not planner._fits_budget(s, kernel)
    fallback = Candidate(
        id="fallback", strategy="torch_compile", source_kind="compiler", source="", verdict="pass"
    )
    answered = replace(s, best=fallback)
    assert planner.plan(answered, runtime)["plan"] is None, "the fallback's answer: keep to the budget"
    assert planner.plan(s, runtime)["plan"] == kernel, "no answer yet: the first step starts"
    s.iterations.append({"step": 2, "strategy": "fused_pointwise", "elapsed_s": 90.0})
    s.steps_used = 2
    assert planner.plan(s, runtime)["plan"] is None, "a second step starts only if it fits"


def test_the_insurance_fallback_runs_however_much_of_the_budget_the_baseline_used():
    """Right after a baseline that used 95 s of 100, the compiler's candidate is still verified
    (it is the answer the run can be sure of); at the end of a run it must fit the tolerance."""
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.decide import fall_back
    from kernelcrew.records import Verdict

    class Passing:
        asked = 0

        def verify(self, request):
            self.asked += 1
            assert not request.profile_kind and not request.mode_checks
            return Verdict(
                verdict="pass", stage="done", message="ok", seed=0, device="cuda", precision="strict"
            )

    executor = Passing()
    runtime = SimpleNamespace(context=CrewContext(executor=executor))
    s = state(task_source=CHAIN, started_at=time.time() - 95.0)
    update = fall_back(s, runtime)
    assert executor.asked == 1 and update["best"].kind == "compiler"
    assert update["best"].time_ms == pytest.approx(1.0), "timed by the baseline's compile"
    late = state(task_source=CHAIN, started_at=time.time() - 95.0, stop_reason="time budget reached (100 s)")
    late.baseline.compile_s = {"default": 30.0}
    update = fall_back(late, runtime)
    assert (
        executor.asked == 1 and "not verified: it would take about" in update["budget"]["fallback"]["skipped"]
    )


def test_a_run_that_verified_nothing_ends_with_the_compile_it_measured_at_parity():
    """On an H100 three level-1 tasks (a conv3d, a grouped transposed conv3d, a tall-skinny matmul)
    ended with no answer although the baseline timed torch.compile within noise of eager (it calls
    the same library). At the end of a GPU run with nothing verified, that compile is verified and
    returned as a parity answer; it is never planned or reserved ahead of the steps."""
    parity = {"eager_ms": 2.0, "compile_ms": {"default": 2.01}, "compile_s": {"default": 4.0}}
    parity["phase_s"] = {"golden": 5.0, "benchmark": 9.0}
    s = state(baseline=parity)
    assert fallback_step(s) is None, "while the run plans, the steps keep the whole budget"
    from kernelcrew.agents import planner

    assert planner.fallback_seconds(s) == 0.0
    ended = replace(s, stop_reason="no strategy left to try")
    step = fallback_step(ended)
    assert step is not None and step.strategy == "torch_compile" and "parity" in step.rationale
    assert route_after_decide(ended) == "fall_back"
    runner_up = Candidate(
        id="c1", strategy="fused_pointwise", source_kind="kernel", source="", verdict="pass"
    )
    assert fallback_step(replace(ended, runner_up=runner_up)) is None, "the run has a parity answer"
    slower = {**parity, "compile_ms": {"default": 2.2}}
    assert fallback_step(replace(ended, baseline=slower)) is None, "significantly slower: no answer"
    assert fallback_step(replace(ended, options=Options(device="cpu", time_budget_s=100.0))) is None


def test_the_parity_fallback_is_kept_as_the_runner_up_and_answers_as_the_compiler():
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.decide import fall_back
    from kernelcrew.records import Verdict

    class Passing:
        def verify(self, request):
            return Verdict(
                verdict="pass", stage="done", message="ok", seed=0, device="cuda", precision="strict"
            )

    parity = {"eager_ms": 2.0, "compile_ms": {"default": 2.01}, "compile_s": {"default": 4.0}}
    parity["phase_s"] = {"golden": 5.0, "benchmark": 9.0}
    s = state(task_source=CHAIN, baseline=parity, stop_reason="no strategy left to try")
    runtime = SimpleNamespace(context=CrewContext(executor=Passing()))
    update = fall_back(s, runtime)
    assert "best" not in update, "not faster than eager: never the best"
    assert update["runner_up"].id == "fallback" and update["runner_up"].time_ms == pytest.approx(2.01)
    assert not update["runner_up"].significant
    done = replace(s, best=update["runner_up"], budget=update["budget"])
    report = Report(run_id="r", status="no_significant_gain", task="t", device="cuda")
    report.best = SimpleNamespace(id="fallback", strategy="torch_compile", kind="compiler")
    said = answer(done, report)
    assert said["answer"] == "compiler" and "parity" in said["why"]
    # a compile that beat eager, at the end of a run with no answer: the best, as before
    faster = fall_back(state(task_source=CHAIN, stop_reason="no strategy left to try"), runtime)
    assert faster["best"].id == "fallback" and "runner_up" not in faster
    assert "diagnosis" in faster and "kept_at_parity" not in faster["budget"]["fallback"]


def _fallback_answer(s: CrewState) -> Candidate:
    """The compiler's candidate as ``fall_back`` keeps it: verified, with the baseline's times."""
    from kernelcrew.agents.decide import timed_by_baseline

    cand = Candidate(
        id="fallback", strategy="torch_compile", source_kind="compiler", source="", verdict="pass"
    )
    return timed_by_baseline(s, cand, "default")


def test_the_compilers_answer_takes_the_baselines_paired_interval():
    s = state()
    assert _fallback_answer(s).speedup_eager == pytest.approx(2.0), "no ratio kept: eager / compile"
    s.baseline.compile_ratios = {
        "default": {"median": 1.9, "ci_low": 1.85, "ci_high": 1.95, "significant": True}
    }
    answer_ = _fallback_answer(s)
    assert answer_.speedup_eager == 1.9 and answer_.speedup_eager_ci == [1.85, 1.95] and answer_.significant
    s.baseline.compile_ratios["default"].update(median=1.01, ci_low=0.99, significant=False)
    assert not _fallback_answer(s).significant, "an interval that reaches 1 is not significant"


def test_an_answer_already_timed_is_not_timed_again():
    """The baseline timed the compiler's answer against eager in one process, interleaved: a final
    timing run would time the same pair again (10-31 s of the H100 sample's runs that ended with
    it). A step's answer is timed again while the budget lasts; past it, its own timing stands."""
    from kernelcrew.agents.decide import already_timed

    s = state()
    s.baseline.compile_ratios = {
        "default": {"median": 1.9, "ci_low": 1.85, "ci_high": 1.95, "significant": True}
    }
    s.best = _fallback_answer(s)
    final, why = already_timed(s, 40.0)
    assert "baseline's own torch.compile" in why
    assert (final.best_ms, final.eager_ms, final.speedup_eager, final.speedup_eager_ci) == (
        1.0,
        2.0,
        1.9,
        [1.85, 1.95],
    )
    assert final.significant and final.speedup_compile == pytest.approx(1.0)
    s.best = Candidate(
        id="c1",
        strategy="fused_pointwise",
        source_kind="kernel",
        source="",
        verdict="pass",
        time_ms=0.8,
        speedup_eager=2.4,
        speedup_eager_ci=[2.3, 2.5],
        significant=True,
    )
    assert already_timed(s, 40.0) == (None, ""), "time left: the final timing times it again"
    final, why = already_timed(s, -3.0)
    assert "had used its 100 s budget" in why
    assert (
        final.best_ms == 0.8 and final.speedup_eager == 2.4 and final.speedup_compile == pytest.approx(1.25)
    )
    s.best.time_ms = None
    assert already_timed(s, -3.0) == (None, ""), "nothing measured: timed as usual"


def test_a_heavy_tasks_first_step_may_use_the_tolerance_once_the_compilers_answer_is_in_hand():
    """On the H100 nine of thirty level-2 tasks ended with the compiler's answer and not one step
    of their own: the baseline and the fallback it went first for left 0-9 s of 90, and a step was
    expected to take 23-42 s. With the compiler's answer verified (and needing no final timing), the
    first step may count on the tolerance and the final timing's share; the steps after it may not."""
    from kernelcrew.agents import planner

    s = state(started_at=time.time() - 70.0)  # 70 s of 100 used: 100 - 70 - 15.3 final share left
    s.iterations = [{"step": 1, "strategy": "torch_compile", "fallback": True, "elapsed_s": 40.0}]
    s.steps_used = 1
    assert planner._seconds_left(s) == pytest.approx(14.7, abs=0.5)
    step = KERNEL  # the fallback's 25 s after the baseline's 15 s, and a 5 s timing run it did not need
    assert planner.expected_seconds(s, step) == pytest.approx(30.0)
    assert planner.first_step_allowance(s) == 0.0 and not planner._fits_budget(s, step), "no answer yet"
    s.best = _fallback_answer(s)
    assert planner.first_step_allowance(s) == pytest.approx(20.0 + 15.3)
    assert planner._fits_budget(s, step)
    assert "35 s more for a first step" in planner._budget_reason(s, step)
    assert not planner._fits_budget(replace(s, started_at=s.started_at - 21.0), step), "past the tolerance"
    stepped = replace(s, iterations=[*s.iterations, {"step": 2, "strategy": "rows", "elapsed_s": 60.0}])
    assert planner.first_step_allowance(stepped) == 0.0, "only the first step"
    kernel_answer = Candidate(id="c1", strategy="rows", source_kind="kernel", source="", verdict="pass")
    assert planner.first_step_allowance(replace(s, best=kernel_answer)) == 0.0, "an answer that needs timing"


def test_a_reference_at_speed_of_light_gets_no_step_and_ends_with_the_compile_at_parity(monkeypatch):
    """On the H100 the pointwise tasks of level 1 run eagerly at 100 % of speed of light; a step of
    their size took a minute for a kernel at 1.00x and ended the run far past its budget. A GPU
    run whose reference is at 95 % of speed of light or more plans nothing and ends with the
    compile the baseline timed at parity (or faster); a floor the reference beats by more than 10 %
    is wrong and stops nothing, as on a CPU, with an answer, or when the user asked for more."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.context import CrewContext

    kernel = PlanStep(strategy="fused_pointwise", rationale="r", expected_gain=2.0, source="playbook")
    monkeypatch.setattr(planner, "_plan_with_playbook", lambda state, prefs: kernel)
    runtime = SimpleNamespace(context=CrewContext(executor=None))
    at_sol = {"eager_ms": 4.27, "compile_ms": {"default": 4.26}, "compile_s": {"default": 4.0}}
    at_sol.update(clock="cuda-event", phase_s={"golden": 40.0, "benchmark": 12.0})
    at_sol["sol_fraction"] = {"eager": 0.995, "compile:default": 0.998}
    s = state(baseline=at_sol, kb_hits=[])
    update = planner.plan(s, runtime)
    assert update["plan"] is None
    assert "torch.compile (default)) already runs at 100% of speed of light" in update["stop_reason"]
    ended = replace(s, stop_reason=update["stop_reason"])
    assert route_after_decide(ended) == "fall_back" and "parity" in fallback_step(ended).rationale

    assert (
        planner.plan(replace(s, baseline={**at_sol, "sol_fraction": {"eager": 0.9}}), runtime)["plan"]
        == kernel
    )
    wrong_floor = {**at_sol, "sol_fraction": {"eager": 1.4}}
    assert planner.plan(replace(s, baseline=wrong_floor), runtime)["plan"] == kernel
    assert (
        planner.plan(replace(s, options=Options(device="cpu", time_budget_s=100.0)), runtime)["plan"]
        == kernel
    )
    best = Candidate(id="c1", strategy="fused_pointwise", source_kind="kernel", source="", verdict="pass")
    assert (
        planner.reference_at_sol(replace(s, best=best))
        and planner.plan(replace(s, best=best), runtime)["plan"]
    )
    more = replace(s, user_messages=["more steps"])
    assert planner.plan(more, runtime)["plan"] == kernel


def test_a_steps_children_stop_where_the_budget_ends_and_the_golden_is_made_whole():
    from kernelcrew.records import VerifyRequest
    from tests.conftest import FIXTURES

    executor = LocalExecutor(Settings(sandbox_timeout_s=120))
    request = dict(
        task_source=(FIXTURES / "tasks" / "softmax.py").read_text(),
        device="cpu",
        precision="strict",
        seed=5,
        candidate_source=(FIXTURES / "candidates" / "hangs.py").read_text(),
    )
    try:
        t0 = time.monotonic()
        # less time than the golden takes: the golden is made anyway, the candidate's child is cut
        verdict = executor.verify(VerifyRequest(**request, within_s=0.5))
        assert verdict.verdict == "fail" and verdict.stage == "timeout", verdict
        assert "the time its caller had left" in verdict.message
        assert len(executor._goldens) == 1
        assert time.monotonic() - t0 < 60  # not the sandbox's 120 s
    finally:
        executor.close()


def test_a_step_may_run_to_the_tolerance_and_an_unanswered_runs_first_to_twice_the_budget():
    from kernelcrew.agents.planner import FIRST_STEP_CAP, GRACE, step_end
    from kernelcrew.agents.state import step_within_s

    step = PlanStep(strategy="row_reduction", rationale="r", expected_gain=1.5)
    now = time.time()
    state = CrewState(
        task_source="x", options=Options(device="cuda", time_budget_s=100.0), started_at=now - 40
    )
    assert step_end(state) == pytest.approx(now - 40 + 100 * FIRST_STEP_CAP)
    later = replace(state, iterations=[{"step": 1, "verdict": "fail"}])
    assert step_end(later) == pytest.approx(now - 40 + 100 * (1 + GRACE))
    running = replace(later, plan=step, step_ends_at=step_end(later))
    assert step_within_s(running) == pytest.approx(100 * (1 + GRACE) - 40, abs=1)
    assert step_within_s(replace(running, plan=None)) is None  # no step under way
    spent = replace(running, step_ends_at=now - 5)
    assert step_within_s(spent) == 1.0  # at least a second: the step fails at once, with its reason
