"""The planner agent: reads the diagnosis, what was tried and the user's messages; returns one step.

With an LLM it asks for a :class:`PlanStep` as JSON (validated; an invalid answer is re-asked
once, then the step counts as failed). Without one, the playbook plans: the applicable
strategies of the task's graph, own kernels first, each with its tuning configurations, never the
same (strategy, parameters) twice, shaped by the user's guidance. Which of them comes next is the
search engine's choice (:mod:`kernelcrew.agents.search`: vary the fittest verified candidate or
explore another family; the menu's order until something verified); with an LLM the engine
selects the parent whose source the planner and the coder edit.

The user's commands (:mod:`kernelcrew.agents.guidance`; several in one message are all obeyed)
bind both planners: the playbook never offers a refused strategy, and an LLM's step that the user
refused is re-asked. Free text goes to the LLM planner and coder as it was written; without an
LLM it is answered with what the playbook can do.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from langgraph.runtime import Runtime
from pydantic import ValidationError

from kernelcrew.agents import search
from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.guidance import parse_commands
from kernelcrew.agents.guidance import parse_guidance as parse_guidance  # re-exported
from kernelcrew.agents.knowledge import hits_text, task_hits
from kernelcrew.agents.profiler import expected_compile_s
from kernelcrew.agents.state import RATIONALE_CHARS, Candidate, CrewState, PlanStep


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def step_key(strategy: str, params: dict[str, Any]) -> str:
    """How a tried step is remembered: the strategy and its parameters."""
    return f"{strategy}{json.dumps(params, sort_keys=True) if params else ''}"


def _menu(state: CrewState) -> list[PlanStep]:
    """Every playbook step applicable to the task, in the order the playbook would try them.

    The knowledge base's hits (``state.kb_hits``) shape the order: the best-known configuration of
    a strategy that won on this pattern (same ops and dtypes) and architecture comes first, and
    each strategy's tuning starts from the best known parameters; otherwise the playbook's order
    holds (own kernels before library and compiler candidates, unless a strategy ranks itself
    otherwise: :func:`playbook.applicable`).
    """
    from kernelcrew.agents import playbook
    from kernelcrew.knowledge_base import from_analysis, order_configs, preferred_strategies

    analysis = playbook.TaskAnalysis(
        state.baseline.analysis, task_source=state.task_source, task_path=state.task_path
    )
    arch = "cpu" if state.options.device == "cpu" else state.baseline.arch or "sm_90"
    hits = state.kb_hits or []
    signature = from_analysis(analysis.to_dict()).text
    won = preferred_strategies(hits, signature)
    steps: list[PlanStep] = []
    idle = idle_fraction(state)
    for strategy, reason in playbook.applicable(analysis):
        if _measured_no_faster(state, strategy):
            continue
        if strategy.name == GRAPH_STRATEGY:
            if idle is None or idle < GRAPH_IDLE_MIN:
                continue
            reason += f"; the GPU ran kernels {1 - idle:.0%} of the reference's time"
        configs = order_configs(
            playbook.tuning_space(strategy.name, analysis, arch) or [{}], hits, strategy.name, signature
        )
        if state.options.device == "cpu":
            configs = configs[:1]  # CPU timings never drive a decision: one config is enough
        gain = 2.0 if strategy.source_kind == "kernel" else 1.5
        if strategy.name in won:
            reason += "; the knowledge base shows it won on this pattern before"
        for params in configs:
            steps.append(
                PlanStep(
                    strategy=strategy.name,
                    rationale=_shorten(reason, RATIONALE_CHARS),
                    expected_gain=gain,
                    params=params,
                    source="playbook",
                )
            )

    # A past win earns its strategy's best-known configuration the first step, not every step:
    # the other strategies' first tries stay ahead of its remaining configurations, so a win that
    # a run recorded without trying everything cannot keep the better strategy from being tried.
    first = {}
    for i, step in enumerate(steps):
        first.setdefault(step.strategy, i)

    def order(item: tuple[int, PlanStep]) -> tuple[int, int]:
        i, step = item
        if step.strategy == GRAPH_STRATEGY and idle is not None and idle >= GRAPH_IDLE_FIRST:
            return 0, -1
        if step.strategy in won and first[step.strategy] == i:
            return 0, won.index(step.strategy)
        return 1, i

    return [step for _, step in sorted(enumerate(steps), key=order)]


#: The strategy that replays the reference's own kernels as CUDA graphs: it can only save the time
#: the GPU sits idle between kernels, so it is offered where the baseline measured that idle time
#: (a GPU) at :data:`GRAPH_IDLE_MIN` of eager's or more, and tried first from
#: :data:`GRAPH_IDLE_FIRST`. The measure understates what a graph saves: KernelBench's GRU with
#: its hidden state read 19 % idle and its graph ran 5.4x faster than eager on an H100.
GRAPH_STRATEGY = "cuda_graphs"
GRAPH_IDLE_MIN = 0.05
GRAPH_IDLE_FIRST = 0.1


def idle_fraction(state: CrewState) -> float | None:
    """The share of eager's time per call that the GPU ran none of the reference's kernels (the
    baseline's profile of all its kernels against eager's median); None on a CPU or unmeasured."""
    base = state.baseline
    if not str(base.hotspot_clock or "").startswith("cuda") or not base.hotspot_total_us or not base.eager_ms:
        return None
    return max(0.0, 1.0 - base.hotspot_total_us / (base.eager_ms * 1000.0))


def _measured_no_faster(state: CrewState, strategy: Any) -> bool:
    """Whether ``strategy`` is a compiler strategy whose torch.compile mode the baseline already
    timed on the GPU at no faster than eager (beyond noise): its candidate is that same compile, so
    a step would spend a verification and a timing (about a minute on a large task) to learn it
    again. Likewise where the baseline's compile of the reference failed or was stopped for time
    (``compile_errors``): a step would compile the same module again, in any mode."""
    if strategy.source_kind != "compiler" or state.options.device == "cpu":
        return False
    if state.baseline.compile_errors:
        return True
    return _compile_beat_eager(state, dict(strategy.options).get("mode", "default")) is False


def _compile_beat_eager(state: CrewState, mode: str) -> bool | None:
    """Whether the baseline timed torch.compile in ``mode`` faster than eager beyond noise; None
    where it timed no such compile (or no eager)."""
    eager, compiled = state.baseline.eager_ms, state.baseline.compile_ms.get(mode)
    if not eager or compiled is None:
        return None
    return compiled < eager * (1 - NOISE)


def _guidance(state: CrewState, llm: bool = False) -> tuple[dict[str, Any], list[str]]:
    """Fold every command of every user message into preferences; answer the new messages (every
    command of a message, in one reply). ``llm``: free text goes to the LLM planner."""
    prefs: dict[str, Any] = {
        "only_kernels": False,
        "no_compiler": False,
        "keep_fp32": False,
        "try": [],
        "skip": set(),
        "more": 0,
        "stop": False,
    }
    replies = []
    for i, message in enumerate(state.user_messages):
        answers = []
        for action, arg in parse_commands(message):
            if action == "only_kernels":
                prefs["only_kernels"] = True
                answers.append("Only own kernels from now on: no torch.compile or library candidates.")
            elif action == "no_compiler":
                prefs["no_compiler"] = True
                answers.append("No torch.compile candidates from now on.")
            elif action == "keep_fp32":
                prefs["keep_fp32"] = True
                answers.append("Precision stays strict: fp32 stays fp32, verified against fp32 thresholds.")
            elif action == "try":
                prefs["try"].append(arg)
                answers.append(f"Trying {arg} next if it applies to this module.")
            elif action == "skip":
                prefs["skip"].add(arg)
                answers.append(f"{arg} will not be tried.")
            elif action == "more":
                prefs["more"] += 3 if i >= state.answered else 0  # each message extends the run once
                answers.append("Three more steps.")
            elif action == "stop":
                prefs["stop"] = True
                answers.append("Stopping: finishing with the best verified candidate.")
            elif llm:
                answers.append(f"Passed to the planner and the coder: {arg!r}.")
            else:
                answers.append(
                    "Without an LLM configured the playbook understands: only triton, no torch.compile, "
                    "keep fp32, try <strategy>, skip <strategy>, more iterations, stop (several in one "
                    "message, separated by commas). Strategies for this module: "
                    + (", ".join(sorted({s.strategy for s in _menu(state)})) or "none")
                    + "."
                )
        if i >= state.answered:
            replies.append(f"> {message}\n" + " ".join(answers))
    return prefs, replies


def plan(state: CrewState, runtime: Runtime[CrewContext]) -> dict[str, Any]:
    """Return the next step, or ``plan=None`` with a stop reason when there is none."""
    ctx = runtime.context
    prefs, replies = _guidance(state, llm=ctx.chat is not None and not state.llm_failure)
    update: dict[str, Any] = {"answered": len(state.user_messages), "repairs": 0, "draft": None}
    if replies:
        update["replies"] = replies
        for reply in replies:
            ctx.emit("reply", message=reply)
    opts = state.options
    if prefs["more"] or (prefs["keep_fp32"] and opts.precision != "strict"):
        precision = "strict" if prefs["keep_fp32"] else opts.precision
        update["options"] = replace(opts, max_iters=opts.max_iters + prefs["more"], precision=precision)
    if prefs["stop"]:
        return {**update, "plan": None, "stop_reason": "stopped by the user"}
    at_sol = reference_at_sol(state)
    if at_sol and state.best is None and not prefs["more"]:
        return {**update, "plan": None, "stop_reason": at_sol}
    if state.kb_hits is None:  # asked once per run; checkpointed with the state
        state = replace(state, kb_hits=task_hits(state, ctx))
        update["kb_hits"] = state.kb_hits
    step = None
    if ctx.chat is not None and not state.llm_failure:
        archive = search.Archive.from_dicts(state.archive, opts.device)
        parent = search.select_parent(archive, seed=opts.seed, step=state.steps_used + 1)
        step, problem, provider_failed = _plan_with_llm(state, ctx, parent)
        if step is not None:
            step = _llm_operator(step, archive, parent)
        if provider_failed:  # the playbook takes over for the rest of the run
            update["llm_failure"] = problem
            ctx.emit("llm_fallback", node="plan", message=f"{problem}; the playbook plans from now on")
            state = replace(state, llm_failure=problem)
        elif step is None:  # counted as a failed step; decide goes on or stops by the budget
            record = {"step": state.steps_used + 1, "strategy": "(plan)", "verdict": "fail", "stage": "plan"}
            return {
                **update,
                "plan": None,
                "iterations": [{**record, "message": problem}],
                "steps_used": state.steps_used + 1,
                "since_gain": state.since_gain + 1,
            }
    if step is None:
        step = _plan_with_playbook(state, prefs)
    planned = sum(1 for r in state.iterations if not r.get("fallback"))
    insured = state.best is not None or fallback_seconds(state) > 0
    if step is not None and (planned or insured) and not _fits_budget(state, step):
        # nothing left that fits; a run without an answer starts its first planned step however
        # heavy the task (a run with one, or with the compiler's fallback still to come, keeps to
        # the budget)
        return {**update, "plan": None, "stop_reason": _budget_reason(state, step)}
    if step is None:
        return {**update, "plan": None, "stop_reason": "no strategy left to try"}
    batch = _round_steps(state, step, prefs)
    for k, planned in enumerate((step, *batch)):
        ctx.emit(
            "plan",
            step=state.steps_used + 1 + k,  # its candidate's number (c<step>)
            strategy=planned.strategy,
            params=planned.params,
            rationale=planned.rationale,
            source=planned.source,
        )
    return {**update, "plan": step, "batch": batch, "step_ends_at": step_end(state)}


def _round_steps(state: CrewState, first: PlanStep, prefs: dict[str, Any]) -> list[PlanStep]:
    """The steps evaluated side by side with ``first`` (``Options.parallel`` - 1 at most, within
    ``max_iters``): the search engine's playbook proposals as if each step before had been tried
    (its selection coin of that step number), distinct, each fitting the budget on its own (they
    run at the same time). With a model planning, the round's other steps are the playbook's: the
    model's step and the engine's operators are evaluated together, and only the model's step goes
    back to the model for repairs, so its calls stay one at a time (and a replay replays them)."""
    room = min(state.options.parallel, state.options.max_iters - state.steps_used) - 1
    keys = [step_key(first.strategy, first.params)]
    batch: list[PlanStep] = []
    for k in range(1, room + 1):
        hypothetical = replace(state, tried=[*state.tried, *keys], steps_used=state.steps_used + k)
        step = _plan_with_playbook(hypothetical, prefs)
        if step is None or step_key(step.strategy, step.params) in keys or not _fits_budget(state, step):
            break
        batch.append(step)
        keys.append(step_key(step.strategy, step.params))
    return batch


#: The reference (eager, or a torch.compile mode the baseline timed) at this fraction of its speed
#: of light leaves at most 1/0.95 - 1 = 5 % to gain: the floor is a perfectly fused kernel's
#: (every input, weight and output moved once, every flop at the peak). Above
#: ``REFERENCE_SOL_TRUSTED`` the floor itself is wrong (faster than the hardware allows) and says
#: nothing.
REFERENCE_AT_SOL = 0.95
REFERENCE_SOL_TRUSTED = 1.1


def reference_at_sol(state: CrewState) -> str:
    """Why no step is planned on a GPU: the reference already runs at :data:`REFERENCE_AT_SOL` of
    speed of light or more, so no candidate could beat it by more than the noise a step must beat,
    and a step of a large task costs most of the budget (on the H100, Softplus at 100 % took a 64 s
    step for a kernel at 1.00x, and its run ended at 166 s); "" otherwise. The run still verifies the
    compiler's answer the baseline measured faster, or at parity (the fallback)."""
    base = state.baseline
    if base is None or state.options.device == "cpu" or base.clock != "cuda-event":
        return ""
    fractions = {k: v for k, v in (base.sol_fraction or {}).items() if v is not None}
    if not fractions:
        return ""
    name, best = max(fractions.items(), key=lambda kv: kv[1])
    if not REFERENCE_AT_SOL <= best <= REFERENCE_SOL_TRUSTED:
        return ""
    who = "eager" if name == "eager" else f"torch.compile ({name.split(':', 1)[-1]})"
    return (
        f"the reference ({who}) already runs at {best:.0%} of speed of light: no step could gain beyond noise"
    )


#: A best under this speedup over torch.compile sends the playbook to the strategies it has not
#: tried. Nearer, another configuration of the same strategy often closes the gap (a measurement,
#: see docs/benchmarks.md).
LOSING_TO_COMPILE = 0.9


def _plan_with_playbook(state: CrewState, prefs: dict[str, Any]) -> PlanStep | None:
    """The search engine's next playbook step (:func:`kernelcrew.agents.search.propose`) among the
    menu's untried steps that the user's guidance allows and the budget affords.

    A strategy the user asked to try comes first; before anything verified the menu's order holds
    (the knowledge base's and the playbook's), so the first step is the menu's first that fits.
    With none that fits, the one expected to take the least time comes back (``plan`` then stops
    with the budget's reason, unless the run has no answer and no step yet).
    """
    from kernelcrew.agents import playbook

    archive = search.Archive.from_dicts(state.archive, state.options.device)
    # a candidate verified outside a step (the compiler's fallback) is not tried again either
    tried = set(state.tried) | {step_key(e.strategy, e.params) for e in archive.entries}
    allowed = [
        s
        for s in _menu(state)
        if s.strategy not in prefs["skip"]
        and not (prefs["only_kernels"] and playbook.STRATEGIES[s.strategy].source_kind != "kernel")
        and not (prefs.get("no_compiler") and playbook.STRATEGIES[s.strategy].source_kind == "compiler")
    ]
    menu = [s for s in allowed if step_key(s.strategy, s.params) not in tried]
    attempted = {it.get("strategy") for it in state.iterations if it.get("strategy")}
    for wanted in prefs["try"]:
        for s in menu:
            if s.strategy == wanted:
                return _with_proposal(s, search.menu_step([s], 0, archive, attempted))
    best = state.best
    losing = (
        best is not None and best.speedup_compile is not None and best.speedup_compile < LOSING_TO_COMPILE
    )
    if losing:
        # the best so far clearly loses to torch.compile: the strategies not tried yet (the
        # compiler's own among them) go ahead of more configurations of those that lost
        menu.sort(key=lambda s: s.strategy in attempted)  # stable: the menu's order otherwise
    fitting = [s for s in menu if _fits_budget(state, s)]
    if not fitting:
        # the one expected to end first; plan() stops the run unless it is an unanswered run's
        # first step, which then overruns the least (ResNet101's max-autotune step, first of its
        # menu, ran 414 s of a 90 s budget on the H200)
        return min(menu, key=lambda s: expected_seconds(state, s)) if menu else None
    recombinable = {s.strategy for s in allowed}
    for recombine in (True, False):
        proposal = search.propose(
            archive,
            fitting,
            seed=state.options.seed,
            step=state.steps_used + 1,
            attempted=attempted,
            tried=tried,
            key=step_key,
            recombinable=recombinable if recombine else set(),
            prefer_new=losing,
        )
        if proposal is None:
            return None
        if proposal.index is not None:
            return _with_proposal(fitting[proposal.index], proposal)
        template = next(s for s in allowed if s.strategy == proposal.strategy)
        step = _with_proposal(template.model_copy(update={"params": proposal.params}), proposal)
        if _fits_budget(state, step):
            return step
    return None


def _with_proposal(step: PlanStep, proposal: search.Proposal) -> PlanStep:
    """The menu's step with the engine's operator, parent and reason."""
    if proposal.operator == "new_strategy" and proposal.parent is None:
        return step
    return step.model_copy(
        update={
            "operator": proposal.operator,
            "parent": proposal.parent,
            "rationale": f"{step.rationale} ({proposal.why})"[:2000],
        }
    )


def baseline_seconds(state: CrewState) -> float:
    """The baseline's wall time: as profile_baseline measured it, else the sum of its phases."""
    measured = state.budget.get("baseline_s")
    return float(measured) if measured is not None else sum(state.baseline.phase_s.values())


def step_seconds(state: CrewState) -> list[float]:
    """How long each finished step of the run took: from one decide to the next, the first from
    the end of the baseline (earlier work, such as the analysis, counts into it). The compiler's
    fallback is a verification only (the baseline timed it), where a step also times its
    candidate: its length counts one timing run more. On the H100 a step planned from a 34 s
    fallback took 42 s and ended its run past the budget's tolerance."""
    start = baseline_seconds(state)
    out = []
    for record in state.iterations:
        mark = record.get("elapsed_s")
        if mark is not None:
            timed = reference_timing_s(state) if record.get("fallback") else 0.0
            out.append(max(0.0, mark - start) + timed)
            start = mark
    return out


NOISE = 0.02
"""Relative gain below which a faster candidate is not better: the timer's spread (see docs/benchmarks.md)."""
#: A step verifies its candidate (children that run it on every input set) and times it against
#: eager (a timing run like the baseline's, without the compile modes): before any step ended, it
#: is expected to take this many times the baseline's timing run. An estimate, not a measurement.
STEP_FROM_BASELINE = 2.0
#: A torch.compile candidate compiles in the verifier (once per input shape) and again in the
#: timing child: this many compiles per step, each as long as the baseline's compile of its mode.
COMPILES_PER_STEP = 3
#: The same compiles when the baseline built the candidate's mode: the candidate starts from the
#: reference's build (``tools.build.seed_from_reference``) and each compile is a cache hit. Counted
#: as one cold compile for all of them (an estimate: a cache hit still loads the build and tunes).
WARM_COMPILES_PER_STEP = 1
#: A compile's expected seconds when the baseline compiled nothing (``--compile-modes none``, the
#: CPU's default). An assumption, not a measurement.
UNMEASURED_COMPILE_S = 10.0
#: How far past its time budget the never-empty-handed fallback, or a heavy task's first step
#: (:func:`first_step_allowance`), may end a run: the run's tolerance.
GRACE = 0.2
TIMED_IN_BASELINE = "timed in the baseline"
"""The flag of a compiler answer whose times are the baseline's own (``decide.timed_by_baseline``)."""


def timed_in_baseline(cand: Candidate) -> bool:
    """Whether ``cand``'s times are the baseline's own (the compiler's fallback, :data:`TIMED_IN_BASELINE`)."""
    return any(flag.startswith(TIMED_IN_BASELINE) for flag in cand.flags)


def compiler_strategies() -> dict[str, str]:
    """The playbook's compiler strategies by the torch.compile mode they generate."""
    from kernelcrew.agents import playbook

    return {
        dict(s.options).get("mode", "default"): s.name
        for s in playbook.STRATEGIES.values()
        if s.source_kind == "compiler"
    }


def reference_timing_s(state: CrewState) -> float:
    """Seconds of the baseline's timing run, less its torch.compile compiles."""
    base = state.baseline
    return max(0.0, base.phase_s.get("benchmark", 0.0) - sum(base.compile_s.values()))


def modelled_seconds(state: CrewState, step: PlanStep) -> float:
    """A step's time from the baseline's measurements alone (what the first step goes by)."""
    from kernelcrew.agents import playbook

    strategy = playbook.STRATEGIES.get(step.strategy)
    seconds = STEP_FROM_BASELINE * reference_timing_s(state)
    if strategy is not None and strategy.source_kind == "compiler":
        mode = dict(strategy.options).get("mode", "default")
        compile_s = expected_compile_s(state.baseline.compile_s, mode) or UNMEASURED_COMPILE_S
        warm = mode in state.baseline.compile_s  # the reference built it: the candidate starts there
        seconds += (WARM_COMPILES_PER_STEP if warm else COMPILES_PER_STEP) * compile_s
    return seconds


def expected_seconds(state: CrewState, step: PlanStep) -> float:
    """The longest step of the run so far times the strategy's cost, or the modelled time of the
    step when that is longer (the only estimate before any step ended)."""
    from kernelcrew.agents import playbook

    strategy = playbook.STRATEGIES.get(step.strategy)
    longest = max(step_seconds(state), default=0.0) * (strategy.cost if strategy else 1.0)
    return max(longest, modelled_seconds(state, step))


#: The final report times the best against eager and torch.compile again, as the baseline's
#: timing phase did, and takes up to 1.7x as long as that phase (a measurement, see
#: docs/benchmarks.md).
FINALIZE_COST = 1.7


def final_reserve_s(state: CrewState) -> float:
    """Seconds kept for the final timing of the best."""
    return FINALIZE_COST * state.baseline.phase_s.get("benchmark", 0.0)


def fallback_mode(state: CrewState) -> str | None:
    """The fastest torch.compile mode the baseline measured faster than eager (beyond noise) that
    the playbook's compiler strategies generate; else, at the end of a GPU run that verified
    nothing (:func:`wants_parity_answer`), the fastest such mode it measured at parity with eager
    (within noise); or None."""
    modes = compiler_strategies()
    eager = state.baseline.eager_ms or 0.0
    measured = {m: ms for m, ms in state.baseline.compile_ms.items() if m in modes and eager}
    faster = {m: ms for m, ms in measured.items() if _compile_beat_eager(state, m)}
    if not faster and wants_parity_answer(state):
        faster = {m: ms for m, ms in measured.items() if ms <= eager * (1 + NOISE)}
    return min(faster, key=lambda mode: faster[mode]) if faster else None


def wants_parity_answer(state: CrewState) -> bool:
    """Whether the run has ended on a GPU with no answer, not even one at parity with eager: then
    a compile the baseline timed within noise of eager (it calls the same library kernels) is
    verified and returned as a parity answer. Never while the run plans: it takes no time from
    the steps."""
    return (
        bool(state.stop_reason)
        and state.options.device != "cpu"
        and state.best is None
        and state.runner_up is None
    )


def refused_by_user(state: CrewState, strategy: str, params: dict[str, Any] | None = None) -> str:
    """Why the user's commands rule ``strategy`` out (only kernels, no torch.compile, skip it), or ""."""
    from kernelcrew.agents import playbook

    entry = playbook.STRATEGIES.get(strategy)
    kind = entry.source_kind if entry is not None else "kernel"
    language = str((params or {}).get("language", "")).lower()
    for message in state.user_messages:
        for action, arg in parse_commands(message):
            if action == "only_kernels" and kind != "kernel":
                return f"the user asked for own kernels only ({message!r})"
            if action == "only_kernels" and "triton" in message.lower() and language in ("cuda", "c++"):
                return f"the user asked for Triton only ({message!r})"
            if action == "no_compiler" and kind == "compiler":
                return f"the user asked for no torch.compile ({message!r})"
            if action == "skip" and arg == strategy.lower():
                return f"the user asked to skip it ({message!r})"
    return ""


def fallback_step(state: CrewState) -> PlanStep | None:
    """The compiler candidate a run ends with when it has no faster verified answer: the baseline
    measured it (torch.compile) faster than eager, or at parity with eager when the run ended with
    no answer at all (:func:`fallback_mode`). None when the best is as fast (beyond noise; on
    a CPU, any best: its answers are ranked by kind, not time), when nothing measured beat eager,
    when the user's guidance rules it out, or when a step already judged that candidate: failed,
    or timed not faster than eager."""
    mode = fallback_mode(state)
    if mode is None:
        return None
    if state.best is not None:
        best_ms = state.best.time_ms if state.options.device != "cpu" else None
        if not (best_ms and state.baseline.compile_ms[mode] < best_ms * (1 - NOISE)):
            return None
    name = compiler_strategies()[mode]
    if refused_by_user(state, name):
        return None
    for record in state.iterations:
        if record.get("strategy") != name or record.get("verdict") not in ("pass", "fail"):
            continue
        if record["verdict"] == "fail" or not (record.get("speedup_eager") or 0) > 1:
            return None
    eager, compiled = state.baseline.eager_ms or 0.0, state.baseline.compile_ms[mode]
    if _compile_beat_eager(state, mode):
        rationale = (
            f"torch.compile ({mode}) ran {eager / compiled:.2f}x faster than eager in the baseline "
            "and no faster answer was verified: its candidate is verified and returned"
        )
    else:
        rationale = (
            f"torch.compile ({mode}) ran at parity with eager in the baseline ({eager / compiled:.2f}x) "
            "and no candidate was verified: its candidate is verified and returned as a parity answer"
        )
    return PlanStep(
        strategy=name,
        rationale=rationale,
        expected_gain=min(max(eager / compiled, 1.001), 1000),
        source="playbook",
    )


def fallback_seconds(state: CrewState) -> float:
    """Seconds kept for the fallback: a compiler step, when the run would need one now and no step
    has verified it yet (a verified one is not verified again)."""
    step = fallback_step(state)
    if step is None or any(r.get("strategy") == step.strategy for r in state.iterations):
        return 0.0
    return modelled_seconds(state, step)


def step_before_fallback(state: CrewState) -> bool:
    """Whether a first step of the baseline's modelled length fits before the compiler's fallback,
    with the fallback and the final timing after it, inside the budget: then the run tries its own
    kernels first and verifies the compiler's candidate at the end, unless a step beat it. A
    heavy task verifies the fallback first, as its insurance."""
    if not state.started_at:
        return False
    return STEP_FROM_BASELINE * reference_timing_s(state) <= _seconds_left(state)


def _seconds_left(state: CrewState) -> float:
    """The time budget left for steps: what the run has not used, less the final report's share and
    the fallback's."""
    used = time.time() - state.started_at
    return state.options.time_budget_s - used - final_reserve_s(state) - fallback_seconds(state)


#: How far past its budget a run without an answer may go for its first step, as a multiple of the
#: budget: such a step starts however heavy the task (the run has nothing else to give), but it is
#: stopped there. On the H200 a torch.compile max-autotune step of ResNet101 ran 414 s of a 90 s
#: budget; on the H100 the longest first step that gave an answer ended its run at 1.8 times it.
FIRST_STEP_CAP = 2.0


def step_end(state: CrewState) -> float:
    """When (epoch seconds) the next step's verification and timing are stopped
    (``CrewState.step_ends_at``): where the run would pass its tolerance (``GRACE`` past the budget)
    with the final timing's and the fallback's shares kept; for the first step of a run without an
    answer, :data:`FIRST_STEP_CAP` times the budget. 0 (no bound) for a run with no start time."""
    if not state.started_at:
        return 0.0
    budget = state.options.time_budget_s
    planned = any(not r.get("fallback") for r in state.iterations)
    insured = state.best is not None or fallback_seconds(state) > 0
    end = budget * (1 + GRACE) if planned or insured else budget * FIRST_STEP_CAP
    return state.started_at + end - final_reserve_s(state) - fallback_seconds(state)


def first_step_allowance(state: CrewState) -> float:
    """Seconds past the budget the run's first planned step may count on, when the compiler's
    answer is already verified (the baseline left no room for a step before it, so it went first):
    the run's tolerance (``GRACE``), and the final timing's share, which that answer does not need
    (the baseline timed it; a step that beats it past the budget keeps its own timing run's times,
    ``decide.already_timed``). Without it a heavy task ended with the baseline's compile and not
    one step of its own. 0 once a step was planned, or while the run has no such answer."""
    best = state.best
    if best is None or any(not r.get("fallback") for r in state.iterations):
        return 0.0
    if not timed_in_baseline(best):
        return 0.0
    return GRACE * state.options.time_budget_s + final_reserve_s(state)


def _fits_budget(state: CrewState, step: PlanStep) -> bool:
    """Whether the step, the final report (and a fallback the run may need) should end inside the
    time budget (a heavy task's first step: inside its tolerance, :func:`first_step_allowance`):
    wall-clock seconds, on a CPU as on a GPU."""
    if not state.started_at:
        return True
    return expected_seconds(state, step) <= _seconds_left(state) + first_step_allowance(state)


def _budget_reason(state: CrewState, step: PlanStep) -> str:
    extra = first_step_allowance(state)
    return (
        f"time budget: {max(_seconds_left(state), 0):.0f} s of {state.options.time_budget_s:g} s left "
        f"after the final report's share"
        + (f" ({extra:.0f} s more for a first step)" if extra else "")
        + f", the next step ({step.strategy}) would take about {expected_seconds(state, step):.0f} s"
    )


PLAN_SCHEMA = {
    "type": "object",
    "properties": {
        "strategy": {"type": "string", "description": "A strategy offered, or custom:<short name>."},
        "rationale": {"type": "string", "description": "Why this step, from the evidence."},
        "expected_gain": {"type": "number", "description": "Expected speedup over the best (>= 1.0)."},
        "params": {"type": "object", "description": "The step's settings ({} when none)."},
    },
    "required": ["strategy", "rationale", "expected_gain", "params"],
}
"""The planner's answer as a JSON schema (a :class:`PlanStep` without its ``source``)."""


def _llm_operator(step: PlanStep, archive: search.Archive, parent: search.Entry | None) -> PlanStep:
    """The LLM's step as a search operator: a step of its own (``custom:``) edits the selected
    parent's source (``llm_edit``); a playbook strategy is generated by its template, a new
    strategy or a tuning of the fittest of its strategy in the archive."""
    from kernelcrew.agents import playbook

    if step.strategy not in playbook.STRATEGIES:
        return step.model_copy(update={"operator": "llm_edit", "parent": parent.id if parent else None})
    same = archive.fittest([e for e in archive.entries if e.strategy == step.strategy])
    if same is None:
        return step.model_copy(update={"operator": "new_strategy", "parent": None})
    return step.model_copy(update={"operator": "tune", "parent": same.id})


def _plan_with_llm(
    state: CrewState, ctx: CrewContext, parent: search.Entry | None = None
) -> tuple[PlanStep | None, str, bool]:
    """(step or None, why not, whether the provider itself failed: no reply at all). The prompt's
    candidate is the search's selected ``parent`` (the coder edits that source), else the best."""
    from kernelcrew.agents.llm import LLMError, Message, OutputSchema, extract_json, provider_failed
    from kernelcrew.agents.prompts import PLANNER_RETRY, render, sections

    menu = _menu(state)
    best = state.best
    base = state.baseline
    if parent is not None and parent.source and (best is None or parent.id != best.id):
        shown_source, shown_summary = parent.source, parent.to_dict(source=False)
    else:
        shown_source, shown_summary = (best.source, best.summary()) if best else (None, None)
    messages = render(
        "planner",
        task_source=sections.capped("task_source", state.task_source),
        best_source=sections.capped("best_source", shown_source)
        if shown_source
        else "(none yet: the reference is the baseline)",
        best_summary=json.dumps(shown_summary, default=str) if shown_summary else "none",
        diagnosis=sections.capped("diagnosis", state.diagnosis or "none"),
        kb_hits=sections.capped("kb_hits", hits_text(state.kb_hits or [])),
        strategies=sections.capped(
            "strategies",
            "\n".join(f"- {s.strategy} {json.dumps(s.params)}: {s.rationale}" for s in menu) or "none",
        ),
        history=sections.history(state.iterations),
        last_failure=sections.capped("last_failure", _last_failure(state)),
        user_messages=sections.user_text(state.user_messages),
        precision=state.options.precision,
        device_facts=sections.device_facts(state.options.device, base.hardware, base.peaks, base.versions),
    )
    schema = OutputSchema("plan_step", "The crew's next optimization step.", PLAN_SCHEMA)
    problem = ""
    for attempt in range(2):
        unusable = ""
        try:
            completion = ctx.chat.complete(messages, schema=schema)
        except LLMError as exc:
            if exc.completion is None:  # no reply at all
                ctx.emit("error", node="plan", message=str(exc))
                return None, f"the planner's model failed: {exc}", provider_failed(exc)
            completion, unusable = exc.completion, str(exc)  # empty, refused or cut: as bad JSON
        if ctx.meter is not None:
            ctx.meter.add(completion, "planner")
        try:
            if unusable:
                raise ValueError(unusable)
            data = extract_json(completion.text)
            step = PlanStep.model_validate({**data, "source": "llm"})
            refused = refused_by_user(state, step.strategy, step.params)
            if refused:
                raise ValueError(f"{step.strategy} is ruled out: {refused}")
            return step, "", False
        except (ValueError, ValidationError) as exc:
            problem = f"the planner's answer was invalid twice: {str(exc)[:300]}"
            ctx.emit("invalid_plan", attempt=attempt + 1, message=str(exc)[:300])
            messages = [
                *messages,
                Message("assistant", completion.text or "(empty reply)"),
                Message("user", PLANNER_RETRY.format(problem=str(exc)[:500])),
            ]
    return None, problem, False


def _last_failure(state: CrewState) -> str:
    for record in reversed(state.iterations):
        if record.get("failure"):
            return json.dumps(record["failure"], default=str)[:3000]
    return "none"
