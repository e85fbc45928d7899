"""The search engine: fitness, selection, operators, termination, and its place in the crew."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from kernelcrew.agents import search
from kernelcrew.agents.planner import step_key
from kernelcrew.agents.search import Archive, Entry
from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep


def entry(id: str, step: int, strategy: str = "row_reduction", params=None, ci_low=None, **kw) -> Entry:
    """A verified GPU candidate; ``ci_low`` set: significant with that lower bound."""
    significant = ci_low is not None
    return Entry(
        id=id,
        step=step,
        strategy=strategy,
        params=params or {},
        kind=kw.pop("kind", "kernel"),
        speedup_eager=kw.pop("speedup", (ci_low or 0.9) + 0.1),
        speedup_eager_ci=[ci_low, (ci_low or 0.9) + 0.2] if significant else [0.8, 1.1],
        significant=significant,
        **kw,
    )


def menu_step(strategy: str, **params) -> PlanStep:
    return PlanStep(strategy=strategy, rationale="r", expected_gain=2.0, params=params)


def propose(archive: Archive, menu, **kw):
    kw.setdefault("seed", 0)
    kw.setdefault("step", 1)
    kw.setdefault("attempted", {e.strategy for e in archive.entries})
    kw.setdefault("tried", {step_key(e.strategy, e.params) for e in archive.entries})
    return search.propose(archive, menu, key=step_key, **kw)


def test_fitness_is_the_judges_lower_bound_on_a_gpu_and_the_kind_on_a_cpu():
    assert search.fitness(entry("c1", 1, ci_low=1.4), "cuda") == 1.4
    assert search.fitness(entry("c2", 2), "cuda") is None  # not significant: no fitness
    assert search.fitness(entry("c3", 3, kind="kernel"), "cpu") > search.fitness(
        entry("c4", 4, kind="compiler"), "cpu"
    )
    # the CPU keeps the first of equal kinds, as decide does
    cpu = Archive([entry("c1", 1, kind="library"), entry("c2", 2), entry("c3", 3)], "cpu")
    assert cpu.fittest().id == "c2"
    gpu = Archive(
        [entry("c1", 1, speedup=1.9), entry("c2", 2, ci_low=1.1), entry("c3", 3, ci_low=1.3)], "cuda"
    )
    assert gpu.fittest().id == "c3"  # a significant 1.3 beats a faster median the judge did not trust


def test_the_archive_round_trips_through_json():
    archive = Archive(
        [
            entry("c1", 1, ci_low=1.2, params={"BLOCK": 1024}, source="class ModelNew: ..."),
            entry(
                "c2",
                2,
                "anchored_fusion",
                {"pointwise": {"BLOCK_SIZE": 512}},
                1.3,
                parent="c1",
                operator="tune",
            ),
        ],
        "cuda",
    )
    back = Archive.from_dicts(json.loads(json.dumps(archive.to_dicts())), "cuda")
    assert back.entries == archive.entries
    assert "source" not in archive.to_dicts(source=False)[0]
    # a record with fields this version does not know still loads
    assert Entry.from_dict({**archive.to_dicts()[0], "later_field": 1}) == archive.entries[0]


def test_the_first_step_is_the_menus_first_whatever_the_seed():
    menu = [menu_step("row_reduction", BLOCK=1024), menu_step("torch_compile")]
    for seed in range(20):
        got = propose(Archive([], "cuda"), menu, seed=seed)
        assert (got.index, got.operator, got.parent) == (0, "new_strategy", None)
    assert propose(Archive([], "cuda"), []) is None


def test_exploit_tunes_the_fittest_nearest_configuration_first():
    archive = Archive(
        [
            entry("c1", 1, params={"BLOCK": 1024, "num_warps": 4}, ci_low=1.2),
            entry("c2", 2, params={"BLOCK": 4096, "num_warps": 8}, ci_low=1.5),
        ],
        "cuda",
    )
    menu = [
        menu_step("row_reduction", BLOCK=512, num_warps=4),  # 3 doublings from c2
        menu_step("row_reduction", BLOCK=8192, num_warps=16),  # 2 doublings from c2
        menu_step("row_reduction", BLOCK=4096, num_warps=4),  # 1 doubling from c2
        menu_step("torch_compile"),
    ]
    got = propose(archive, menu, explore_rate=0.0, attempted={"row_reduction", "torch_compile"})
    assert (got.operator, got.parent, got.index) == ("tune", "c2", 2)
    assert [menu[i].params["BLOCK"] for i in search.neighbours(archive.get("c2"), menu)] == [4096, 8192, 512]
    assert search.distance({"a": {"B": 1024}}, {"a": {"B": 2048}, "c": "x"}) == 2.0


def test_exploit_moves_on_to_an_untried_strategy_when_the_fittest_has_no_neighbour_left():
    archive = Archive([entry("c1", 1, ci_low=1.2)], "cuda")
    menu = [menu_step("torch_compile"), menu_step("sdpa_attention")]
    got = propose(archive, menu, explore_rate=0.0)
    assert (got.operator, got.index, got.parent) == ("new_strategy", 0, None)


def test_explore_takes_an_untried_family_then_the_best_of_the_least_tried_niche():
    archive = Archive(
        [
            entry("c1", 1, "row_reduction", {"BLOCK": 1024}, 1.6),
            entry("c2", 2, "row_reduction", {"BLOCK": 2048}, 1.5),
            entry("c3", 3, "torch_compile", {"v": 1}, 1.2, kind="compiler"),
            entry("c4", 4, "torch_compile", {"v": 2}, 1.3, kind="compiler"),
            entry("c5", 5, "matmul_epilogue", {"v": 1}, 1.1),
        ],
        "cuda",
    )
    tuning = [
        menu_step("row_reduction", BLOCK=4096),
        menu_step("torch_compile", v=3),
        menu_step("matmul_epilogue", v=2),
    ]
    untried = [*tuning, menu_step("sdpa_attention")]
    got = propose(archive, untried, explore_rate=1.0)
    assert (got.operator, got.index) == ("new_strategy", 3)  # a family never tried: zero tries
    got = propose(archive, tuning, explore_rate=1.0)
    # matmul (one try) is less tried than torch_compile (two); the fittest's niche is not explored
    assert (got.operator, got.parent, got.index) == ("tune", "c5", 2)
    got = propose(archive, tuning[:2], explore_rate=1.0)
    assert (got.operator, got.parent, got.index) == ("tune", "c4", 1)  # the best of its niche
    # nothing to explore: back to exploiting the fittest
    assert propose(archive, tuning[:1], explore_rate=1.0).parent == "c1"


def test_the_seed_makes_a_run_reproducible_and_explores_about_a_quarter_of_the_steps():
    runs = {seed: [search.explores(seed, step) for step in range(1, 401)] for seed in (0, 1)}
    assert runs[0] == [search.explores(0, step) for step in range(1, 401)]
    assert runs[0] != runs[1]
    for coins in runs.values():
        assert 0.15 < sum(coins) / len(coins) < 0.35
    archive = Archive(
        [
            entry("c1", 1, ci_low=1.5, params={"B": 1}),
            entry("c2", 2, "torch_compile", ci_low=1.2, kind="compiler"),
        ],
        "cuda",
    )
    menu = [menu_step("row_reduction", B=2), menu_step("torch_compile", v=2)]
    picks = [propose(archive, menu, seed=7, step=s).parent for s in range(1, 41)]
    assert picks == [propose(archive, menu, seed=7, step=s).parent for s in range(1, 41)]
    assert set(picks) == {"c1", "c2"}  # both exploit and explore happen over a run
    parents = [search.select_parent(archive, seed=7, step=s).id for s in range(1, 41)]
    assert parents == picks  # the LLM path's parent follows the same coin


def test_recombine_crosses_the_parts_of_two_anchored_winners():
    pw = [{"BLOCK_SIZE": 1024, "num_warps": 4}, {"BLOCK_SIZE": 4096, "num_warps": 8}]
    rw = [{"CHUNK": 2048, "num_warps": 4}, {"CHUNK": 8192, "num_warps": 8}]
    a = entry("c1", 1, "anchored_fusion", {"pointwise": pw[0], "rows": rw[0]}, 1.4)
    b = entry("c2", 2, "anchored_fusion", {"pointwise": pw[1], "rows": rw[1]}, 1.2)
    archive = Archive([a, b], "cuda")
    menu = [menu_step("anchored_fusion", pointwise=pw[0], rows=rw[1])]
    got = propose(archive, menu, explore_rate=0.0, recombinable={"anchored_fusion"})
    assert (got.operator, got.parent, got.index) == ("recombine", "c1", None)
    assert got.params == {"pointwise": pw[1], "rows": rw[0]}
    tried = {step_key("anchored_fusion", p) for p in (a.params, b.params, got.params)}
    assert [c for c, _ in search.crossings(archive, a, tried, step_key)] == [
        {"pointwise": pw[0], "rows": rw[1]}
    ]
    # the user no longer allows the strategy: no crossing, the menu's steps only
    assert propose(archive, menu, explore_rate=0.0, recombinable=set()).operator == "tune"
    # parents that share a part give nothing new
    same = Archive([a, entry("c2", 2, "anchored_fusion", {"pointwise": pw[0], "rows": rw[1]}, 1.2)], "cuda")
    assert search.crossings(same, a, set(), step_key) == []


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"steps": 6}, "iteration budget reached (6)"),
        ({"elapsed_s": 900.0}, "time budget reached (900 s)"),
        ({"best_sol_fraction": 0.93}, "the best runs at 93% of speed of light (target 90%)"),
        ({"since_gain": 3}, "3 steps without a gain beyond noise"),
        ({"best_sol_fraction": 0.89}, ""),
        ({"since_gain": 3, "device": "cpu"}, ""),
        ({"best_sol_fraction": 0.95, "device": "cpu"}, ""),
        ({"since_gain": 3, "has_best": False}, ""),
    ],
)
def test_termination_rules(kw, reason):
    args = {
        "device": "cuda",
        "steps": 2,
        "max_iters": 6,
        "elapsed_s": 10.0,
        "time_budget_s": 900.0,
        "since_gain": 0,
        "patience": 3,
        "best_sol_fraction": None,
        "has_best": True,
    }
    assert search.stop_reason(**{**args, **kw}) == reason


def test_lineage_and_summary():
    archive = Archive(
        [
            entry("c1", 1, ci_low=1.2),
            entry("c2", 2, "torch_compile", ci_low=1.1, kind="compiler"),
            entry("c3", 3, ci_low=1.5, parent="c1", operator="tune"),
            entry("c5", 5, ci_low=1.7, parent="c3", operator="tune"),
        ],
        "cuda",
    )
    chain = search.lineage(archive, "c5")
    assert [(link["id"], link["operator"], link["parent"]) for link in chain] == [
        ("c1", "new_strategy", None),
        ("c3", "tune", "c1"),
        ("c5", "tune", "c3"),
    ]
    assert search.lineage(archive, "missing") == []
    iterations = [
        {"operator": "new_strategy", "verdict": "pass"},
        {"operator": "new_strategy", "verdict": "pass"},
        {"operator": "tune", "verdict": "pass"},
        {"operator": "tune", "verdict": "fail"},
        {"operator": "tune", "verdict": "pass"},
        {"strategy": "(plan)", "verdict": "fail"},
    ]
    got = search.summary(archive, iterations)
    assert got["archive_size"] == 4
    assert got["operators"] == {
        "new_strategy": {"steps": 2, "verified": 2},
        "tune": {"steps": 3, "verified": 2},
    }
    assert got["niches"] == ["row_reduction x kernel", "torch_compile x compiler"]


# ------------------------------------------------------------------------------------------------
# In the crew: the planner asks the engine, decide fills the archive, the coder branches from the
# parent, the report shows the lineage
# ------------------------------------------------------------------------------------------------


def gpu_state(**kw) -> CrewState:
    return CrewState(
        task_source="",
        options=Options(device="cuda", time_budget_s=600.0, seed=kw.pop("seed", 0)),
        baseline={"phase_s": {"golden": 1.0, "benchmark": 1.0}},
        started_at=time.time() - 5.0,
        **kw,
    )


def test_the_playbook_planner_tunes_the_archives_fittest_and_guidance_still_binds(monkeypatch):
    from kernelcrew.agents import planner

    rows = [menu_step("row_reduction", BLOCK=b) for b in (1024, 8192, 2048)]
    compiler = PlanStep(strategy="torch_compile", rationale="r", expected_gain=1.5)
    monkeypatch.setattr(planner, "_menu", lambda state: [*rows, compiler])
    first = entry("c1", 1, params={"BLOCK": 1024}, ci_low=1.3)
    state = gpu_state(
        archive=[first.to_dict()],
        iterations=[{"step": 1, "elapsed_s": 3.0, "strategy": "row_reduction", "verdict": "pass"}],
        tried=[step_key("row_reduction", {"BLOCK": 1024})],
        steps_used=1,
    )
    prefs = {"only_kernels": False, "try": [], "skip": set(), "more": 0, "stop": False}
    monkeypatch.setattr(search, "explores", lambda seed, step, rate=0.0: False)
    step = planner._plan_with_playbook(state, prefs)
    assert (step.strategy, step.params, step.operator, step.parent) == (
        "row_reduction",
        {"BLOCK": 2048},
        "tune",
        "c1",
    )
    assert "nearest c1" in step.rationale
    # the user's guidance binds the engine: skip, try, only kernels
    assert planner._plan_with_playbook(state, {**prefs, "skip": {"row_reduction"}}) == compiler
    assert planner._plan_with_playbook(state, {**prefs, "try": ["torch_compile"]}) == compiler
    monkeypatch.setattr(search, "explores", lambda seed, step, rate=0.0: True)
    assert planner._plan_with_playbook(state, prefs) == compiler  # exploring: the untried family
    assert planner._plan_with_playbook(state, {**prefs, "only_kernels": True}).params == {"BLOCK": 2048}


def test_decide_archives_verified_candidates_with_their_parent_and_operator():
    from kernelcrew.agents.decide import decide

    events = []
    runtime = SimpleNamespace(context=SimpleNamespace(emit=lambda *a, **k: events.append(a), meter=None))
    plan = PlanStep(
        strategy="row_reduction",
        rationale="r",
        expected_gain=2.0,
        params={"BLOCK": 2048},
        parent="c1",
        operator="tune",
    )
    draft = Candidate(
        id="c2",
        strategy="row_reduction",
        source_kind="kernel",
        source="class ModelNew: pass",
        params={"BLOCK": 2048},
        verdict="pass",
        kind="kernel",
        time_ms=0.5,
        speedup_eager=1.8,
        speedup_eager_ci=[1.6, 2.0],
        significant=True,
        sol_fraction=0.95,
    )
    state = gpu_state(plan=plan, draft=draft, steps_used=1)
    update = decide(state, runtime)
    (archived,) = update["archive"]
    assert Entry.from_dict(archived) == Entry.from_candidate(draft, 2, "c1", "tune")
    assert archived["source"] == "class ModelNew: pass"
    assert update["iterations"][0]["operator"] == "tune" and update["iterations"][0]["parent"] == "c1"
    assert update["stop_reason"] == "the best runs at 95% of speed of light (target 90%)"
    failed = gpu_state(plan=plan, draft=Candidate(**{**draft.__dict__, "verdict": "fail"}), steps_used=1)
    assert "archive" not in decide(failed, runtime)


def test_the_coder_branches_from_the_selected_parent():
    from kernelcrew.agents.coder import parent_source

    best = Candidate(id="c3", strategy="custom:x", source_kind="kernel", source="BEST", verdict="pass")
    archive = [
        entry("c1", 1, "custom:y", source="PARENT").to_dict(),
        entry("c3", 3, "custom:x", source="BEST").to_dict(),
    ]
    step = PlanStep(strategy="custom:z", rationale="r", expected_gain=1.2, parent="c1", operator="llm_edit")
    assert parent_source(gpu_state(plan=step, best=best, archive=archive)) == "PARENT"
    orphan = step.model_copy(update={"parent": None})
    assert parent_source(gpu_state(plan=orphan, best=best, archive=archive)) == "BEST"
    assert parent_source(gpu_state(plan=orphan)).startswith("(none")


def test_an_llm_step_becomes_an_operator_of_the_search():
    from kernelcrew.agents.planner import _llm_operator

    archive = Archive([entry("c1", 1, ci_low=1.2), entry("c2", 2, "custom:a", ci_low=1.4)], "cuda")
    custom = PlanStep(strategy="custom:b", rationale="r", expected_gain=1.2, source="llm")
    got = _llm_operator(custom, archive, archive.get("c2"))
    assert (got.operator, got.parent) == ("llm_edit", "c2")
    assert _llm_operator(custom, Archive([], "cuda"), None).parent is None
    tuned = _llm_operator(custom.model_copy(update={"strategy": "row_reduction"}), archive, archive.get("c2"))
    assert (tuned.operator, tuned.parent) == ("tune", "c1")
    new = _llm_operator(custom.model_copy(update={"strategy": "torch_compile"}), archive, archive.get("c2"))
    assert (new.operator, new.parent) == ("new_strategy", None)


def test_the_report_shows_the_lineage_and_old_reports_still_load():
    from kernelcrew.agents.report import render_markdown
    from kernelcrew.records import Report

    old = Report.model_validate({"status": "improved"})
    assert old.lineage == [] and old.search == {}
    archive = Archive(
        [
            entry("c1", 1, params={"BLOCK": 1024}, ci_low=1.2),
            entry("c3", 3, params={"BLOCK": 2048}, ci_low=1.5, parent="c1", operator="tune"),
        ],
        "cuda",
    )
    report = Report(
        status="improved",
        lineage=search.lineage(archive, "c3"),
        search=search.summary(
            archive,
            [{"operator": "new_strategy", "verdict": "pass"}, {"operator": "tune", "verdict": "pass"}],
        ),
    )
    again = Report.model_validate_json(report.model_dump_json())
    assert again.lineage == report.lineage
    md = render_markdown(again)
    assert "## Lineage of the answer" in md
    assert '- step 3: c3 row_reduction {"BLOCK": 2048} (tune of c1), 1.6x vs eager' in md
    assert "Search: 2 verified candidate(s); new_strategy 1/1 verified, tune 1/1 verified." in md


def test_a_compiler_candidate_the_fallback_verified_is_not_planned_again(monkeypatch):
    """The fallback (verified before the first step) goes into the archive: the first step is the
    menu's next entry, not the same compiler candidate verified a second time."""
    from kernelcrew.agents import planner

    compiler = PlanStep(strategy="torch_compile", rationale="r", expected_gain=1.5)
    rows = menu_step("row_reduction", BLOCK=1024)
    monkeypatch.setattr(planner, "_menu", lambda state: [compiler, rows])
    fallback = entry("fallback", 1, "torch_compile", ci_low=1.2, kind="compiler", operator="fallback")
    state = gpu_state(
        archive=[fallback.to_dict()],
        iterations=[
            {"step": 1, "elapsed_s": 3.0, "strategy": "torch_compile", "verdict": "pass", "fallback": True}
        ],
        steps_used=1,
    )
    prefs = {"only_kernels": False, "try": [], "skip": set(), "more": 0, "stop": False}
    for seed in range(8):
        state.options.seed = seed
        assert planner._plan_with_playbook(state, prefs) == rows


def test_the_archive_and_a_steps_parent_survive_the_checkpointers_serializer():
    """The state is checkpointed with the graph's own serializer (its allowed types only)."""
    from kernelcrew.agents.graph import serializer

    step = PlanStep(strategy="row_reduction", rationale="r", expected_gain=2.0, parent="c1", operator="tune")
    archive = [entry("c1", 1, params={"BLOCK": {"x": 1024}}, ci_low=1.3, source="SRC").to_dict()]
    serde = serializer()
    back = serde.loads_typed(serde.dumps_typed({"archive": archive, "plan": step}))
    assert back["archive"] == archive
    assert back["plan"] == step
    # a checkpoint written before the search: no archive, a plan without parent or operator
    assert CrewState(task_source="").archive == []
    assert (
        PlanStep.model_validate({"strategy": "s", "rationale": "r", "expected_gain": 2.0}).operator
        == "new_strategy"
    )


def test_the_llm_plans_and_codes_from_the_parent_the_search_selected(monkeypatch):
    """With seed 0 step 3 explores: the planner's prompt and the coder's base are the other niche's
    best (c2), not the fittest (c1); step 2 exploits the fittest. The provider is a replay."""
    from kernelcrew.agents import planner
    from kernelcrew.agents.coder import code
    from kernelcrew.agents.context import CrewContext
    from kernelcrew.agents.llm import ReplayChat

    assert [search.explores(0, s) for s in (2, 3)] == [False, True]
    monkeypatch.setattr(planner, "_menu", lambda state: [])
    archive = [
        entry("c1", 1, "custom:tiles", ci_low=1.5, source="FITTEST_SOURCE").to_dict(),
        entry("c2", 2, "custom:graph", ci_low=1.1, kind="hybrid", source="OTHER_SOURCE").to_dict(),
    ]
    best = Candidate(
        id="c1", strategy="custom:tiles", source_kind="kernel", source="FITTEST_SOURCE", verdict="pass"
    )
    reply = {"strategy": "custom:vectorize", "rationale": "wider loads", "expected_gain": 1.2, "params": {}}
    for steps_used, parent, shown in ((1, "c1", "FITTEST_SOURCE"), (2, "c2", "OTHER_SOURCE")):
        chat = ReplayChat([json.dumps(reply), "```python\nclass ModelNew:\n    pass\n```"])
        runtime = SimpleNamespace(context=CrewContext(executor=None, chat=chat))
        state = CrewState(
            task_source="class Model: pass",
            options=Options(device="cuda", backend="replay"),
            archive=archive,
            best=best,
            kb_hits=[],
            steps_used=steps_used,
        )
        step = planner.plan(state, runtime)["plan"]
        assert (step.strategy, step.operator, step.parent) == ("custom:vectorize", "llm_edit", parent)
        assert shown in chat.sent[0][-1].content
        draft = code(CrewState(**{**state.__dict__, "plan": step}), runtime)["draft"]
        assert draft.source.startswith("class ModelNew")
        assert shown in chat.sent[1][-1].content
        hidden = "OTHER_SOURCE" if shown == "FITTEST_SOURCE" else "FITTEST_SOURCE"
        assert hidden not in chat.sent[1][-1].content
