"""What a submitted job or chat message goes through: option and source checks, the import check, queueing.

Shared by the REST API and the web UI's forms, so both refuse the same inputs with the same HTTP
errors, apply the same limits and write the same job events.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import HTTPException
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationInfo, field_validator
from sqlalchemy import func, select

from kernelcrew.agents.llm import BACKENDS
from kernelcrew.config import Settings
from kernelcrew.service import jobs
from kernelcrew.service.auth import Principal
from kernelcrew.task import TaskError, check_source
from kernelcrew.tools.taskcheck import validate_in_sandbox


class JobOptions(BaseModel):
    """What a job may ask for; anything else is refused (422) rather than failing the job later.

    The allowed values are those the orchestrator's consumers accept: the LLM backends, the
    ``torch.compile`` modes of the timing tool, and a GPU request the queue routing can serve on
    the chosen device. Whether a worker is online for it is decided when the job runs.
    """

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("auto", max_length=64, description=f"auto or one of {', '.join(BACKENDS)}.")
    model: str = Field("", max_length=200)
    max_iters: int = Field(6, ge=1, le=200)
    time_budget_s: float = Field(900.0, gt=0, le=7 * 86400)
    precision: Literal["strict", "relaxed"] = "strict"
    device: Literal["cuda", "cpu"] = "cuda"
    gpu: str | None = Field(
        None,
        max_length=128,
        description="A GPU model (h100-sxm), an architecture (sm_90), any, or cpu (with device cpu).",
    )
    local_only: bool = False
    compile_modes: str = Field(
        "auto", max_length=200, description="auto, none, or a comma list of torch.compile modes."
    )
    quick: bool = False
    parallel: int = Field(
        1,
        ge=1,
        le=16,
        description="Steps evaluated side by side per round, one per worker of the job's GPU model "
        "(no more than the workers serving it when the job starts).",
    )
    seed: int | None = None
    timing: bool = True
    use_kb: bool = False
    webhook_url: HttpUrl | None = None

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in ("auto", *BACKENDS):
            raise ValueError(f"unknown backend {value!r}: choose auto or one of {', '.join(BACKENDS)}")
        return value

    @field_validator("model", "gpu")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        if value and "\x00" in value:
            raise ValueError("contains a NUL byte (\\x00)")
        return value

    @field_validator("compile_modes")
    @classmethod
    def _known_compile_modes(cls, value: str) -> str:
        from kernelcrew.tools.timing import parse_compile_modes

        parse_compile_modes(value, "cuda")  # ValueError naming the unknown modes and the known ones
        return value

    @field_validator("gpu")
    @classmethod
    def _servable_gpu(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Refuse what queue routing refuses for any inventory: no GPU named, or one against the device."""
        from kernelcrew.tools.hardware import GpuRequest

        device = info.data.get("device", "cuda")
        want = GpuRequest.parse(value)
        if want.kind == "model" and not want.value:
            raise ValueError(
                f"{value!r} names no GPU: use a model (h100-sxm), an architecture (sm_90), any, or cpu"
            )
        if want.kind == "cpu" and device == "cuda":
            raise ValueError("'cpu' asks for the CPU but device is 'cuda': set device 'cpu' or name a GPU")
        if device == "cpu" and want.kind in ("model", "arch"):
            raise ValueError(f"{want} is a GPU but device is 'cpu': set device 'cuda' or leave gpu empty")
        return value


def read_source(raw: bytes | str | None, what: str, kind: str, max_bytes: int) -> str | None:
    """An uploaded source checked as the API checks it: size (413), UTF-8 and a valid ``kind`` (422)."""
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > max_bytes:
        raise HTTPException(413, f"the {what} is {len(data)} bytes; at most {max_bytes}")
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(422, f"the {what} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        check_source(source, kind, f"{what}.py")
    except TaskError as exc:
        raise HTTPException(422, f"the {what} is not a valid {kind}: {exc}") from exc
    return source


async def check_task_imports(task: str, settings: Settings) -> None:
    """Import the task once in a sandbox child (422 if that fails or outlasts the bound).

    Shared by the REST route and the web form. User code: never in this process; in a thread, so
    the event loop keeps serving while the child runs. Where user code cannot be isolated here, the
    job is refused (503): the service never runs it unisolated.
    """
    from kernelcrew.tools import sandbox

    refusal = await run_in_threadpool(sandbox.service_refusal, settings)
    if refusal is not None:
        raise HTTPException(503, f"this service cannot isolate user code, so it takes no jobs: {refusal}")
    try:
        await run_in_threadpool(
            validate_in_sandbox,
            task,
            "task",
            "task.py",
            timeout_s=settings.api_validate_timeout_s,
            settings=settings,
        )
    except TaskError as exc:
        raise HTTPException(422, f"the task is not usable: {exc}") from exc


def enqueue_job(
    session: Any,
    who: Principal,
    task: str,
    candidate: str | None,
    mode: str,
    options: dict[str, Any],
    max_active: int,
) -> jobs.Job:
    """Queue a checked job for ``who``; 429 when they already have ``max_active`` queued or running.

    Shared by the REST route and the web form, so both apply the same limit and write the same events.
    """
    active = session.scalar(
        select(func.count())
        .select_from(jobs.Job)
        .where(jobs.Job.owner_id == who.user_id, jobs.Job.status.in_(("queued", "running")))
    )
    if active >= max_active:
        raise HTTPException(429, f"{active} jobs are queued or running; at most {max_active}")
    t = jobs.now()
    job = jobs.Job(
        id=jobs.new_job_id(),
        owner_id=who.user_id,
        token_id=who.token_id,
        status="queued",
        mode=mode,
        task_source=task,
        candidate_source=candidate,
        options=options,
        cancel_requested=False,
        attempts=0,
        created_at=t,
        updated_at=t,
    )
    session.add(job)
    session.flush()
    jobs.add_event(session, job.id, "status", {"status": "queued"})
    return job


def add_message(session: Any, job: jobs.Job, text: str, user: str) -> None:
    """A chat message: a queued or running optimize job takes it at its next plan; a succeeded or
    failed one is queued again and resumes with it.

    Refused before anything is written: 422 for a NUL byte (no text column stores one); 409 for a
    verify job (it has no crew to read it) and for a cancelled job (cancelled means stopped).
    """
    if "\x00" in text:
        raise HTTPException(422, "the message contains a NUL byte (\\x00)")
    if job.mode != "optimize":
        raise HTTPException(409, f"job {job.id} is a {job.mode} job: it has no crew to take a message")
    if job.status == "cancelled":
        raise HTTPException(409, f"job {job.id} was cancelled: a message does not restart it")
    session.add(jobs.JobMessage(job_id=job.id, text=text, created_at=jobs.now()))
    jobs.add_event(session, job.id, "message", {"text": text, "user": user})
    if job.status in ("succeeded", "failed"):
        job.status = "queued"
        job.cancel_requested = False
        job.finished_at = None
        jobs.add_event(session, job.id, "status", {"status": "queued", "resumed_by": "message"})


__all__ = ["JobOptions", "add_message", "check_task_imports", "enqueue_job", "read_source"]
