"""The records of kernelcrew.records: each round-trips through JSON, stored rows of older versions read."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import BaseModel, ValidationError

from kernelcrew.records import (
    Baseline,
    BenchmarkRequest,
    BenchmarkResult,
    FinalTiming,
    Hotspot,
    JobResult,
    ProfileRequest,
    ProfileResult,
    ReferenceProfile,
    Report,
    ReportBaseline,
    ReportBest,
    SpeedupRatio,
    TimingFailure,
    TimingStats,
    Verdict,
    VerifyOutcome,
    VerifyRequest,
)

COMMON = {
    "task_source": "class Model: ...\n",
    "task_path": "t.py",
    "device": "cpu",
    "precision": "strict",
    "seed": 7,
}
STATS = {
    "median_ms": 1.5, "mean_ms": 1.6, "p10_ms": 1.4, "p90_ms": 1.9, "iqr_ms": 0.2, "spread_pct": None,
    "reps": 40, "wall_median_ms": 1.7, "host_median_ms": 0.1, "graph_median_ms": None, "warmup_calls": 3,
    "samples": 2, "lead_us": 0.0, "lead_short_reps": 0,
}  # fmt: skip
RATIO = {
    "median": 1.3, "ci_low": 1.1, "ci_high": 1.4, "ci_coverage": 0.96, "significant": True,
    "wall_median": 1.2, "graph_median": None,
}  # fmt: skip
HOT = Hotspot(name="aten::softmax", calls=1, time_us=12.5, share=1.0)
VERDICT = Verdict(
    verdict="fail",
    stage="correctness",
    message="input set 0: wrong",
    seed=7,
    device="cpu",
    precision="strict",
    kind="kernel",
    max_rel_error=math.inf,  # an output with Inf where the golden has none
    flags=["verified at one shape"],
    checks=[{"name": "static", "passed": True, "detail": "no rule broken"}],
    failures=[{"stage": "correctness", "message": "wrong", "max_abs_error": math.inf}],
)
BENCH = BenchmarkResult.model_validate(
    {
        "clock": "cpu-wall",
        "device": "cpu",
        "baseline": "eager",
        "results": {"eager": STATS, "c1": STATS, "compile:default": {**STATS, "median_ms": 1.0}},
        "ratios": {"c1": RATIO},
        "ci_method": "order-statistic",
        "graph": {"used": False, "reason": "CPU: no CUDA graphs"},
        "config": {"min_reps": 10},
        "l2_flush_bytes": 0,
        "input_sets": 3,
        "rounds": 40,
        "stop_reason": "stable",
        "elapsed_s": 0.5,
        "profile": {
            "device": "cpu",
            "clock": "cpu aten ops",
            "total_us": 12.5,
            "hotspots": [HOT.model_dump()],
        },
        "compile_s": {"default": 3.2},
        "compile_errors": {},
        "builds": {"c1": {"kind": {}}},
        "hardware": {"device": "cpu", "name": "x86"},
        "versions": {"torch": "2"},
        "seed": 7,
    }
)
BASELINE = Baseline(
    clock="cpu-wall",
    eager_ms=1.5,
    compile_ms={"default": 1.0},
    hotspots=[HOT],
    floor={"floor_ms": 0.01, "bound": "memory"},
    ncu={"available": False, "reason": "not asked for (CPU run)"},
    phase_s={"benchmark": 2.0},
    sol_fraction={"eager": None},
)
REPORT = Report(
    run_id="r1",
    status="verified_cpu_only",
    stop_reason="iteration budget reached (1)",
    task="t.py",
    device="cpu",
    precision="strict",
    backend="playbook",
    seed=7,
    baseline=ReportBaseline(eager_ms=1.5, compile_ms={"default": 1.0}, hotspots=[HOT]),
    best=ReportBest(
        id="c1",
        strategy="fused_rows",
        kind="kernel",
        source_kind="kernel",
        **FinalTiming(clock="cpu-wall", eager_ms=1.5, best_ms=1.2, speedup_eager_ci=[1.1, None]).model_dump(),
        packaging={"custom_op": None, "why": "a compiler candidate"},
    ),
    iterations=[{"step": 1, "strategy": "fused_rows", "verdict": "pass"}],
)

RECORDS: list[BaseModel] = [
    VerifyRequest(**COMMON, candidate_source="class ModelNew: ...\n"),
    BenchmarkRequest(**COMMON, candidates={"c1": "src"}, compile_modes=["default"], hotspots=True),
    ProfileRequest(**COMMON, ncu=True, work={"bytes": 8, "flops": 2}),
    VERDICT,
    TimingStats.model_validate(STATS),
    SpeedupRatio.model_validate(RATIO),
    TimingFailure(stage="timed_output", message="c1: wrong"),
    HOT,
    ReferenceProfile(device="cpu", clock="cpu aten ops", total_us=12.5, hotspots=[HOT]),
    BENCH,
    BenchmarkResult(failure=TimingFailure(stage="crash", message="timing run failed"), seed=3),
    ProfileResult(
        hotspots=[HOT], hardware={"device": "cpu"}, peaks={"basis": "none"}, phase_s={"golden": 0.1}
    ),
    BASELINE,
    FinalTiming(clock="cpu-wall", best_ms=1.2, failure=TimingFailure(stage="timeout", message="slow")),
    REPORT,
    VerifyOutcome(verify=VERDICT, verdict="pass", timing=BENCH, speedup=1.3),
    JobResult(report=REPORT, best_source="class ModelNew: ...\n", report_md="# report\n"),
    JobResult(report=VerifyOutcome(verify=VERDICT, verdict="fail")),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_json(record):
    """What the Celery executor sends through Redis and the service stores comes back equal."""
    wire = json.loads(json.dumps(record.model_dump(mode="json")))
    again = type(record).model_validate(wire)
    assert again == record
    assert again.model_dump(mode="json") == record.model_dump(mode="json")


def test_a_benchmark_result_dumps_only_the_parts_it_has():
    """A failed run is its failure and seed, as the timing function always returned it."""
    failed = BenchmarkResult(failure=TimingFailure(stage="crash", message="boom"), seed=3)
    assert failed.model_dump(mode="json") == {"seed": 3, "failure": {"stage": "crash", "message": "boom"}}
    dumped = BENCH.model_dump(mode="json")
    assert "profile" in dumped and "failure" not in dumped and "phase_s" not in dumped
    timed = BENCH.model_copy()
    timed.phase_s = {"benchmark": 1.0}
    assert timed.model_dump(mode="json")["phase_s"] == {"benchmark": 1.0}
    assert BENCH.compile_medians() == {"default": 1.0}
    assert BENCH.median_ms("c1") == 1.5 and BENCH.median_ms("absent") is None


def test_requests_are_checked_where_they_are_made():
    with pytest.raises(ValidationError, match="device"):
        VerifyRequest(**{**COMMON, "device": "cuda:1"}, candidate_source="x")
    with pytest.raises(ValidationError, match="seed"):
        ProfileRequest(**{**COMMON, "seed": True})
    with pytest.raises(ValidationError, match="candidates"):
        BenchmarkRequest(**COMMON, candidates=["x"])
    with pytest.raises(ValidationError, match="extra"):
        ProfileRequest(**COMMON, ncu_typo=True)


def test_an_old_stored_job_result_reads_without_its_magic_keys():
    """Rows stored with the report flat and the files under ``_best_py``/``_report_md``."""
    old = {**REPORT.model_dump(mode="json"), "_best_py": "best source", "_report_md": "# md"}
    outcome = JobResult.model_validate(old)
    assert outcome.best_source == "best source" and outcome.report_md == "# md"
    assert outcome.report == REPORT
    old_verify = VerifyOutcome(verify=VERDICT, verdict="fail", timing=None).model_dump(mode="json")
    assert isinstance(JobResult.model_validate(old_verify).report, VerifyOutcome)
    assert JobResult.model_validate(old_verify).best_source is None


def test_stored_records_keep_fields_they_do_not_know():
    """A report or baseline written by another version loses nothing when read and stored again."""
    report = Report.model_validate({**REPORT.model_dump(mode="json"), "future": {"x": 1}})
    assert report.model_dump(mode="json")["future"] == {"x": 1}
    assert Baseline.model_validate({"eager_ms": 2.0, "later": True}).model_dump()["later"] is True


def test_a_checkpointed_state_with_dict_records_still_reads():
    """CrewState from a checkpoint written when the baseline and report were dicts."""
    from kernelcrew.agents.state import CrewState

    state = CrewState(task_source="x", baseline=BASELINE.model_dump(mode="json"), report={})
    assert state.baseline == BASELINE and state.report is None
    assert CrewState(task_source="x", report=REPORT.model_dump(mode="json")).report == REPORT
