"""The chat models through the real SDKs against local stubs of the providers, and reply parsing."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kernelcrew.agents import prompts
from kernelcrew.agents.llm import (
    AnthropicChat,
    ChatModel,
    Completion,
    LLMError,
    Message,
    OpenAIChat,
    ReplayChat,
    Usage,
    UsageMeter,
    backoff_delay,
    extract_code,
    extract_json,
    parse_retry_after,
    price_per_million,
    resolve_chat_model,
)
from kernelcrew.config import Settings, get_settings

KEY = "sk-test-0123456789abcdefSECRET"

# --- Provider stubs -----------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class Stub:
    """A provider on 127.0.0.1: answers POSTs with queued replies (the last one repeats), records requests."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.requests: list[Request] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                headers = {k.lower(): v for k, v in self.headers.items()}
                stub.requests.append(Request(self.path, headers, body))
                reply = stub.replies.pop(0) if len(stub.replies) > 1 else stub.replies[0]
                time.sleep(reply.delay_s)
                data = json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that timed out closed the socket; nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def queue(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.close()


class Sleeps:
    """An injected sleep that records the delays instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def openai_ok(
    text: str,
    *,
    model: str = "gpt-4.1-2025-04-14",
    prompt: int = 1000,
    completion: int = 500,
    finish: str = "stop",
) -> Reply:
    return Reply(200, {
        "id": "chatcmpl-stub1",
        "object": "chat.completion",
        "created": 1767225600,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    })  # fmt: skip


def openai_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Reply:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return Reply(status, body, headers or {})


def anthropic_ok(text: str, *, model: str = "claude-sonnet-4-6") -> Reply:
    return Reply(200, {
        "id": "msg_01stub",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 2000, "output_tokens": 1000},
    })  # fmt: skip


def anthropic_error(status: int, kind: str, message: str) -> Reply:
    return Reply(status, {"type": "error", "error": {"type": kind, "message": message}})


def make_openai(
    stub: Stub, sleeps: Sleeps, *, model: str = "gpt-4.1", key: str = KEY, **kw: Any
) -> OpenAIChat:
    kw.setdefault("max_retries", 4)
    return OpenAIChat(model, api_key=key, base_url=f"http://127.0.0.1:{stub.port}/v1", sleep=sleeps, **kw)


def make_anthropic(stub: Stub, sleeps: Sleeps, **kw: Any) -> AnthropicChat:
    return AnthropicChat(
        "claude-sonnet-4-6", api_key=KEY, base_url=f"http://127.0.0.1:{stub.port}", sleep=sleeps, **kw
    )


CHAT = [Message("system", "You are terse."), Message("user", "Say hi.")]

# --- OpenAI -------------------------------------------------------------------------------------------


def test_openai_request_usage_and_cost(stub: Stub) -> None:
    stub.queue(openai_ok("hi"))
    sleeps = Sleeps()
    chat = make_openai(stub, sleeps)
    assert isinstance(chat, ChatModel)
    out = chat.complete(CHAT, temperature=0.3, max_tokens=123)

    (req,) = stub.requests
    assert req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.body["model"] == "gpt-4.1"
    assert req.body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    assert req.body["temperature"] == 0.3
    assert req.body["max_tokens"] == 123
    assert out.text == "hi"
    assert (out.provider, out.model, out.attempts, out.stop_reason) == (
        "openai",
        "gpt-4.1-2025-04-14",
        1,
        "stop",
    )
    assert (out.usage.input_tokens, out.usage.output_tokens) == (1000, 500)
    assert out.usage.cost_usd == pytest.approx((1000 * 2.0 + 500 * 8.0) / 1e6)  # gpt-4.1 list price
    assert sleeps.calls == []


def test_openai_reasoning_model_gets_max_completion_tokens_and_no_temperature(stub: Stub) -> None:
    stub.queue(openai_ok("ok", model="gpt-5.1-2025-11-13"))
    out = make_openai(stub, Sleeps(), model="gpt-5.1").complete(CHAT, max_tokens=2000)
    body = stub.requests[0].body
    assert body["max_completion_tokens"] == 2000
    assert "max_tokens" not in body and "temperature" not in body
    assert out.usage.cost_usd == pytest.approx((1000 * 1.25 + 500 * 10.0) / 1e6)


def test_openai_retries_429_with_retry_after(stub: Stub) -> None:
    limited = openai_error(429, "Rate limit reached", "rate_limit_exceeded", {"retry-after": "0"})
    stub.queue(limited, limited, openai_ok("third time"))
    sleeps = Sleeps()
    out = make_openai(stub, sleeps).complete(CHAT)
    assert out.text == "third time"
    assert out.attempts == 3
    assert sleeps.calls == [0.0, 0.0]
    assert len(stub.requests) == 3


def test_openai_retries_500_with_backoff(stub: Stub) -> None:
    stub.queue(openai_error(500, "The server had an error", "server_error"), openai_ok("fine"))
    sleeps = Sleeps()
    out = make_openai(stub, sleeps).complete(CHAT)
    assert (out.text, out.attempts) == ("fine", 2)
    (delay,) = sleeps.calls
    assert 0.25 <= delay <= 0.5  # base 0.5 s with jitter


def test_openai_401_is_not_retried_and_hides_the_key(stub: Stub) -> None:
    stub.queue(openai_error(401, f"Incorrect API key provided: {KEY}.", "invalid_request_error"))
    sleeps = Sleeps()
    with pytest.raises(LLMError) as info:
        make_openai(stub, sleeps).complete(CHAT)
    err = info.value
    assert "401" in str(err) and "openai" in str(err) and "API key" in str(err)
    assert KEY not in str(err) and KEY[:12] not in str(err)
    assert not err.retryable and err.status_code == 401 and err.attempts == 1
    assert len(stub.requests) == 1 and sleeps.calls == []


def test_openai_400_says_why(stub: Stub) -> None:
    stub.queue(openai_error(400, "Unsupported parameter: 'max_tokens'", "invalid_request_error"))
    with pytest.raises(LLMError, match=r"rejected the request \(400\).*max_tokens") as info:
        make_openai(stub, Sleeps()).complete(CHAT)
    assert not info.value.retryable and len(stub.requests) == 1


def test_openai_gives_up_after_max_retries(stub: Stub) -> None:
    stub.queue(openai_error(503, "Service unavailable", "server_error"))
    sleeps = Sleeps()
    with pytest.raises(LLMError, match="gave up after 3 attempts") as info:
        make_openai(stub, sleeps, max_retries=2).complete(CHAT)
    assert info.value.retryable and info.value.attempts == 3 and info.value.status_code == 503
    assert len(stub.requests) == 3 and len(sleeps.calls) == 2
    assert pickle.loads(pickle.dumps(info.value)).retryable  # survives a checkpoint or a queue


def test_openai_retries_a_timeout(stub: Stub) -> None:
    stub.queue(Reply(**{**vars(openai_ok("late")), "delay_s": 1.0}), openai_ok("on time"))
    out = make_openai(stub, Sleeps(), timeout_s=0.2).complete(CHAT)
    assert (out.text, out.attempts) == ("on time", 2)


def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    sleeps = Sleeps()
    chat = OpenAIChat(
        "gpt-4.1", api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", max_retries=1, sleep=sleeps
    )
    with pytest.raises(LLMError, match="could not connect") as info:
        chat.complete(CHAT)
    assert info.value.retryable and info.value.attempts == 2 and len(sleeps.calls) == 1


def test_openai_empty_reply_cut_by_max_tokens(stub: Stub) -> None:
    stub.queue(openai_ok("", finish="length"))
    with pytest.raises(LLMError, match="max_tokens=50"):
        make_openai(stub, Sleeps()).complete(CHAT, max_tokens=50)


def test_unusable_replies_keep_their_tokens_for_the_meter(stub: Stub) -> None:
    stub.queue(openai_ok("", finish="length", prompt=700, completion=50))
    with pytest.raises(LLMError, match="max_tokens=50") as info:
        make_openai(stub, Sleeps()).complete(CHAT, max_tokens=50)
    cut = info.value.completion
    assert cut is not None and (cut.usage.input_tokens, cut.usage.output_tokens) == (700, 50)
    assert cut.stop_reason == "length" and cut.usage.cost_usd == pytest.approx((700 * 2.0 + 50 * 8.0) / 1e6)
    assert pickle.loads(pickle.dumps(info.value)).completion == cut

    refusal = anthropic_ok("")
    refusal.body = {**refusal.body, "content": [], "stop_reason": "refusal"}
    stub.replies.clear()
    stub.queue(refusal)
    with pytest.raises(LLMError, match="refused") as info:
        make_anthropic(stub, Sleeps()).complete(CHAT)
    meter = UsageMeter()
    meter.add(info.value.completion, "coder")
    assert (meter.calls, meter.input_tokens, meter.output_tokens) == (1, 2000, 1000)


def test_unknown_model_has_unknown_cost_unless_priced(stub: Stub) -> None:
    stub.queue(openai_ok("x", model="Qwen/Qwen3-Coder-30B"))
    assert make_openai(stub, Sleeps(), model="Qwen/Qwen3-Coder-30B").complete(CHAT).usage.cost_usd is None
    stub.queue(openai_ok("x", model="Qwen/Qwen3-Coder-30B"))
    chat = make_openai(stub, Sleeps(), model="Qwen/Qwen3-Coder-30B", price_in=0.5, price_out=1.0)
    assert chat.complete(CHAT).usage.cost_usd == pytest.approx((1000 * 0.5 + 500 * 1.0) / 1e6)


# --- Anthropic ----------------------------------------------------------------------------------------


def test_anthropic_request_usage_and_cost(stub: Stub) -> None:
    stub.queue(anthropic_ok("hello"))
    messages = [*CHAT, Message("assistant", "Hi."), Message("user", "Again.")]
    out = make_anthropic(stub, Sleeps()).complete(messages, temperature=0.1, max_tokens=300)

    (req,) = stub.requests
    assert req.path == "/v1/messages"
    # anthropic 2.x sends the key as a bearer token (1.x sent x-api-key) and API version 2026-10-21,
    # which rejects sampling parameters: no temperature goes out.
    assert req.headers["authorization"] == f"Bearer {KEY}"
    assert req.headers["anthropic-version"]
    assert "temperature" not in req.body
    assert req.body["system"] == "You are terse."
    assert req.body["messages"] == [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again."},
    ]
    assert (req.body["model"], req.body["max_tokens"]) == ("claude-sonnet-4-6", 300)
    assert (out.text, out.provider, out.attempts, out.stop_reason) == ("hello", "anthropic", 1, "end_turn")
    assert (out.usage.input_tokens, out.usage.output_tokens) == (2000, 1000)
    assert out.usage.cost_usd == pytest.approx((2000 * 3.0 + 1000 * 15.0) / 1e6)


def test_anthropic_retries_overloaded(stub: Stub) -> None:
    stub.queue(
        anthropic_error(529, "overloaded_error", "Overloaded"),
        anthropic_error(503, "api_error", "Service unavailable"),
        anthropic_ok("made it"),
    )
    sleeps = Sleeps()
    out = make_anthropic(stub, sleeps).complete(CHAT)
    assert (out.text, out.attempts, len(sleeps.calls)) == ("made it", 3, 2)


def test_anthropic_401(stub: Stub) -> None:
    stub.queue(anthropic_error(401, "authentication_error", "invalid x-api-key"))
    with pytest.raises(LLMError, match=r"anthropic rejected the API key \(401\)") as info:
        make_anthropic(stub, Sleeps()).complete(CHAT)
    assert not info.value.retryable and len(stub.requests) == 1


# --- Retry timing -------------------------------------------------------------------------------------


def test_backoff_grows_and_is_capped() -> None:
    assert 0.25 <= backoff_delay(1) <= 0.5
    assert 2.0 <= backoff_delay(4) <= 4.0
    assert backoff_delay(30) <= 20.0
    assert backoff_delay(1, retry_after_s=3.0) == 3.0
    assert backoff_delay(1, retry_after_s=600.0) == 20.0
    assert parse_retry_after({"retry-after-ms": "1500"}) == 1.5
    assert parse_retry_after({"retry-after": "7"}) == 7.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_prices_match_snapshots_not_siblings() -> None:
    assert price_per_million("claude-sonnet-4-6-20250929") == price_per_million("claude-sonnet-4-5")
    assert price_per_million("gpt-4.1-2025-04-14") == (2.0, 8.0)
    assert price_per_million("gpt-5-mini") != price_per_million("gpt-5")
    assert price_per_million("my-local-model") is None


# --- Parsing replies ----------------------------------------------------------------------------------


def test_extract_json() -> None:
    fenced = 'Plan:\n```json\n{"strategy": "fuse", "expected_gain": 1.3, "params": {"BLOCK": 1024}}\n```\n'
    assert extract_json(fenced) == {"strategy": "fuse", "expected_gain": 1.3, "params": {"BLOCK": 1024}}
    assert extract_json('I use {braces} in prose. {"a": [1, {"b": 2}]} and more {"c": 3}') == {
        "a": [1, {"b": 2}]
    }
    for garbage in ["", "no json here", "[1, 2, 3]", '{"a": 1,']:
        with pytest.raises(ValueError):
            extract_json(garbage)
    with pytest.raises(ValueError, match="not valid JSON"):
        extract_json("```json\n{'strategy': 'fuse'}\n```")


SOURCE = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x\n"


def test_extract_code() -> None:
    reply = f"First a helper:\n```python\ndef helper(): pass\n```\nThe file:\n```python\n{SOURCE}```\nDone."
    assert extract_code(reply) == SOURCE
    # The last block wins, but a later block without ModelNew does not hide the candidate.
    assert (
        extract_code(f"```python\n{SOURCE}```\nUse it like this:\n```python\nm = ModelNew()\n```") == SOURCE
    )
    assert extract_code(f"```py\n{SOURCE}```") == SOURCE
    assert extract_code(SOURCE) == SOURCE  # no fence, but the whole reply is the file
    with pytest.raises(ValueError, match="never closed"):
        extract_code(f"```python\n{SOURCE}")
    for garbage in ["", "Sorry, I cannot help.", "```text\nhello\n```"]:
        with pytest.raises(ValueError):
            extract_code(garbage)


# --- Replay and usage ---------------------------------------------------------------------------------


def test_replay_plays_in_order_and_records(tmp_path) -> None:
    chat = ReplayChat(["one", "two"])
    assert chat.complete([Message("user", "a")]).text == "one"
    assert chat.complete([Message("user", "b")]).text == "two"
    with pytest.raises(LLMError, match="all 2 recorded responses"):
        chat.complete([Message("user", "c")])
    assert [m[0].content for m in chat.sent] == ["a", "b", "c"]
    assert chat.remaining == 0

    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"responses": ["from file"]}))
    out = ReplayChat(path).complete(CHAT)
    assert (out.text, out.provider, out.usage.cost_usd) == ("from file", "replay", 0.0)
    path.write_text(json.dumps(["no", "object"]))
    with pytest.raises(ValueError, match="responses"):
        ReplayChat(str(path))


def completion(n_in: int, n_out: int, cost: float | None) -> Completion:
    return Completion("x", Usage(n_in, n_out, cost), "m", "openai", 1)


def test_usage_meter_sums_and_round_trips() -> None:
    meter = UsageMeter()
    meter.add(completion(100, 10, 0.01), "planner")
    meter.add(completion(200, 20, 0.02), "coder")
    meter.add(completion(300, 30, 0.03), "coder")
    assert (meter.calls, meter.input_tokens, meter.output_tokens) == (3, 600, 60)
    assert meter.cost_usd == pytest.approx(0.06) and meter.cost_text == "$0.0600"
    assert meter.by_agent["coder"].calls == 2 and meter.by_agent["coder"].input_tokens == 500

    data = json.loads(json.dumps(meter.to_dict()))
    assert UsageMeter.from_dict(data) == meter

    meter.add(completion(1, 1, None), "planner")
    assert meter.cost_usd is None and meter.cost_text == "unknown"
    assert meter.by_agent["coder"].cost_usd == pytest.approx(0.05)
    assert UsageMeter.from_dict(json.loads(json.dumps(meter.to_dict()))) == meter

    total = UsageMeter() + meter
    assert total == meter and total is not meter


# --- Choosing the backend -----------------------------------------------------------------------------

LLM_VARS = [
    "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_BASE_URL",
    "KERNELCREW_OPENAI_API_KEY", "KERNELCREW_ANTHROPIC_API_KEY", "KERNELCREW_LLM", "KERNELCREW_MODEL",
    "KERNELCREW_LLM_BASE_URL", "KERNELCREW_REPLAY_FILE", "KERNELCREW_LLM_PRICE_IN", "KERNELCREW_LLM_PRICE_OUT",
    "KERNELCREW_LLM_API_KEY", "KERNELCREW_ANTHROPIC_BASE_URL",
]  # fmt: skip


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No LLM configuration from the outside; settings rebuilt after each change."""
    for name in LLM_VARS:
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


def set_env(env: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        env.setenv(name, value)
    get_settings.cache_clear()


def test_no_keys_means_playbook(env) -> None:
    assert resolve_chat_model() is None
    assert resolve_chat_model(backend="playbook") is None


def test_openai_key_picks_openai(env) -> None:
    set_env(env, OPENAI_API_KEY=KEY)
    chat = resolve_chat_model()
    assert isinstance(chat, OpenAIChat) and chat.model == "gpt-5.1"
    set_env(env, ANTHROPIC_API_KEY=KEY, KERNELCREW_MODEL="gpt-4.1")
    chat = resolve_chat_model()
    assert isinstance(chat, OpenAIChat) and chat.model == "gpt-4.1"
    assert resolve_chat_model(model="o3").model == "o3"  # an argument beats the environment
    assert KEY not in repr(chat)


def test_anthropic_key_picks_anthropic(env) -> None:
    set_env(env, ANTHROPIC_API_KEY=KEY)
    chat = resolve_chat_model()
    assert isinstance(chat, AnthropicChat) and chat.model == "claude-sonnet-4-6"


def test_explicit_backend_beats_settings(env) -> None:
    set_env(env, KERNELCREW_LLM="anthropic", ANTHROPIC_API_KEY=KEY)
    assert resolve_chat_model(backend="playbook") is None
    assert isinstance(resolve_chat_model(), AnthropicChat)


def test_backend_without_key_says_what_to_set(env) -> None:
    with pytest.raises(LLMError, match="ANTHROPIC_API_KEY"):
        resolve_chat_model(backend="anthropic")
    with pytest.raises(LLMError, match="OPENAI_API_KEY"):
        resolve_chat_model(backend="openai")
    with pytest.raises(LLMError, match="KERNELCREW_REPLAY_FILE"):
        resolve_chat_model(backend="replay")
    with pytest.raises(ValueError, match="playbook, openai, anthropic, replay"):
        resolve_chat_model(backend="gemini")


def test_base_url_without_key_works(env, stub: Stub) -> None:
    set_env(env, KERNELCREW_LLM_BASE_URL=f"http://127.0.0.1:{stub.port}/v1", KERNELCREW_MODEL="qwen3-coder")
    chat = resolve_chat_model()  # a local server alone is enough to choose openai
    assert isinstance(chat, OpenAIChat)
    stub.queue(openai_ok("local", model="qwen3-coder"))
    out = chat.complete(CHAT)
    assert out.text == "local" and out.usage.cost_usd is None
    assert stub.requests[0].headers["authorization"] == "Bearer EMPTY"


def test_anthropic_key_never_goes_to_the_openai_compatible_server(env, stub: Stub) -> None:
    local = f"http://127.0.0.1:{stub.port}/v1"
    set_env(env, KERNELCREW_LLM_BASE_URL=local, ANTHROPIC_API_KEY=KEY, OPENAI_BASE_URL=local)
    chat = resolve_chat_model(backend="anthropic")
    assert isinstance(chat, AnthropicChat) and chat.base_url == ""
    assert str(chat._client.base_url).startswith("https://api.anthropic.com")
    assert str(stub.port) not in repr(chat)

    # Its own base URL, set explicitly, is where the key goes.
    set_env(env, KERNELCREW_ANTHROPIC_BASE_URL=f"http://127.0.0.1:{stub.port}")
    stub.queue(anthropic_ok("via gateway"))
    assert resolve_chat_model(backend="anthropic").complete(CHAT).text == "via gateway"
    assert stub.requests[-1].path == "/v1/messages" and KEY in str(stub.requests[-1].headers)


def test_openai_key_never_goes_to_another_server(env, stub: Stub) -> None:
    set_env(env, KERNELCREW_LLM_BASE_URL=f"http://127.0.0.1:{stub.port}/v1", OPENAI_API_KEY=KEY)
    stub.queue(openai_ok("local"))
    assert resolve_chat_model().complete(CHAT).text == "local"
    assert stub.requests[-1].headers["authorization"] == "Bearer EMPTY", "the server's own key, none set"
    set_env(env, KERNELCREW_LLM_API_KEY="local-server-key")
    resolve_chat_model().complete(CHAT)
    assert stub.requests[-1].headers["authorization"] == "Bearer local-server-key"

    # Without a base URL: OpenAI's API, whatever the SDK's own variable or an anthropic base URL say.
    env.delenv("KERNELCREW_LLM_BASE_URL")
    set_env(env, OPENAI_BASE_URL=f"http://127.0.0.1:{stub.port}/v1")
    set_env(env, KERNELCREW_ANTHROPIC_BASE_URL=f"http://127.0.0.1:{stub.port}")
    chat = resolve_chat_model(backend="openai")
    assert str(chat._client.base_url).startswith("https://api.openai.com")
    from kernelcrew.config import openai_endpoint

    assert openai_endpoint(Settings(llm_base_url="https://api.openai.com/v1", openai_api_key=KEY))[1] == KEY


def test_local_only_judges_the_endpoint_of_the_chosen_provider(env) -> None:
    from kernelcrew.agents.run import resolve_chat

    set_env(env, KERNELCREW_LLM_BASE_URL="http://127.0.0.1:8000/v1", ANTHROPIC_API_KEY=KEY)
    chat, backend, note = resolve_chat("anthropic", "", True, get_settings())
    assert chat is None and backend == "playbook" and "external" in note
    chat, backend, note = resolve_chat("openai", "", True, get_settings())
    assert chat is not None and backend == "openai" and not note


def test_replay_backend_reads_its_file(env, tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"responses": ["a"]}))
    set_env(env, KERNELCREW_LLM="replay", KERNELCREW_REPLAY_FILE=str(path))
    chat = resolve_chat_model()
    assert isinstance(chat, ReplayChat) and chat.complete(CHAT).text == "a"


def test_keys_are_secret(env) -> None:
    set_env(env, OPENAI_API_KEY=KEY, KERNELCREW_ANTHROPIC_API_KEY="sk-ant-another-secret")
    settings = get_settings()
    assert settings.openai_api_key.get_secret_value() == KEY
    assert settings.anthropic_api_key.get_secret_value() == "sk-ant-another-secret"
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert KEY not in text and "another-secret" not in text
    assert Settings(openai_api_key="sk-direct").openai_api_key.get_secret_value() == "sk-direct"


# --- Prompts ------------------------------------------------------------------------------------------

PLANNER_FIELDS = {
    "task_source", "best_source", "best_summary", "diagnosis", "kb_hits", "strategies", "history",
    "last_failure", "user_messages", "precision", "device_facts",
}  # fmt: skip
CODER_FIELDS = {
    "task_source", "base_source", "step", "diagnosis", "last_failure", "precision", "device_facts",
    "kb_sources", "user_messages",
}  # fmt: skip


def test_render_fills_fields() -> None:
    assert prompts.fields("planner") == PLANNER_FIELDS
    assert prompts.fields("coder") == CODER_FIELDS
    values = {name: f"<{name}>" for name in PLANNER_FIELDS} | {"user_messages": "keep it {fp32}"}
    system, user = prompts.render("planner", **values)
    assert (system.role, user.role) == ("system", "user")
    assert "planner" in system.content and '"expected_gain": 1.3' in system.content  # braces unescaped
    assert "<task_source>" in user.content and "<device_facts>" in user.content
    assert "keep it {fp32}" in user.content  # values are not formatted again

    system, user = prompts.render("coder", **{name: f"<{name}>" for name in CODER_FIELDS})
    assert "class ModelNew" in system.content and "<base_source>" in user.content


def test_render_missing_or_unknown_field() -> None:
    values = {name: "x" for name in CODER_FIELDS if name != "step"}
    with pytest.raises(KeyError, match="step"):
        prompts.render("coder", **values)
    with pytest.raises(TypeError, match="stepp"):
        prompts.render("coder", **values, step="x", stepp="x")
    with pytest.raises(FileNotFoundError):
        prompts.render("nobody")
