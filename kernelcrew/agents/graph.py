"""The crew's workflow: profile_baseline -> plan -> code -> verify -> profile -> decide -> plan | finalize.

With ``Options.parallel`` > 1 a plan of several steps goes to evaluate_round instead, which runs
each step's code -> verify -> profile side by side (:mod:`kernelcrew.agents.rounds`) before decide.

When the baseline measured torch.compile faster than eager and a first step, the compiler's
candidate and the final timing all fit the budget, the steps come first (each must fit with the
fallback's time kept) and the run ends through fall_back unless a step beat the compile. Otherwise
its candidate is verified first (fall_back, the run's insurance: whatever the budget allows later,
the run has an answer) and the steps that follow must beat it and fit the budget; a run that ends
without an answer goes through fall_back again only when that first attempt gave no verdict (no
compiler candidate could be made)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Literal

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.decide import decide, fall_back, finish, route_after_decide
from kernelcrew.agents.planner import fallback_step, plan, step_before_fallback
from kernelcrew.agents.profiler import profile_baseline
from kernelcrew.agents.rounds import add_step, evaluate_round
from kernelcrew.agents.state import CrewState

#: The state's own types, allowed when a checkpoint is read back (nothing else is unpickled).
STATE_TYPES = [
    ("kernelcrew.agents.state", "Options"),
    ("kernelcrew.agents.state", "Candidate"),
    ("kernelcrew.agents.state", "PlanStep"),
    ("kernelcrew.agents.state", "CrewState"),
    ("kernelcrew.records", "Baseline"),
    ("kernelcrew.records", "Report"),
]


def route_after_plan(state: CrewState) -> Literal["code", "evaluate_round", "decide"]:
    """A step goes to the coder, a round of several to evaluate_round; no step (none left, the user
    said stop, a failed plan) to decide."""
    if state.plan is None:
        return "decide"
    return "evaluate_round" if state.batch else "code"


def route_after_baseline(state: CrewState) -> Literal["fall_back", "plan"]:
    """The compiler's measured win first, when there is one and no room for a step before it (see
    the module docstring)."""
    return "fall_back" if fallback_step(state) is not None and not step_before_fallback(state) else "plan"


def route_after_fall_back(state: CrewState) -> Literal["plan", "finalize"]:
    """Steps follow the first fallback (unless it used the last one); the one at the end of a run
    finalizes."""
    return "finalize" if state.stop_reason or state.steps_used >= state.options.max_iters else "plan"


def build_graph() -> StateGraph:
    """The uncompiled builder: callers compile it with their own checkpointer."""
    builder = StateGraph(CrewState, context_schema=CrewContext)
    builder.add_node("profile_baseline", profile_baseline)
    builder.add_node("plan", plan)
    builder.add_node("evaluate_round", evaluate_round)
    builder.add_node("decide", decide)
    builder.add_node("fall_back", fall_back)
    builder.add_node("finalize", finish)
    add_step(builder, "decide")

    builder.add_edge(START, "profile_baseline")
    builder.add_conditional_edges("profile_baseline", route_after_baseline)
    builder.add_conditional_edges("plan", route_after_plan)
    builder.add_edge("evaluate_round", "decide")
    builder.add_conditional_edges("decide", route_after_decide)
    builder.add_conditional_edges("fall_back", route_after_fall_back)
    builder.add_edge("finalize", END)
    return builder


def serializer() -> JsonPlusSerializer:
    return JsonPlusSerializer(allowed_msgpack_modules=STATE_TYPES)


def sqlite_checkpointer(path: Path) -> SqliteSaver:
    """LangGraph's SQLite saver on ``path`` (thread id = run id)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return SqliteSaver(sqlite3.connect(str(path), check_same_thread=False), serde=serializer())


def compile_graph(checkpointer, *, pause_before_plan: bool = False):
    """The compiled graph; ``pause_before_plan`` stops before each plan so a user can add guidance."""
    return build_graph().compile(
        checkpointer=checkpointer, interrupt_before=["plan"] if pause_before_plan else None
    )


__all__ = ["CrewContext", "build_graph", "compile_graph", "sqlite_checkpointer"]
