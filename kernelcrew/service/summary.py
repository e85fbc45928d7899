"""What a job's list entry says about it, computed from its task source and its stored result.

The task's name, the verdict, the speedup over eager with its interval and where it was timed, and the
answer's kind: the API's job list and the web pages read them from here, so both say the same thing.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from kernelcrew.records import JobResult, Report, VerifyOutcome
from kernelcrew.task import parse_python

Verdict = Literal["pass", "no_gain", "fail", "none"]
AnswerKind = Literal["kernel", "hybrid", "library", "compiler", "reference"]
SpeedupTiming = Literal["final", "step", "baseline"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
ANSWER_KINDS: tuple[str, ...] = get_args(AnswerKind)
MAX_NAME = 80


@dataclass
class JobSummary:
    task_name: str
    """The task's title: its docstring's first line, else its ``Model``'s, else what its forward calls."""
    verdict: Verdict
    """``pass``: the job returns a verified answer; ``no_gain``: an optimize run whose candidates passed
    their checks but none was faster than eager, so its answer is the reference (or ``torch.compile``,
    when the baseline timed it faster); ``fail``: it ended without one (the candidate failed its check,
    or no candidate passed); ``none``: no verdict (not ended, or ended without a result)."""
    speedup: float | None
    """The answer's median speedup over eager."""
    speedup_ci: list[float] | None
    """Its 95% interval ``[low, high]``, when the report has one."""
    cpu_timing: bool
    """The speedup is a CPU wall-clock timing (never a GPU speedup)."""
    answer_kind: str | None
    """What the answer is: kernel, hybrid, library or compiler; ``reference`` when it is the task itself."""
    speedup_timing: SpeedupTiming | None = None
    """Which timing the speedup is: ``final`` (the answer timed after the run, interleaved with eager),
    ``step`` (the step that verified it: a cancelled run stops before its final timing) or ``baseline``
    (``torch.compile`` as the reference's baseline timed it)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0].strip() if lines else ""


def _short(text: str) -> str:
    return text if len(text) <= MAX_NAME else text[: MAX_NAME - 3] + "..."


def _called(func: ast.FunctionDef) -> list[str]:
    """The names the function calls, in order, once each (``torch.matmul`` -> ``matmul``)."""
    names: list[str] = []
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name and name not in names and name != "super":
                names.append(name)
    return names


def task_name(source: str) -> str:
    """The module's docstring's first line; else ``Model``'s docstring's; else ``Model: <what its
    forward calls>``; else a short hash of the source, so two different tasks are told apart."""
    digest = "task " + hashlib.sha256(source.encode()).hexdigest()[:8]
    try:
        module = parse_python(source)
    except SyntaxError:
        return digest
    first = _first_line(ast.get_docstring(module))
    if first:
        return _short(first)
    model = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return digest
    first = _first_line(ast.get_docstring(model))
    if first:
        return _short(first)
    forward = next((n for n in model.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
    calls = _called(forward) if forward is not None else []
    return _short(f"Model: {', '.join(calls[:4])}") if calls else digest


def _interval(low: float | None, high: float | None) -> list[float] | None:
    return [low, high] if low is not None and high is not None else None


def _no_gain(name: str, report: Report) -> JobSummary:
    """An optimize run that verified candidates but kept none (none was faster than eager): its answer
    is ``torch.compile`` when the baseline timed a mode faster than eager, else the reference."""
    eager = report.baseline.eager_ms
    compiled = {m: ms for m, ms in (report.baseline.compile_ms or {}).items() if ms}
    fastest = min(compiled, key=compiled.__getitem__) if compiled else None
    cpu = report.device == "cpu" or report.clock == "cpu-wall"
    if eager and fastest is not None and compiled[fastest] < eager:
        return JobSummary(name, "no_gain", eager / compiled[fastest], None, cpu, "compiler", "baseline")
    return JobSummary(name, "no_gain", None, None, cpu, "reference", None)


def summarize(task_source: str, outcome: JobResult | None, status: str | None = None) -> JobSummary:
    """The job's summary from its task, its stored result (``None`` before it ends) and its status (a
    ``cancelled`` job's best was timed by its step, not by a final timing)."""
    name = task_name(task_source)
    report = outcome.report if outcome is not None else None
    if isinstance(report, VerifyOutcome):
        ratio = report.timing.ratios.get("candidate") if report.timing is not None else None
        clock = report.timing.clock if report.timing is not None else None
        return JobSummary(
            task_name=name,
            verdict="pass" if report.verdict == "pass" else "fail",
            speedup=report.speedup,
            speedup_ci=_interval(ratio.ci_low, ratio.ci_high) if ratio is not None else None,
            cpu_timing=clock == "cpu-wall",
            answer_kind=report.verify.kind,
            speedup_timing="final" if report.speedup is not None else None,
        )
    if isinstance(report, Report):
        best = report.best
        if best is None and report.status == "no_significant_gain":
            return _no_gain(name, report)
        if best is None:
            return JobSummary(name, "fail", None, None, report.device == "cpu", None)
        ci = best.speedup_eager_ci
        timing: SpeedupTiming | None = None
        if best.speedup_eager is not None:
            timing = "step" if status == "cancelled" else "final"
        return JobSummary(
            task_name=name,
            verdict="pass",
            speedup=best.speedup_eager,
            speedup_ci=_interval(*ci) if len(ci) == 2 else None,
            cpu_timing=best.clock == "cpu-wall" or report.device == "cpu",
            answer_kind=best.kind or best.source_kind,
            speedup_timing=timing,
        )
    return JobSummary(name, "none", None, None, False, None)


__all__ = [
    "ANSWER_KINDS",
    "VERDICTS",
    "AnswerKind",
    "JobSummary",
    "SpeedupTiming",
    "Verdict",
    "summarize",
    "task_name",
]
