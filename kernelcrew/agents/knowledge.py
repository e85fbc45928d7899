"""The crew's use of the knowledge base: hits for the planner, the run's win recorded by finalize.

Both go through the run's :class:`~kernelcrew.knowledge_base.KnowledgeBase` handle
(``CrewContext.kb``; None when the run was asked for ``--no-kb``). The knowledge base is a help,
not a requirement: a database that fails mid-run is reported as an ``error`` event and the run
goes on without it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.profiler import assess_subject
from kernelcrew.agents.state import CrewState
from kernelcrew.knowledge_base import WinRefused, from_analysis, hit_line
from kernelcrew.knowledge_base.db import DatabaseError
from kernelcrew.records import FinalTiming
from kernelcrew.tools.roofline import sol_fraction

BOTTLENECKS = ("memory", "compute", "latency", "launch")


def device_of(state: CrewState) -> tuple[str | None, str]:
    """(GPU model, architecture) the run measures on; ``("cpu", "cpu")`` on a CPU."""
    if state.options.device == "cpu":
        return "cpu", "cpu"
    hardware = state.baseline.hardware
    return hardware.get("model"), hardware.get("arch") or state.baseline.arch or "sm_90"


def task_hits(state: CrewState, ctx: CrewContext, k: int = 5) -> list[dict[str, Any]]:
    """The top hits for the task's pattern on this device, each with a one-line ``line``."""
    if ctx.kb is None:
        return []
    gpu_model, arch = device_of(state)
    try:
        hits = ctx.kb.hits_for_task(state.baseline.analysis, gpu_model, arch, k=k)
    except DatabaseError as exc:
        ctx.emit("error", node="plan", message=f"knowledge base unavailable: {exc}")
        return []
    found = [{**h, "line": hit_line(h)} for h in hits]
    ctx.emit("kb", hits=[{"id": h["id"], "match": h["match"], "line": h["line"]} for h in found])
    return found


def hits_text(hits: list[dict[str, Any]]) -> str:
    """The planner prompt's knowledge-base section: one line per hit."""
    if not hits:
        return "nothing recorded yet for this pattern on this architecture"
    return "\n".join(f"- {h['line']}" for h in hits)


def record_best(state: CrewState, ctx: CrewContext, final: FinalTiming | None) -> dict[str, Any]:
    """Store the best candidate as a win if it passed verification and the final timing shows a gain.

    On a GPU the gain must be significant; on a CPU the verified best is recorded with its
    ``cpu-wall`` clock (retrievable by CPU jobs, never shown as a GPU speedup). Returns what
    happened: ``{"recorded": True, "id", "action", "confirmations"}`` or ``{"recorded": False,
    "reason"}``.
    """
    best = state.best
    if ctx.kb is None:
        return {"recorded": False, "reason": "knowledge base disabled for this run"}
    if best is None or best.verdict != "pass":
        return {"recorded": False, "reason": "no candidate passed verification"}
    if final is None:
        return {"recorded": False, "reason": "the best candidate was not timed again"}
    if final.failure is not None:
        return {"recorded": False, "reason": f"the final timing failed: {final.failure.message}"}
    if final.clock != "cpu-wall" and not final.significant:
        return {"recorded": False, "reason": "not significantly faster than eager in the final timing"}
    gpu_model, arch = device_of(state)
    sig = from_analysis(state.baseline.analysis)
    step = next((it for it in state.iterations if it.get("id") == best.id), {})
    reading = assess_subject(state.baseline)  # the reference's bottleneck, before the win
    bottleneck = "launch" if reading["bound"] == "launch overhead" else reading["bound"]
    fraction = sol_fraction(state.baseline.floor_ms, final.best_ms)
    ncu = best.ncu.get("summary") if best.ncu and best.ncu.get("available") else None
    win = {
        "gpu_model": gpu_model or "unknown-gpu",
        "arch": arch,
        "signature": sig.text,
        "pattern_kinds": [sig.kind],
        "strategy": re.sub(r"[^\w:.+ -]", "-", best.strategy)[:80],
        "candidate_source": best.source,
        "description": f"{Path(state.task_path).name}: {step.get('rationale') or best.strategy}"[:4000],
        "tags": list(dict.fromkeys(t for t in (best.source_kind, best.kind, state.options.precision) if t)),
        "params": dict(best.params),
        "versions": dict(state.baseline.versions),
        "bottleneck": bottleneck if bottleneck in BOTTLENECKS else None,
        "source_kind": best.kind,
        "job_id": ctx.run_id[:64] or None,
        "sol_fraction": fraction if final.clock != "cpu-wall" and fraction and fraction <= 2 else None,
        "ncu_summary": {k: v for k, v in ncu.items() if k != "kernels"} if ncu else None,
    }
    verdict = {
        "verdict": best.verdict,
        "stage": best.stage,
        "baseline_ms": final.eager_ms,
        "candidate_ms": final.best_ms,
        "speedup": final.speedup_eager,
        "speedup_significant": final.significant,
        "speedup_vs_compile": final.speedup_compile,
        "clock": final.clock,
    }
    try:
        result = ctx.kb.record_win(win, verdict=verdict)
    except WinRefused as exc:
        return {"recorded": False, "reason": str(exc)}
    except DatabaseError as exc:
        ctx.emit("error", node="finalize", message=f"knowledge base unavailable: {exc}")
        return {"recorded": False, "reason": f"knowledge base unavailable: {exc}"}
    ctx.emit("kb_record", **result.to_dict())
    return {"recorded": True, **result.to_dict()}
