"""Chat models behind one interface: OpenAI (and compatible servers), Anthropic and recorded replies.

The agents see only :class:`ChatModel`. :func:`resolve_chat_model` picks the provider from an explicit
argument, then ``KERNELCREW_LLM``, then the keys it finds; it returns ``None`` for the offline playbook
(no LLM at all), which is the default when no key is set. The SDKs' own retries are turned off: our
loop retries rate limits (429), server errors (5xx, 529 overloaded), timeouts and connection errors
with exponential backoff and jitter, honouring ``retry-after``, and raises :class:`LLMError` at once
for a rejected request (400, 401, 403, 404). Token usage comes from the responses and cost from
:data:`PRICES`; :class:`UsageMeter` adds them up per run and per agent.

Settings (:class:`Sampling`: temperature, reasoning effort, max tokens) are sent only where the
provider and model take them: no temperature to OpenAI's reasoning models, no reasoning effort to
the others, and a parameter a server rejects (400 naming it) is dropped and the call repeated
without it. A structured answer (:class:`OutputSchema`) is asked as a JSON schema (OpenAI) or a
forced tool call (Anthropic); a server that rejects it gets plain text from then on, which the
agents parse the same way. :class:`RecordingChat` writes one transcript per call and
:class:`ReplayChat` plays such a folder back, errors and usage included.
"""

from __future__ import annotations

import email.utils
import importlib
import json
import logging
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from kernelcrew.config import Settings, get_settings, openai_endpoint

log = logging.getLogger(__name__)

BACKENDS = ("playbook", "openai", "anthropic", "replay")
"""Valid values of ``KERNELCREW_LLM`` (empty means auto)."""

DEFAULT_MODELS = {"openai": "gpt-5.1", "anthropic": "claude-sonnet-4-6", "replay": "replay"}
"""Models used when neither an argument nor ``KERNELCREW_MODEL`` names one."""

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 20.0

# Dollars per million tokens (input, output): list prices as of 2026, which may change. Set
# KERNELCREW_LLM_PRICE_IN / KERNELCREW_LLM_PRICE_OUT to override (e.g. 0 for a local server).
# Cached-input discounts and batch prices are ignored, so the cost is an upper bound. A model not
# listed here (and not overridden) has an unknown cost, reported as "unknown", never as $0.
PRICES: dict[str, tuple[float, float]] = {
    # OpenAI
    "gpt-5.4": (2.50, 15.0),
    "gpt-5.2": (1.75, 14.0),
    "gpt-5.1": (1.25, 10.0),
    "gpt-5": (1.25, 10.0),
    "gpt-5-mini": (0.25, 2.0),
    "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.0, 8.0),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4o": (2.50, 10.0),
    "o3": (2.0, 8.0),
    "o4-mini": (1.10, 4.40),
    # Anthropic
    "claude-opus-4-7": (5.0, 25.0),
    "claude-opus-4-6": (5.0, 25.0),
    "claude-opus-4-5": (5.0, 25.0),
    "claude-opus-4-1": (15.0, 75.0),
    "claude-sonnet-4-6": (3.0, 15.0),
    "claude-sonnet-4-5": (3.0, 15.0),
    "claude-sonnet-4": (3.0, 15.0),
    "claude-haiku-4-5": (1.0, 5.0),
}

_SNAPSHOT_SUFFIX = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2})$")
_REASONING_MODEL = re.compile(r"^(o\d|gpt-([5-9]|\d\d))")  # o1/o3/o4..., gpt-5 and later
_KEY_LIKE = re.compile(r"\b(sk-[A-Za-z0-9_-]{4})[A-Za-z0-9_*-]{4,}")


# --- Data -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """A client's settings, sent only where its provider and model accept them."""

    temperature: float | None = None
    """None: the provider's default (nothing sent)."""
    effort: str = ""
    """Reasoning effort (none, minimal, low, medium, high, ...); "": the model's default."""
    max_tokens: int = 4096
    """Output budget when the caller names none."""


@dataclass(frozen=True)
class OutputSchema:
    """A structured answer: a JSON object of this schema (OpenAI json_schema, Anthropic tool use)."""

    name: str
    description: str
    schema: dict[str, Any]


@dataclass
class Message:
    """One chat message."""

    role: Literal["system", "user", "assistant"]
    content: str


@dataclass
class Usage:
    """Tokens of one completion and its cost in dollars (None when the model's price is unknown)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None


@dataclass
class Completion:
    """A model's reply with its usage; ``attempts`` counts HTTP requests (1 + retries)."""

    text: str
    usage: Usage
    model: str
    provider: str
    attempts: int
    stop_reason: str = ""
    """The provider's finish/stop reason ("stop", "end_turn", "length", "max_tokens"...)."""
    structured: bool = False
    """Whether ``text`` is the provider's structured answer (a JSON object of the schema asked)."""


@runtime_checkable
class ChatModel(Protocol):
    """What the agents call; tests pass a :class:`ReplayChat`.

    ``temperature`` and ``max_tokens`` left None take the client's :class:`Sampling`; ``schema``
    asks for a structured answer where the provider supports it (plain text otherwise).
    """

    provider: str
    model: str

    def complete(
        self,
        messages: list[Message],
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> Completion: ...


class LLMError(RuntimeError):
    """A model call failed: a rejected request, or retries exhausted (``retryable`` is then True).

    The message names the provider, the model and the reason; it never contains an API key. A reply
    that came but is unusable (empty, refused, cut at max_tokens) keeps its ``completion``, so its
    tokens are metered like any other.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        provider: str = "",
        model: str = "",
        status_code: int | None = None,
        attempts: int = 0,
        completion: Completion | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.provider = provider
        self.model = model
        self.status_code = status_code
        self.attempts = attempts
        self.completion = completion

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "retryable": self.retryable,
            "provider": self.provider,
            "model": self.model,
            "status_code": self.status_code,
            "attempts": self.attempts,
            "completion": self.completion,
        }
        return (_rebuild_llm_error, (str(self), kwargs))


def _rebuild_llm_error(message: str, kwargs: dict[str, Any]) -> LLMError:
    return LLMError(message, **kwargs)


class ReplayExhausted(LLMError):
    """A replayed run asked for more calls than its recording holds (it diverged from it): a failed
    call, not a provider failure, so the playbook does not take over."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (ReplayExhausted, (str(self),), {"provider": self.provider, "model": self.model})


def provider_failed(exc: LLMError) -> bool:
    """Whether ``exc`` means the provider itself failed (no reply at all: network, key, quota...),
    after which the playbook takes over; an unusable reply or a replay that ran out is not."""
    return exc.completion is None and not isinstance(exc, ReplayExhausted)


# --- Prices and usage ---------------------------------------------------------------------------------


def price_per_million(model: str) -> tuple[float, float] | None:
    """(input, output) dollars per million tokens of ``model`` or its dated snapshot, else None."""
    name = model.strip().lower()
    if name in PRICES:
        return PRICES[name]
    base = _SNAPSHOT_SUFFIX.sub("", name)
    return PRICES.get(base)


def estimate_cost(
    models: Sequence[str],
    input_tokens: int,
    output_tokens: int,
    *,
    price_in: float | None = None,
    price_out: float | None = None,
) -> float | None:
    """Dollars for the tokens, priced by the first of ``models`` in :data:`PRICES`; overrides win."""
    table = next((p for p in map(price_per_million, models) if p is not None), None)
    p_in = price_in if price_in is not None else (table[0] if table else None)
    p_out = price_out if price_out is not None else (table[1] if table else None)
    if p_in is None or p_out is None:
        return None
    return (input_tokens * p_in + output_tokens * p_out) / 1e6


def _add_cost(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


@dataclass
class AgentUsage:
    """Calls, tokens and cost of one agent."""

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0


@dataclass
class UsageMeter:
    """Calls, tokens and dollars of a run, in total and per agent; JSON-serializable via to_dict().

    ``cost_usd`` becomes None (reported "unknown") as soon as one call's price is unknown.
    ``meter_a + meter_b`` returns a new meter, so a graph state can use ``operator.add`` as reducer.
    """

    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = 0.0
    by_agent: dict[str, AgentUsage] = field(default_factory=dict)

    def add(self, completion: Completion, agent: str) -> None:
        """Count one completion made by ``agent``."""
        u = completion.usage
        for tally in (self, self.by_agent.setdefault(agent, AgentUsage())):
            tally.calls += 1
            tally.input_tokens += u.input_tokens
            tally.output_tokens += u.output_tokens
            tally.cost_usd = _add_cost(tally.cost_usd, u.cost_usd)

    def __add__(self, other: UsageMeter) -> UsageMeter:
        if not isinstance(other, UsageMeter):
            return NotImplemented
        merged = UsageMeter.from_dict(self.to_dict())
        for tally, theirs in [(merged, other)] + [
            (merged.by_agent.setdefault(name, AgentUsage()), a) for name, a in other.by_agent.items()
        ]:
            tally.calls += theirs.calls
            tally.input_tokens += theirs.input_tokens
            tally.output_tokens += theirs.output_tokens
            tally.cost_usd = _add_cost(tally.cost_usd, theirs.cost_usd)
        return merged

    @property
    def cost_text(self) -> str:
        """The cost for a report: "$0.0123", or "unknown" when a price was unknown."""
        return "unknown" if self.cost_usd is None else f"${self.cost_usd:.4f}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (stored in LangGraph checkpoints and reports)."""
        return {
            "calls": self.calls,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": self.cost_usd,
            "by_agent": {
                name: {
                    "calls": a.calls,
                    "input_tokens": a.input_tokens,
                    "output_tokens": a.output_tokens,
                    "cost_usd": a.cost_usd,
                }
                for name, a in self.by_agent.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageMeter:
        """The inverse of :meth:`to_dict`."""
        return cls(
            calls=int(data.get("calls", 0)),
            input_tokens=int(data.get("input_tokens", 0)),
            output_tokens=int(data.get("output_tokens", 0)),
            cost_usd=data.get("cost_usd", 0.0),
            by_agent={name: AgentUsage(**a) for name, a in data.get("by_agent", {}).items()},
        )


# --- Retries ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Failure:
    retryable: bool
    reason: str
    status_code: int | None = None
    retry_after_s: float | None = None


def parse_retry_after(headers: Any) -> float | None:
    """Seconds asked for by ``retry-after-ms`` or ``retry-after`` (seconds or an HTTP date), or None."""
    if headers is None:
        return None
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / divisor
        except ValueError:
            if name != "retry-after":
                continue
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError):
                continue
            seconds = when.timestamp() - time.time()
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


def backoff_delay(
    attempt: int, retry_after_s: float | None = None, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based).

    The server's ``retry-after`` when given, else ``0.5 s * 2**(attempt-1)`` with jitter (50-100%);
    both capped at 20 s.
    """
    if retry_after_s is not None:
        return min(retry_after_s, BACKOFF_CAP_S)
    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1))
    return delay * (0.5 + 0.5 * (rng or random).random())


def _redact(text: str, secret: str) -> str:
    if secret and len(secret) >= 4:
        text = text.replace(secret, "***")
    return _KEY_LIKE.sub(r"\1***", text)


def _server_message(exc: Any) -> str:
    """The provider's own explanation from an error body, shortened."""
    body = getattr(exc, "body", None)
    message = None
    if isinstance(body, dict):
        inner = body.get("error")
        message = inner.get("message") if isinstance(inner, dict) else None
        message = message or body.get("message")
    message = str(message or getattr(exc, "message", "") or exc)
    return message if len(message) <= 300 else message[:297] + "..."


def _classify(sdk: Any, exc: Exception, provider: str, model: str, where: str, timeout_s: float) -> _Failure:
    """Turn an SDK error (openai/anthropic share the class names) into a retry decision and a reason."""
    if isinstance(exc, sdk.APITimeoutError):
        return _Failure(True, f"no answer from {where} within {timeout_s:g} s (timeout)")
    if isinstance(exc, sdk.APIConnectionError):
        return _Failure(True, f"could not connect to {where} ({exc.__cause__ or exc})")
    if not isinstance(exc, sdk.APIStatusError):
        return _Failure(False, f"malformed response from {where}: {exc}")
    status = exc.status_code
    headers = exc.response.headers
    detail = _server_message(exc)
    should_retry = headers.get("x-should-retry")
    if status == 429:
        failure = _Failure(True, f"rate limited (429): {detail}", status)
    elif status == 529:
        failure = _Failure(True, f"overloaded (529): {detail}", status)
    elif status >= 500:
        failure = _Failure(True, f"server error ({status}): {detail}", status)
    elif status in (408, 409):
        failure = _Failure(True, f"transient error ({status}): {detail}", status)
    elif status == 401:
        # The server's text quotes part of the key: leave it out.
        return _Failure(False, f"{provider} rejected the API key (401)", status)
    elif status == 403:
        failure = _Failure(False, f"{provider} denied access to model {model} (403): {detail}", status)
    elif status == 404:
        failure = _Failure(
            False, f"{provider} has no model {model!r} or endpoint at {where} (404): {detail}", status
        )
    elif status == 400:
        failure = _Failure(False, f"{provider} rejected the request (400): {detail}", status)
    else:
        failure = _Failure(False, f"{provider} rejected the request ({status}): {detail}", status)
    if should_retry in ("true", "false"):  # the providers' own hint, as their SDKs obey it
        failure = _Failure(should_retry == "true", failure.reason, status)
    if failure.retryable:
        failure = _Failure(True, failure.reason, status, parse_retry_after(headers))
    return failure


class _RetryingClient:
    """The retry loop shared by the HTTP providers."""

    provider: str
    model: str
    _sdk_name: str
    _default_host: str
    _default_url: str
    """Where requests go without a base_url, given to the SDK so its own environment variables
    (``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL``) cannot send the key elsewhere."""

    def __init__(
        self,
        model: str,
        *,
        api_key: str = "",
        base_url: str = "",
        timeout_s: float = 120.0,
        max_retries: int = 4,
        price_in: float | None = None,
        price_out: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        sampling: Sampling | None = None,
        structured: bool = True,
    ) -> None:
        self.model = model
        self.base_url = base_url
        self.sampling = sampling or Sampling()
        self.structured = structured
        """Whether structured answers are asked (turned off when the server rejects them)."""
        self.rejected: set[str] = set()
        """Optional parameters the server rejected; never sent again by this client."""
        self.price_in = price_in
        self.price_out = price_out
        self._sdk = _import_sdk(self._sdk_name)
        self._where = base_url or self._default_host
        self._secret = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._client = self._make_client()

    def _make_client(self) -> Any:
        raise NotImplementedError

    def _completion(
        self,
        text: str,
        n_in: int,
        n_out: int,
        served: str | None,
        attempts: int,
        stop: str,
        structured: bool = False,
    ) -> Completion:
        """The reply with its usage, priced by the model that served it (or the one asked for)."""
        model = served or self.model
        cost = estimate_cost(
            [model, self.model], n_in, n_out, price_in=self.price_in, price_out=self.price_out
        )
        return Completion(text, Usage(n_in, n_out, cost), model, self.provider, attempts, stop, structured)

    def _send(self, build: Callable[[], dict[str, Any]], create: Callable[..., Any]) -> tuple[Any, int]:
        """``create(**build())``; a 400 that names an optional parameter we sent drops it (and a
        rejected structured answer turns structured answers off), then the call is made again."""
        attempts = 0
        while True:
            params = build()
            try:
                response, n = self._call(lambda params=params: create(**params))
            except LLMError as exc:
                attempts += exc.attempts
                dropped = self._rejected_option(exc, params)
                if dropped is None:
                    exc.attempts = attempts
                    raise
                log.warning(
                    "%s (%s): the server rejected %s; sent without it from now on",
                    self.provider,
                    self.model,
                    dropped,
                )
                continue
            return response, attempts + n

    _OPTIONAL: tuple[str, ...] = ()
    """Request parameters this client may drop when the server rejects them."""
    _SCHEMA_PARAMS: tuple[str, ...] = ()

    def _rejected_option(self, exc: LLMError, params: dict[str, Any]) -> str | None:
        if exc.status_code not in (400, 422):
            return None
        text = str(exc).lower()
        for name in self._OPTIONAL:
            if name in params and name.lower() in text and name not in self.rejected:
                self.rejected.add(name)
                return name
        if self.structured and any(name in params for name in self._SCHEMA_PARAMS):
            self.structured = False  # a server without structured outputs: plain text from now on
            return "the structured answer"
        return None

    def _call(self, request: Callable[[], Any]) -> tuple[Any, int]:
        attempt = 0
        while True:
            attempt += 1
            try:
                return request(), attempt
            except self._sdk.APIError as exc:
                failure = _classify(self._sdk, exc, self.provider, self.model, self._where, self.timeout_s)
                reason = _redact(failure.reason, self._secret)
                if failure.retryable and attempt <= self.max_retries:
                    delay = backoff_delay(attempt, failure.retry_after_s, self._rng)
                    log.warning(
                        "%s (%s): %s; retry %d/%d in %.1f s",
                        self.provider,
                        self.model,
                        reason,
                        attempt,
                        self.max_retries,
                        delay,
                    )
                    self._sleep(delay)
                    continue
                if failure.retryable:
                    reason += f"; gave up after {attempt} attempts"
                raise LLMError(
                    f"{self.provider} ({self.model}): {reason}",
                    retryable=failure.retryable,
                    provider=self.provider,
                    model=self.model,
                    status_code=failure.status_code,
                    attempts=attempt,
                ) from None

    def _empty_reply(self, reply: Completion, max_tokens: int, refusal: str = "") -> LLMError:
        stop_reason = reply.stop_reason
        if refusal:
            why = f"the model refused: {refusal[:300]}"
        elif stop_reason in ("length", "max_tokens"):
            why = (
                f"the reply was cut at max_tokens={max_tokens} before any text "
                "(reasoning models spend part of it thinking): raise max_tokens"
            )
        else:
            why = f"the reply has no text (stop reason {stop_reason or 'none'})"
        return LLMError(
            f"{self.provider} ({self.model}): {why}",
            provider=self.provider,
            model=self.model,
            attempts=reply.attempts,
            completion=reply,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, where={self._where!r})"


def _import_sdk(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise LLMError(
            f"the {name} backend needs the {name} package: pip install {name}", provider=name
        ) from None


# --- Providers ----------------------------------------------------------------------------------------


class OpenAIChat(_RetryingClient):
    """OpenAI's Chat Completions API, or any OpenAI-compatible server (vLLM, Ollama, SGLang) at base_url.

    On OpenAI's reasoning models (gpt-5 and later, o1/o3/o4...) the budget goes in ``max_completion_tokens``
    and no temperature is sent: those models reject ``max_tokens`` and any temperature but 1.
    """

    provider = "openai"

    _sdk_name = "openai"
    _default_host = "api.openai.com"
    _default_url = "https://api.openai.com/v1"

    def _make_client(self) -> Any:
        return self._sdk.OpenAI(
            api_key=self._secret or "EMPTY",
            base_url=self.base_url or self._default_url,
            timeout=self.timeout_s,
            max_retries=0,
        )

    _OPTIONAL = ("temperature", "reasoning_effort")
    _SCHEMA_PARAMS = ("response_format",)

    def _params(
        self,
        messages: list[Message],
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
        }
        temperature = self.sampling.temperature if temperature is None else temperature
        budget = max_tokens or self.sampling.max_tokens
        if _REASONING_MODEL.match(self.model):
            params["max_completion_tokens"] = budget
            if self.sampling.effort:
                params["reasoning_effort"] = self.sampling.effort
        else:
            if temperature is not None:
                params["temperature"] = temperature
            params["max_tokens"] = budget
        if schema is not None and self.structured:
            params["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": schema.name,
                    "description": schema.description,
                    "schema": schema.schema,
                    "strict": False,
                },
            }
        for name in self.rejected:
            params.pop(name, None)
        return params

    def complete(
        self,
        messages: list[Message],
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> Completion:
        """One chat completion, retried on transient failures."""
        sent: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            sent.clear()
            sent.update(self._params(messages, temperature, max_tokens, schema))
            return sent

        response, attempts = self._send(build, self._client.chat.completions.create)
        choice = response.choices[0] if response.choices else None
        text = (choice.message.content or "") if choice else ""
        stop = (choice.finish_reason or "") if choice else ""
        usage = response.usage
        n_in = (usage.prompt_tokens or 0) if usage else 0
        n_out = (usage.completion_tokens or 0) if usage else 0
        reply = self._completion(
            text, n_in, n_out, response.model, attempts, stop, structured="response_format" in sent
        )
        if not text.strip():
            refusal = getattr(choice.message, "refusal", None) if choice else None
            budget = sent.get("max_completion_tokens", sent.get("max_tokens", 0))
            raise self._empty_reply(reply, budget, refusal or "")
        return reply


class AnthropicChat(_RetryingClient):
    """Anthropic's Messages API; system messages go into ``system``, the rest stay in order.

    No temperature is sent: the SDK (2.x) speaks API version 2026-10-21, which rejects every
    sampling parameter (and removed them from ``messages.create``). The reasoning effort goes in
    ``output_config.effort`` (low, medium, high, xhigh, max; other values are not sent). A
    structured answer is a forced call of one tool whose input schema is the answer's. The SDK
    sends the key as ``Authorization: Bearer``.
    """

    provider = "anthropic"

    _sdk_name = "anthropic"
    _default_host = "api.anthropic.com"
    _default_url = "https://api.anthropic.com"
    _OPTIONAL = ("output_config",)
    _SCHEMA_PARAMS = ("tools", "tool_choice")
    _EFFORTS = ("low", "medium", "high", "xhigh", "max")

    def _make_client(self) -> Any:
        return self._sdk.Anthropic(
            api_key=self._secret,
            base_url=self.base_url or self._default_url,
            timeout=self.timeout_s,
            max_retries=0,
        )

    def _params(
        self, messages: list[Message], max_tokens: int | None, schema: OutputSchema | None
    ) -> dict[str, Any]:
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        turns = [{"role": m.role, "content": m.content} for m in messages if m.role != "system"]
        if not turns:
            raise ValueError("anthropic needs at least one user message besides the system prompt")
        params: dict[str, Any] = {
            "model": self.model,
            "messages": turns,
            "max_tokens": max_tokens or self.sampling.max_tokens,
        }
        if system:
            params["system"] = system
        if self.sampling.effort in self._EFFORTS:
            params["output_config"] = {"effort": self.sampling.effort}
        if schema is not None and self.structured:
            params["tools"] = [
                {"name": schema.name, "description": schema.description, "input_schema": schema.schema}
            ]
            params["tool_choice"] = {"type": "tool", "name": schema.name}
        for name in self.rejected:
            params.pop(name, None)
        return params

    def complete(
        self,
        messages: list[Message],
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> Completion:
        """One message, retried on transient failures (``temperature`` is not sent: see the class)."""
        sent: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            sent.clear()
            sent.update(self._params(messages, max_tokens, schema))
            return sent

        response, attempts = self._send(build, self._client.messages.create)
        tool = next((b for b in response.content if getattr(b, "type", "") == "tool_use"), None)
        if tool is not None:
            text, structured = json.dumps(tool.input), True
        else:
            text = "".join(b.text for b in response.content if getattr(b, "type", "") == "text")
            structured = False
        stop = response.stop_reason or ""
        usage = response.usage
        n_in = (usage.input_tokens or 0) if usage else 0
        n_out = (usage.output_tokens or 0) if usage else 0
        reply = self._completion(text, n_in, n_out, response.model, attempts, stop, structured)
        if not text.strip():
            raise self._empty_reply(reply, sent["max_tokens"], "refused" if stop == "refusal" else "")
        return reply


TRANSCRIPT_GLOB = "call-*.json"
"""The files :class:`RecordingChat` writes, one per call, numbered in call order."""


def _transcript(
    n: int,
    provider: str,
    model: str,
    messages: list[Message],
    request: dict[str, Any],
    reply: Completion | None,
    error: LLMError | None,
) -> dict[str, Any]:
    def completion(c: Completion) -> dict[str, Any]:
        return {
            "text": c.text,
            "model": c.model,
            "provider": c.provider,
            "attempts": c.attempts,
            "stop_reason": c.stop_reason,
            "structured": c.structured,
            "usage": {
                "input_tokens": c.usage.input_tokens,
                "output_tokens": c.usage.output_tokens,
                "cost_usd": c.usage.cost_usd,
            },
        }

    return {
        "call": n,
        "provider": provider,
        "model": model,
        "request": {"messages": [{"role": m.role, "content": m.content} for m in messages], **request},
        "reply": completion(reply) if reply is not None else None,
        "error": None
        if error is None
        else {
            "message": str(error),
            "retryable": error.retryable,
            "status_code": error.status_code,
            "attempts": error.attempts,
        },
    }


class RecordingChat:
    """Wraps a chat model and writes each call (messages, settings, reply or error, usage) to
    ``<folder>/call-NNNN.json``; a resumed run goes on numbering after the files already there."""

    def __init__(self, inner: Any, folder: str | Path) -> None:
        self.inner = inner
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.provider: str = inner.provider
        self.model: str = inner.model
        self.base_url: str = getattr(inner, "base_url", "")
        self._count = len(list(self.folder.glob(TRANSCRIPT_GLOB)))

    def complete(
        self,
        messages: list[Message],
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> Completion:
        """The inner model's reply (or error), written down first."""
        request = {
            "temperature": temperature,
            "max_tokens": max_tokens,
            "schema": schema.name if schema is not None else None,
        }
        self._count += 1
        path = self.folder / f"call-{self._count:04d}.json"
        try:
            reply = self.inner.complete(
                messages, temperature=temperature, max_tokens=max_tokens, schema=schema
            )
        except LLMError as exc:
            record = _transcript(
                self._count, self.provider, self.model, messages, request, exc.completion, exc
            )
            path.write_text(json.dumps(record, indent=1), encoding="utf-8")
            raise
        record = _transcript(self._count, self.provider, self.model, messages, request, reply, None)
        path.write_text(json.dumps(record, indent=1), encoding="utf-8")
        return reply


class ReplayChat:
    """Plays recorded replies in order and records what it was sent (``.sent``), for tests and CI.

    ``responses`` is a list of reply texts, the path of a JSON file ``{"responses": [...]}``, or a
    folder of transcripts written by :class:`RecordingChat` (``--record``): those are played with
    their usage, stop reasons and errors, so a replayed run is metered and fails as the recorded one.
    """

    provider = "replay"

    def __init__(self, responses: Sequence[str] | str | Path, *, model: str = "replay") -> None:
        entries: list[dict[str, Any]]
        if isinstance(responses, (str, Path)) and Path(responses).is_dir():
            entries = _load_transcripts(Path(responses))
        else:
            if isinstance(responses, (str, Path)):
                responses = _load_replay_file(Path(responses))
            if not all(isinstance(r, str) for r in responses):
                raise ValueError("replay responses must be strings")
            entries = [{"reply": {"text": r}} for r in responses]
        self.model = model
        self.entries = entries
        self.responses: list[str] = [(e.get("reply") or {}).get("text", "") for e in entries]
        self.sent: list[list[Message]] = []
        self._next = 0

    @property
    def remaining(self) -> int:
        """Replies not played yet."""
        return len(self.entries) - self._next

    def complete(
        self,
        messages: list[Message],
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        schema: OutputSchema | None = None,
    ) -> Completion:
        """The next recorded reply (or the recorded error); LLMError when all were played."""
        self.sent.append([Message(m.role, m.content) for m in messages])
        if self._next >= len(self.entries):
            raise ReplayExhausted(
                f"replay ({self.model}): all {len(self.entries)} recorded responses were used",
                provider=self.provider,
                model=self.model,
            )
        entry = self.entries[self._next]
        self._next += 1
        reply = entry.get("reply")
        completion = None
        if reply is not None:
            usage = reply.get("usage") or {"cost_usd": 0.0}
            completion = Completion(
                reply.get("text", ""),
                Usage(usage.get("input_tokens", 0), usage.get("output_tokens", 0), usage.get("cost_usd")),
                reply.get("model", self.model),
                reply.get("provider", self.provider),
                reply.get("attempts", 1),
                reply.get("stop_reason", "end_turn"),
                reply.get("structured", False),
            )
        error = entry.get("error")
        if error is not None:
            raise LLMError(
                error.get("message", "recorded error"),
                retryable=bool(error.get("retryable")),
                provider=self.provider,
                model=self.model,
                status_code=error.get("status_code"),
                attempts=error.get("attempts", 1),
                completion=completion,
            )
        assert completion is not None
        return completion


def _load_replay_file(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read replay file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"replay file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("responses"), list):
        raise ValueError(f'replay file {path} must hold an object {{"responses": [...]}}')
    return data["responses"]


def _load_transcripts(folder: Path) -> list[dict[str, Any]]:
    paths = sorted(folder.glob(TRANSCRIPT_GLOB))
    if not paths:
        raise ValueError(f"no transcripts ({TRANSCRIPT_GLOB}) in {folder}")
    entries = []
    for path in paths:
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read transcript {path}: {exc}") from None
        if not isinstance(entry, dict) or ("reply" not in entry and "error" not in entry):
            raise ValueError(f"transcript {path} has neither a reply nor an error")
        entries.append(entry)
    return entries


# --- Choosing the model -------------------------------------------------------------------------------


def _auto_backend(settings: Settings) -> str:
    if settings.openai_api_key.get_secret_value() or settings.llm_base_url:
        return "openai"
    if settings.anthropic_api_key.get_secret_value():
        return "anthropic"
    return "playbook"


def resolve_chat_model(
    settings: Settings | None = None, *, backend: str | None = None, model: str | None = None
) -> ChatModel | None:
    """The chat model to use, or None for the offline playbook.

    The backend is ``backend`` if given, else ``KERNELCREW_LLM``, else auto: openai when
    ``OPENAI_API_KEY`` (or ``KERNELCREW_LLM_BASE_URL``, an OpenAI-compatible server) is set, anthropic
    when ``ANTHROPIC_API_KEY`` is, else the playbook. The model is ``model``, else
    ``KERNELCREW_MODEL``, else gpt-5.1 (openai) / claude-sonnet-4-6 (anthropic). An openai backend
    with a base_url needs no key; it sends ``KERNELCREW_LLM_API_KEY`` there, never the OpenAI key,
    and the anthropic backend goes only to ``KERNELCREW_ANTHROPIC_BASE_URL`` or Anthropic's API.
    Raises LLMError when the chosen backend lacks its key or file, and ValueError for an unknown
    backend.
    """
    settings = settings or get_settings()
    name = (settings.llm if backend is None else backend).strip().lower()
    if not name:
        name = _auto_backend(settings)
    if name not in BACKENDS:
        raise ValueError(f"unknown LLM backend {name!r}: choose one of {', '.join(BACKENDS)}")
    if name == "playbook":
        return None
    chosen = model or settings.model or DEFAULT_MODELS[name]
    if name == "replay":
        if not settings.replay_file:
            raise LLMError(
                "the replay backend needs a recording: set KERNELCREW_REPLAY_FILE (a file or a --record folder)",
                provider="replay",
            )
        return ReplayChat(settings.replay_file, model=chosen)
    common: dict[str, Any] = {
        "sampling": Sampling(
            temperature=settings.llm_temperature,
            effort=settings.llm_reasoning_effort,
            max_tokens=settings.llm_max_tokens,
        ),
        "structured": settings.llm_structured,
        "timeout_s": settings.llm_timeout_s,
        "max_retries": settings.llm_max_retries,
        "price_in": settings.llm_price_in,
        "price_out": settings.llm_price_out,
    }
    # Each key goes only to its own provider's endpoint: KERNELCREW_LLM_BASE_URL is the openai
    # backend's server (with KERNELCREW_LLM_API_KEY), KERNELCREW_ANTHROPIC_BASE_URL anthropic's.
    if name == "openai":
        base_url, key = openai_endpoint(settings)
        if not key and not base_url:
            raise LLMError(
                "the openai backend needs an API key: set OPENAI_API_KEY (or KERNELCREW_OPENAI_API_KEY), "
                "or KERNELCREW_LLM_BASE_URL for an OpenAI-compatible server",
                provider="openai",
                model=chosen,
            )
        return OpenAIChat(chosen, api_key=key, base_url=base_url, **common)
    key = settings.anthropic_api_key.get_secret_value()
    if not key:
        raise LLMError(
            "the anthropic backend needs an API key: set ANTHROPIC_API_KEY (or KERNELCREW_ANTHROPIC_API_KEY)",
            provider="anthropic",
            model=chosen,
        )
    return AnthropicChat(chosen, api_key=key, base_url=settings.anthropic_base_url.strip(), **common)


# --- Reading replies ----------------------------------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
_OPEN_FENCE = re.compile(r"^[ \t]*```[ \t]*(python3?|py)\b", re.M)
_PYTHON = ("python", "python3", "py")


def extract_json(text: str) -> dict[str, Any]:
    """The first JSON object in a reply (a ```json block first, else anywhere); ValueError otherwise."""
    if not text or not text.strip():
        raise ValueError("the reply is empty")
    decoder = json.JSONDecoder()
    fence_error = ""
    for lang, body in _FENCE.findall(text):
        if lang.lower() not in ("json", ""):
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            fence_error = f"its ```json block is not valid JSON ({exc.msg} at line {exc.lineno})"
            continue
        if isinstance(value, dict):
            return value
    for match in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    raise ValueError(
        f"no JSON object in the reply: {fence_error}" if fence_error else "no JSON object in the reply"
    )


def extract_code(text: str) -> str:
    """The candidate source in a reply: the last ```python block (preferring one that defines
    ``class ModelNew``), else the whole reply if it defines ``class ModelNew``; ValueError otherwise."""
    if not text or not text.strip():
        raise ValueError("the reply is empty")
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON]
    if not blocks:
        blocks = [body for lang, body in _FENCE.findall(text) if not lang and "class ModelNew" in body]
    if blocks:
        with_model = [b for b in blocks if re.search(r"^class ModelNew\b", b, re.M)]
        return (with_model or blocks)[-1].strip("\n") + "\n"
    if _OPEN_FENCE.search(text):
        raise ValueError("the reply's ```python block is never closed (truncated reply?)")
    if re.search(r"^class ModelNew\b", text, re.M) and "```" not in text:
        return text.strip("\n") + "\n"
    raise ValueError("no ```python block and no `class ModelNew` in the reply")
