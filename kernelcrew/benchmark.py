"""``kernelcrew bench``: ``optimize`` on every task of a suite, one row per task, resumable.

A suite may take longer than one batch job or CI step may run, so the run is sharded by design:

* every finished task is written to ``OUT/suite.json`` (and ``suite.md``) at once;
* ``--resume`` skips the tasks that already have a row, so the next command continues;
* ``--max-wall S`` starts no new task once the command has run S seconds;
* ``--tasks`` picks tasks by name.

Each task runs the whole crew under its own time budget, with its run folder under ``OUT/runs``.
The table: ``{"device", "arch", "versions", "rows":
[{"task", "eager_ms", "compile_ms", "best_ms", "speedup_eager", "speedup_compile", "sol_fraction",
"strategy", "params", "source_kind", "verified", "wall_s"}]}``, plus the status and stop reason per row,
the answer (``candidate``, ``compiler``: the fallback, or ``reference``: nothing beat eager) and where
the run's seconds went (``budget_s``: baseline, steps, fallback, final timing, total).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from kernelcrew.config import Settings
from kernelcrew.records import Report
from kernelcrew.task import TaskError


def suite_tasks(suite_dir: Path, names: list[str] | None = None) -> list[Path]:
    """The task files of a suite (``*.py``, sorted), or the named ones; unknown names are an error."""
    if not suite_dir.is_dir():
        raise TaskError(f"{suite_dir} is not a directory of task files")
    found = {p.stem: p for p in sorted(suite_dir.glob("*.py")) if not p.name.startswith("_")}
    if not found:
        raise TaskError(f"no task files (*.py) in {suite_dir}")
    if not names:
        return list(found.values())
    missing = [n for n in names if n not in found]
    if missing:
        raise TaskError(f"unknown task(s) {', '.join(missing)} in {suite_dir} (known: {', '.join(found)})")
    return [found[n] for n in names]


def row_from_report(task: str, report: Report | None, wall_s: float) -> dict[str, Any]:
    """One table row from an optimize report (``verified`` only for a candidate that passed)."""
    if report is None:
        return {"task": task, "verified": False, "status": "error", "wall_s": round(wall_s, 1)}
    best = report.best
    budget = (report.model_extra or {}).get("budget") or {}
    answer = (report.model_extra or {}).get("answer") or {}
    compiled = (best.compile_ms if best else None) or report.baseline.compile_ms or {}
    compile_ms = min(compiled.values()) if compiled else None
    fractions = report.roofline.get("sol_fraction") or {}
    return {
        "task": task,
        "status": report.status,
        "stop_reason": report.stop_reason,
        "eager_ms": (best.eager_ms if best else None) or report.baseline.eager_ms,
        "compile_ms": compile_ms,
        "best_ms": best.best_ms if best else None,
        "speedup_eager": best.speedup_eager if best else None,
        "speedup_compile": best.speedup_compile if best else None,
        "sol_fraction": fractions.get("best"),
        "strategy": best.strategy if best else None,
        "params": best.params if best else None,
        "source_kind": best.kind if best else None,
        "verified": best is not None,
        "significant": best.significant if best else None,
        "wall_s": round(wall_s, 1),
        "run_id": report.run_id,
        "answer": answer.get("answer"),
        "within_budget": budget.get("within_tolerance"),
        "budget_s": {
            k: budget.get(k) for k in ("baseline_s", "steps_s", "fallback_s", "final_timing_s", "total_s")
        }
        if budget
        else None,
        "phases": time_account(report, budget) if budget else None,
    }


def time_account(report: Report, budget: dict[str, Any]) -> dict[str, Any]:
    """Where one run's seconds went, phase by phase: the baseline's phases and its golden child's,
    each step (strategy, verdict, its profile node's phases), the fallback and the final timing. A
    GPU run's table says from this, without another run, what used a task's budget."""
    outcome = {r.get("step"): r for r in report.iterations}
    fallback = budget.get("fallback") or {}
    return {
        "baseline": budget.get("baseline_phase_s") or {},
        "golden": report.baseline.golden_phase_s or {},
        "baseline_skipped": sorted(budget.get("baseline_skipped") or {}),
        "steps": [
            {
                "strategy": s.get("strategy"),
                "seconds": s.get("seconds"),
                "verdict": outcome.get(s.get("step"), {}).get("verdict"),
                "stage": outcome.get(s.get("step"), {}).get("stage"),
                "phase_s": s.get("phase_s") or {},
            }
            for s in budget.get("steps") or []
        ],
        "fallback": {
            "seconds": fallback.get("seconds"),
            "skipped": fallback.get("skipped"),
            "phase_s": fallback.get("phase_s") or {},
        },
        "final_timing": budget.get("final_timing_s"),
    }


def roofline_peaks(hw: dict[str, Any], out: Console, settings: Settings | None = None) -> dict[str, Any]:
    """The roofs the suite's SOL column is measured against: this GPU's, calibrated once per model.

    The DRAM floor is taken at the bandwidth a device copy reaches here, not the datasheet's, which
    no kernel reaches (a measurement, see docs/benchmarks.md). A calibration already stored for this
    GPU model is reused, so later shards share it.
    """
    from kernelcrew.tools import roofline

    if roofline.load_calibration(str(hw.get("model") or ""), settings) is None:
        out.print(f"[dim]calibrating {hw.get('name') or hw.get('model')}: copy bandwidth and matmul rates[/]")
        roofline.calibrate(hw, settings=settings)
    peaks = roofline.peaks_for(hw, settings)
    return {
        "basis": peaks.basis,
        "dram_gbs": peaks.dram_gbs,
        "datasheet_dram_gbs": peaks.datasheet_dram_gbs,
        "sources": {"dram_gbs": peaks.sources.get("dram_gbs")},
    }


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def markdown(data: dict[str, Any]) -> str:
    v = data.get("versions") or {}

    def f(x: Any, spec: str = ".4g") -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        f"# kernelcrew bench: {data.get('suite')}",
        "",
        f"Device: {data.get('device')} ({data.get('arch')}); torch {v.get('torch')}, Triton {v.get('triton')}; "
        f"clock: {data.get('clock')}.",
        *(
            [
                "",
                f"SOL: the best time against the task's floor at {data['peaks']['dram_gbs']:.0f} GB/s of DRAM "
                f"bandwidth ({data['peaks']['basis']}; datasheet {f(data['peaks'].get('datasheet_dram_gbs'), '.0f')} "
                "GB/s) and the calibrated compute peaks.",
            ]
            if data.get("peaks")
            else []
        ),
        "",
        "| task | status | eager ms | compile ms | best ms | vs eager | vs compile | SOL | strategy (kind) | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['task']} | {r.get('status')} | {f(r.get('eager_ms'))} | {f(r.get('compile_ms'))} | "
            f"{f(r.get('best_ms'))} | {f(r.get('speedup_eager'), '.3g')} | {f(r.get('speedup_compile'), '.3g')} | "
            f"{f(r.get('sol_fraction'), '.0%')} | {r.get('strategy') or '-'} ({r.get('source_kind') or '-'}) | "
            f"{r.get('wall_s')} |"
        )
    s = data.get("summary") or {}
    lines += [
        "",
        f"Geometric mean over {s.get('tasks')} tasks with a verified best: {f(s.get('geomean_eager'), '.3g')}x over "
        f"eager, {f(s.get('geomean_compile'), '.3g')}x over torch.compile; own kernels are the answer on "
        f"{s.get('own_kernels')} tasks.",
        "Answers: "
        + (", ".join(f"{n} {a}" for a, n in (s.get("answers") or {}).items()) or "-")
        + f"; runs past their budget plus 20 %: {s.get('over_budget', 0)}.",
        "",
    ]
    return "\n".join(lines)


#: What a run answers with: a candidate of its own, the compiler fallback, or the reference.
ANSWERS = ("candidate", "compiler", "reference")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    verified = [r for r in rows if r.get("verified")]
    return {
        "tasks": len(verified),
        "geomean_eager": geomean([r.get("speedup_eager") for r in verified]),
        "geomean_compile": geomean([r.get("speedup_compile") for r in verified]),
        "own_kernels": sum(1 for r in verified if r.get("source_kind") == "kernel"),
        "answers": {a: sum(1 for r in rows if r.get("answer") == a) for a in ANSWERS},
        "over_budget": sum(1 for r in rows if r.get("within_budget") is False),
    }


def run_bench(
    suite_dir: Path,
    out_dir: Path,
    *,
    device: str,
    names: list[str] | None = None,
    resume: bool = False,
    time_budget_s: float = 90.0,
    max_iters: int = 6,
    max_wall_s: float | None = None,
    compile_modes: str = "auto",
    quick: bool = False,
    parallel: int = 0,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the suite (or its remaining tasks) and return the table written to ``out_dir``."""
    from kernelcrew.agents.run import OptimizeRequest, run_optimize
    from kernelcrew.tools import hardware

    out = console or Console(stderr=True)
    tasks = suite_tasks(suite_dir, names)
    out_dir.mkdir(parents=True, exist_ok=True)
    table_path = out_dir / "suite.json"
    previous: dict[str, Any] = {}
    if resume and table_path.exists():
        try:
            previous = json.loads(table_path.read_text())
        except ValueError as exc:
            raise TaskError(
                f"{table_path} is not a bench table ({exc}); move it away or run without --resume"
            ) from exc
    rows = {r["task"]: r for r in previous.get("rows", [])} if resume else {}
    info = hardware.detect(device)
    peaks = roofline_peaks(info.to_dict(), out) if info.is_cuda else None
    data: dict[str, Any] = {
        "suite": str(suite_dir),
        "device": info.name,
        "model": info.model,
        "arch": info.arch,
        "clock": "cuda-event" if info.is_cuda else "cpu-wall (Triton interpreter: not GPU speedups)",
        "versions": hardware.versions(),
        "settings": {
            "time_budget_s": time_budget_s,
            "max_iters": max_iters,
            "compile_modes": compile_modes,
            "parallel": parallel,
        },
        **({"peaks": peaks} if peaks else {}),
    }
    started = time.monotonic()
    for path in tasks:
        if path.stem in rows:
            out.print(f"[dim]{path.stem}: done in an earlier shard, skipped[/]")
            continue
        if max_wall_s is not None and time.monotonic() - started > max_wall_s:
            out.print(f"[yellow]--max-wall {max_wall_s:g} s reached: run again with --resume to continue[/]")
            break
        t0 = time.monotonic()
        try:
            report = run_optimize(
                OptimizeRequest(
                    task=path,
                    device=device,
                    max_iters=max_iters,
                    time_budget_s=time_budget_s,
                    out=out_dir / "runs" / path.stem,
                    compile_modes=compile_modes,
                    quick=quick,
                    parallel=parallel,
                ),
                console=out,
            )
        except Exception as exc:  # a broken task, or a fault of the crew's on it, is a row with its error
            why = (
                str(exc)
                if isinstance(exc, TaskError)
                else f"internal error: {type(exc).__name__}: {str(exc)[:1000]}"
            )
            out.print(f"[red]{path.stem}: {why}[/]")
            rows[path.stem] = {**row_from_report(path.stem, None, time.monotonic() - t0), "error": why}
        else:
            rows[path.stem] = row_from_report(path.stem, report, time.monotonic() - t0)
        data["rows"] = [rows[p.stem] for p in suite_tasks(suite_dir) if p.stem in rows]
        data["summary"] = summarize(data["rows"])
        tmp = table_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, default=str))
        tmp.replace(table_path)
        (out_dir / "suite.md").write_text(markdown(data))
    data.setdefault("rows", [rows[p.stem] for p in suite_tasks(suite_dir) if p.stem in rows])
    data.setdefault("summary", summarize(data["rows"]))
    return data
