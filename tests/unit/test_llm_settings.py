"""Settings and structured answers through the real SDKs against local stubs of OpenAI and Anthropic."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kernelcrew.agents.llm import (
    LLMError,
    OutputSchema,
    RecordingChat,
    ReplayChat,
    Sampling,
    extract_json,
    resolve_chat_model,
)
from kernelcrew.agents.planner import PLAN_SCHEMA
from kernelcrew.config import Settings
from tests.unit.test_llm import (
    CHAT,
    Reply,
    Sleeps,
    Stub,
    anthropic_error,
    anthropic_ok,
    make_anthropic,
    make_openai,
    openai_error,
    openai_ok,
)

SCHEMA = OutputSchema("plan_step", "The next step.", PLAN_SCHEMA)
STEP = {"strategy": "fused_pointwise", "rationale": "one pass", "expected_gain": 1.5, "params": {}}


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.close()


def anthropic_tool(data: dict, name: str = "plan_step") -> Reply:
    return Reply(200, {
        "id": "msg_01tool",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-6",
        "content": [{"type": "tool_use", "id": "toolu_01", "name": name, "input": data}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 700, "output_tokens": 60},
    })  # fmt: skip


def test_openai_chat_model_gets_temperature_and_no_effort(stub: Stub) -> None:
    stub.queue(openai_ok("a"))
    chat = make_openai(stub, Sleeps(), sampling=Sampling(temperature=0.7, effort="high", max_tokens=999))
    chat.complete(CHAT)
    body = stub.requests[0].body
    assert body["temperature"] == 0.7 and body["max_tokens"] == 999
    assert "reasoning_effort" not in body and "max_completion_tokens" not in body


def test_openai_reasoning_model_gets_effort_and_no_temperature(stub: Stub) -> None:
    stub.queue(openai_ok("a", model="gpt-5.1-2025-11-13"))
    chat = make_openai(stub, Sleeps(), model="gpt-5.1", sampling=Sampling(temperature=0.7, effort="high"))
    chat.complete(CHAT, max_tokens=3000)
    body = stub.requests[0].body
    assert body["reasoning_effort"] == "high" and body["max_completion_tokens"] == 3000
    assert "temperature" not in body and "max_tokens" not in body


def test_a_parameter_the_server_rejects_is_dropped_and_never_sent_again(stub: Stub) -> None:
    stub.queue(
        openai_error(400, "Unsupported parameter: 'temperature' is not supported with this model.", "invalid_request_error"),
        openai_ok("first"),
        openai_ok("second"),
    )  # fmt: skip
    chat = make_openai(stub, Sleeps(), model="qwen3-coder", sampling=Sampling(temperature=0.2))
    assert chat.complete(CHAT).text == "first"
    assert chat.complete(CHAT).text == "second"
    bodies = [r.body for r in stub.requests]
    assert "temperature" in bodies[0] and "temperature" not in bodies[1] and "temperature" not in bodies[2]
    assert chat.rejected == {"temperature"}


def test_a_400_that_names_nothing_we_sent_is_still_an_error(stub: Stub) -> None:
    stub.queue(openai_error(400, "messages: too long", "invalid_request_error"))
    chat = make_openai(stub, Sleeps(), sampling=Sampling(temperature=0.2))
    with pytest.raises(LLMError, match="too long"):
        chat.complete(CHAT)
    assert len(stub.requests) == 1


def test_openai_structured_answer_is_a_json_schema(stub: Stub) -> None:
    stub.queue(openai_ok(json.dumps(STEP)))
    out = make_openai(stub, Sleeps()).complete(CHAT, schema=SCHEMA)
    fmt = stub.requests[0].body["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "plan_step"
    assert fmt["json_schema"]["schema"]["required"] == ["strategy", "rationale", "expected_gain", "params"]
    assert out.structured and extract_json(out.text) == STEP


def test_a_server_without_structured_outputs_gets_plain_text_from_then_on(stub: Stub) -> None:
    stub.queue(
        openai_error(400, "response_format json_schema is not supported by this server", "invalid_request_error"),
        openai_ok(f"Here it is:\n```json\n{json.dumps(STEP)}\n```"),
        openai_ok(json.dumps(STEP)),
    )  # fmt: skip
    chat = make_openai(stub, Sleeps(), model="llama-local")
    first = chat.complete(CHAT, schema=SCHEMA)
    assert not first.structured and extract_json(first.text) == STEP
    assert first.attempts == 2
    chat.complete(CHAT, schema=SCHEMA)
    assert ["response_format" in r.body for r in stub.requests] == [True, False, False]
    assert not chat.structured


def test_anthropic_structured_answer_is_a_forced_tool_call(stub: Stub) -> None:
    stub.queue(anthropic_tool(STEP))
    chat = make_anthropic(stub, Sleeps(), sampling=Sampling(temperature=0.5, effort="high"))
    out = chat.complete(CHAT, schema=SCHEMA)
    body = stub.requests[0].body
    assert body["tools"][0]["name"] == "plan_step" and body["tools"][0]["input_schema"] == PLAN_SCHEMA
    assert body["tool_choice"] == {"type": "tool", "name": "plan_step"}
    assert body["output_config"] == {"effort": "high"} and "temperature" not in body
    assert out.structured and json.loads(out.text) == STEP
    assert (out.usage.input_tokens, out.usage.output_tokens) == (700, 60)


def test_anthropic_effort_it_does_not_know_is_not_sent_and_a_rejected_one_is_dropped(stub: Stub) -> None:
    stub.queue(anthropic_ok("plain"))
    make_anthropic(stub, Sleeps(), sampling=Sampling(effort="minimal")).complete(CHAT)
    assert "output_config" not in stub.requests[-1].body

    stub.replies.clear()
    stub.queue(
        anthropic_error(400, "invalid_request_error", "output_config.effort: not supported on this model"),
        anthropic_ok("without"),
    )
    chat = make_anthropic(stub, Sleeps(), sampling=Sampling(effort="max"))
    assert chat.complete(CHAT).text == "without"
    assert "output_config" in stub.requests[-2].body and "output_config" not in stub.requests[-1].body


def test_anthropic_refusal_is_an_error_that_keeps_its_tokens(stub: Stub) -> None:
    stub.queue(Reply(200, {
        "id": "msg_r", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
        "content": [], "stop_reason": "refusal", "stop_sequence": None,
        "usage": {"input_tokens": 900, "output_tokens": 3},
    }))  # fmt: skip
    with pytest.raises(LLMError, match="refused") as info:
        make_anthropic(stub, Sleeps()).complete(CHAT)
    assert info.value.completion is not None and info.value.completion.usage.input_tokens == 900


def test_settings_reach_the_clients(stub: Stub) -> None:
    settings = Settings(
        llm="openai",
        model="gpt-5.1",
        llm_base_url=f"http://127.0.0.1:{stub.port}/v1",
        llm_reasoning_effort="low",
        llm_temperature=0.9,
        llm_max_tokens=5000,
        llm_structured=False,
    )
    chat = resolve_chat_model(settings)
    assert chat.sampling == Sampling(temperature=0.9, effort="low", max_tokens=5000)
    stub.queue(openai_ok(json.dumps(STEP), model="gpt-5.1"))
    chat.complete(CHAT, schema=SCHEMA)
    body = stub.requests[0].body
    assert body["reasoning_effort"] == "low" and body["max_completion_tokens"] == 5000
    assert "response_format" not in body, "structured answers turned off by the settings"
    with pytest.raises(ValueError):
        Settings(llm_reasoning_effort="extreme")


def test_recorded_calls_replay_with_their_usage_and_errors(stub: Stub, tmp_path) -> None:
    stub.queue(
        openai_ok("one", prompt=11, completion=7),
        openai_ok("", finish="length", prompt=12, completion=99),
        openai_error(401, "Incorrect API key provided: sk-abc***", "invalid_request_error"),
    )
    chat = RecordingChat(make_openai(stub, Sleeps()), tmp_path / "rec")
    assert chat.complete(CHAT).text == "one"
    with pytest.raises(LLMError, match="cut at max_tokens"):
        chat.complete(CHAT)
    with pytest.raises(LLMError, match="rejected the API key"):
        chat.complete(CHAT)
    files = sorted(p.name for p in (tmp_path / "rec").iterdir())
    assert files == ["call-0001.json", "call-0002.json", "call-0003.json"]
    first = json.loads((tmp_path / "rec" / "call-0001.json").read_text())
    assert first["request"]["messages"][1] == {"role": "user", "content": "Say hi."}
    assert first["reply"]["usage"]["input_tokens"] == 11

    replay = ReplayChat(tmp_path / "rec")
    out = replay.complete(CHAT)
    assert (out.text, out.usage.input_tokens, out.usage.output_tokens) == ("one", 11, 7)
    with pytest.raises(LLMError, match="cut at max_tokens") as cut:
        replay.complete(CHAT)
    assert cut.value.completion is not None and cut.value.completion.usage.output_tokens == 99
    with pytest.raises(LLMError, match="rejected the API key") as auth:
        replay.complete(CHAT)
    assert auth.value.completion is None and auth.value.status_code == 401
    assert replay.remaining == 0

    # a resumed recording goes on numbering
    stub.replies.clear()
    stub.queue(openai_ok("four"))
    RecordingChat(make_openai(stub, Sleeps()), tmp_path / "rec").complete(CHAT)
    assert (tmp_path / "rec" / "call-0004.json").exists()
    with pytest.raises(ValueError, match="no transcripts"):
        ReplayChat(tmp_path)
