"""The API's request and response models, one family per entity (jobs, messages, knowledge base, workers).

Every route declares its answer with one of these (``response_model``) and its refusals with
:func:`errors`, so the OpenAPI document lists every status code a route can return.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kernelcrew.api.kb import KbImported
from kernelcrew.service.summary import SpeedupTiming, Verdict

# -- errors -------------------------------------------------------------------------------------


class ErrorMessage(BaseModel):
    """A refusal: ``detail`` says what was wrong, in at most a few hundred characters."""

    detail: str


class ValidationProblem(BaseModel):
    """One field that failed validation: where (``loc``), why (``msg``), and a short echo of the input."""

    loc: list[str | int]
    msg: str
    type: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class ValidationErrors(BaseModel):
    """A 422: either one sentence naming the problem, or the list of fields that failed validation
    (at most ten, each refused value cut to 200 characters)."""

    detail: str | list[ValidationProblem]


#: What each refusal means, shared by every route that can return it.
ERROR_TEXT: dict[int, str] = {
    400: "The body cannot be parsed (not UTF-8 JSON).",
    401: "No bearer token, or an unknown or revoked one.",
    403: "The token lacks the scope this route needs.",
    404: "No such job, or it belongs to another user.",
    409: "The request conflicts with the job's state (or, for a new job, with the workers online).",
    413: "The request body is larger than the service accepts.",
    422: "A parameter or body field is invalid (including a NUL byte in a query parameter).",
    429: "Too many requests a minute with this token, or too many active jobs.",
    503: "A dependency (broker, sandbox) is unavailable.",
}


def errors(*codes: int, **described: str) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` entry of a route: each status code in ``codes`` with its model and meaning;
    ``described`` (``e409="..."``) gives a code a route-specific description."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        text = described.get(f"e{code}", ERROR_TEXT[code])
        out[code] = {"model": ValidationErrors if code == 422 else ErrorMessage, "description": text}
    return out


#: Refusals of every route that needs a token: no or bad token, rate limit, a NUL in the query.
AUTH_ERRORS = (401, 403, 422, 429)

# -- health -------------------------------------------------------------------------------------


class Health(BaseModel):
    """The process answers."""

    ok: bool


class WorkersSeen(BaseModel):
    """The workers the live inventory shows: information, never a readiness condition (jobs queue
    until a worker comes)."""

    count: int | None = Field(description="Workers online; null when the inventory cannot be read.")
    devices: dict[str, int] = Field(
        default_factory=dict, description='Workers per device: {"h100-sxm (sm_90)": 2, "cpu": 1}.'
    )
    detail: str = Field(
        description="One line: what is online, that jobs queue until a worker comes, or the error."
    )


class Readiness(BaseModel):
    """Whether the database and the broker answer, and the orchestrators run where this process
    supervises them (``kernelcrew serve --orchestrators N``); each check is ``ok`` (or how many
    run) or ``error: <reason>``. ``workers`` reports the worker inventory without deciding ``ok``."""

    ok: bool
    database: str
    broker: str
    orchestrators: str | None = None
    workers: WorkersSeen | None = None


# -- jobs ---------------------------------------------------------------------------------------


def _utc(value: datetime | None) -> datetime | None:
    """Timestamps are stored in UTC; a database without time zones (SQLite) returns them naive."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


#: A UTC timestamp, always written with its offset (RFC 3339).
UtcDatetime = Annotated[datetime, AfterValidator(_utc)]

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JobMode = Literal["optimize", "verify"]


class JobCreate(BaseModel):
    """A new job as JSON (multipart takes the same fields, ``options`` as a JSON string)."""

    task: str = Field(description="The task's Python source (Model, get_inputs, get_init_inputs).")
    candidate: str | None = Field(None, description="A ModelNew source (needed for mode=verify).")
    mode: str = Field("optimize", description="optimize or verify")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Job options (see JobOptions); unknown ones are refused."
    )


class JobPublic(BaseModel):
    """A job as its owner sees it."""

    id: str
    status: JobStatus
    mode: JobMode
    options: dict[str, Any]
    attempts: int
    cancel_requested: bool
    error: str | None
    created_at: UtcDatetime | None
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    task_name: str = Field(
        description="The task's title: its docstring's first line, else its Model's, else what its forward calls."
    )
    verdict: Verdict = Field(
        description="pass: the job returns a verified answer; no_gain: an optimize run whose candidates "
        "passed their checks but none was faster than eager, so its answer is the reference (or "
        "torch.compile, when the baseline timed it faster; see answer_kind); fail: it ended without one "
        "(its candidate failed the check, or no candidate passed); none: not ended, or ended without a result."
    )
    speedup: float | None = Field(description="The answer's median speedup over eager.")
    speedup_ci: list[float] | None = Field(description="Its 95% interval [low, high], when measured.")
    speedup_timing: SpeedupTiming | None = Field(
        None,
        description="Which timing the speedup is: final (the answer timed after the run, interleaved with "
        "eager); step (the step that verified it: a cancelled run stops before its final timing); "
        "baseline (torch.compile as the reference's baseline timed it).",
    )
    cpu_timing: bool = Field(description="The speedup is a CPU wall-clock timing, not a GPU speedup.")
    answer_kind: str | None = Field(
        description="What the answer is: kernel, hybrid, library or compiler; reference when it is the "
        "task itself (no candidate was faster than eager)."
    )


class JobsPublic(BaseModel):
    """A page of the caller's jobs that pass the filters, newest first, and how many pass in all."""

    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class JobResultPublic(JobPublic):
    """An ended job with its result: the report's JSON, the best source and the report in markdown
    (``result`` is empty and both sources are null when the job ended without one)."""

    result: dict[str, Any]
    best_source: str | None
    report_md: str | None


class MessageCreate(BaseModel):
    """A chat message to the crew."""

    text: str = Field(min_length=1, max_length=10_000)


# -- knowledge base and workers -----------------------------------------------------------------


class KbHit(BaseModel):
    """One knowledge-base record that answers a search, with why it matched."""

    model_config = ConfigDict(extra="allow")

    id: str
    source: str
    match: str
    why: str
    score: float
    strategy: str
    gpu_model: str | None
    arch: str
    signature: str
    visibility: str


class KbHits(BaseModel):
    """The records that answer a search, best first."""

    items: list[KbHit]


class WorkerPublic(BaseModel):
    """One worker process online (one GPU, or the CPU)."""

    hostname: str
    host: str
    pid: int
    queues: list[str]
    device: str
    model: str
    arch: str
    gpu: dict[str, Any] | None
    ncu: dict[str, Any]
    versions: dict[str, Any]
    started_at: float
    heartbeat_at: float
    current: dict[str, Any] | None


class WorkersPublic(BaseModel):
    """The workers online now, sorted by hostname."""

    items: list[WorkerPublic]


__all__ = [
    "AUTH_ERRORS",
    "ErrorMessage",
    "Health",
    "JobCreate",
    "JobMode",
    "JobPublic",
    "JobResultPublic",
    "JobStatus",
    "JobsPublic",
    "KbHit",
    "KbHits",
    "KbImported",
    "MessageCreate",
    "Readiness",
    "ValidationErrors",
    "ValidationProblem",
    "WorkerPublic",
    "WorkersPublic",
    "WorkersSeen",
    "errors",
]
