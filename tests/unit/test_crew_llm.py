"""The crew against a local stub of the OpenAI API: unusable replies are metered, re-asked and recorded."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kernelcrew.agents.llm import OpenAIChat
from kernelcrew.agents.run import run_optimize
from kernelcrew.config import Settings
from tests.unit.test_crew import GOOD, PLAN, report_json, request
from tests.unit.test_llm import Stub, openai_ok


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.close()


def chat_on(stub: Stub) -> OpenAIChat:
    return OpenAIChat(
        "gpt-4.1", base_url=f"http://127.0.0.1:{stub.port}/v1", max_retries=0, sleep=lambda s: None
    )


def test_a_cut_off_code_reply_is_metered_and_asked_again(stub: Stub, tmp_path) -> None:
    stub.queue(
        openai_ok("", finish="length", prompt=100, completion=20),  # the planner's reply, cut
        openai_ok(json.dumps(PLAN), prompt=100, completion=30),
        openai_ok("", finish="length", prompt=3000, completion=8192),  # the coder's, cut
        openai_ok(f"```python\n{GOOD}\n```", prompt=3000, completion=900),
    )
    settings = Settings(data_dir=tmp_path / "data")
    report = report_json(
        run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=chat_on(stub))
    )
    step = report["iterations"][0]
    assert step["verdict"] == "pass" and step["repairs"] == 0, step
    assert len(step["unusable_replies"]) == 1 and "max_tokens=8192" in step["unusable_replies"][0]
    usage = report["usage"]
    assert usage["calls"] == 4 and usage["output_tokens"] == 20 + 30 + 8192 + 900
    assert usage["by_agent"]["coder"] == {
        "calls": 2, "input_tokens": 6000, "output_tokens": 9092, "cost_usd": pytest.approx((6000 * 2.0 + 9092 * 8.0) / 1e6)
    }  # fmt: skip
    retry = stub.requests[3].body["messages"]
    assert retry[-2] == {"role": "assistant", "content": "(empty reply)"}
    assert "max_tokens=8192" in retry[-1]["content"] and "```python" in retry[-1]["content"]


def test_replies_without_code_twice_end_the_step_with_their_reasons(stub: Stub, tmp_path) -> None:
    stub.queue(
        openai_ok(json.dumps(PLAN), prompt=100, completion=30),
        openai_ok("I can't help with that.", prompt=3000, completion=10),
        openai_ok("", finish="content_filter", prompt=3000, completion=0),
    )
    settings = Settings(data_dir=tmp_path / "data")
    report = report_json(
        run_optimize(request(max_iters=1, out=tmp_path / "o"), settings=settings, chat=chat_on(stub))
    )
    step = report["iterations"][0]
    assert step["verdict"] == "fail" and step["stage"] == "code", step
    assert "unusable twice" in step["message"] and "content_filter" in step["message"]
    assert "no ```python block" in step["unusable_replies"][0] and len(step["unusable_replies"]) == 2
    assert report["usage"]["by_agent"]["coder"]["calls"] == 2
    assert report["usage"]["by_agent"]["coder"]["input_tokens"] == 6000
