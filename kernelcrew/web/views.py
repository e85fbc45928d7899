"""What the pages show, computed from a job's row, its event stream and its report.

The event stream is the one record that exists while a job runs and after it ends, so the timeline,
the chat and the live numbers are read from it; the evidence that only the end provides (final
timings, speed of light, Nsight Compute, the best source) comes from the report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kernelcrew.agents.report import _NCU_ROWS, _stalls
from kernelcrew.records import JobResult, Report
from kernelcrew.web.charts import Chart, Series, roofline_chart, time_chart


def age(when: datetime | None, now: datetime | None = None) -> str:
    if when is None:
        return "-"
    when = when if when.tzinfo else when.replace(tzinfo=UTC)
    seconds = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def public_result(outcome: JobResult | None) -> dict[str, Any]:
    """The report's JSON without the stored files (best source, markdown), which are shown on their own."""
    return {} if outcome is None else outcome.report.model_dump(mode="json")


def target_of(options: dict[str, Any], outcome: JobResult | None) -> str:
    """Where the job ran (from its report) or was asked to run (from its options)."""
    report = outcome.report if outcome is not None and isinstance(outcome.report, Report) else None
    if report is not None and report.gpu_name and report.device != "cpu":
        return f"{report.gpu_name} ({report.arch})"
    if options.get("device") == "cpu" or (report is not None and report.device == "cpu"):
        return "CPU"
    return options.get("gpu") or "any GPU"


@dataclass
class JobRow:
    id: str
    status: str
    mode: str
    task: str
    target: str
    verdict: str
    """``pass``, ``no_gain``, ``fail`` or ``none`` (see :class:`kernelcrew.service.summary.JobSummary`)."""
    speedup: float | None
    speedup_ci: list[float] | None
    speedup_timing: str | None
    """``final``, ``step`` or ``baseline``: which timing the speedup is."""
    cpu_timing: bool
    answer_kind: str | None
    age: str


def job_row(job: Any) -> JobRow:
    """The job's list entry, from its (cached) summary: the same fields as the API's job list."""
    summary = job.summary()
    return JobRow(
        id=job.id,
        status=job.status,
        mode=job.mode,
        task=summary["task_name"],
        target=target_of(job.options or {}, job.outcome()),
        verdict=summary["verdict"],
        speedup=summary["speedup"],
        speedup_ci=summary["speedup_ci"],
        speedup_timing=summary["speedup_timing"],
        cpu_timing=summary["cpu_timing"],
        answer_kind=summary["answer_kind"],
        age=age(job.created_at),
    )


def answer_note(row: JobRow, report: dict[str, Any]) -> str:
    """One sentence on what the answer is when the speedup needs one: a run with no gain (its answer
    is the reference or ``torch.compile``) or a best timed only by its step (a cancelled run)."""
    if row.verdict == "no_gain":
        if row.answer_kind == "compiler":
            compiled = (report.get("baseline") or {}).get("compile_ms") or {}
            mode = min(compiled, key=compiled.__getitem__) if compiled else "default"
            return (
                "Candidates passed their checks but none was faster than eager: the answer is torch.compile "
                f"(mode {mode}), faster than eager in the baseline timing."
            )
        return (
            "Candidates passed their checks but none was faster than eager: the answer is the reference, "
            "your module as it is."
        )
    if row.speedup_timing == "step":
        return (
            "The best's timing is the timing of the step that verified it: the job was cancelled before "
            "its final timing."
        )
    return ""


# ------------------------------------------------------------------------------------------------
# The timeline and the chat, from the events
# ------------------------------------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    state: str
    """``ok``, ``fail`` or ``info``: the colour of the stage's mark."""
    detail: str


@dataclass
class Step:
    number: int
    strategy: str
    params: dict[str, Any] = field(default_factory=dict)
    rationale: str = ""
    origin: str = ""
    stages: list[Stage] = field(default_factory=list)
    verdict: str | None = None
    time_ms: float | None = None
    speedup: float | None = None
    new_best: bool = False
    failure: str = ""


@dataclass
class ChatItem:
    seq: int
    who: str
    """``user``, ``crew`` or ``note``."""
    author: str
    text: str


@dataclass
class Progress:
    """What the events say so far: the baseline, the steps, the chat, and the best step."""

    baseline: dict[str, Any] | None = None
    steps: list[Step] = field(default_factory=list)
    chat: list[ChatItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    last_seq: int = 0

    @property
    def best(self) -> Step | None:
        bests = [s for s in self.steps if s.new_best]
        return bests[-1] if bests else None


def _numbered(progress: Progress, number: int | None) -> Step:
    """The step of that number (a round's steps run side by side, so their events interleave);
    else the last one planned."""
    return next((s for s in reversed(progress.steps) if s.number == number), None) or _current(progress)


def _of_candidate(progress: Progress, data: dict[str, Any]) -> Step:
    """The step of the event's candidate: ``c3``, its repair ``c3r1`` or sample ``c3s2`` is step 3."""
    found = re.match(r"c(\d+)", str(data.get("candidate") or ""))
    return _numbered(progress, int(found.group(1)) if found else None)


def _current(progress: Progress, strategy: str = "") -> Step:
    """The step an event belongs to: the last one planned (a start kernel's check is step 0)."""
    if not progress.steps:
        progress.steps.append(Step(0, strategy or "your kernel"))
    return progress.steps[-1]


def _on_verify(progress: Progress, data: dict[str, Any]) -> None:
    step = _of_candidate(progress, data)
    ok = data.get("verdict") == "pass"
    step.stages.append(Stage("verify", "ok" if ok else "fail", _said(data.get("stage"), data.get("message"))))
    step.verdict = data.get("verdict")
    if not ok:
        step.failure = _said(data.get("stage"), data.get("message"))


def _on_timing(progress: Progress, data: dict[str, Any]) -> None:
    step = _of_candidate(progress, data)
    if data.get("verdict") == "fail":
        step.stages.append(Stage("profile", "fail", _said(data.get("message"))))
        step.verdict, step.failure = "fail", _said(data.get("message"))
        return
    step.time_ms, step.speedup = data.get("time_ms"), data.get("speedup_eager")
    cpu = " (CPU timing)" if data.get("clock") == "cpu-wall" else ""
    detail = f"{_num(step.time_ms, ' ms')}, {_num(step.speedup, 'x')} over eager{cpu}"
    step.stages.append(Stage("profile", "ok", detail + (", significant" if data.get("significant") else "")))


def _said(*parts: Any) -> str:
    """The parts an event gave, joined with ": " (a part it left out is not printed as None)."""
    return ": ".join(str(p) for p in parts if p not in (None, "")) or "-"


def _num(v: float | None, unit: str) -> str:
    return "-" if v is None else f"{v:.4g}{unit}"


def _on_event(progress: Progress, seq: int, kind: str, data: dict[str, Any]) -> None:
    if kind == "baseline":
        progress.baseline = data
    elif kind == "plan":
        progress.steps.append(
            Step(
                data.get("step") or len([s for s in progress.steps if s.number > 0]) + 1,
                str(data.get("strategy")),
                params=data.get("params") or {},
                rationale=str(data.get("rationale") or ""),
                origin=str(data.get("source") or ""),
                stages=[Stage("plan", "info", str(data.get("rationale") or ""))],
            )
        )
    elif kind == "code":
        repair = " (repair)" if data.get("repair") else ""
        lines = f"{data['lines']} lines" if data.get("lines") is not None else "written"
        _of_candidate(progress, data).stages.append(Stage("code", "info", lines + repair))
    elif kind == "verify":
        _on_verify(progress, data)
    elif kind == "timing":
        _on_timing(progress, data)
    elif kind == "benchmark":  # a verify job's timing of its candidate
        cpu = " (CPU timing)" if data.get("clock") == "cpu-wall" else ""
        step = _current(progress)
        step.speedup = data.get("speedup")
        step.stages.append(Stage("profile", "info", f"{_num(step.speedup, 'x')} over eager{cpu}"))
    elif kind == "ncu":
        state = "ok" if data.get("available") else "info"
        detail = "Nsight Compute profile taken" if data.get("available") else "no Nsight Compute profile"
        _current(progress).stages.append(Stage("ncu", state, detail))
    elif kind == "decide":
        step = _numbered(progress, data.get("step"))
        step.verdict = data.get("verdict") or step.verdict
        step.new_best = bool(data.get("new_best"))
    elif kind == "message":
        progress.chat.append(ChatItem(seq, "user", str(data.get("user") or "you"), str(data.get("text"))))
    elif kind == "reply":
        progress.chat.append(ChatItem(seq, "crew", "crew", _said(data.get("message"))))
    elif kind == "message_taken":
        note = f"the crew took {len(data.get('messages') or [])} message(s) before step {data.get('step')}"
        progress.chat.append(ChatItem(seq, "note", "", note))
    elif kind == "status" and data.get("resumed_by") == "message":
        progress.chat.append(
            ChatItem(seq, "note", "", "the job was queued again to continue from its checkpoint")
        )
    elif kind in ("error", "invalid_plan"):
        progress.errors.append(_said(data.get("node") or kind, data.get("message")))


def progress_of(events: list[tuple[int, str, dict[str, Any]]]) -> Progress:
    progress = Progress()
    for seq, kind, data in events:
        _on_event(progress, seq, kind, data)
        progress.last_seq = seq
    return progress


# ------------------------------------------------------------------------------------------------
# The evidence, from the report
# ------------------------------------------------------------------------------------------------


@dataclass
class NcuTable:
    available: bool
    reason: str = ""
    header: str = ""
    rows: list[tuple[str, str, str]] = field(default_factory=list)


def ncu_table(report: dict[str, Any]) -> NcuTable:
    """Reference and best side by side, with the report's own rows and formats."""
    ncu = report.get("ncu") or {}
    ref, best = ncu.get("reference") or {}, ncu.get("best") or {}
    if not ref.get("available"):
        return NcuTable(False, reason=str(ref.get("reason") or "Nsight Compute did not run"))
    rs = ref.get("summary") or {}
    bs = (best.get("summary") if best.get("available") else None) or {}

    def cell(summary: dict[str, Any], key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else fmt.format(value)

    rows = [(label, cell(rs, key, fmt), cell(bs, key, fmt)) for label, key, fmt in _NCU_ROWS]
    rows.append(("top stalls", _stalls(rs), _stalls(bs) if bs else "-"))
    header = f"ncu {ref.get('version')}, clock control {ref.get('clock_control')}"
    reason = "" if bs else f"best: {best.get('reason') or 'no profile of the best candidate'}"
    return NcuTable(True, reason=reason, header=header, rows=rows)


def time_series(progress: Progress) -> tuple[list[tuple[int, Series | None]], list[Series]]:
    """Each step's time from the events, and eager / compile / floor from the baseline."""
    steps: list[tuple[int, Series | None]] = []
    for s in progress.steps:
        label = f"{s.strategy}"
        if s.time_ms is not None:
            steps.append((s.number, Series(label, s.time_ms)))
        elif s.verdict == "fail":
            steps.append((s.number, Series(label, 0.0, ok=False)))
        else:
            steps.append((s.number, None))
    refs = []
    base = progress.baseline or {}
    if base.get("eager_ms"):
        refs.append(Series("eager", base["eager_ms"]))
    for mode, ms in (base.get("compile_ms") or {}).items():
        if ms:
            refs.append(Series(f"compile {mode}", ms))
    if base.get("floor_ms"):
        refs.append(Series("speed of light", base["floor_ms"]))
    return steps, refs


@dataclass
class Evidence:
    """The charts and tables of a job page."""

    time: Chart
    roofline: Chart
    ncu: NcuTable | None


def evidence(report: dict[str, Any], progress: Progress, mode: str) -> Evidence:
    steps, refs = time_series(progress)
    if mode == "verify":
        roof = Chart(reason="Not available for a verify job: it checks and times one kernel, unprofiled.")
        return Evidence(time_chart(steps, refs), roof, None)
    if report.get("iterations") is None:
        roof = Chart(reason="The roofline is drawn from the final report, when the job has ended.")
        return Evidence(time_chart(steps, refs), roof, None)
    return Evidence(time_chart(steps, refs), roofline_chart(report), ncu_table(report))


__all__ = [
    "ChatItem",
    "Evidence",
    "JobRow",
    "NcuTable",
    "Progress",
    "Stage",
    "Step",
    "age",
    "evidence",
    "job_row",
    "ncu_table",
    "progress_of",
    "public_result",
    "target_of",
    "time_series",
]
