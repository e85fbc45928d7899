"""Decide: keep the step's candidate if it is the new best, record the step, stop or go on; at the
end, never empty-handed, and the final report inside the time budget.

On a GPU a candidate becomes the best only when its speedup over eager is significant (the lower
bound of its 95% interval above 1) and it beats the best so far by more than the noise of both
timings. On a CPU, interpreter timings never drive a decision: the first verified candidate is
kept, an own kernel preferred over a library or compiler one, and its timings are labelled CPU.
Every verified candidate also goes into the search's archive with its step's parent and operator
(:mod:`kernelcrew.agents.search`, which chooses what the next step varies); the rules that stop
a run are :func:`kernelcrew.agents.search.stop_reason`'s.

When the baseline measured torch.compile faster than eager, the compiler candidate is verified
first, with the baseline's times of the same compile (``fall_back``), so the run has an answer
whatever the budget allows later; a run that stops without a best (that first attempt did not
fit) tries it again at the end. ``finish``
runs the final report with what the budget still affords and says in it what the budget covered
and what the answer is (a candidate, the compiler's, or the reference itself).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

from langgraph.runtime import Runtime

from kernelcrew.agents import search
from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.planner import (
    GRACE,
    NOISE,
    TIMED_IN_BASELINE,
    baseline_seconds,
    compiler_strategies,
    fallback_mode,
    fallback_step,
    final_reserve_s,
    modelled_seconds,
    reference_timing_s,
    refused_by_user,
    step_key,
    timed_in_baseline,
    wants_parity_answer,
)
from kernelcrew.agents.profiler import NCU_COST, diagnose, with_ncu
from kernelcrew.agents.prompts.sections import ncu_text
from kernelcrew.agents.state import Candidate, CrewState, apply_update, merge_updates
from kernelcrew.records import FinalTiming, Report, VerifyRequest

KIND_RANK = search.KIND_RANK


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


def at_parity(new: Candidate, runner_up: Candidate | None) -> bool:
    """Whether ``new`` (verified and timed on a GPU, not significantly faster than eager) should
    replace ``runner_up``: its speedup's interval reaches 1 (not significantly slower than eager),
    or it is slower by less than ``NOISE`` (the gain a better answer must show), and it is faster
    than the runner-up."""
    if new.verdict != "pass" or new.time_ms is None or new.speedup_eager is None:
        return False
    ci = new.speedup_eager_ci or []
    high = ci[1] if len(ci) == 2 and ci[1] is not None else new.speedup_eager * (1 + NOISE)
    if high < 1.0 and new.speedup_eager < 1.0 - NOISE:
        return False
    return runner_up is None or runner_up.time_ms is None or new.time_ms < runner_up.time_ms


def decide(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Record the finished step (a round's steps one after another, in plan order), update the
    best, and set ``stop_reason`` when the run is done."""
    if not state.evaluated:
        return _decide_step(state, runtime)
    update: dict[str, Any] = {"evaluated": []}
    current = replace(state, evaluated=[])
    for done in state.evaluated:
        current = replace(current, plan=done["plan"], draft=done["draft"], repairs=done["repairs"])
        step = _decide_step(current, runtime)
        # the round's first step number: its records share the round's seconds (the first holds them)
        step["iterations"] = [{**r, "round": state.steps_used + 1} for r in step.get("iterations", [])]
        current = apply_update(current, step)
        update = merge_updates(update, step)
    return update


def _decide_step(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    ctx = runtime.context
    opts = state.options
    update: dict[str, Any] = {"draft": None, "plan": None, "repair": False, "step_ends_at": 0.0}
    steps = state.steps_used
    best = state.best
    draft = state.draft
    since_gain = state.since_gain
    elapsed = time.time() - state.started_at if state.started_at else 0.0
    if state.plan is not None or draft is not None:
        steps += 1
        record: dict[str, Any] = {
            "step": steps,
            "elapsed_s": round(elapsed, 1),
            "seconds": round(max(0.0, elapsed - _last_mark(state)), 1),
        }
        if draft is not None:
            record.update(draft.summary())
            record["repairs"] = state.repairs
            record["ncu_text"] = ncu_text(draft.ncu)  # the planner's history shows every candidate's
        if state.plan is not None:
            record.update(
                strategy=state.plan.strategy,
                params=state.plan.params,
                rationale=state.plan.rationale,
                operator=state.plan.operator,
                parent=state.plan.parent,
            )
            update["tried"] = [*state.tried, step_key(state.plan.strategy, state.plan.params)]
        if draft is not None and draft.verdict == "pass":
            plan = state.plan
            entry = search.Entry.from_candidate(
                draft,
                steps,
                plan.parent if plan is not None else None,
                plan.operator if plan is not None else "new_strategy",
            )
            update["archive"] = [entry.to_dict()]
        gained = draft is not None and is_better(draft, best, opts.device)
        record["new_best"] = gained
        if gained:
            best = draft
            update["best"] = draft
            since_gain = 0
        else:
            since_gain += 1
            parity = best is None and draft is not None and opts.device != "cpu"
            if parity and at_parity(draft, state.runner_up):
                update["runner_up"] = draft
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
        stop = search.stop_reason(
            device=opts.device,
            steps=steps,
            max_iters=max_iters,
            elapsed_s=elapsed,
            time_budget_s=opts.time_budget_s,
            since_gain=since_gain,
            patience=opts.patience,
            best_sol_fraction=best.sol_fraction if best is not None else None,
            has_best=best is not None,
        )
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


def _last_mark(state: CrewState) -> float:
    """Seconds into the run at which the last step (or the baseline) ended."""
    marks = [r["elapsed_s"] for r in state.iterations if r.get("elapsed_s") is not None]
    return marks[-1] if marks else baseline_seconds(state)


def route_after_decide(state: CrewState) -> Literal["plan", "fall_back", "finalize"]:
    """Plan the next step until a stop reason is set; then the fallback when the run has no answer
    but the baseline measured one, else finalize."""
    if not state.stop_reason:
        return "plan"
    return "fall_back" if fallback_step(state) is not None else "finalize"


def fall_back(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Verify the compiler candidate the baseline measured faster than eager, and keep it as the
    answer if it passes (its time is the baseline's of the same compile: :func:`timed_by_baseline`).

    A step that already verified it is not verified again (its timing stands until the final
    one). Right after the baseline (when no step fits before it) it always runs: it is the
    cheapest answer the run can be sure of, and a heavy task whose baseline left no room for it
    went on to a first step anyway and ended past the budget with nothing (the steps after it must
    fit the budget). At the end of a run, with no answer or a step's answer it is faster than, it
    runs when it ends inside the budget plus the run's tolerance (``GRACE``); otherwise the report
    says why it did not. A compile the baseline timed at parity with eager, at the end of a GPU run
    with no answer at all (:func:`~kernelcrew.agents.planner.wants_parity_answer`), is kept as the
    runner-up when it verifies: the run's answer at parity, never its best.
    """
    from kernelcrew.agents.playbook.compiler import generate_compiled

    ctx = runtime.context
    step = fallback_step(state)
    mode = fallback_mode(state)
    if step is None or mode is None:
        raise ValueError(
            "fall_back reached without a measured configuration faster than eager (or at parity at the end)"
        )
    started = time.time()
    opts = state.options
    used = started - state.started_at if state.started_at else 0.0
    prior = next(
        (r for r in state.iterations if r.get("strategy") == step.strategy and r.get("verdict") == "pass"),
        None,
    )
    expected = 0.0 if prior else modelled_seconds(state, step)
    note: dict[str, Any] = {"strategy": step.strategy, "mode": mode, "why": step.rationale}
    if state.stop_reason and used + expected > opts.time_budget_s * (1 + GRACE):
        note["skipped"] = (
            f"not verified: it would take about {expected:.0f} s and the run has used {used:.0f} s "
            f"of its {opts.time_budget_s:g} s budget"
        )
        return {"budget": {**state.budget, "fallback": note}}
    ctx.emit("node", node="fall_back", message=step.rationale)
    try:
        source = generate_compiled(state.task_source, mode)
    except ValueError as exc:
        note["skipped"] = f"no compiler candidate: {exc}"
        return {"budget": {**state.budget, "fallback": note}}
    cand = Candidate(id="fallback", strategy=step.strategy, source_kind="compiler", source=source)
    if prior is not None:
        cand = replace(
            cand,
            verdict="pass",
            stage=prior.get("stage") or "done",
            message=prior.get("message") or "",
            kind=prior.get("kind"),
            time_ms=prior.get("time_ms"),
            speedup_eager=prior.get("speedup_eager"),
            significant=bool(prior.get("significant")),
            flags=list(prior.get("flags") or []),
        )
        note["verified_in_step"] = prior.get("step")
        timed = cand
    else:
        # kernelcrew's own torch.compile of the reference: its kind is known, and profiling it
        # cost about 20 s on a GPU; the calls with autograd on and in inference mode compile it
        # again for each mode (the checks where they run took 36 s of ResNet101's 66 s
        # verification on an H100), and a compile of the user's own module has no cheat to catch.
        verdict = ctx.executor.verify(
            ctx.request(
                VerifyRequest,
                state,
                candidate_source=source,
                candidate_path="fallback.py",
                profile_kind=False,
                mode_checks=False,
            )
        )
        cand.verdict, cand.stage, cand.message = verdict.verdict, verdict.stage, verdict.message
        cand.kind, cand.failures, cand.flags = "compiler", verdict.failures, verdict.flags
        note["phase_s"] = verdict.verify_phases()
        ctx.emit("verify", candidate=cand.id, verdict=cand.verdict, stage=cand.stage, message=cand.message)
        timed = timed_by_baseline(state, cand, mode) if cand.verdict == "pass" else cand
    kept = timed.verdict == "pass" and (opts.device == "cpu" or (timed.speedup_eager or 0.0) > 1.0)
    # not faster than eager, at the end of a run with no answer: its answer at parity, never its best
    parity = not kept and wants_parity_answer(state) and timed.verdict == "pass" and at_parity(timed, None)
    if parity:
        note["kept_at_parity"] = True
    elif kept and state.best is not None and not (timed.time_ms or 0.0) < (state.best.time_ms or 0.0):
        kept = False  # a step's answer came first and is as fast
        note["skipped"] = f"verified, but no faster than the answer {state.best.id}: not returned"
    elif not kept:
        note["skipped"] = (
            f"verified but timed at {timed.speedup_eager or 0:.3g}x eager: not returned"
            if timed.verdict == "pass"
            else f"failed {timed.stage}: {timed.message[:300]}"
        )
    elapsed = time.time() - state.started_at if state.started_at else 0.0
    note["seconds"] = round(time.time() - started, 1)
    record = {
        "step": state.steps_used + 1,
        "elapsed_s": round(elapsed, 1),
        "seconds": note["seconds"],
        **timed.summary(),
        "strategy": step.strategy,
        "rationale": step.rationale,
        "fallback": True,
        "operator": "fallback",
        "new_best": kept,
    }
    ctx.emit("decide", step=record["step"], strategy=step.strategy, verdict=timed.verdict, new_best=kept)
    update: dict[str, Any] = {
        "iterations": [record],
        "steps_used": state.steps_used + 1,
        "elapsed_s": round(elapsed, 1),
        "budget": {**state.budget, "fallback": note},
    }
    if prior is None and timed.verdict == "pass":
        entry = search.Entry.from_candidate(timed, record["step"], None, "fallback")
        update["archive"] = [entry.to_dict()]
    if kept:
        update["best"] = timed
        update["diagnosis"] = diagnose(state.baseline, timed)
    elif parity:
        update["runner_up"] = timed
    return update


def timed_by_baseline(state: CrewState, cand: Candidate, mode: str) -> Candidate:
    """The verified compiler fallback with the baseline's times of the same compile: the reference's
    process compiled the module in ``mode`` and timed it against eager, interleaved (its paired
    speedup and interval are the answer's). A timing run of its own, or a final one
    (:func:`already_timed`), would repeat that measurement at the price of another compile and
    timing run out of the budget."""
    base = state.baseline
    compiled, eager = base.compile_ms[mode], base.eager_ms
    flag = f"{TIMED_IN_BASELINE} (torch.compile of the reference in its own process, against eager)"
    if base.clock == "cpu-wall":
        flag += "; CPU timings (wall clock): not GPU speedups"
    ratio = base.compile_ratios.get(mode)
    if ratio:  # the baseline's paired rounds: the same interval and test as any candidate's
        speedup, ci, significant = ratio["median"], [ratio["ci_low"], ratio["ci_high"]], ratio["significant"]
    else:  # a baseline recorded before its ratios were kept
        speedup = eager / compiled if eager and compiled else None
        ci, significant = None, bool(eager and compiled < eager * (1 - NOISE))
    return replace(
        cand,
        time_ms=compiled,
        speedup_eager=speedup,
        speedup_eager_ci=ci,
        significant=bool(significant),
        speedup_compile=1.0,
        flags=[*cand.flags, flag],
    )


def finish(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """The final report (``report.finalize``), its timing cut to what the budget still affords, with
    what the budget covered (``report.budget``) and what the answer is (``report.answer``).

    The final timing re-times every torch.compile mode, which is what makes it long: when the
    expected full timing no longer fits, the best is timed against eager only (quick when even that
    does not fit) and its speedup over torch.compile comes from the baseline's compile times. An
    answer whose times already stand (:func:`already_timed`) is not timed again.
    """
    from kernelcrew.agents.report import deliverable, finalize, write_report

    ctx = runtime.context
    opts = state.options
    started = time.time()
    promoted = state.best is None and state.runner_up is not None
    if promoted:
        state = replace(state, best=state.runner_up)
    profiled, ncu_note = profile_answer(state, ctx)
    if profiled is not state.best:
        state = replace(state, best=profiled)
    used = time.time() - state.started_at if state.started_at else 0.0
    left = opts.time_budget_s - used
    final: dict[str, Any] = {"compile_modes": list(opts.compile_modes), "quick": opts.quick, **ncu_note}
    timed_state = state
    measured, why = already_timed(state, left)
    if measured is not None:
        final = {"compile_modes": [], "quick": False, "timed": False, "note": why, **ncu_note}
    elif state.best is not None and opts.compile_modes and final_reserve_s(state) > left:
        quick = opts.quick or 2.0 * reference_timing_s(state) > left
        timed_state = replace(state, options=replace(opts, compile_modes=[], quick=quick))
        final = {
            "compile_modes": [],
            "quick": quick,
            "note": f"{max(left, 0):.0f} s left of the budget: the best was timed against eager only"
            + (" (quick)" if quick and not opts.quick else "")
            + ", its speedup over torch.compile is against the baseline's compile times",
        }
    update = finalize(timed_state, _without_out_dir(ctx), measured)
    report: Report = update["report"]
    best = report.best
    timed_modes = best.compile_ms if best is not None else {}
    from_baseline = {m: ms for m, ms in state.baseline.compile_ms.items() if m not in timed_modes}
    if best is not None and best.best_ms and from_baseline:
        # modes the final timing did not time again (cut, or optional ones the baseline afforded)
        best.compile_ms = {**best.compile_ms, **from_baseline}
        best.speedup_compile = min(best.compile_ms.values()) / best.best_ms
        final["compile_ms_from_baseline"] = sorted(from_baseline)
    ended = time.time()
    final["seconds"] = round(ended - started, 1)
    report.elapsed_s = round(ended - state.started_at, 1) if state.started_at else report.elapsed_s
    report.budget = budget_account(state, final, report.elapsed_s)
    report.answer = answer(state, report)
    ctx.emit("answer", **report.answer)
    if ctx.out_dir is not None:
        best_py = deliverable(state.best.source, state.best.source_kind)[0] if report.best else None
        write_report(ctx.out_dir, report, best_py)
        with (ctx.out_dir / "report.md").open("a") as md:
            md.write("\n".join(budget_lines(report)) + "\n")
    return {**update, "report": report, **({"best": state.best} if promoted or ncu_note.get("ncu_s") else {})}


def already_timed(state: CrewState, left_s: float) -> tuple[FinalTiming | None, str]:
    """The best's times as already measured, and why they stand, where a final timing run would only
    spend time: a compiler answer the baseline timed (its own process compiled that same module and
    timed it against eager, interleaved: the final run would time the same pair again), or any
    answer with a timing of its own once the run has used its budget (the final run would take it
    past it). The answer's speedup over eager is then its paired one, eager's and torch.compile's
    times the baseline's. None where the best has no timing to stand on: it is timed as usual."""
    best, base = state.best, state.baseline
    if best is None or not best.time_ms or not best.speedup_eager:
        return None, ""
    if timed_in_baseline(best):
        why = (
            "the answer is the baseline's own torch.compile, timed there against eager in one "
            "process: not timed again"
        )
    elif left_s <= 0:
        why = (
            f"the run had used its {state.options.time_budget_s:g} s budget: the answer was not timed "
            "again; its times are its step's timing run (against eager, interleaved) and the "
            "baseline's eager and torch.compile times"
        )
    else:
        return None, ""
    compiled = dict(base.compile_ms)
    return (
        FinalTiming(
            clock=base.clock,
            eager_ms=base.eager_ms,
            compile_ms=compiled,
            best_ms=best.time_ms,
            speedup_eager=best.speedup_eager,
            speedup_eager_ci=list(best.speedup_eager_ci or []),
            significant=best.significant,
            speedup_compile=min(compiled.values()) / best.time_ms if compiled else None,
        ),
        why,
    )


def profile_answer(state: CrewState, ctx: CrewContext) -> tuple[Candidate | None, dict[str, Any]]:
    """The best with Nsight Compute's reading of it, for the report, when a GPU run's best has none
    yet (a playbook run profiles only its answer: :func:`~kernelcrew.agents.profiler.profiles_each_candidate`)
    and the profile fits the budget before the final timing's share; and what the budget note says."""
    best = state.best
    if best is None or best.ncu or not state.baseline.ncu.get("available"):
        return best, {}
    expected = NCU_COST * reference_timing_s(state)
    used = time.time() - state.started_at if state.started_at else 0.0
    left = state.options.time_budget_s - used - final_reserve_s(state)
    if expected > left:
        return best, {
            "ncu": f"Nsight Compute of the answer not run: it would take about {expected:.0f} s, and "
            f"{max(left, 0):.0f} s of the budget are left before the final timing"
        }
    profiled = with_ncu(state, ctx, best)
    return profiled, {"ncu_s": profiled.phase_s.get("ncu")}


def _without_out_dir(ctx: CrewContext) -> Any:
    """The runtime ``finalize`` sees: ``ctx`` without an output folder (``finish`` writes the files
    once the report is complete)."""
    from types import SimpleNamespace

    return SimpleNamespace(context=replace(ctx, out_dir=None))


def budget_account(state: CrewState, final: dict[str, Any], total_s: float) -> dict[str, Any]:
    """What the time budget covered: the baseline (its share, its seconds, what it skipped and why),
    each step, the fallback, the final timing, and the total against the budget."""
    budget = state.options.time_budget_s
    steps = [
        {
            "step": r.get("step"),
            "strategy": r.get("strategy"),
            "seconds": r.get("seconds"),
            "phase_s": r.get("phase_s") or {},
        }
        for r in state.iterations
        if r.get("step") and not r.get("fallback")
    ]
    fallback = state.budget.get("fallback")
    return {
        "time_budget_s": budget,
        "baseline_share": state.budget.get("baseline_share", state.options.baseline_share),
        "baseline_budget_s": state.budget.get("baseline_budget_s"),
        "baseline_s": state.budget.get("baseline_s"),
        "baseline_phase_s": state.baseline.phase_s,
        "baseline_skipped": state.budget.get("baseline_skipped", {}),
        "steps": steps,
        "steps_s": round(sum(s["seconds"] or 0.0 for s in steps), 1),
        "fallback": fallback,
        "fallback_s": (fallback or {}).get("seconds", 0.0),
        "final_timing": final,
        "final_timing_s": final["seconds"],
        "total_s": total_s,
        "within_budget": total_s <= budget,
        "within_tolerance": total_s <= budget * (1 + GRACE),
    }


def answer(state: CrewState, report: Report) -> dict[str, str]:
    """What the user gets: ``candidate`` (a verified candidate of the run), ``compiler`` (the
    fallback: torch.compile of the reference, verified) or ``reference`` (nothing measured beat
    eager: the module as written), with the reason in one sentence."""
    best = report.best
    fallback = state.budget.get("fallback") or {}
    if best is not None and best.id == "fallback":
        return {
            "answer": "compiler",
            "why": f"no faster candidate of the run was verified; {fallback.get('why', '')}",
        }
    if best is not None and state.runner_up is not None and best.id == state.runner_up.id:
        return {
            "answer": "candidate",
            "why": f"{best.strategy} ({best.kind}), verified: the fastest verified candidate, not "
            "significantly slower than eager (no step's timing showed one significantly faster)",
        }
    if best is not None:
        return {"answer": "candidate", "why": f"{best.strategy} ({best.kind}), verified"}
    eager = state.baseline.eager_ms
    compiled = state.baseline.compile_ms
    mode = fallback_mode(state)
    refused = refused_by_user(state, compiler_strategies()[mode]) if mode else ""
    if fallback.get("skipped"):
        why = (
            f"torch.compile ({fallback.get('mode')}) beat eager in the baseline but was {fallback['skipped']}"
        )
    elif refused:
        why = f"torch.compile ({mode}) beat eager in the baseline, but {refused}"
    elif compiled and eager:
        mode, ms = min(compiled.items(), key=lambda kv: kv[1])
        why = f"nothing measured beat eager: torch.compile ({mode}) ran at {eager / ms:.2f}x eager"
    else:
        why = "no candidate was verified faster than eager, and no torch.compile baseline was timed"
    return {"answer": "reference", "why": why + "; the answer is the reference, your module as written"}


def budget_lines(report: Report) -> list[str]:
    """report.md's account of the answer and of the time budget."""
    budget: dict[str, Any] = getattr(report, "budget", None) or {}
    ans: dict[str, str] = getattr(report, "answer", None) or {}
    lines = ["", "## Answer and budget", ""]
    if ans:
        lines.append(f"Answer: **{ans['answer']}**: {ans['why']}.")
    if budget:
        lines.append(
            f"Budget {budget['time_budget_s']:g} s, used {budget['total_s']:g} s: baseline "
            f"{budget.get('baseline_s')} s (at most {budget.get('baseline_share', 0):.0%} planned), "
            f"{len(budget['steps'])} step(s) {budget['steps_s']:g} s, fallback {budget['fallback_s']:g} s, "
            f"final timing {budget['final_timing_s']:g} s."
        )
        lines += [f"- {what}: {why}" for what, why in (budget.get("baseline_skipped") or {}).items()]
        if budget["final_timing"].get("note"):
            lines.append(f"- final timing: {budget['final_timing']['note']}")
        fallback = budget.get("fallback") or {}
        if fallback.get("skipped"):
            lines.append(f"- fallback ({fallback.get('strategy')}): {fallback['skipped']}")
    return lines
