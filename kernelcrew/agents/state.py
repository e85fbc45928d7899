"""The crew's typed state: compact (best candidate, last diagnosis, ideas tried), never a chat log."""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, get_type_hints

from pydantic import BaseModel, Field

from kernelcrew.records import Baseline, Report

BASELINE_SHARE = 0.4
"""The largest share of the time budget the baseline plans to use; the steps and the final
timing get the rest (docs/playbook.md#how-the-budget-is-spent)."""


RATIONALE_CHARS = 2000
"""The longest rationale a step holds (a playbook strategy's reason for a module of a hundred
parts is cut to it; a model's longer one is asked again)."""


class PlanStep(BaseModel):
    """One next step, as the planner returns it (validated: an invalid answer is re-asked)."""

    strategy: str = Field(min_length=1, max_length=80, description="A playbook strategy or custom:<name>.")
    rationale: str = Field(min_length=1, max_length=RATIONALE_CHARS)
    expected_gain: float = Field(gt=0, le=1000, description="Expected speedup of this step (1.3 = 30%).")
    params: dict[str, Any] = Field(default_factory=dict)
    source: str = Field("playbook", description="Who proposed it: playbook or llm.")
    parent: str | None = Field(
        None, description="The archived candidate this step varies (none: from the reference)."
    )
    operator: str = Field(
        "new_strategy",
        description="The search's operator: new_strategy, tune, recombine, llm_edit or fallback.",
    )


@dataclass
class Options:
    """What the user asked for; fixed for a run except the budget, which a continuation extends."""

    device: str = "cpu"
    precision: str = "strict"
    backend: str = "playbook"
    model: str = ""
    max_iters: int = 6
    time_budget_s: float = 900.0
    max_repairs: int = 2
    patience: int = 3
    local_only: bool = False
    seed: int = 0
    compile_modes: list[str] = field(default_factory=list)
    """torch.compile modes the baseline always times."""
    optional_compile_modes: list[str] = field(default_factory=list)
    """Modes the baseline times only when their expected compile time fits its share of the budget
    (``--compile-modes auto`` on a GPU: max-autotune-no-cudagraphs)."""
    quick: bool = False
    baseline_share: float = BASELINE_SHARE
    parallel: int = 1
    """Steps evaluated side by side per round (one per GPU or worker; 1: one step at a time)."""


@dataclass
class Candidate:
    """A candidate the crew produced, with what the verifier and the profiler said of it."""

    id: str
    strategy: str
    source_kind: str
    source: str
    params: dict[str, Any] = field(default_factory=dict)
    verdict: str = "pending"
    stage: str = ""
    message: str = ""
    kind: str | None = None
    time_ms: float | None = None
    speedup_eager: float | None = None
    speedup_eager_ci: list[float] | None = None
    speedup_compile: float | None = None
    significant: bool = False
    sol_fraction: float | None = None
    """The task's speed-of-light floor over this candidate's time (1.0 = at the floor)."""
    ncu: dict[str, Any] | None = None
    """Nsight Compute summary of one forward (GPU with ncu; the best candidates only)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    unusable_replies: list[str] = field(default_factory=list)
    """Why the coder's model replies before this source could not be used (empty, refused, cut off)."""
    phase_s: dict[str, float] = field(default_factory=dict)
    """Seconds of the profile node's phases for this candidate: its timing run, Nsight Compute."""
    samples: list[str] = field(default_factory=list)
    """The other usable sources the coder's model wrote for this step (``llm_samples`` > 1), each
    verified in turn when this one fails, before any repair."""

    def summary(self) -> dict[str, Any]:
        """Everything but the source (what an iteration record keeps)."""
        return {
            k: v for k, v in self.__dict__.items() if k not in ("source", "failures", "ncu", "samples")
        } | {"failure": self.failures[0] if self.failures else None}


@dataclass
class CrewState:
    """The state of one optimization run (thread id = run id)."""

    task_source: str
    """The task file's text (KernelBench format)."""
    task_path: str = "task.py"
    options: Options = field(default_factory=Options)
    start_source: str | None = None
    """A user's kernel to start from (``--start``), verified before anything builds on it."""
    baseline: Baseline = field(default_factory=Baseline)
    """Eager and torch.compile timings, hotspots and the graph analysis of the reference."""
    diagnosis: str = ""
    """The profiler's latest reading of where time goes, for the planner."""
    kb_hits: list[dict[str, Any]] | None = None
    """The knowledge base's top hits for this task and device (None: not asked yet)."""
    plan: PlanStep | None = None
    batch: list[PlanStep] = field(default_factory=list)
    """The round's other steps, evaluated side by side with ``plan`` (``Options.parallel`` > 1)."""
    step_ends_at: float = 0.0
    """When (epoch seconds) the current step's verification and timing are stopped, set with its
    plan (``planner.step_end``); 0 outside a step."""
    evaluated: list[dict[str, Any]] = field(default_factory=list)
    """The round's finished steps for decide, in plan order: ``plan``, ``draft`` and ``repairs``."""
    draft: Candidate | None = None
    """The candidate of the current step, between code, verify and profile."""
    repairs: int = 0
    """Repairs spent on the current step."""
    repair: bool = False
    """Whether the coder repairs the failed draft next (set by the verifier)."""
    best: Candidate | None = None
    """The best verified candidate so far (the answer); the coder branches from it when the step
    names no parent."""
    runner_up: Candidate | None = None
    """The fastest verified candidate that was not significantly slower than eager (GPU): the
    answer, labelled not significantly faster, when no candidate became the best."""
    tried: list[str] = field(default_factory=list)
    """Strategies (with their parameters) already tried, whatever came of them."""
    iterations: Annotated[list[dict[str, Any]], operator.add] = field(default_factory=list)
    """One compact record per finished step (no sources)."""
    archive: Annotated[list[dict[str, Any]], operator.add] = field(default_factory=list)
    """The search's verified candidates with their evidence, parent and operator
    (:class:`kernelcrew.agents.search.Entry` as dicts, sources included)."""
    user_messages: list[str] = field(default_factory=list)
    """The user's guidance, in order; each is answered once (``answered``)."""
    answered: int = 0
    replies: Annotated[list[str], operator.add] = field(default_factory=list)
    """The crew's answers to the user's messages."""
    steps_used: int = 0
    since_gain: int = 0
    """Steps since the best candidate last improved beyond noise."""
    started_at: float = 0.0
    elapsed_s: float = 0.0
    usage: dict[str, Any] = field(default_factory=dict)
    """Tokens and cost per agent (an LLM UsageMeter as a dict)."""
    llm_failure: str = ""
    """Why the LLM provider failed (network, key, quota): the playbook plans from then on."""
    budget: dict[str, Any] = field(default_factory=dict)
    """How the time budget is spent: the baseline's share and seconds, what it skipped and why, the
    fallback's and the final timing's seconds (replaced whole by each node that adds to it)."""
    stop_reason: str = ""
    status: str = "running"
    report: Report | None = None
    """The final report (set by finalize)."""

    def __post_init__(self) -> None:
        # A checkpoint written before these fields were records holds them as dicts.
        if isinstance(self.baseline, dict):
            self.baseline = Baseline.model_validate(self.baseline)
        if isinstance(self.report, dict):
            self.report = Report.model_validate(self.report) if self.report else None


@functools.cache
def _reduced_fields() -> frozenset[str]:
    """The fields the graph grows instead of replacing (``Annotated[..., operator.add]``)."""
    hints = get_type_hints(CrewState, include_extras=True)
    return frozenset(
        name for name, hint in hints.items() if operator.add in getattr(hint, "__metadata__", ())
    )


def apply_update(state: CrewState, update: dict[str, Any]) -> CrewState:
    """``state`` after a node's ``update``, as the graph applies it (list fields with a reducer
    grow, the others are replaced): for nodes run one after another inside a node."""
    reduced = _reduced_fields()
    return replace(state, **{k: getattr(state, k) + v if k in reduced else v for k, v in update.items()})


def merge_updates(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """One update with the effect of ``first`` followed by ``then``."""
    reduced = _reduced_fields()
    merged = dict(first)
    for k, v in then.items():
        merged[k] = merged[k] + v if k in reduced and k in merged else v
    return merged


def step_within_s(state: CrewState) -> float | None:
    """Seconds the current step's executor calls may take (their ``within_s``): what is left until
    ``step_ends_at``, at least one (the call fails at once, saying why); None outside a step."""
    if state.plan is None or not state.step_ends_at:
        return None
    return max(1.0, state.step_ends_at - time.time())
