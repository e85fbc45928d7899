"""What a job's list entry says about it, computed from its task source and its stored result.

The task's name, the verdict, the speedup over eager with its interval, and the answer's kind: the
API's job list and the web pages read them from here, so both say the same thing.
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kernelcrew.records import JobResult, Report, VerifyOutcome
from kernelcrew.task import parse_python

Verdict = Literal["pass", "fail", "none"]
MAX_NAME = 80


@dataclass
class JobSummary:
    task_name: str
    """The task's title: its docstring's first line, else its ``Model``'s, else what its forward calls."""
    verdict: Verdict
    """``pass``: the job returns a verified answer; ``fail``: it ended without one (the candidate failed
    its check, or no candidate passed); ``none``: no verdict (not ended, or ended without a result)."""
    speedup: float | None
    """The answer's median speedup over eager."""
    speedup_ci: list[float] | None
    """Its 95% interval ``[low, high]``, when the report has one."""
    cpu_timing: bool
    """The speedup is a CPU wall-clock timing (never a GPU speedup)."""
    answer_kind: str | None
    """What the answer is: kernel, hybrid, library or compiler."""

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


def summarize(task_source: str, outcome: JobResult | None) -> JobSummary:
    """The job's summary from its task and its stored result (``None`` before it ends)."""
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
        )
    if isinstance(report, Report):
        best = report.best
        if best is None:
            return JobSummary(name, "fail", None, None, report.device == "cpu", None)
        ci = best.speedup_eager_ci
        return JobSummary(
            task_name=name,
            verdict="pass",
            speedup=best.speedup_eager,
            speedup_ci=_interval(*ci) if len(ci) == 2 else None,
            cpu_timing=best.clock == "cpu-wall" or report.device == "cpu",
            answer_kind=best.kind or best.source_kind,
        )
    return JobSummary(name, "none", None, None, False, None)


__all__ = ["JobSummary", "Verdict", "summarize", "task_name"]
