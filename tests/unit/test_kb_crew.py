"""The crew with its knowledge base on CPU: a job's verified win reaches the next, similar job."""

from __future__ import annotations

import json

import pytest

from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.graph import compile_graph, sqlite_checkpointer
from kernelcrew.agents.knowledge import record_best
from kernelcrew.agents.llm import ReplayChat
from kernelcrew.agents.planner import _menu
from kernelcrew.agents.run import OptimizeRequest, run_optimize
from kernelcrew.agents.state import Candidate, CrewState, Options
from kernelcrew.config import Settings
from kernelcrew.knowledge_base import KnowledgeBase, from_analysis
from kernelcrew.records import FinalTiming, Report
from kernelcrew.tools.packaging import unpack
from tests.conftest import FIXTURES

TASKS = FIXTURES / "tasks"
WRONG = (FIXTURES / "candidates" / "pointwise_triton.py").read_text()  # tanh(2x + y): wrong for sigmoid


def report_json(report: Report | None) -> dict | None:
    """A run's report as report.json has it."""
    return None if report is None else report.model_dump(mode="json")


def request(task, out, **kw) -> OptimizeRequest:
    base = dict(task=task, device="cpu", max_iters=1, quick=True, compile_modes="none", backend="playbook")
    return OptimizeRequest(**{**base, "out": out, **kw})


@pytest.fixture(scope="module")
def first_job(tmp_path_factory):
    """A playbook job on tanh(x * 2 + y): its verified best goes into the knowledge base."""
    root = tmp_path_factory.mktemp("kbcrew")
    settings = Settings(data_dir=root / "data")
    kb = KnowledgeBase.open(settings, owner="alice")
    report = report_json(run_optimize(request(TASKS / "pointwise.py", root / "o1"), settings=settings, kb=kb))
    return report, settings, kb, root


def test_finalize_records_the_verified_best_as_a_labelled_cpu_win(first_job):
    report, _, kb, root = first_job
    recorded = report["knowledge_base"]["recorded"]
    assert recorded["recorded"] and recorded["action"] == "inserted"
    win = kb.get(recorded["id"])
    assert win["job_id"] == report["run_id"] and win["owner"] == "alice"
    assert win["strategy"] == "fused_pointwise" and win["source"] == "verified"
    assert (win["gpu_model"], win["arch"], win["clock"]) == ("cpu", "cpu", "cpu-wall")
    assert win["signature"].startswith("ops=mul>add>tanh | dtypes=float32 | shape=2d rows=32 x cols=64")
    assert win["params"] == report["best"]["params"] and (win["candidate_source"], True) == unpack(
        (root / "o1" / "best.py").read_text()
    )
    assert win["before_ms"] == report["best"]["eager_ms"] and win["after_ms"] == report["best"]["best_ms"]
    assert "this run's win: inserted" in (root / "o1" / "report.md").read_text()


def test_a_second_similar_job_gets_the_first_win_and_records_nothing_unverified(first_job):
    """sigmoid(x * 3 - y): the planner's prompt carries the first job's win; its own candidate fails."""
    first, settings, kb, root = first_job
    plan = {"strategy": "custom:fused_sigmoid", "rationale": "one pass", "expected_gain": 2.0, "params": {}}
    chat = ReplayChat([json.dumps(plan), f"```python\n{WRONG}\n```"])  # then exhausted: the repair fails
    report = report_json(
        run_optimize(
            request(TASKS / "pointwise_sigmoid.py", root / "o2", backend="replay"),
            settings=settings,
            kb=kb,
            chat=chat,
        )
    )
    planner_prompt = chat.sent[0][-1].content
    section = planner_prompt.split("What worked before on this kind of GPU (knowledge base):")[1]
    first_line = section.strip().splitlines()[0]
    assert first_line.startswith("- [verified cpu cpu] fused_pointwise")
    assert "ops=mul>add>tanh" in first_line and "CPU wall clock" in first_line
    hits = report["knowledge_base"]["hits"]
    assert hits[0]["id"] == first["knowledge_base"]["recorded"]["id"] and hits[0]["match"] == "exact_model"
    assert report["iterations"][0]["verdict"] == "fail" and report["best"] is None
    assert report["knowledge_base"]["recorded"] == {
        "recorded": False,
        "reason": "no candidate passed verification",
    }
    assert len(kb.export()["records"]) == 1, "nothing written for the unverified job"


def _state(best: Candidate | None, device: str = "cuda") -> CrewState:
    return CrewState(
        task_source="",
        task_path="t.py",
        options=Options(device=device),
        best=best,
        baseline={
            "hardware": {"model": "h100-sxm", "arch": "sm_90"},
            "analysis": {
                "op_sequence": ["mul", "add"],
                "inputs": [{"kind": "tensor", "shape": [4096, 4096], "dtype": "float32"}],
            },
        },
    )


def test_only_a_verified_significant_gpu_gain_is_recorded(first_job):
    _, _, kb, _ = first_job
    best = Candidate(
        id="c1",
        strategy="fused_pointwise",
        source_kind="kernel",
        source="class ModelNew: ...",
        verdict="pass",
    )
    final = {
        "clock": "cuda-event",
        "eager_ms": 1.0,
        "best_ms": 0.5,
        "speedup_eager": 2.0,
        "significant": True,
    }
    ctx = CrewContext(executor=None, kb=kb, run_id="gpu-job")
    before = len(kb.export()["records"])
    cases = [
        (None, final, "no candidate passed verification"),
        (Candidate(**{**best.__dict__, "verdict": "fail"}), final, "no candidate passed verification"),
        (best, {**final, "significant": False}, "not significantly faster"),
        (
            best,
            {**final, "failure": {"stage": "timed_output", "message": "timed output differs"}},
            "the final timing failed",
        ),
        (best, {**final, "best_ms": 1.5}, "not faster than eager"),
    ]
    for cand, fin, reason in cases:
        outcome = record_best(_state(cand), ctx, FinalTiming.model_validate(fin))
        assert not outcome["recorded"] and reason in outcome["reason"]
    assert len(kb.export()["records"]) == before
    assert record_best(_state(best), CrewContext(executor=None, kb=None), FinalTiming(**final))[
        "reason"
    ].startswith("knowledge base disabled")
    done = record_best(_state(best), ctx, FinalTiming(**final))
    assert done["recorded"] and kb.get(done["id"])["clock"] == "cuda-event"


def test_the_playbook_prefers_what_won_and_starts_tuning_from_its_params(first_job):
    """On sm_90, a torch_compile win moves ahead of the own kernel; a block size known to win on this
    task comes first, one that won on another task second (after the playbook's choice)."""
    first, settings, _, _ = first_job
    graph = compile_graph(sqlite_checkpointer(settings.data_dir / "checkpoints.sqlite"))
    run = graph.get_state({"configurable": {"thread_id": first["run_id"]}}).values
    analysis = run["baseline"].analysis  # the first job's FX analysis of the same task
    state = CrewState(
        task_source="", options=Options(device="cuda"), baseline={"analysis": analysis, "arch": "sm_90"}
    )
    plain = _menu(state)
    assert plain[0].strategy == "fused_pointwise" and plain[0].params == {"BLOCK_SIZE": 1024, "num_warps": 4}
    same = from_analysis(analysis).text  # wins on this pattern (ops and dtypes)
    hits = [
        {"source": "verified", "strategy": "torch_compile", "params": {}, "signature": same},
        {
            "source": "verified",
            "strategy": "fused_pointwise",
            "params": {"BLOCK_SIZE": 4096, "num_warps": 8},
            "exact_signature": True,
            "signature": same,
        },
    ]
    menu = _menu(CrewState(**{**state.__dict__, "kb_hits": hits}))
    assert menu[0].strategy == "torch_compile" and "knowledge base shows it won" in menu[0].rationale
    kernel = [s.params for s in menu if s.strategy == "fused_pointwise"]
    assert kernel[0] == {"BLOCK_SIZE": 4096, "num_warps": 8} and len(kernel) == len(
        [s for s in plain if s.strategy == "fused_pointwise"]
    )
    hits[1]["exact_signature"] = False  # a win on another task: after the playbook's first choice
    kernel = [
        s.params
        for s in _menu(CrewState(**{**state.__dict__, "kb_hits": hits}))
        if s.strategy == "fused_pointwise"
    ]
    assert kernel[:2] == [plain[0].params, {"BLOCK_SIZE": 4096, "num_warps": 8}]
