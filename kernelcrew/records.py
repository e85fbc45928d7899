"""The typed records that cross kernelcrew's seams: executor requests and results, the baseline, the
report and a job's stored result.

Every record is a pydantic model that round-trips through JSON (``model_dump(mode="json")`` and
``model_validate``), because the Celery executor sends requests and results through Redis and the
service stores reports in the database. Records the code produces and consumes at once (requests,
results, verdicts) forbid unknown fields, so a malformed message fails at the seam with the field
that is wrong; records that are stored (the baseline in a checkpoint, the report, a job's result)
keep unknown fields, so a row written by another version still reads and nothing stored is lost.

Nested parts that another module defines and reads as a whole (hardware, device peaks, the floor,
the work, Nsight Compute's summary, the graph analysis) stay ``dict[str, Any]`` here.

This module imports only pydantic and the standard library, so every package may use it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
    model_validator,
)

Json = dict[str, Any]


class Record(BaseModel):
    """A record made and read by kernelcrew itself: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class StoredRecord(BaseModel):
    """A record that is stored: unknown fields are kept, so older and newer rows still read."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")


# ------------------------------------------------------------------------------------------------
# Executor requests
# ------------------------------------------------------------------------------------------------


class ExecutorRequest(Record):
    """What every executor operation needs: the task and the job's device, precision and seed."""

    task_source: str = Field(description="The task file's text (KernelBench format).")
    task_path: str = Field("task.py", description="The task's file name, for messages and tracebacks.")
    device: Literal["cuda", "cpu"] = Field(description="Where the operation runs.")
    precision: str = Field(description="The precision policy: strict or relaxed.")
    seed: int = Field(strict=True, description="The job's secret seed: one golden per seed.")
    within_s: float | None = Field(
        None,
        gt=0,
        description="Seconds the operation may take (what the run's time budget leaves a step): its "
        "children are stopped past them. The golden, made once for every later call, is not. None: "
        "the sandbox's own limits.",
    )


class VerifyRequest(ExecutorRequest):
    """Verify one candidate against the task (the verification protocol)."""

    candidate_source: str = Field(description="The candidate's source (defines ModelNew).")
    candidate_path: str = Field("candidate.py", description="The candidate's file name.")
    profile_kind: bool = Field(
        True,
        description="Profile whose kernels did the work (the verdict's kind); off where a timing "
        "follows that profiles the timed calls anyway.",
    )
    mode_checks: bool = Field(
        True,
        description="Also call the candidate with autograd on and in inference mode. Off only for "
        "kernelcrew's own torch.compile of the reference (the compiler fallback): recompiling a "
        "large network for both modes was most of its verification.",
    )


class BenchmarkRequest(ExecutorRequest):
    """Time eager, the torch.compile baselines and the candidates together."""

    candidates: dict[str, str] = Field(description="Candidates to time, {name: source}.")
    compile_modes: list[str] = Field(default_factory=list, description="torch.compile modes to time.")
    quick: bool = Field(False, description="The quick timing configuration (fewer reps).")
    hotspots: bool = Field(False, description="Also rank the reference's kernels (result's profile).")
    compile_within_s: float | None = Field(
        None,
        gt=0,
        description="Seconds the reference's default-mode torch.compile may take where it is compiled "
        "ahead, alongside the golden (on a GPU): a compile still running then is stopped and the mode "
        "is not timed (its compile_errors entry says why). None: no limit.",
    )


class ProfileRequest(ExecutorRequest):
    """Hotspots, peaks, floor and (optionally) Nsight Compute of the reference or a candidate."""

    candidate_source: str | None = Field(None, description="A candidate to profile instead of the reference.")
    candidate_path: str = Field("candidate.py", description="The candidate's file name.")
    ncu: bool = Field(False, description="Run Nsight Compute.")
    hotspots: bool = Field(True, description="Rank the reference's kernels (without a candidate).")
    work: Json | None = Field(None, description="The reference's work, when already measured.")
    kernel_filter: str = Field("", description="Nsight Compute's kernel name filter.")


# ------------------------------------------------------------------------------------------------
# Executor results
# ------------------------------------------------------------------------------------------------


class Verdict(Record):
    """Everything the verification protocol found about one candidate."""

    verdict: str = Field(description="pass or fail.")
    stage: str = Field(description="The stage that decided (done when passed).")
    message: str = Field(description="One line for the user.")
    seed: int = Field(description="The seed of the inputs it was judged on.")
    device: str = Field(description="Where it ran.")
    precision: str = Field(description="The precision policy it was judged under.")
    kind: str | None = Field(
        None, description="kernel, hybrid, library or compiler: whose kernels took the time."
    )
    kind_evidence: Json = Field(default_factory=dict, description="The profile that decided the kind.")
    max_rel_error: float | None = Field(None, description="The worst relative error over the outputs.")
    flags: list[str] = Field(default_factory=list, description="Caveats of the verdict.")
    checks: list[Json] = Field(default_factory=list, description="Each check: name, passed, detail.")
    failures: list[Json] = Field(default_factory=list, description="Structured failures, in call order.")
    input_sets: list[Json] = Field(default_factory=list, description="The input sets judged.")
    isolation: Json = Field(default_factory=dict, description="How the children were isolated.")
    golden_mode: str = Field("", description="The dtype the golden outputs were computed in.")
    phase_s: dict[str, float] = Field(
        default_factory=dict,
        description="Where the verification's time went, seconds: the candidate child's phases, "
        "its start and end (child_other), copying its outputs out of its box (copy_out), and the "
        "judging of its outputs (judge).",
    )

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def verify_phases(self) -> dict[str, float]:
        """``phase_s`` as a step's or a command's account lists it: ``verify:build``, ``verify:judge``..."""
        return {f"verify:{k}": v for k, v in self.phase_s.items()}


class TimingStats(Record):
    """One callable's timings in a benchmark (milliseconds per call)."""

    median_ms: float = Field(description="Median of the event-timed (GPU) or wall-timed (CPU) reps.")
    mean_ms: float = Field(description="Mean of the same reps.")
    p10_ms: float = Field(description="10th percentile.")
    p90_ms: float = Field(description="90th percentile.")
    iqr_ms: float = Field(description="Interquartile range.")
    spread_pct: float | None = Field(description="(p90 - p10) / median, in percent.")
    reps: int = Field(description="Timed rounds.")
    wall_median_ms: float = Field(description="Median wall time of a call on an idle device.")
    host_median_ms: float = Field(description="Median time a call took to return on the host.")
    graph_median_ms: float | None = Field(description="Median per CUDA graph replay, when graphs ran.")
    warmup_calls: int = Field(description="Calls before timing.")
    samples: int = Field(description="Outputs sampled for checking.")
    lead_us: float = Field(description="Median lead before the timed call (GPU).")
    lead_short_reps: int = Field(description="Reps whose launches outlasted their lead.")
    off_stream_ms: float | None = Field(
        None,
        description="Median device time after the call's end event (work left on another stream or "
        "deferred); when set, the times are device-wide spans.",
    )


class SpeedupRatio(Record):
    """A candidate's paired speedup over the baseline callable (baseline / candidate per round)."""

    median: float = Field(description="Median per-round ratio.")
    ci_low: float = Field(description="Lower bound of the 95% interval of the median.")
    ci_high: float = Field(description="Upper bound of that interval.")
    ci_coverage: float = Field(description="The interval's exact coverage.")
    significant: bool = Field(description="Lower bound above 1 at 95% coverage.")
    wall_median: float = Field(description="Median ratio of the wall-clock times.")
    graph_median: float | None = Field(description="Median ratio of the CUDA graph replays.")


class TimingFailure(Record):
    """Why a timing run gave no numbers, or a timed output was wrong."""

    stage: str = Field(description="timing, timeout, crash, timed_output, or the child's stage.")
    message: str = Field(description="One line for the user.")


class Hotspot(Record):
    """One of the reference's kernels (GPU) or aten ops (CPU), by time per call."""

    name: str = Field(description="Kernel or op name.")
    calls: int = Field(description="Launches per forward.")
    time_us: float = Field(description="Self time per forward, microseconds.")
    share: float = Field(description="Fraction of the total: the most replacing it alone saves.")


class ReferenceProfile(Record):
    """The reference's kernels ranked by time and its work (torch.profiler)."""

    device: str = Field(description="Where it was profiled.")
    clock: str = Field(description="What the times are: device kernels or CPU aten ops.")
    total_us: float = Field(description="Total self time per forward, microseconds.")
    hotspots: list[Hotspot] = Field(default_factory=list, description="The top entries, by time.")
    work: Json | None = Field(None, description="Compulsory bytes and flops (for the floor).")


class BenchmarkResult(Record):
    """A benchmark run: eager and torch.compile in one process, the candidates in another, interleaved.

    A run that failed carries only ``failure`` and ``seed``. Its JSON has the parts it was given or
    assigned, as the timing child produced them: no ``profile`` without hotspots, no ``failure``
    when it passed (assign a field to change it; an in-place edit of a default is not dumped).
    """

    clock: str | None = Field(None, description="cuda-event or cpu-wall.")
    device: str | None = Field(None, description="The torch device timed on.")
    baseline: str | None = Field(None, description="The callable the ratios are against (eager).")
    results: dict[str, TimingStats] = Field(default_factory=dict, description="Timings by callable.")
    ratios: dict[str, SpeedupRatio] = Field(default_factory=dict, description="Speedups by candidate.")
    ci_method: str | None = Field(None, description="How the intervals are computed.")
    graph: Json | None = Field(None, description="Whether CUDA graph timings ran, and why.")
    config: Json | None = Field(None, description="The timing configuration used.")
    l2_flush_bytes: int | None = Field(None, description="Bytes written to flush L2 between reps.")
    input_sets: int | None = Field(None, description="Input sets rotated through.")
    rounds: int | None = Field(None, description="Timed rounds.")
    stop_reason: str | None = Field(None, description="Why the timing loop stopped.")
    elapsed_s: float | None = Field(None, description="Wall time of the timing loop.")
    profile: ReferenceProfile | None = Field(None, description="The reference's hotspots, when asked.")
    compile_s: dict[str, float] = Field(default_factory=dict, description="Compile time by mode.")
    compile_errors: dict[str, str] = Field(default_factory=dict, description="Modes that did not compile.")
    builds: dict[str, Json] = Field(default_factory=dict, description="Each candidate's build record.")
    hardware: Json = Field(default_factory=dict, description="The device (hardware.detect).")
    versions: Json = Field(default_factory=dict, description="Library versions.")
    seed: int | None = Field(None, description="The seed of the inputs.")
    samples_checked: int | None = Field(None, description="Timed outputs judged against the golden.")
    kinds: dict[str, Json] = Field(
        default_factory=dict,
        description="Each candidate's kind (kernel, hybrid, compiler, library) and its evidence, from a "
        "profile of calls on fresh data.",
    )
    failure: TimingFailure | None = Field(None, description="Why the run failed, if it did.")
    phase_s: dict[str, float] | None = Field(None, description="The executor's phases, seconds.")
    golden_phase_s: dict[str, float] | None = Field(None, description="The golden child's phases.")

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler: SerializerFunctionWrapHandler) -> Json:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}

    def compile_medians(self) -> dict[str, float]:
        """The median time of each torch.compile baseline, by mode."""
        return {k.split(":", 1)[1]: v.median_ms for k, v in self.results.items() if k.startswith("compile:")}

    def median_ms(self, name: str) -> float | None:
        """The median time of one callable, or None when it was not timed."""
        stats = self.results.get(name)
        return stats.median_ms if stats is not None else None


class ProfileResult(Record):
    """What a profile operation found: hotspots and work (reference), peaks, floor, Nsight Compute."""

    device: str | None = Field(None, description="Where the hotspots were ranked.")
    clock: str | None = Field(None, description="What the hotspot times are.")
    total_us: float | None = Field(None, description="Total self time per forward, microseconds.")
    hotspots: list[Hotspot] = Field(default_factory=list, description="The reference's top entries.")
    work: Json | None = Field(None, description="Compulsory bytes and flops.")
    hardware: Json = Field(default_factory=dict, description="The device (hardware.detect).")
    peaks: Json = Field(default_factory=dict, description="The device's peaks (roofline.Peaks).")
    floor: Json | None = Field(None, description="The task's speed-of-light floor.")
    ncu: Json | None = Field(None, description="Nsight Compute's summary, when asked.")
    phase_s: dict[str, float] = Field(default_factory=dict, description="The executor's phases, seconds.")


# ------------------------------------------------------------------------------------------------
# The run: baseline, final timing, report
# ------------------------------------------------------------------------------------------------


class Baseline(StoredRecord):
    """The reference measured once per run: eager and torch.compile, hotspots, floor, analysis."""

    clock: str | None = Field(None, description="cuda-event or cpu-wall.")
    eager_ms: float | None = Field(None, description="Eager's median time.")
    eager_spread_pct: float | None = Field(None, description="Eager's spread, percent.")
    compile_ms: dict[str, float] = Field(default_factory=dict, description="torch.compile by mode.")
    compile_ratios: dict[str, Json] = Field(
        default_factory=dict,
        description="torch.compile's paired speedup over eager by mode (a SpeedupRatio as a dict).",
    )
    compile_s: dict[str, float] = Field(default_factory=dict, description="Compile time by mode.")
    compile_errors: dict[str, str] = Field(default_factory=dict, description="Modes that did not compile.")
    hardware: Json = Field(default_factory=dict, description="The device (hardware.detect).")
    versions: Json = Field(default_factory=dict, description="Library versions.")
    arch: str | None = Field(None, description="The device's architecture (sm_90, or cpu).")
    hotspots: list[Hotspot] = Field(default_factory=list, description="The reference's top kernels.")
    hotspot_clock: str | None = Field(None, description="What the hotspot times are.")
    hotspot_total_us: float | None = Field(None, description="Their total per forward, microseconds.")
    work: Json | None = Field(None, description="Compulsory bytes and flops.")
    peaks: Json | None = Field(None, description="The device's peaks.")
    floor: Json | None = Field(None, description="The task's speed-of-light floor.")
    ncu: Json = Field(default_factory=dict, description="Nsight Compute's summary of the reference.")
    analysis: Json = Field(default_factory=dict, description="The FX graph analysis of the reference.")
    phase_s: dict[str, float] = Field(default_factory=dict, description="Where the baseline's time went.")
    golden_phase_s: dict[str, float] | None = Field(None, description="The golden child's phases.")
    timing_run: Json = Field(default_factory=dict, description="How the timing loop ended.")
    sol_fraction: dict[str, float | None] = Field(default_factory=dict, description="Floor / time.")

    @property
    def floor_ms(self) -> float | None:
        """The floor's time, when there is one."""
        return (self.floor or {}).get("floor_ms")


class FinalTiming(Record):
    """The finalize benchmark of the best candidate against eager and torch.compile."""

    clock: str | None = Field(None, description="cuda-event or cpu-wall.")
    eager_ms: float | None = Field(None, description="Eager's median time.")
    compile_ms: dict[str, float] = Field(default_factory=dict, description="torch.compile by mode.")
    best_ms: float | None = Field(None, description="The best candidate's median time.")
    speedup_eager: float | None = Field(None, description="Median speedup over eager.")
    speedup_eager_ci: list[float | None] = Field(default_factory=list, description="Its 95% interval.")
    significant: bool | None = Field(None, description="Whether the interval is above 1.")
    speedup_compile: float | None = Field(None, description="Speedup over the fastest torch.compile.")
    failure: TimingFailure | None = Field(None, description="Why the final timing failed, if it did.")


class ReportBaseline(StoredRecord):
    """The report's summary of the baseline."""

    eager_ms: float | None = Field(None, description="Eager's median time.")
    compile_ms: dict[str, float] | None = Field(None, description="torch.compile by mode.")
    compile_s: dict[str, float] | None = Field(None, description="Compile time by mode.")
    hotspots: list[Hotspot] = Field(default_factory=list, description="The top five kernels.")
    phase_s: dict[str, float] | None = Field(None, description="Where the baseline's time went.")
    golden_phase_s: dict[str, float] | None = Field(None, description="The golden child's phases.")
    timing_run: Json | None = Field(None, description="How the timing loop ended.")


class ReportBest(StoredRecord):
    """The best candidate in the report, with its final timing."""

    id: str = Field(description="The candidate's id.")
    strategy: str = Field(description="The strategy that made it.")
    params: Json = Field(default_factory=dict, description="Its parameters.")
    kind: str | None = Field(None, description="kernel, hybrid, library or compiler.")
    source_kind: str | None = Field(None, description="What its source is (kernel, compiler, ...).")
    flags: list[str] = Field(default_factory=list, description="Caveats.")
    clock: str | None = Field(None, description="cuda-event or cpu-wall.")
    eager_ms: float | None = Field(None, description="Eager's median time (final timing).")
    compile_ms: dict[str, float] = Field(default_factory=dict, description="torch.compile by mode.")
    best_ms: float | None = Field(None, description="Its median time.")
    speedup_eager: float | None = Field(None, description="Median speedup over eager.")
    speedup_eager_ci: list[float | None] = Field(default_factory=list, description="Its 95% interval.")
    significant: bool | None = Field(None, description="Whether the interval is above 1.")
    speedup_compile: float | None = Field(None, description="Speedup over the fastest torch.compile.")
    failure: TimingFailure | None = Field(None, description="Why the final timing failed, if it did.")
    packaging: Json | None = Field(None, description="How best.py is packaged (custom op or not).")


class Report(StoredRecord):
    """What a finished optimize run reports (report.json); the markdown is rendered from it."""

    run_id: str = Field("", description="The run (thread) id.")
    status: str = Field(description="improved, no_significant_gain, no_verified_candidate, ...")
    stop_reason: str = Field("", description="Why the run stopped.")
    task: str = Field("", description="The task file.")
    device: str = Field("", description="cuda or cpu.")
    gpu_model: str | None = Field(None, description="The GPU model slug.")
    gpu_name: str | None = Field(None, description="The GPU's name.")
    arch: str | None = Field(None, description="The architecture.")
    versions: Json | None = Field(None, description="Library versions.")
    precision: str = Field("", description="The precision policy.")
    backend: str = Field("", description="The planner/coder backend.")
    model: str | None = Field(None, description="The LLM, if any.")
    seed: int | None = Field(None, description="The run's seed.")
    scope: str = Field("", description="What was optimized.")
    clock: str | None = Field(None, description="The baseline's clock.")
    timings_note: str = Field("", description="How to read the timings.")
    baseline: ReportBaseline = Field(default_factory=ReportBaseline, description="The reference.")
    best: ReportBest | None = Field(None, description="The best verified candidate, if any.")
    roofline: Json = Field(default_factory=dict, description="Work, floor, peaks, fractions of it.")
    ncu: Json = Field(default_factory=dict, description="Nsight Compute of the reference and the best.")
    diagnosis: Json = Field(default_factory=dict, description="The bottleneck reading.")
    iterations: list[Json] = Field(default_factory=list, description="One record per step.")
    replies: list[str] = Field(default_factory=list, description="Answers to the user's messages.")
    usage: Json = Field(default_factory=dict, description="LLM tokens and cost.")
    elapsed_s: float = Field(0.0, description="The run's wall time.")
    reproduce: str = Field("", description="The command that reruns it.")
    knowledge_base: Json = Field(default_factory=dict, description="Hits used and the win recorded.")
    lineage: list[Json] = Field(
        default_factory=list,
        description="The best's ancestors, the root first: step, strategy, params, operator, speedup.",
    )
    search: Json = Field(
        default_factory=dict, description="The search: archive size, niches, steps and verified per operator."
    )


# ------------------------------------------------------------------------------------------------
# A service job's stored result
# ------------------------------------------------------------------------------------------------


class VerifyOutcome(StoredRecord):
    """What a verify job reports: the verdict and, when it passed, its timing."""

    verify: Verdict = Field(description="The verdict.")
    verdict: str = Field(description="pass or fail (fail too when a timed output was wrong).")
    timing: BenchmarkResult | None = Field(None, description="The benchmark, when it ran.")
    speedup: float | None = Field(None, description="The candidate's median speedup over eager.")


def _report_kind(value: Any) -> str:
    if isinstance(value, VerifyOutcome) or (isinstance(value, dict) and "verify" in value):
        return "verify"
    return "optimize"


class JobResult(StoredRecord):
    """A finished job's stored result: its report, and the files a user downloads."""

    report: Annotated[
        Annotated[Report, Tag("optimize")] | Annotated[VerifyOutcome, Tag("verify")],
        Discriminator(_report_kind),
    ] = Field(description="An optimize job's report or a verify job's outcome.")
    best_source: str | None = Field(None, description="best.py of an optimize job.")
    report_md: str | None = Field(None, description="report.md of an optimize job.")

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        """Rows stored before this record: the report itself, the files under ``_best_py`` and
        ``_report_md``."""
        if isinstance(data, dict) and "report" not in data:
            rest = {k: v for k, v in data.items() if k not in ("_best_py", "_report_md")}
            return {"report": rest, "best_source": data.get("_best_py"), "report_md": data.get("_report_md")}
        return data


__all__ = [
    "Baseline",
    "BenchmarkRequest",
    "BenchmarkResult",
    "ExecutorRequest",
    "FinalTiming",
    "Hotspot",
    "JobResult",
    "ProfileRequest",
    "ProfileResult",
    "ReferenceProfile",
    "Report",
    "ReportBaseline",
    "ReportBest",
    "SpeedupRatio",
    "TimingFailure",
    "TimingStats",
    "Verdict",
    "VerifyOutcome",
    "VerifyRequest",
]
