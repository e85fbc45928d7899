"""The crew's LLM path end to end against local stubs of OpenAI and Anthropic, recorded and replayed."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kernelcrew.agents.coder import _write_with_llm
from kernelcrew.agents.context import CrewContext
from kernelcrew.agents.guidance import parse_commands
from kernelcrew.agents.llm import AnthropicChat, OpenAIChat, ReplayChat
from kernelcrew.agents.planner import _plan_with_llm, fallback_step, refused_by_user
from kernelcrew.agents.run import run_optimize
from kernelcrew.agents.state import Candidate, CrewState, Options, PlanStep
from kernelcrew.config import Settings
from kernelcrew.records import Baseline
from tests.unit.test_crew import GOOD, PLAN, POINTWISE, report_json, request
from tests.unit.test_llm import Reply, Stub, anthropic_ok, openai_error, openai_ok


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.close()


def openai_on(stub: Stub) -> OpenAIChat:
    return OpenAIChat(
        "gpt-4.1", base_url=f"http://127.0.0.1:{stub.port}/v1", max_retries=0, sleep=lambda s: None
    )


def anthropic_on(stub: Stub) -> AnthropicChat:
    return AnthropicChat(
        "claude-sonnet-4-6", api_key="k", base_url=f"http://127.0.0.1:{stub.port}", max_retries=0
    )


def code_reply(source: str) -> str:
    return f"```python\n{source}\n```"


def test_anthropic_end_to_end_tool_use_plan_and_a_refused_reply_asked_again(stub: Stub, tmp_path) -> None:
    refusal = Reply(200, {
        "id": "m", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6", "content": [],
        "stop_reason": "refusal", "stop_sequence": None, "usage": {"input_tokens": 1500, "output_tokens": 2},
    })  # fmt: skip
    tool = Reply(200, {
        "id": "m", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
        "content": [{"type": "tool_use", "id": "t", "name": "plan_step", "input": PLAN}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 800, "output_tokens": 40},
    })  # fmt: skip
    stub.queue(tool, refusal, anthropic_ok(code_reply(GOOD)))
    settings = Settings(data_dir=tmp_path / "data")
    report = report_json(
        run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=anthropic_on(stub))
    )
    step = report["iterations"][0]
    assert step["strategy"] == PLAN["strategy"] and step["verdict"] == "pass", step
    assert len(step["unusable_replies"]) == 1 and "refused" in step["unusable_replies"][0]
    coder = report["usage"]["by_agent"]["coder"]
    assert coder["calls"] == 2 and coder["input_tokens"] == 1500 + 2000, "the refusal is metered"
    planner_body, coder_body = stub.requests[0].body, stub.requests[1].body
    assert planner_body["tool_choice"] == {"type": "tool", "name": "plan_step"}
    assert "tools" not in coder_body
    prompt = planner_body["messages"][0]["content"]
    assert "CPU (" in prompt and "Versions: " in prompt and "torch " in prompt, "device facts and versions"


def test_a_failing_provider_hands_the_run_to_the_playbook_with_the_reason(stub: Stub, tmp_path) -> None:
    stub.queue(openai_error(401, "Incorrect API key provided", "invalid_request_error"))
    settings = Settings(data_dir=tmp_path / "data")
    report = report_json(
        run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=openai_on(stub))
    )
    [step] = report["iterations"]
    assert step["strategy"] == "fused_pointwise" and step["verdict"] == "pass", step
    assert "rejected the API key (401)" in report["usage"]["llm_fallback"]
    assert len(stub.requests) == 1, "a failed provider is not asked again in the run"
    assert "the playbook took over" in (tmp_path / "o" / "report.md").read_text()


def test_quota_exhausted_mid_run_the_playbook_finishes_it(stub: Stub, tmp_path) -> None:
    stub.queue(
        openai_ok(json.dumps(PLAN)),
        openai_error(
            429, "You exceeded your current quota", "insufficient_quota", {"x-should-retry": "false"}
        ),
    )
    settings = Settings(data_dir=tmp_path / "data")
    report = report_json(
        run_optimize(request(max_iters=2, out=tmp_path / "o"), settings=settings, chat=openai_on(stub))
    )
    first, second = report["iterations"]
    assert first["stage"] == "code" and "exceeded your current quota" in first["message"]
    assert second["strategy"] == "fused_pointwise" and second["verdict"] == "pass"
    assert "quota" in report["usage"]["llm_fallback"]


def test_record_then_replay_gives_the_same_run(stub: Stub, tmp_path) -> None:
    zeros = GOOD.replace("return out", "return torch.zeros_like(out)")
    stub.queue(
        openai_ok("thinking aloud", prompt=100, completion=5),
        openai_ok(json.dumps(PLAN), prompt=110, completion=30),
        openai_ok(code_reply(zeros), prompt=3000, completion=800),
        openai_ok(code_reply(GOOD), prompt=3100, completion=820),
    )
    settings = Settings(data_dir=tmp_path / "data")
    recorded = report_json(
        run_optimize(
            request(max_iters=1, out=tmp_path / "o1", record=tmp_path / "rec"),
            settings=settings,
            chat=openai_on(stub),
        )
    )
    assert len(list((tmp_path / "rec").glob("call-*.json"))) == 4

    replay_settings = Settings(data_dir=tmp_path / "data2", llm="replay", replay_file=str(tmp_path / "rec"))
    replayed = report_json(
        run_optimize(request(max_iters=1, out=tmp_path / "o2", backend="replay"), settings=replay_settings)
    )

    def outcome(report: dict) -> list[tuple]:
        return [(it["strategy"], it["verdict"], it["repairs"]) for it in report["iterations"]]

    assert outcome(recorded) == outcome(replayed) == [(PLAN["strategy"], "pass", 1)]
    for key in ("calls", "input_tokens", "output_tokens", "cost_usd"):
        assert recorded["usage"][key] == replayed["usage"][key], key
    assert replayed["usage"]["input_tokens"] == 100 + 110 + 3000 + 3100


def test_samples_per_step_are_verified_in_turn_before_any_repair(tmp_path) -> None:
    zeros = GOOD.replace("return out", "return torch.zeros_like(out)")
    chat = ReplayChat([json.dumps(PLAN), code_reply(zeros), code_reply(GOOD)])
    settings = Settings(data_dir=tmp_path / "data", llm_samples=2)
    report = report_json(run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=chat))
    step = report["iterations"][0]
    assert step["verdict"] == "pass" and step["repairs"] == 0 and step["id"] == "c1s2", step
    assert report["usage"]["by_agent"]["coder"]["calls"] == 2
    assert chat.sent[1] == chat.sent[2], "both samples were asked with the same prompt"


def test_two_commands_in_one_message_are_both_obeyed(tmp_path) -> None:
    assert parse_commands("keep fp32, only triton") == [("keep_fp32", ""), ("only_kernels", "")]
    assert parse_commands("skip fused_pointwise and no torch.compile") == [
        ("skip", "fused_pointwise"),
        ("no_compiler", ""),
    ]
    compile_plan = {"strategy": "torch_compile", "rationale": "r", "expected_gain": 1.2, "params": {}}
    chat = ReplayChat([json.dumps(compile_plan), json.dumps(PLAN), code_reply(GOOD)])
    settings = Settings(data_dir=tmp_path / "data")
    req = request(max_iters=1, out=tmp_path / "o", precision="relaxed", messages=["keep fp32, only triton"])
    report = report_json(run_optimize(req, settings=settings, chat=chat))
    assert report["iterations"][0]["strategy"] == PLAN["strategy"]
    assert "ruled out" in chat.sent[1][-1].content and "own kernels only" in chat.sent[1][-1].content
    reply = report["replies"][0]
    assert "Precision stays strict" in reply and "Only own kernels" in reply
    assert report["precision"] == "strict"
    assert "keep fp32, only triton" in chat.sent[2][1].content, "the coder sees the user's messages"


def test_the_compiler_fallback_never_runs_after_the_user_refused_it() -> None:
    base = Baseline(eager_ms=2.0, compile_ms={"default": 1.0})
    state = CrewState(task_source="", baseline=base)
    assert fallback_step(state) is not None
    for message in ("keep fp32, only triton", "no torch.compile", "only kernels; more iterations"):
        refused = CrewState(task_source="", baseline=base, user_messages=[message])
        assert fallback_step(refused) is None, message
        assert refused_by_user(refused, "torch_compile")
    assert refused_by_user(
        CrewState(task_source="", user_messages=["only triton"]), "custom:x", {"language": "cuda"}
    )


def _facts_state(**kw) -> CrewState:
    baseline = Baseline(
        hardware={"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "sm_count": 132},
        peaks={"basis": "datasheet", "dram_gbs": 3350.0, "compute": {"fp32": 67.0, "tf32": 495.0}},
        versions={"torch": "2.9.1", "triton": "3.5.1", "cuda": "12.8"},
    )
    return CrewState(
        task_source=POINTWISE.read_text(), options=Options(device="cuda"), baseline=baseline, **kw
    )


def test_prompts_carry_device_facts_history_and_are_capped() -> None:
    huge = GOOD + "\n" + "\n".join(f"# filler line {i:06d} " + "x" * 60 for i in range(3000))
    assert len(huge) > 225_000
    best = Candidate(id="c2", strategy="fused_pointwise", source_kind="kernel", source=huge, verdict="pass")
    iterations = [
        {"step": 1, "strategy": "fused_pointwise", "params": {"BLOCK": 1024}, "verdict": "pass", "time_ms": 0.5,
         "speedup_eager": 1.8, "kind": "kernel", "new_best": True, "seconds": 12.0,
         "ncu_text": "ncu: tanh_kernel 41.2us 88.1% DRAM"},
        {"step": 2, "strategy": "custom:split", "params": {}, "verdict": "fail", "stage": "correctness",
         "message": "max error 3.1 at index 17", "seconds": 9.0},
    ]  # fmt: skip
    state = _facts_state(best=best, iterations=iterations, user_messages=["keep fp32"])
    chat = ReplayChat([json.dumps(PLAN)])
    ctx = CrewContext(executor=None, chat=chat)
    step, problem, failed = _plan_with_llm(state, ctx)
    assert step is not None and not failed, problem
    prompt = "".join(m.content for m in chat.sent[0])
    assert len(prompt) < 80_000, "a 225 KB best does not make a 58k-token prompt"
    assert "characters of best source left out" in prompt
    assert "NVIDIA H100 80GB HBM3, architecture sm_90, 132 SMs" in prompt
    assert "DRAM 3350 GB/s" in prompt and "fp32 67 TFLOP/s" in prompt and "triton 3.5.1" in prompt
    assert "step 1: fused_pointwise" in prompt and "0.5 ms, 1.8x eager" in prompt and "88.1% DRAM" in prompt
    assert "step 2: custom:split" in prompt and "fail at correctness: max error 3.1" in prompt

    cuda_step = PlanStep(
        strategy="custom:wmma", rationale="r", expected_gain=1.5, params={"language": "cuda"}
    )
    coder_chat = ReplayChat([code_reply(GOOD)])
    sources, _, _, _ = _write_with_llm(
        _facts_state(best=best, plan=cuda_step, user_messages=["only use tensor cores"]),
        CrewContext(executor=None, chat=coder_chat),
        repairing=False,
    )
    assert sources == [GOOD.strip("\n") + "\n"]
    system, user = (m.content for m in coder_chat.sent[0])
    assert "load_inline" in system and "Triton" in system
    assert '"language": "cuda"' in user and "only use tensor cores" in user and "sm_90" in user
    assert len(system + user) < 80_000 and "characters of base source left out" in user


def test_cli_replays_a_recording_and_records_what_it_played(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from kernelcrew.cli import app
    from kernelcrew.config import get_settings

    recording = tmp_path / "recording"
    recording.mkdir()
    usage = {"input_tokens": 10, "output_tokens": 5, "cost_usd": 0.001}
    for n, text in enumerate([json.dumps(PLAN), code_reply(GOOD)], start=1):
        entry = {"call": n, "reply": {"text": text, "usage": usage}, "error": None}
        (recording / f"call-{n:04d}.json").write_text(json.dumps(entry))
    monkeypatch.setenv("KERNELCREW_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(
            app,
            [
                "optimize", str(POINTWISE), "--device", "cpu", "--max-iters", "1", "--compile-modes", "none",
                "--quick", "--no-kb", "--out", str(tmp_path / "o"),
                "--replay", str(recording), "--record", str(tmp_path / "again"),
            ],
        )  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["iterations"][0]["strategy"] == PLAN["strategy"] and report["best"] is not None
    assert report["usage"]["calls"] == 2 and report["usage"]["input_tokens"] == 20
    again = sorted((tmp_path / "again").glob("call-*.json"))
    assert [json.loads(p.read_text())["reply"]["text"] for p in again] == [json.dumps(PLAN), code_reply(GOOD)]


def test_the_coder_sees_the_knowledge_base_sources(tmp_path) -> None:
    from kernelcrew.knowledge_base import KnowledgeBase

    kb = KnowledgeBase.open(Settings(data_dir=tmp_path / "data"), owner="alice")
    marked = GOOD.replace("class ModelNew", "# the recorded win's own line\nclass ModelNew", 1)
    result = kb.record_win(
        {
            "gpu_model": "h100-sxm",
            "arch": "sm_90",
            "signature": "tanh(mul(x, 2) + y)",
            "pattern_kinds": ["pointwise"],
            "strategy": "fused_pointwise",
            "candidate_source": marked,
            "params": {"BLOCK_SIZE": 2048},
            "description": "tanh(x * 2 + y) as one kernel",
            "job_id": "job-kb-test",
        },
        verdict={"verdict": "pass", "baseline_ms": 1.0, "candidate_ms": 0.5, "clock": "cuda-event"},
    )
    hits = [{"id": result.id, "line": "fused_pointwise won 2.0x on h100-sxm"}]
    step = PlanStep(strategy="custom:x", rationale="r", expected_gain=1.2)
    chat = ReplayChat([code_reply(GOOD)])
    _write_with_llm(
        _facts_state(plan=step, kb_hits=hits), CrewContext(executor=None, chat=chat, kb=kb), repairing=False
    )
    user = chat.sent[0][1].content
    assert "the recorded win's own line" in user and "fused_pointwise won 2.0x on h100-sxm" in user


def test_every_verified_candidate_s_nsight_compute_evidence_reaches_the_history() -> None:
    from types import SimpleNamespace

    from kernelcrew.agents.decide import decide
    from kernelcrew.agents.prompts.sections import history

    ncu = {
        "available": True,
        "summary": {
            "kernels": [
                {"name": "void tanh_kernel<...>", "short_name": "tanh_kernel", "duration_us": 41.2,
                 "dram_pct": 88.1, "sm_pct": 20.5, "achieved_occupancy_pct": 71.0, "registers_per_thread": 32},
            ]
        },
    }  # fmt: skip
    best = Candidate(id="c1", strategy="a", source_kind="kernel", source="x", verdict="pass", time_ms=0.4)
    slower = Candidate(
        id="c2", strategy="b", source_kind="kernel", source="y", verdict="pass", time_ms=0.9, ncu=ncu
    )
    state = CrewState(
        task_source="",
        best=best,
        draft=slower,
        plan=PlanStep(strategy="b", rationale="r", expected_gain=1.1),
        options=Options(device="cuda"),
    )
    update = decide(state, SimpleNamespace(context=CrewContext(executor=None)))
    [record] = update["iterations"]
    assert not record["new_best"] and "source" not in record and "samples" not in record
    assert record["ncu_text"] == "ncu: tanh_kernel 41.2us 88.1% DRAM 20.5% SM 71% occupancy 32 regs"
    assert "88.1% DRAM" in history(update["iterations"])
