"""Settings for every part of kernelcrew, read from the environment (prefix KERNELCREW_)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: Environment variables that hold a secret, and what the secret opens. Each process of the service
#: holds only those its role needs (:data:`ROLE_SECRETS`); docs/security.md, "Where user code runs".
SECRET_ENV: dict[str, str] = {
    "OPENAI_API_KEY": "an LLM provider key",
    "KERNELCREW_OPENAI_API_KEY": "an LLM provider key",
    "ANTHROPIC_API_KEY": "an LLM provider key",
    "KERNELCREW_ANTHROPIC_API_KEY": "an LLM provider key",
    "KERNELCREW_LLM_API_KEY": "an LLM server key",
    "KERNELCREW_DATABASE_URL": "the database URL and its credentials",
    "PGPASSWORD": "a PostgreSQL password (libpq)",
}
#: The secret variables each role may hold: GPU workers none (the broker URL is their only
#: credential), the API the database, the orchestrator all of them.
ROLE_SECRETS: dict[str, frozenset[str]] = {
    "worker": frozenset(),
    "api": frozenset({"KERNELCREW_DATABASE_URL", "PGPASSWORD"}),
    "orchestrator": frozenset(SECRET_ENV),
}


def unneeded_secrets(role: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret variables set (non-empty) in ``environ`` (default: this process's) that ``role``
    does not need, sorted: names only, never their values."""
    env = os.environ if environ is None else environ
    allowed = ROLE_SECRETS[role]
    return sorted(k for k in SECRET_ENV if k not in allowed and env.get(k, "").strip())


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kernelcrew"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernelcrew"


class Settings(BaseSettings):
    """All configuration; each field is also the environment variable KERNELCREW_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="KERNELCREW_", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir, description="Runs, reports, database file.")
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="Build caches (Triton, CUDA).")
    precision: Literal["strict", "relaxed"] = "strict"

    # Sandbox: every task and candidate runs in a child process under these limits.
    sandbox: Literal["bwrap", "unsafe-none"] = Field(
        "bwrap",
        description="How children are isolated: bwrap (bubblewrap namespaces; a job is refused where "
        "they cannot be set up) or unsafe-none (a plain child process: the CLI's --unsafe-no-sandbox).",
    )
    sandbox_bwrap: str = Field("bwrap", description="The bubblewrap executable.")
    sandbox_tmp_mb: int = Field(
        1024, ge=16, description="Size of the child's private /tmp and /dev/shm (memory-backed)."
    )
    sandbox_disk_mb: int = Field(
        0,
        ge=0,
        description="Size of the child's own folder: a memory-backed tmpfs the parent copies results "
        "out of; a child that fills it gets ENOSPC and its record says so. 0: the memory limit (its "
        "pages count against the child's memory cgroup, so memory and folder share one bound).",
    )
    sandbox_user: str = Field("nobody", description="Unprivileged user the child drops to when run as root.")
    sandbox_timeout_s: float = 300.0
    sandbox_cpu_s: int = Field(
        0,
        description="RLIMIT_CPU of a child in CPU-seconds; 0: its wall-clock limit times the usable cores "
        "(at least 1800).",
    )
    sandbox_memory_mb: int = Field(
        0,
        ge=0,
        description="Memory cgroup limit of the child (all its processes) and its RLIMIT_DATA; "
        "0: 80 % of this machine's memory, so a task holds what the machine can.",
    )
    sandbox_max_procs: int = Field(512, description="pids cgroup limit / RLIMIT_NPROC of the child.")
    sandbox_max_open_files: int = 1024
    sandbox_max_output_bytes: int = Field(
        8 * 1024 * 1024, description="stdout+stderr before the child is killed."
    )
    sandbox_max_file_bytes: int = Field(
        0,
        ge=0,
        description="RLIMIT_FSIZE: largest file a child writes. 0: its folder's size (the golden "
        "outputs of a task with inputs of many GB are one file larger than any fixed cap).",
    )

    bytecode_cache: Literal["auto", "always", "off"] = Field(
        "auto",
        description="One bytecode tree under cache_dir for the sandboxed children (and the command "
        "line): auto where the installed torch has no bytecode of its own, always, or off.",
    )

    # Verification protocol.
    verify_seeds: int = Field(5, ge=5, description="Fresh get_inputs() seeds per verification (at least 5).")
    compute_sanitizer: bool = Field(
        False, description="Run compute-sanitizer memcheck on the smallest input set."
    )

    # Profiler (tools/ncu.py, tools/roofline.py).
    ncu_clock_control: Literal["none", "base"] = Field(
        "none", description="ncu --clock-control: none measures the GPU as it runs (never lock clocks)."
    )
    ncu_timeout_s: float = Field(600.0, gt=0, description="Wall-clock limit of one ncu run.")
    suspect_floor_ratio: float = Field(
        0.9, gt=0, le=1, description="A time below this fraction of the speed-of-light floor is suspect."
    )
    # Workers (kernelcrew/worker): Celery over Redis. Every task has a soft limit (a clean timeout
    # error) and a hard limit (its process is killed). Redis hands an unacknowledged task to another
    # worker only after the visibility timeout, the hard limit plus a margin, so a task that is still
    # running is never run twice, and a lost worker's task comes back at most task_max_attempts times.
    broker_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis: Celery broker, result backend, worker inventory."
    )
    task_soft_time_limit_s: float = Field(1200.0, gt=0, description="A task past this gets a timeout error.")
    task_time_limit_s: float = Field(1260.0, gt=0, description="A task past this has its process killed.")
    visibility_margin_s: float = Field(
        60.0, gt=0, description="Visibility timeout = hard limit + this: when a lost task is redelivered."
    )
    task_max_attempts: int = Field(
        3, ge=1, description="Deliveries of one task (a worker lost each time) before it fails."
    )
    task_queue_timeout_s: float = Field(
        3600.0, gt=0, description="How long a call waits in its queue for a worker to start it."
    )
    result_expires_s: int = Field(
        86400, gt=0, description="Task results and attempt records are kept this long."
    )
    worker_heartbeat_s: float = Field(
        10.0, gt=0, description="Inventory refresh; a worker missing 3 beats is offline."
    )
    worker_restore_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often a worker redelivers tasks of lost workers past the visibility timeout.",
    )
    worker_max_tasks_per_child: int = Field(
        200, ge=1, description="Tasks before a worker process is recycled."
    )
    worker_max_goldens: int = Field(8, ge=1, description="Goldens a worker process keeps for later calls.")
    ncu_probe_timeout_s: float = Field(120.0, gt=0, description="Limit of the ncu hardware-counter probe.")

    @property
    def visibility_timeout_s(self) -> float:
        """Seconds before Redis redelivers an unacknowledged task: just above the hard limit."""
        return self.task_time_limit_s + self.visibility_margin_s

    @model_validator(mode="after")
    def _hard_limit_above_soft(self) -> Settings:
        if self.task_time_limit_s <= self.task_soft_time_limit_s:
            raise ValueError(
                f"KERNELCREW_TASK_TIME_LIMIT_S ({self.task_time_limit_s:g}) must be above "
                f"KERNELCREW_TASK_SOFT_TIME_LIMIT_S ({self.task_soft_time_limit_s:g})"
            )
        return self

    # LLM (kernelcrew/agents/llm.py). Empty `llm` means auto: the offline playbook unless an API key
    # (or llm_base_url) is set. Keys are SecretStr so they never print.
    llm: str = Field("", description='Backend: "", "playbook", "openai", "anthropic" or "replay".')
    model: str = Field("", description="Model name; empty means the backend's default.")
    llm_base_url: str = Field(
        "", description="OpenAI-compatible server (vLLM, Ollama, SGLang) or a gateway for the openai backend."
    )
    llm_api_key: SecretStr = Field(
        SecretStr(""), description="Key of the server at llm_base_url; OPENAI_API_KEY is never sent there."
    )
    anthropic_base_url: str = Field(
        "",
        validation_alias=AliasChoices("KERNELCREW_ANTHROPIC_BASE_URL", "ANTHROPIC_BASE_URL"),
        description="Endpoint of the anthropic backend (a gateway); empty: api.anthropic.com.",
    )
    llm_timeout_s: float = Field(120.0, gt=0, description="Timeout of one LLM request.")
    llm_max_retries: int = Field(4, ge=0, description="Retries on 429, 5xx, timeouts, connection errors.")
    llm_price_in: float | None = Field(None, ge=0, description="$ per million input tokens (overrides).")
    llm_price_out: float | None = Field(None, ge=0, description="$ per million output tokens (overrides).")
    openai_api_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("KERNELCREW_OPENAI_API_KEY", "OPENAI_API_KEY")
    )
    anthropic_api_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("KERNELCREW_ANTHROPIC_API_KEY", "ANTHROPIC_API_KEY")
    )
    replay_file: str = Field(
        "",
        description='The replay backend\'s recording: a JSON file {"responses": [...]} or a folder of '
        "transcripts written by --record.",
    )
    llm_record_dir: str = Field("", description="Folder where every LLM call's transcript is written.")
    llm_temperature: float | None = Field(
        None, ge=0, le=2, description="Sampling temperature; sent only to models that accept one."
    )
    llm_reasoning_effort: str = Field(
        "",
        pattern=r"^(|none|minimal|low|medium|high|xhigh|max)$",
        description="Reasoning effort; sent only to models that take one (OpenAI reasoning models, "
        "Anthropic's effort setting).",
    )
    llm_max_tokens: int = Field(8192, ge=256, description="Output token budget of the coder's replies.")
    llm_samples: int = Field(
        1, ge=1, le=8, description="Candidates the coder's model writes per step (verified in turn)."
    )
    llm_structured: bool = Field(
        True, description="Ask for JSON-schema (OpenAI) or tool-use (Anthropic) answers from the planner."
    )

    # Storage (kernelcrew/knowledge_base/db.py): the knowledge base and the service's tables.
    kb_embedding_model: str = Field(
        "",
        description="Embedding model that blends with BM25 in knowledge-base retrieval (OpenAI API, or the "
        "OpenAI-compatible server at llm_base_url); empty: BM25 only.",
    )
    database_url: str = Field(
        "",
        description="SQLAlchemy URL (postgresql://user@host/db); empty: SQLite file data_dir/kernelcrew.db.",
    )
    kb_owner: str = Field("", description="Who the CLI acts as in the knowledge base; empty: the OS user.")
    kb_team: str = Field("", description="The CLI user's team (sees the team's records); empty: none.")

    # Service (kernelcrew/api, kernelcrew/worker/orchestrator.py).
    job_lease_s: float = Field(
        60.0, gt=0, description="An orchestrator's lease on a job, renewed by heartbeat."
    )
    job_max_attempts: int = Field(
        5, ge=1, description="Leases of one job (orchestrators lost) before it fails."
    )
    orchestrator_poll_s: float = Field(
        1.0, gt=0, description="How often an idle orchestrator looks for jobs."
    )
    api_max_upload_bytes: int = Field(1024 * 1024, gt=0, description="Largest task or candidate source.")
    api_max_kb_import_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="Largest knowledge-base import file the API takes."
    )
    api_max_active_jobs: int = Field(4, ge=1, description="Queued + running jobs one user may have.")
    api_rate_per_minute: int = Field(600, ge=1, description="Requests one token may make per minute.")
    api_validate_timeout_s: float = Field(
        60.0, gt=0, description="Limit of importing an uploaded task in a sandbox child (422 above)."
    )
    webhook_attempts: int = Field(4, ge=1, description="Deliveries of one webhook (backoff 1, 2, 4 s).")


def resolve_database_url(settings: Settings) -> str:
    """The SQLAlchemy URL to connect to: ``database_url``, or the SQLite file ``data_dir/kernelcrew.db``.

    PostgreSQL goes through psycopg 3: ``postgresql://`` and ``postgres://`` (libpq's spellings)
    become ``postgresql+psycopg://``; a URL that names a driver keeps it.
    """
    url = settings.database_url.strip()
    if not url:
        return f"sqlite:///{(settings.data_dir / 'kernelcrew.db').expanduser()}"
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, built on first use (never at import)."""
    return Settings()


def openai_endpoint(settings: Settings) -> tuple[str, str]:
    """(base URL, key) for OpenAI-style requests: the server at ``llm_base_url`` with ``llm_api_key``,
    else OpenAI's API with ``openai_api_key``: the OpenAI key goes to no other host."""
    from urllib.parse import urlparse

    base_url = settings.llm_base_url.strip()
    if base_url and urlparse(base_url).hostname != "api.openai.com":
        return base_url, settings.llm_api_key.get_secret_value()
    return base_url, settings.openai_api_key.get_secret_value()
