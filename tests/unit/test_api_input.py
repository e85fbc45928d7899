"""Bad input to the API: NUL bytes, oversized fields, invalid job options, jobs no worker online
could run, chat a job cannot take, and offline ``/docs``.

Every refusal is a 4xx whose body names the problem and stays small, and nothing is stored.
In-process on SQLite, no orchestrator; the worker inventory is real Redis (its own database).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from kernelcrew.api.app import PREFIX, create_app
from kernelcrew.config import Settings
from kernelcrew.knowledge_base.db import get_engine, transaction
from kernelcrew.service import jobs
from kernelcrew.service.submissions import JobOptions
from kernelcrew.worker import inventory
from kernelcrew.worker.inventory import WorkerInfo
from tests.conftest import FIXTURES

TASK = (FIXTURES / "tasks" / "pointwise.py").read_text()
BODY_LIMIT = 4096  # no refusal below echoes more than this
#: The worker inventory these tests publish to (a Redis database no other test file uses).
INVENTORY_URL = "redis://127.0.0.1:6379/15"


class Api:
    def __init__(self, tmp_path) -> None:
        s = Settings(
            data_dir=tmp_path,
            broker_url=INVENTORY_URL,
            api_rate_per_minute=100_000,
            api_max_active_jobs=100,
        )
        self.engine = get_engine(s)
        with transaction(self.engine) as session:
            tok, token = jobs.create_token(session, "ann", ["submit", "read"])
            job = jobs.Job(
                id=jobs.new_job_id(),
                owner_id=tok.user_id,
                token_id=tok.id,
                status="running",
                mode="optimize",
                task_source=TASK,
                options={},
                created_at=jobs.now(),
            )
            session.add(job)
            self.job_id = job.id
        self.client = TestClient(create_app(s))
        self.client.headers["authorization"] = f"Bearer {token}"

    def count(self, table) -> int:
        with transaction(self.engine) as session:
            return session.scalar(select(func.count()).select_from(table))


@pytest.fixture
def online() -> Iterator[list[WorkerInfo]]:
    """The workers the inventory lists: none at first; append one and :func:`publish` it."""
    r = redis.Redis.from_url(INVENTORY_URL, decode_responses=True)
    for hostname in r.zrange(inventory.store.WORKERS_INDEX, 0, -1):
        inventory.remove(r, hostname)
    workers: list[WorkerInfo] = []
    yield workers
    for worker in workers:
        inventory.remove(r, worker.hostname)


def publish(workers: list[WorkerInfo], worker: WorkerInfo) -> None:
    inventory.publish(redis.Redis.from_url(INVENTORY_URL, decode_responses=True), worker, ttl_s=120)
    workers.append(worker)


def cpu_worker() -> WorkerInfo:
    return WorkerInfo(hostname="kc-cpu@test", host="test", pid=1, queues=["cpu"], device="cpu")


def h100_worker() -> WorkerInfo:
    gpu = {"device": "cuda", "name": "NVIDIA H100 80GB HBM3", "model": "h100-sxm", "arch": "sm_90"}
    queues = ["gpu.h100-sxm", "gpu.sm_90"]
    return WorkerInfo(hostname="kc-gpu0@test", host="test", pid=1, queues=queues, device="cuda", gpu=gpu)


@pytest.fixture
def api(tmp_path, online) -> Api:
    return Api(tmp_path)


def refused(r, status: int | tuple[int, ...], *words: str) -> str:
    """The refusal's body as text, after checking its status, its size and that it names ``words``."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    assert len(r.content) <= BODY_LIMIT, len(r.content)
    for word in words:
        assert word in r.text, (word, r.text[:500])
    return r.text


# -- NUL bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        f"{PREFIX}/kb?q=fused%00softmax",
        f"{PREFIX}/kb?arch=sm_90%00",
        f"{PREFIX}/jobs?status=queued%00",
        f"{PREFIX}/jobs/abc%00def",
        f"{PREFIX}/jobs/abc%00def/events",
    ],
)
def test_a_nul_byte_in_a_query_or_path_is_a_422_that_names_it(api, path):
    refused(api.client.get(path), 422, "NUL")


def test_a_nul_byte_in_a_chat_message_is_refused_and_not_stored(api):
    before = (api.count(jobs.JobMessage), api.count(jobs.JobEvent))
    r = api.client.post(f"{PREFIX}/jobs/{api.job_id}/messages", json={"text": "use fp16\u0000 please"})
    refused(r, 422, "NUL")
    assert (api.count(jobs.JobMessage), api.count(jobs.JobEvent)) == before


@pytest.mark.parametrize("multipart", [False, True], ids=["json", "multipart"])
@pytest.mark.parametrize("field", ["task", "candidate"])
def test_a_nul_byte_in_an_uploaded_source_is_refused_and_not_stored(api, field, multipart):
    sources = {"task": TASK, "candidate": TASK.replace("class Model", "class ModelNew")}
    sources[field] = sources[field] + "\n# \u0000\n"
    if multipart:
        files = {k: (f"{k}.py", v.encode()) for k, v in sources.items()}
        r = api.client.post(f"{PREFIX}/jobs", files=files, data={"mode": "verify"})
    else:
        r = api.client.post(f"{PREFIX}/jobs", json={**sources, "mode": "verify"})
    text = refused(r, 422, field)
    assert re.search(r"NUL|null byte", text), text  # the parser's own words name it
    assert api.count(jobs.Job) == 1  # the fixture's job only


def test_a_nul_byte_in_a_free_text_option_is_refused(api):
    r = api.client.post(f"{PREFIX}/jobs", json={"task": TASK, "options": {"model": "gpt\u0000"}})
    refused(r, 422, "model", "NUL")


# -- oversized fields ---------------------------------------------------------------------------


def test_a_5mb_chat_message_gets_a_small_refusal_and_nothing_is_stored(api):
    before = (api.count(jobs.JobMessage), api.count(jobs.JobEvent))
    r = api.client.post(f"{PREFIX}/jobs/{api.job_id}/messages", json={"text": "x" * 5_000_000})
    refused(r, (413, 422), "text")
    assert "x" * 1000 not in r.text
    assert (api.count(jobs.JobMessage), api.count(jobs.JobEvent)) == before


def test_validation_errors_never_echo_a_large_input(api):
    r = api.client.get(f"{PREFIX}/jobs", params={"limit": "9" * 20_000})
    refused(r, 422, "limit")
    r = api.client.post(f"{PREFIX}/jobs/{api.job_id}/messages", json={"txt": "y" * 200_000})
    refused(r, 422, "text")
    assert "y" * 1000 not in r.text


def test_an_oversized_option_is_refused_without_echoing_it(api):
    r = api.client.post(f"{PREFIX}/jobs", json={"task": TASK, "options": {"gpu": "h" * 100_000}})
    refused(r, 422, "gpu")


# -- job options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"backend": "gpt5"}, ("backend", "playbook", "openai", "anthropic", "replay")),
        ({"compile_modes": "fast"}, ("compile_modes", "max-autotune", "none")),
        ({"compile_modes": "default,turbo"}, ("compile_modes", "turbo", "reduce-overhead")),
        ({"precision": "loose"}, ("precision", "strict", "relaxed")),
        ({"device": "tpu"}, ("device", "cuda", "cpu")),
        ({"device": "cuda", "gpu": "cpu"}, ("gpu", "cpu")),
        ({"device": "cpu", "gpu": "h100-sxm"}, ("gpu", "h100-sxm", "cpu")),
        ({"device": "cpu", "gpu": "sm_90"}, ("gpu", "sm_90")),
        ({"gpu": "!!!"}, ("gpu",)),
    ],
)
def test_an_invalid_job_option_is_a_422_naming_the_field_and_what_is_allowed(api, options, words):
    r = api.client.post(f"{PREFIX}/jobs", json={"task": TASK, "options": options})
    refused(r, 422, *words)
    assert api.count(jobs.Job) == 1


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"backend": "auto"},
        {"backend": "replay", "compile_modes": "none"},
        {"compile_modes": "default, max-autotune-no-cudagraphs"},
        {"device": "cuda", "gpu": "h100-sxm"},
        {"device": "cuda", "gpu": "sm_90"},
        {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"},
        {"device": "cuda", "gpu": "any"},
        {"device": "cpu", "gpu": "cpu"},
        {"device": "cpu", "compile_modes": "auto"},
    ],
)
def test_valid_job_options_are_accepted(options):
    assert JobOptions.model_validate(options).model_dump(mode="json")


# -- /docs offline ------------------------------------------------------------------------------


def test_the_docs_page_loads_its_assets_from_this_server(api):
    page = api.client.get("/docs")
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    scripts = [a for a in assets if a.endswith(".js")]
    styles = [a for a in assets if a.endswith(".css")]
    assert scripts and styles, assets
    for url in assets:
        assert url.startswith("/"), f"/docs loads {url} from elsewhere"
        r = api.client.get(url)
        assert r.status_code == 200 and len(r.content) > 0, url
    assert "SwaggerUIBundle" in api.client.get(scripts[0]).text
    assert "/openapi.json" in page.text


def test_the_docs_pages_reference_no_external_url(api):
    for path in ("/docs", "/redoc"):
        page = api.client.get(path)
        assert page.status_code == 200
        assert not re.findall(r"https?://", page.text), f"{path} references an external URL"


# -- jobs no worker online could run ------------------------------------------------------------


def submit(api: Api, **options):
    return api.client.post(f"{PREFIX}/jobs", json={"task": TASK, "options": options})


def test_a_gpu_job_with_only_cpu_workers_online_is_a_409_and_nothing_is_stored(api, online):
    publish(online, cpu_worker())
    events = api.count(jobs.JobEvent)
    refused(submit(api), 409, "no worker online", "a GPU", "cpu (1 worker)")  # device cuda by default
    refused(submit(api, device="cuda", gpu="sm_90"), 409, "sm_90")
    assert (api.count(jobs.Job), api.count(jobs.JobEvent)) == (1, events)
    assert submit(api, device="cpu").status_code == 201


def test_a_job_for_a_gpu_model_no_worker_serves_is_a_409_naming_what_is_online(api, online):
    publish(online, h100_worker())
    refused(submit(api, gpu="a100-sxm"), 409, "a100-sxm", "gpu.h100-sxm")
    refused(submit(api, device="cpu"), 409, "the CPU")
    assert api.count(jobs.Job) == 1
    assert submit(api, gpu="h100-sxm").status_code == 201
    assert submit(api, gpu="NVIDIA H100 PCIe").status_code == 201  # another sm_90 model: its arch queue
    assert submit(api).status_code == 201


def test_a_job_is_accepted_when_the_inventory_cannot_tell(tmp_path, online):
    """No worker online (none started yet, or orchestrators running GPU work themselves), or no
    broker to ask: the inventory cannot tell, so the job is queued."""
    assert submit(Api(tmp_path / "empty"), device="cuda", gpu="h100-sxm").status_code == 201
    s = Settings(data_dir=tmp_path / "nobroker", broker_url="redis://127.0.0.1:1/0")
    with transaction(get_engine(s)) as session:
        token = jobs.create_token(session, "ann", ["submit"])[1]
    client = TestClient(create_app(s), headers={"authorization": f"Bearer {token}"})
    r = client.post(f"{PREFIX}/jobs", json={"task": TASK, "options": {"device": "cuda"}})
    assert r.status_code == 201, r.text


# -- chat a job cannot take ---------------------------------------------------------------------


def store_job(api: Api, mode: str, status: str) -> str:
    with transaction(api.engine) as session:
        owner = session.get(jobs.Job, api.job_id)
        job = jobs.Job(
            id=jobs.new_job_id(),
            owner_id=owner.owner_id,
            token_id=owner.token_id,
            status=status,
            mode=mode,
            task_source=TASK,
            options={},
            created_at=jobs.now(),
        )
        session.add(job)
        return job.id


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [
        ("verify", "queued", ("verify",)),
        ("verify", "running", ("verify",)),
        ("verify", "succeeded", ("verify",)),
        ("optimize", "cancelled", ("cancelled",)),
    ],
)
def test_chat_to_a_job_that_cannot_take_it_is_a_409_and_nothing_is_stored(api, mode, status, words):
    job_id = store_job(api, mode, status)
    before = (api.count(jobs.JobMessage), api.count(jobs.JobEvent))
    r = api.client.post(f"{PREFIX}/jobs/{job_id}/messages", json={"text": "keep it in fp32"})
    refused(r, 409, job_id, *words)
    assert (api.count(jobs.JobMessage), api.count(jobs.JobEvent)) == before
    assert api.client.get(f"{PREFIX}/jobs/{job_id}").json()["status"] == status


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_chat_to_an_ended_optimize_job_queues_it_again(api, status):
    job_id = store_job(api, "optimize", status)
    r = api.client.post(f"{PREFIX}/jobs/{job_id}/messages", json={"text": "try a persistent kernel"})
    assert r.status_code == 202 and r.json()["status"] == "queued", r.text
    assert api.count(jobs.JobMessage) == 1


# -- query parameters ---------------------------------------------------------------------------


def test_an_unknown_job_status_filter_is_a_422_naming_the_statuses(api):
    refused(api.client.get(f"{PREFIX}/jobs", params={"status": "done"}), 422, "status", "succeeded")
    r = api.client.get(f"{PREFIX}/jobs", params={"status": "running"})
    assert r.status_code == 200 and [j["id"] for j in r.json()["items"]] == [api.job_id]


def test_a_body_that_is_not_multipart_is_a_422_naming_it(api):
    """Starlette answers such a body with a 400 the OpenAPI document did not list."""
    headers = {"content-type": "multipart/form-data; boundary=b0undary"}
    r = api.client.post(f"{PREFIX}/jobs", content=b"--b0undary\r\n-5.7e16--b0undary--\r\n", headers=headers)
    refused(r, 422, "multipart")
    assert api.count(jobs.Job) == 1


def test_timestamps_are_written_with_their_utc_offset(api):
    """SQLite returns naive datetimes; an RFC 3339 date-time needs its offset."""
    job = api.client.get(f"{PREFIX}/jobs/{api.job_id}").json()
    assert job["created_at"].endswith(("+00:00", "Z")), job["created_at"]
