"""``/readyz`` reports the workers the live inventory shows (real Redis) without depending on them:
with none online it stays ready, since jobs wait in their queue until a worker comes."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from kernelcrew.api.app import create_app
from kernelcrew.config import Settings
from kernelcrew.worker import store
from kernelcrew.worker.inventory import WorkerInfo, device_counts, publish, remove

INVENTORY_URL = "redis://127.0.0.1:6379/14"


def gpu_worker(hostname: str, model: str, arch: str) -> WorkerInfo:
    gpu = {"name": model.upper(), "model": model, "arch": arch}
    return WorkerInfo(hostname=hostname, host="h", pid=1, queues=[f"gpu.{model}"], device="cuda", gpu=gpu)


H100_A = gpu_worker("kc-gpu0@a", "h100-sxm", "sm_90")
H100_B = gpu_worker("kc-gpu1@a", "h100-sxm", "sm_90")
CPU = WorkerInfo(hostname="kc-cpu@b", host="b", pid=2, queues=["cpu"], device="cpu")


@pytest.fixture
def inventory():
    r = store.client(INVENTORY_URL)
    try:
        r.ping()
    except redis.RedisError as exc:
        pytest.fail(f"the unit tests need Redis at {INVENTORY_URL}: {exc}")
    for w in (H100_A, H100_B, CPU):
        remove(r, w.hostname)
    yield r
    for w in (H100_A, H100_B, CPU):
        remove(r, w.hostname)


def readiness(tmp_path, broker_url: str) -> tuple[int, dict]:
    client = TestClient(create_app(Settings(data_dir=tmp_path, broker_url=broker_url)))
    r = client.get("/readyz")
    return r.status_code, r.json()


def test_readiness_lists_the_workers_online_by_device(tmp_path, inventory):
    for w in (H100_A, CPU, H100_B):
        publish(inventory, w, ttl_s=60)
    code, body = readiness(tmp_path, INVENTORY_URL)
    assert code == 200 and body["ok"] is True
    assert body["workers"] == {
        "count": 3,
        "devices": {"h100-sxm (sm_90)": 2, "cpu": 1},
        "detail": "3 online: 2 x h100-sxm (sm_90), 1 x cpu",
    }


def test_readiness_stays_ready_with_no_worker_online(tmp_path, inventory):
    code, body = readiness(tmp_path, INVENTORY_URL)
    assert code == 200 and body["ok"] is True
    assert body["workers"]["count"] == 0 and body["workers"]["devices"] == {}
    assert "jobs wait in their queue until a worker comes" in body["workers"]["detail"]


def test_readiness_without_a_broker_is_not_ready_and_cannot_count_workers(tmp_path):
    code, body = readiness(tmp_path, "redis://127.0.0.1:1/0")
    assert code == 503 and body["ok"] is False and body["broker"].startswith("error")
    assert body["workers"]["count"] is None and "broker does not answer" in body["workers"]["detail"]


def test_device_counts_put_the_most_served_device_first():
    assert device_counts([CPU, H100_A, H100_B]) == {"h100-sxm (sm_90)": 2, "cpu": 1}
    assert list(device_counts([CPU, gpu_worker("kc-gpu0@c", "a100-sxm", "sm_80")])) == [
        "a100-sxm (sm_80)",
        "cpu",
    ]
    assert device_counts([]) == {}


def test_readiness_documents_the_workers_it_reports(tmp_path):
    client = TestClient(create_app(Settings(data_dir=tmp_path, broker_url="redis://127.0.0.1:1/0")))
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert "workers" in schemas["Readiness"]["properties"]
    assert {"count", "devices", "detail"} <= set(schemas["WorkersSeen"]["properties"])
