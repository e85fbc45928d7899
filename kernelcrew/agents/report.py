"""Finalize: time the best against eager and torch.compile once more, then write the report.

Writes ``best.py``, ``report.json`` and ``report.md`` into the run's output directory. The final
numbers come from one interleaved benchmark of the best candidate, eager and every requested
``torch.compile`` mode in the same process. A best that passed verification and was measured
faster goes into the knowledge base (:func:`kernelcrew.agents.knowledge.record_best`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from langgraph.runtime import Runtime

from kernelcrew.agents import search
from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.knowledge import record_best
from kernelcrew.agents.profiler import assess_subject
from kernelcrew.agents.state import CrewState
from kernelcrew.records import Baseline, BenchmarkRequest, FinalTiming, Report, ReportBaseline, ReportBest
from kernelcrew.tools.packaging import custom_op_name, packable, package
from kernelcrew.tools.roofline import sol_fraction, sol_fractions


def finalize(
    state: CrewState, runtime: Runtime[CrewContext], timing: FinalTiming | None = None
) -> dict[str, Any]:
    """Final timing of the best candidate, the report (JSON and markdown) and ``best.py``;
    ``timing``: the best's times as already measured, instead of a final timing run."""
    ctx = runtime.context
    opts = state.options
    best = state.best
    final: FinalTiming | None = timing
    if best is not None and final is None:
        bench = ctx.executor.benchmark(
            ctx.request(
                BenchmarkRequest,
                state,
                candidates={best.id: best.source},
                compile_modes=list(opts.compile_modes),
                quick=opts.quick,
            )
        )
        ratio = bench.ratios.get(best.id)
        compiled = bench.compile_medians()
        best_ms = bench.median_ms(best.id)
        final = FinalTiming(
            clock=bench.clock,
            eager_ms=bench.median_ms("eager"),
            compile_ms=compiled,
            best_ms=best_ms,
            speedup_eager=ratio.median if ratio else None,
            speedup_eager_ci=[ratio.ci_low if ratio else None, ratio.ci_high if ratio else None],
            significant=ratio.significant if ratio else None,
            speedup_compile=(min(compiled.values()) / best_ms) if compiled and best_ms else None,
            failure=bench.failure,
        )
    recorded = record_best(state, ctx, final)
    report = build_report(state, final, ctx)
    report.knowledge_base = {
        "hits": [{k: h[k] for k in ("id", "match", "why", "line")} for h in state.kb_hits or []],
        "recorded": recorded,
    }
    best_py = None
    if best is not None and report.best is not None:
        best_py, report.best.packaging = deliverable(best.source, best.source_kind)
    if ctx.out_dir is not None:
        write_report(ctx.out_dir, report, best_py)
    best_json = report.best.model_dump(mode="json") if report.best is not None else None
    ctx.emit("done", status=report.status, stop_reason=state.stop_reason, best=best_json)
    return {"report": report, "status": report.status}


def build_report(state: CrewState, final: FinalTiming | None, ctx: CrewContext) -> Report:
    opts = state.options
    base = state.baseline
    best = state.best
    hardware = base.hardware
    if best is None:
        verified = any(it.get("verdict") == "pass" for it in state.iterations)
        status = "no_significant_gain" if verified else "no_verified_candidate"
    elif opts.device == "cpu":
        status = "verified_cpu_only"
    elif final is not None and final.significant:
        status = "improved"
    else:
        status = "no_significant_gain"
    cmd = ["kernelcrew", "optimize", state.task_path, "--device", opts.device, "--precision", opts.precision]
    cmd += ["--backend", opts.backend, "--max-iters", str(opts.max_iters), "--seed", str(opts.seed)]
    if opts.model:
        cmd += ["--model", opts.model]
    return Report(
        run_id=ctx.run_id,
        status=status,
        stop_reason=state.stop_reason,
        task=state.task_path,
        device=opts.device,
        gpu_model=hardware.get("model"),
        gpu_name=hardware.get("name"),
        arch=hardware.get("arch"),
        versions=base.versions,
        precision=opts.precision,
        backend=opts.backend,
        model=opts.model or None,
        seed=opts.seed,
        scope="forward only (no backward kernels)",
        clock=base.clock,
        timings_note="CPU wall-clock timings (Triton interpreter): not GPU speedups"
        if base.clock == "cpu-wall"
        else "CUDA-event medians, interleaved, L2 flushed",
        baseline=ReportBaseline(
            eager_ms=base.eager_ms,
            compile_ms=base.compile_ms,
            compile_s=base.compile_s,
            hotspots=base.hotspots[:5],
            phase_s=base.phase_s,
            golden_phase_s=base.golden_phase_s,
            timing_run=base.timing_run,
        ),
        best=None
        if best is None
        else ReportBest(
            id=best.id,
            strategy=best.strategy,
            params=best.params,
            kind=best.kind,
            source_kind=best.source_kind,
            flags=best.flags,
            **(final or FinalTiming()).model_dump(),
        ),
        roofline=_roofline(base, final),
        ncu={"reference": base.ncu, "best": best.ncu if best else None},
        diagnosis=assess_subject(base, best),
        iterations=state.iterations,
        replies=state.replies,
        usage=(state.usage or {"calls": 0, "note": "offline playbook: no LLM tokens"})
        | ({"llm_fallback": state.llm_failure} if state.llm_failure else {}),
        elapsed_s=state.elapsed_s,
        reproduce=shlex.join(cmd),
        lineage=_lineage(state),
        search=search.summary(search.Archive.from_dicts(state.archive, opts.device), state.iterations),
    )


def _lineage(state: CrewState) -> list[dict[str, Any]]:
    """The best's chain of ancestors from the archive; a best the archive does not hold (a run
    checkpointed before the archive existed) is its own one-link chain."""
    best = state.best
    if best is None:
        return []
    chain = search.lineage(search.Archive.from_dicts(state.archive, state.options.device), best.id)
    if chain:
        return chain
    return [
        {
            "step": None,
            "id": best.id,
            "strategy": best.strategy,
            "params": best.params,
            "operator": None,
            "parent": None,
            "speedup_eager": best.speedup_eager,
            "kind": best.kind,
        }
    ]


def _roofline(base: Baseline, final: FinalTiming | None) -> dict[str, Any]:
    """The floor and how close eager, torch.compile and the best run to it (final measurement)."""
    floor = base.floor or {}
    floor_ms = floor.get("floor_ms")
    eager_ms = (final.eager_ms if final else None) or base.eager_ms
    compiled = (final.compile_ms if final else None) or base.compile_ms
    fractions = sol_fractions(floor_ms, eager_ms, compiled)
    if final is not None and final.best_ms:
        fractions["best"] = sol_fraction(floor_ms, final.best_ms)
    return {"work": base.work, "floor": floor, "peaks": base.peaks, "sol_fraction": fractions}


def deliverable(source: str, source_kind: str) -> tuple[str, dict[str, Any]]:
    """``best.py`` and how it is packaged: own Triton kernels behind one ``torch.library.custom_op``
    (so a user's ``torch.compile(fullgraph=True)`` takes the module whole); library and compiler
    candidates as they are."""
    ok, why = packable(source) if source_kind == "kernel" else (False, f"a {source_kind} candidate")
    if not ok:
        return source, {"custom_op": None, "why": why}
    packaged = package(source)
    return packaged, {"custom_op": custom_op_name(packaged), "why": "own Triton kernels"}


def write_report(out_dir: Path, report: Report, best_source: str | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report.model_dump(mode="json"), indent=2, default=str))
    (out_dir / "report.md").write_text(render_markdown(report))
    if best_source is not None:
        (out_dir / "best.py").write_text(best_source)
    elif (out_dir / "best.py").exists():
        (out_dir / "best.py").unlink()


def _ms(v: Any) -> str:
    return "-" if v is None else f"{v:.4g} ms"


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}x"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.0%}"


def _roofline_lines(report: dict[str, Any]) -> list[str]:
    roof = report.get("roofline") or {}
    floor = roof.get("floor") or {}
    diag = report.get("diagnosis") or {}
    lines = ["", "## Speed of light", ""]
    if floor.get("floor_ms"):
        peaks = roof.get("peaks") or {}
        lines.append(
            f"Floor {_ms(floor['floor_ms'])} ({floor['bound']}-bound): {floor['bytes'] / 1e6:.3g} MB compulsory "
            f"traffic at {floor['dram_gbs']:.0f} GB/s, {floor['flops'] / 1e9:.3g} GFLOP at "
            f"{floor['compute_tflops']:.0f} TFLOP/s ({floor['compute_class']}); peaks: {peaks.get('basis')}."
        )
        fr = roof.get("sol_fraction") or {}
        lines.append(
            "Fraction of speed of light: " + ", ".join(f"{k} {_pct(v)}" for k, v in fr.items()) + "."
        )
    else:
        lines.append(f"No floor: {floor.get('reason') or 'no peaks for this device'}.")
    if diag:
        lines.append(
            f"Diagnosis of the {diag.get('subject')}: **{diag.get('bound')}**-bound ({diag.get('metrics_source')})."
        )
        lines += [
            f"- {e['metric']} = {e['value']} {e['unit']} ({e['meaning']})" for e in diag.get("evidence", [])
        ]
        if diag.get("remedies"):
            lines.append("Remedies: " + "; ".join(diag["remedies"]) + ".")
    return lines


_NCU_ROWS = (
    ("kernel time / call", "kernel_time_us", "{:.4g} us"),
    ("launches / call", "launches_per_call", "{:g}"),
    ("DRAM bytes / call", "dram_bytes", "{:.4g}"),
    ("DRAM throughput", "dram_pct", "{:.1f}%"),
    ("L2 throughput", "l2_pct", "{:.1f}%"),
    ("SM throughput", "sm_pct", "{:.1f}%"),
    ("tensor pipe", "tensor_pct", "{:.1f}%"),
    ("achieved occupancy", "achieved_occupancy_pct", "{:.1f}%"),
    ("spills (local ld/st)", "spills", "{:g}"),
)


def _stalls(summary: dict[str, Any]) -> str:
    tops = summary.get("top_stalls", [])
    return ", ".join(f"{t['reason']} {(t.get('share') or 0):.0%}" for t in tops) or "-"


def _ncu_lines(report: dict[str, Any]) -> list[str]:
    ref = (report.get("ncu") or {}).get("reference") or {}
    best = (report.get("ncu") or {}).get("best") or {}
    if not ref.get("available"):
        return ["", f"Nsight Compute: not run ({ref.get('reason', 'not available')})."]
    rs, bs = ref.get("summary") or {}, (best.get("summary") if best.get("available") else None) or {}

    def cell(summary: dict[str, Any], key: str, fmt: str) -> str:
        value = summary.get(key)
        return "-" if value is None else fmt.format(value)

    lines = [
        "",
        f"## Nsight Compute (ncu {ref.get('version')}, clock control {ref.get('clock_control')})",
        "",
    ]
    lines += ["| metric | reference | best |", "|---|---|---|"]
    lines += [f"| {label} | {cell(rs, key, fmt)} | {cell(bs, key, fmt)} |" for label, key, fmt in _NCU_ROWS]
    lines.append(f"| top stalls | {_stalls(rs)} | {_stalls(bs)} |")
    return lines


def render_markdown(record: Report) -> str:
    """report.md: the report's tables and lists as markdown."""
    report = record.model_dump(mode="json")
    best = report["best"]
    base = report["baseline"]
    # One table, one measurement: the final benchmark's eager and compile times when it ran.
    eager_ms = (best or {}).get("eager_ms") or base["eager_ms"]
    compile_ms = (best or {}).get("compile_ms") or base.get("compile_ms") or {}
    lines = [
        f"# kernelcrew report: {report['task']}",
        "",
        f"Status: **{report['status']}** ({report['stop_reason']}). Device: {report['device']}"
        + (f" ({report['gpu_name']}, {report['arch']})" if report.get("gpu_name") else "")
        + f"; precision {report['precision']}; backend {report['backend']}. {report['scope']}.",
        f"Timings: {report['timings_note']}.",
        "",
        "| | time | speedup |",
        "|---|---|---|",
        f"| eager | {_ms(eager_ms)} | 1x |",
    ]
    for mode, ms in compile_ms.items():
        lines.append(
            f"| torch.compile ({mode}) | {_ms(ms)} | {_x(eager_ms / ms if eager_ms and ms else None)} |"
        )
    if best:
        ci = best.get("speedup_eager_ci") or [None, None]
        ci_text = f" [{ci[0]:.3g}, {ci[1]:.3g}]" if None not in ci else ""
        lines.append(
            f"| best: {best['strategy']} ({best['kind']}) | {_ms(best.get('best_ms'))} | "
            f"{_x(best.get('speedup_eager'))}{ci_text} vs eager, {_x(best.get('speedup_compile'))} vs compile |"
        )
    else:
        lines.append(
            "| best | - | "
            + (
                "candidates passed verification, none was significantly faster than eager |"
                if report["status"] == "no_significant_gain"
                else "no candidate passed verification |"
            )
        )
    custom_op = ((best or {}).get("packaging") or {}).get("custom_op")
    if custom_op:
        lines += [
            "",
            f"`best.py` registers its forward as the custom op `{custom_op}`: it works inside `torch.compile`.",
        ]
    lines += _roofline_lines(report) + _ncu_lines(report)
    lines += [
        "",
        "## Steps",
        "",
        "| step | strategy | verdict | stage | time | speedup | new best |",
        "|---|---|---|---|---|---|---|",
    ]
    for it in report["iterations"]:
        lines.append(
            f"| {it.get('step')} | {it.get('strategy')} {json.dumps(it.get('params') or {})} | {it.get('verdict')} | "
            f"{it.get('stage')} | {_ms(it.get('time_ms'))} | {_x(it.get('speedup_eager'))} | {it.get('new_best')} |"
        )
    lines += _lineage_lines(report.get("lineage") or [], report.get("search") or {})
    failures = [it for it in report["iterations"] if it.get("verdict") == "fail"]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- step {it.get('step')} ({it.get('strategy')}): {it.get('message')}" for it in failures]
    if report.get("replies"):
        lines += ["", "## Conversation", "", *report["replies"]]
    lines += _knowledge_lines(report.get("knowledge_base") or {})
    usage = report.get("usage") or {}
    lines += [
        "",
        f"LLM usage: {usage.get('calls', 0)} calls, {usage.get('input_tokens', 0)} input and "
        f"{usage.get('output_tokens', 0)} output tokens, cost {usage.get('cost_usd', 'n/a')}.",
        *(
            [f"The LLM failed and the playbook took over: {usage['llm_fallback']}"]
            if usage.get("llm_fallback")
            else []
        ),
        f"Wall time: {report['elapsed_s']} s{_phase_text(base.get('phase_s') or {})}. "
        f"Reproduce: `{report['reproduce']}`",
        "",
    ]
    return "\n".join(lines)


def _lineage_lines(lineage: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """How the answer was found: its ancestors, each with the operator that made it, and what
    each operator of the search did."""
    if not lineage:
        return []
    lines = ["", "## Lineage of the answer", ""]
    for link in lineage:
        origin = link.get("operator") or "unknown"
        if link.get("parent"):
            origin += f" of {link['parent']}"
        step = f"step {link['step']}" if link.get("step") is not None else "earlier"
        lines.append(
            f"- {step}: {link.get('id')} {link.get('strategy')} {json.dumps(link.get('params') or {})} "
            f"({origin}), {_x(link.get('speedup_eager'))} vs eager"
        )
    ops = summary.get("operators") or {}
    if ops:
        lines += [
            "",
            f"Search: {summary.get('archive_size', 0)} verified candidate(s); "
            + ", ".join(f"{op} {c['verified']}/{c['steps']} verified" for op, c in ops.items())
            + ".",
        ]
    return lines


def _phase_text(phase_s: dict[str, float]) -> str:
    """Where the baseline's seconds went, for the wall-time line."""
    if not phase_s:
        return ""
    return " (baseline: " + ", ".join(f"{k} {v:g} s" for k, v in phase_s.items()) + ")"


def _knowledge_lines(kb: dict[str, Any]) -> list[str]:
    """What the knowledge base offered this run and what the run gave back."""
    recorded = kb.get("recorded")
    if not recorded:
        return []
    lines = ["", "## Knowledge base", ""]
    lines += [f"- hit ({h['match']}): {h['line']}" for h in kb.get("hits", [])] or ["- no hits for this task"]
    if recorded.get("recorded"):
        lines.append(
            f"- this run's win: {recorded['action']} as {recorded['id']} "
            f"({recorded['confirmations']} confirmation(s))"
        )
    else:
        lines.append(f"- this run's win was not recorded: {recorded.get('reason')}")
    return lines
