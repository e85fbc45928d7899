"""Decide: keep the step's candidate if it is the new best, record the step, stop or go on.

On a GPU a candidate becomes the best only when its speedup over eager is significant (the lower
bound of its 95% interval above 1) and it beats the best so far by more than the noise of both
timings. On a CPU, interpreter timings never drive a decision: the first verified candidate is
kept, an own kernel preferred over a library or compiler one, and its timings are labelled CPU.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from langgraph.runtime import Runtime

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.planner import step_key
from kernelcrew.agents.profiler import diagnose
from kernelcrew.agents.state import Candidate, CrewState

KIND_RANK = {"kernel": 0, "hybrid": 1, "library": 2, "compiler": 3}
NOISE = 0.02
"""Relative gain below which a faster candidate is not better: the timer's spread (see docs/benchmarks.md)."""


def is_better(new: Candidate, best: Candidate | None, device: str) -> bool:
    """Whether ``new`` (verified and timed) should replace ``best``."""
    if new.verdict != "pass":
        return False
    if device == "cpu":
        if best is None:
            return True
        return KIND_RANK.get(new.kind or "", len(KIND_RANK)) < KIND_RANK.get(best.kind or "", len(KIND_RANK))
    if not new.significant or new.time_ms is None:
        return False
    if best is None or best.time_ms is None:
        return True
    return new.time_ms < best.time_ms * (1 - NOISE)


def decide(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Record the finished step, update the best, and set ``stop_reason`` when the run is done."""
    ctx = runtime.context
    opts = state.options
    update: dict[str, Any] = {"draft": None, "plan": None, "repair": False}
    steps = state.steps_used
    best = state.best
    draft = state.draft
    since_gain = state.since_gain
    elapsed = time.time() - state.started_at if state.started_at else 0.0
    if state.plan is not None or draft is not None:
        steps += 1
        record: dict[str, Any] = {"step": steps, "elapsed_s": round(elapsed, 1)}
        if draft is not None:
            record.update(draft.summary())
            record["repairs"] = state.repairs
        if state.plan is not None:
            record.update(
                strategy=state.plan.strategy, params=state.plan.params, rationale=state.plan.rationale
            )
            update["tried"] = [*state.tried, step_key(state.plan.strategy, state.plan.params)]
        gained = draft is not None and is_better(draft, best, opts.device)
        record["new_best"] = gained
        if gained:
            best = draft
            update["best"] = draft
            since_gain = 0
        else:
            since_gain += 1
        update["iterations"] = [record]
        ctx.emit(
            "decide",
            step=steps,
            strategy=record.get("strategy"),
            verdict=record.get("verdict"),
            new_best=gained,
        )
    stop = state.stop_reason
    max_iters = opts.max_iters
    if not stop:
        if steps >= max_iters:
            stop = f"iteration budget reached ({max_iters})"
        elif elapsed >= opts.time_budget_s:
            stop = f"time budget reached ({opts.time_budget_s:g} s)"
        elif since_gain >= opts.patience and opts.device != "cpu" and best is not None:
            stop = f"{since_gain} steps without a gain beyond noise"
    update.update(
        steps_used=steps,
        since_gain=since_gain,
        elapsed_s=round(elapsed, 1),
        stop_reason=stop,
        diagnosis=diagnose(state.baseline, best),
    )
    if ctx.meter is not None:
        update["usage"] = ctx.meter.to_dict()
    return update


def route_after_decide(state: CrewState) -> Literal["plan", "finalize"]:
    """Finalize once a stop reason is set, else plan the next step."""
    return "finalize" if state.stop_reason else "plan"
