"""The round node: the planned step and the round's other steps (``state.batch``), each coded,
verified and timed by the step's own nodes (code -> verify -> profile, repairs included), side by
side in threads, one executor branch each (a GPU of this machine, or a connection to the workers).
Decide then takes their outcomes in plan order, as if they had come one after another."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from langgraph.graph import END, START, StateGraph
from langgraph.runtime import Runtime

from kernelcrew.agents.coder import code, route_after_code
from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.profiler import profile
from kernelcrew.agents.state import CrewState, PlanStep
from kernelcrew.agents.verifier import route_after_verify, verify
from kernelcrew.tools.executor import branch


def add_step(builder: StateGraph, done: str) -> None:
    """One step's nodes, code -> verify -> profile (a failed verify back to code while repairs
    remain), ending at ``done``: the crew's graph and each step of a round run these."""
    builder.add_node("code", code)
    builder.add_node("verify", verify)
    builder.add_node("profile", profile)
    builder.add_conditional_edges("code", route_after_code, {"verify": "verify", "decide": done})
    builder.add_conditional_edges(
        "verify", route_after_verify, {"profile": "profile", "code": "code", "decide": done}
    )
    builder.add_edge("profile", done)


@functools.cache
def _step_graph() -> Any:
    """One step alone, from its plan to its timed draft."""
    builder = StateGraph(CrewState, context_schema=CrewContext)
    add_step(builder, END)
    builder.add_edge(START, "code")
    return builder.compile()


def evaluate_round(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Run the round's steps side by side; their drafts go to decide in ``evaluated``."""
    ctx = runtime.context
    if state.plan is None:
        raise ValueError("evaluate_round reached without a plan")
    steps = [state.plan, *state.batch]
    ctx.emit("round", steps=len(steps), strategies=[s.strategy for s in steps])

    def one(k: int, step: PlanStep) -> dict[str, Any]:
        start = replace(
            state, plan=step, batch=[], steps_used=state.steps_used + k, draft=None, repairs=0, repair=False
        )
        return _step_graph().invoke(start, context=replace(ctx, executor=branch(ctx.executor, k)))

    with ThreadPoolExecutor(len(steps), thread_name_prefix="round") as pool:
        ends = list(pool.map(one, range(len(steps)), steps))
    update: dict[str, Any] = {
        "batch": [],
        "evaluated": [
            {"plan": step, "draft": end["draft"], "repairs": end["repairs"]}
            for step, end in zip(steps, ends, strict=True)
        ],
    }
    failure = next((end["llm_failure"] for end in ends if end.get("llm_failure")), "")
    if failure and not state.llm_failure:
        update["llm_failure"] = failure
    if ctx.meter is not None:
        update["usage"] = ctx.meter.to_dict()
    return update
