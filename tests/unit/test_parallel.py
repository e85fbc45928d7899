"""Parallel evaluation: a round's steps side by side, each on its own slot (GPU) or worker."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kernelcrew.agents.decide import decide
from kernelcrew.agents.graph import serializer
from kernelcrew.agents.planner import plan
from kernelcrew.agents.run import round_size
from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep, apply_update, merge_updates
from kernelcrew.config import Settings
from kernelcrew.tools import sandbox
from kernelcrew.tools.executor import LocalExecutor, branch, slots_for, split_cores
from kernelcrew.tools.sandbox import SandboxLimits
from tests.conftest import FIXTURES

T = "tests.unit.sandbox_targets"
POINTWISE = FIXTURES / "tasks" / "pointwise.py"


def test_a_slot_sets_the_childrens_gpus_and_their_share_of_memory(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    limits = SandboxLimits(wall_s=30, cpu_s=60, memory_bytes=2 * 1024**3, max_procs=64)
    whole = SandboxLimits.from_settings(Settings()).memory_bytes
    with sandbox.in_slot(sandbox.Slot("1", 0.5)):
        res = sandbox.run(f"{T}:environment", {}, limits=limits)
        halved = SandboxLimits.from_settings(Settings()).memory_bytes
    assert res.ok, res
    assert res.value["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert halved == max(sandbox.MIN_CHILD_MEMORY, int(whole * 0.5))
    outside = sandbox.run(f"{T}:environment", {}, limits=limits)
    assert outside.value["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"  # no slot: the caller's GPUs


def test_a_slot_with_cores_runs_its_thread_and_children_on_them_and_gives_them_back():
    limits = SandboxLimits(wall_s=30, cpu_s=60, memory_bytes=2 * 1024**3, max_procs=64)
    before = os.sched_getaffinity(0)
    one = min(before)
    with sandbox.in_slot(sandbox.Slot(cpus=frozenset({one}))):
        assert os.sched_getaffinity(0) == {one}
        res = sandbox.run(f"{T}:affinity", {}, limits=limits)
    assert res.ok, res
    assert res.value["cpus"] == [one]
    assert os.sched_getaffinity(0) == before


def test_slots_split_the_cores_in_equal_runs(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    halves = split_cores(2)
    assert halves == [frozenset(range(16)), frozenset(range(16, 32))]
    assert split_cores(1) == [None]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert split_cores(2) == [None, None]  # under two cores a slot: no pinning


def test_slots_are_one_per_visible_gpu_and_one_that_changes_nothing_on_a_single_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")
    assert slots_for("cuda") == ["2", "5", "7"]
    assert slots_for("cuda", 2) == ["2", "5"]
    assert slots_for("cuda", 1) == [None]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert slots_for("cuda", 4) == [None]  # one GPU: its children see what the caller sees
    assert slots_for("cpu") == [None] and slots_for("cpu", 2) == [None, None]


def test_calls_side_by_side_hold_different_slots_and_a_call_past_them_waits():
    executor = LocalExecutor(Settings(), slots=["0", "1"])
    held: list[str | None] = []
    release = threading.Event()

    def call() -> None:
        with executor._slot():
            held.append(sandbox.current_slot().visible_devices)
            assert sandbox.current_slot().memory_share == 0.5
            release.wait(30)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    while len(held) < 2:
        time.sleep(0.01)
    assert sorted(held) == ["0", "1"]
    third = threading.Thread(target=call)
    third.start()
    time.sleep(0.3)
    assert len(held) == 2  # no slot free: the third call waits
    release.set()
    for t in [*threads, third]:
        t.join(30)
    assert len(held) == 3 and sandbox.current_slot() is None
    assert executor.capacity("cuda") == 2 and branch(executor, 1) is executor


def _gpu_state(**kw) -> CrewState:
    opts = Options(device="cuda", max_iters=kw.pop("max_iters", 6), parallel=kw.pop("parallel", 3))
    return CrewState(task_source="x", options=opts, **kw)


def test_a_round_plans_distinct_steps_up_to_parallel_and_the_steps_left(monkeypatch):
    from kernelcrew.agents import planner

    menu = [PlanStep(strategy=s, rationale="r", expected_gain=1.5) for s in ("a", "b", "c", "d")]
    monkeypatch.setattr(planner, "_menu", lambda state: menu)
    monkeypatch.setattr(planner, "_fits_budget", lambda state, step: step.strategy != "c")
    monkeypatch.setattr(planner, "task_hits", lambda state, ctx: [])
    monkeypatch.setattr(
        "kernelcrew.agents.playbook.STRATEGIES",
        {s: SimpleNamespace(source_kind="kernel", cost=1.0, options=()) for s in "abcd"},
    )
    runtime = SimpleNamespace(context=SimpleNamespace(chat=None, emit=lambda *a, **k: None))
    out = plan(_gpu_state(), runtime)
    # each further step as if the ones before had been tried; "c" does not fit the budget
    assert [out["plan"].strategy, *(s.strategy for s in out["batch"])] == ["a", "b", "d"]
    out = plan(_gpu_state(tried=["b"]), runtime)
    assert [out["plan"].strategy, *(s.strategy for s in out["batch"])] == ["a", "d"]
    out = plan(_gpu_state(parallel=3, max_iters=2, steps_used=1), runtime)
    assert out["batch"] == []  # one step left in the run
    out = plan(_gpu_state(parallel=1), runtime)
    assert out["batch"] == []


def _timed(cid: str, strategy: str, speedup: float) -> Candidate:
    return Candidate(
        id=cid,
        strategy=strategy,
        source_kind="kernel",
        source="class ModelNew: ...",
        verdict="pass",
        kind="kernel",
        time_ms=1.0 / speedup,
        speedup_eager=speedup,
        speedup_eager_ci=[speedup * 0.95, speedup * 1.05],
        significant=True,
    )


def test_decide_takes_a_rounds_steps_in_plan_order_as_if_one_after_another():
    steps = [PlanStep(strategy=s, rationale="r", expected_gain=1.5) for s in ("a", "b", "c")]
    failed = replace(_timed("c3", "c", 1.0), verdict="fail", stage="correctness", time_ms=None)
    state = _gpu_state(
        steps_used=2,
        evaluated=[
            {"plan": steps[0], "draft": _timed("c3", "a", 1.3), "repairs": 0},
            {"plan": steps[1], "draft": _timed("c4", "b", 2.0), "repairs": 0},
            {"plan": steps[2], "draft": replace(failed, id="c5"), "repairs": 1},
        ],
        started_at=time.time(),
    )
    runtime = SimpleNamespace(context=SimpleNamespace(emit=lambda *a, **k: None, meter=None))
    update = decide(state, runtime)
    assert [r["step"] for r in update["iterations"]] == [3, 4, 5]
    assert {r["round"] for r in update["iterations"]} == {3}
    assert [r["strategy"] for r in update["iterations"]] == ["a", "b", "c"]
    assert [r["new_best"] for r in update["iterations"]] == [True, True, False]
    assert update["best"].id == "c4" and update["steps_used"] == 5 and update["since_gain"] == 1
    assert [e["id"] for e in update["archive"]] == ["c3", "c4"]  # the verified ones
    assert update["evaluated"] == [] and len(update["tried"]) == 3
    after = apply_update(state, update)
    assert len(after.iterations) == 3 and after.evaluated == [] and after.best.id == "c4"


def test_updates_merge_as_the_graph_applies_them():
    assert merge_updates({"iterations": [1], "best": "x"}, {"iterations": [2], "best": "y"}) == {
        "iterations": [1, 2],
        "best": "y",
    }
    state = apply_update(_gpu_state(iterations=[{"step": 1}]), {"iterations": [{"step": 2}], "steps_used": 2})
    assert state.iterations == [{"step": 1}, {"step": 2}] and state.steps_used == 2


def test_a_round_in_the_state_survives_the_checkpointers_serializer():
    step = PlanStep(strategy="a", rationale="r", expected_gain=1.5)
    state = _gpu_state(
        batch=[step], evaluated=[{"plan": step, "draft": _timed("c1", "a", 1.2), "repairs": 0}]
    )
    serde = serializer()
    back = serde.loads_typed(serde.dumps_typed(state))
    assert back.batch == [step] and back.evaluated[0]["draft"].speedup_eager == 1.2


@pytest.mark.parametrize(
    "capacity, asked, expected", [(3, 2, 2), (1, 4, 1), (2, 0, 2), (None, 0, 1), (None, 3, 3)]
)
def test_a_run_asks_no_more_side_by_side_than_its_executor_can_run(capacity, asked, expected):
    remote = SimpleNamespace(capacity=lambda device: capacity) if capacity else object()
    assert round_size(remote, "cuda", asked) == expected


def test_overlapping_judges_keep_their_threads_and_give_torch_its_count_back():
    import torch

    from kernelcrew.tools import correctness

    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        first = correctness._judging_pools(4)
        pool_a, _ = first.__enter__()
        second = correctness._judging_pools(4)
        pool_b, _ = second.__enter__()  # a round's other step judges while the first still does
        assert torch.get_num_threads() == 1
        assert pool_a._max_workers == pool_b._max_workers == 4  # not the one thread the first set
        first.__exit__(None, None, None)
        assert torch.get_num_threads() == 1  # the second still judges
        second.__exit__(None, None, None)
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_the_progress_view_gives_a_rounds_interleaved_events_to_their_own_steps():
    from kernelcrew.web.views import progress_of

    events = [
        (1, "plan", {"step": 3, "strategy": "a"}),
        (2, "plan", {"step": 4, "strategy": "b"}),
        (3, "code", {"candidate": "c4", "lines": 30}),
        (4, "code", {"candidate": "c3", "lines": 20}),
        (5, "verify", {"candidate": "c3", "verdict": "pass", "stage": "done", "message": "ok"}),
        (6, "verify", {"candidate": "c4", "verdict": "fail", "stage": "correctness", "message": "wrong"}),
        (7, "timing", {"candidate": "c3", "time_ms": 1.0, "speedup_eager": 2.0}),
        (8, "decide", {"step": 3, "verdict": "pass", "new_best": True}),
        (9, "decide", {"step": 4, "verdict": "fail", "new_best": False}),
    ]
    steps = {s.number: s for s in progress_of(events).steps}
    assert steps[3].speedup == 2.0 and steps[3].new_best and steps[3].verdict == "pass"
    assert steps[4].failure == "correctness: wrong" and not steps[4].new_best
    assert [st.detail for st in steps[4].stages if st.name == "code"] == ["30 lines"]


@pytest.mark.parametrize("source, repaired", [("llm", True), ("playbook", False)])
def test_only_the_models_own_step_of_a_round_goes_back_to_it_for_repair(source, repaired):
    from kernelcrew.agents.verifier import verify

    broken = Candidate(id="c2", strategy="row_reduction", source_kind="kernel", source="def broken(:\n")
    state = _gpu_state(
        plan=PlanStep(strategy="row_reduction", rationale="r", expected_gain=1.5, source=source),
        draft=broken,
    )
    runtime = SimpleNamespace(context=SimpleNamespace(chat=object(), emit=lambda *a, **k: None))
    update = verify(state, runtime)
    assert update["draft"].stage == "build"  # a syntax error, found without running it
    assert update["repair"] is repaired
