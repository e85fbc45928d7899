"""The verifier agent: tools only, no LLM verdict. Build, anti-cheat, correctness; pass or a failure."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from langgraph.runtime import Runtime

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.state import CrewState, step_within_s
from kernelcrew.records import VerifyRequest
from kernelcrew.task import TaskError, check_source
from kernelcrew.tools.packaging import unpack


def verify(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Run the verification protocol on the draft through the executor."""
    ctx = runtime.context
    draft = state.draft
    if draft is None:
        raise ValueError("verify reached without a draft")
    path = f"{draft.id}.py"
    unusable = _unusable(draft.source, path)
    if unusable is not None:
        checked = replace(
            draft, verdict="fail", stage=unusable["stage"], message=unusable["message"], failures=[unusable]
        )
    else:
        # The kind comes from the timing that follows a pass (a profile of the timed calls): a
        # profile here too cost a compiled candidate about 20 s on a GPU.
        verdict = ctx.executor.verify(
            ctx.request(
                VerifyRequest,
                state,
                candidate_source=draft.source,
                candidate_path=path,
                profile_kind=False,
                within_s=step_within_s(state),
            )
        )
        checked = replace(
            draft,
            verdict=verdict.verdict,
            stage=verdict.stage,
            message=verdict.message,
            kind=verdict.kind,
            failures=verdict.failures,
            flags=verdict.flags,
            phase_s={**draft.phase_s, **verdict.verify_phases()},
        )
    ctx.emit(
        "verify", candidate=draft.id, verdict=checked.verdict, stage=checked.stage, message=checked.message
    )
    failed = checked.verdict != "pass"
    sample = failed and bool(checked.samples)  # the next sample of the step first: not a repair
    # a round's playbook steps are not the model's to repair: the model's calls stay one at a time
    own = state.plan is None or state.plan.source != "playbook"
    llm = ctx.chat is not None and not state.llm_failure and own
    repair = failed and not sample and state.repairs < state.options.max_repairs and llm
    return {"draft": checked, "repair": sample or repair, "repairs": state.repairs + int(repair)}


def _unusable(source: str, path: str) -> dict[str, Any] | None:
    """A failure for a source that cannot be a candidate (a syntax error: stage ``build``; no
    ``ModelNew`` class: ``input``), found without running it; None when it can go to the tools."""
    try:
        check_source(unpack(source, path)[0], "candidate", path)
    except TaskError as exc:
        stage = "build" if exc.message.startswith("syntax error") else "input"
        return {"stage": stage, "message": str(exc), "details": {"line": exc.line}}
    return None


def route_after_verify(state: CrewState) -> Literal["profile", "code", "decide"]:
    """A pass is profiled; a failure goes back to the coder while repairs remain (with an LLM)."""
    if state.draft is None:
        raise ValueError("no draft after verify")
    if state.draft.verdict == "pass":
        return "profile"
    return "code" if state.repair else "decide"
