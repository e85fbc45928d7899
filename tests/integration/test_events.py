"""Job events: atomic sequence numbers under concurrent writers, the migration that adds their
counter, and the async event streams (one poller per process) over real HTTP on PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from alembic import command
from sqlalchemy import create_engine, event, select, text

from kernelcrew.api.app import PREFIX, create_app
from kernelcrew.config import Settings, resolve_database_url
from kernelcrew.knowledge_base.db import alembic_config, make_engine, transaction, upgrade
from kernelcrew.service import jobs
from kernelcrew.service.events import EventHub, job_event_stream
from tests.integration.test_service import TASK, free_port
from tests.integration.test_worker import wait_for
from tests.unit.test_knowledge_base import databases  # noqa: F401  (fixture)
from tests.unit.test_web import form_csrf

REDIS_URL = "redis://127.0.0.1:6379/13"


def new_job(engine: Any, user: str, status: str = "queued", mode: str = "optimize") -> str:
    with transaction(engine) as s:
        owner = s.scalar(select(jobs.User).where(jobs.User.name == user))
        if owner is None:
            owner = jobs.User(name=user)
            s.add(owner)
            s.flush()
        job = jobs.Job(
            id=jobs.new_job_id(),
            owner_id=owner.id,
            status=status,
            mode=mode,
            task_source=TASK,
            options={},
            created_at=jobs.now(),
        )
        s.add(job)
        s.flush()
        jobs.add_event(s, job.id, "status", {"status": status})
        return job.id


def seqs(engine: Any, job_id: str) -> list[int]:
    with transaction(engine) as s:
        return list(
            s.scalars(
                select(jobs.JobEvent.seq).where(jobs.JobEvent.job_id == job_id).order_by(jobs.JobEvent.seq)
            )
        )


def add_plan(engine: Any, job_id: str) -> None:
    with transaction(engine) as s:
        jobs.add_event(s, job_id, "plan", {"strategy": "fused_pointwise"})


def end_job(engine: Any, job_id: str, status: str = "succeeded") -> None:
    with transaction(engine) as s:
        s.get(jobs.Job, job_id).status = status
        jobs.add_event(s, job_id, "status", {"status": status})


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def engine(request, databases):  # noqa: F811
    eng = make_engine(resolve_database_url(Settings(database_url=databases(request.param))))
    upgrade(eng)
    yield eng
    eng.dispose()


# -- sequence numbers ---------------------------------------------------------------------------


def test_concurrent_writers_to_one_job_get_distinct_consecutive_numbers(engine):
    """Each writer in its own transaction, all at once: none fails, none is lost, no number twice."""
    job_id = new_job(engine, "seq")
    writers = 32
    barrier = threading.Barrier(writers)

    def write(i: int) -> int:
        barrier.wait()
        with transaction(engine) as s:
            return jobs.add_event(s, job_id, "message", {"text": f"m{i}"})

    with ThreadPoolExecutor(writers) as pool:
        got = list(pool.map(write, range(writers)))
    assert sorted(got) == list(range(2, writers + 2))
    assert seqs(engine, job_id) == list(range(1, writers + 2))
    with transaction(engine) as s:
        assert s.get(jobs.Job, job_id).event_seq == writers + 1


def test_a_rolled_back_event_gives_its_number_back(engine):
    job_id = new_job(engine, "seq")
    with pytest.raises(RuntimeError), transaction(engine) as s:
        jobs.add_event(s, job_id, "plan", {})
        raise RuntimeError("the step failed")
    with transaction(engine) as s:
        assert jobs.add_event(s, job_id, "plan", {}) == 2
    assert seqs(engine, job_id) == [1, 2]


def test_the_migration_keeps_child_rows_and_counts_existing_events(tmp_path):
    """A SQLite database at the previous revision, with a job that has events and messages: the new
    column is added in place (no table copy, whose drop would cascade), set to the last number."""
    url = f"sqlite:///{tmp_path}/old.db"
    eng = make_engine(url)
    upgrade(eng, "0002_service")
    with eng.begin() as conn:
        conn.execute(text("INSERT INTO users (id, name, created_at) VALUES (1, 'ann', '2026-01-01')"))
        for job_id in ("a", "b"):
            conn.execute(
                text(
                    "INSERT INTO jobs (id, owner_id, status, mode, task_source, options, cancel_requested,"
                    " attempts, created_at, updated_at) VALUES (:id, 1, 'succeeded', 'optimize', 'x', '{}',"
                    " 0, 1, '2026-01-01', '2026-01-01')"
                ),
                {"id": job_id},
            )
        for seq in (1, 2, 3):
            conn.execute(
                text(
                    "INSERT INTO job_events (job_id, seq, type, data, created_at)"
                    " VALUES ('a', :seq, 'status', '{}', '2026-01-01')"
                ),
                {"seq": seq},
            )
        conn.execute(
            text("INSERT INTO job_messages (job_id, text, created_at) VALUES ('a', 'hi', '2026-01-01')")
        )
    upgrade(eng)
    with eng.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM job_events")).scalar() == 3
        assert conn.execute(text("SELECT COUNT(*) FROM job_messages")).scalar() == 1
        counters = dict(conn.execute(text("SELECT id, event_seq FROM jobs")).all())
    assert counters == {"a": 3, "b": 0}
    with transaction(eng) as s:
        assert jobs.add_event(s, "a", "message", {"text": "again"}) == 4
        assert jobs.add_event(s, "b", "message", {"text": "first"}) == 1
    with eng.begin() as conn:  # and back: the column goes, the rows stay
        command.downgrade(alembic_config(conn), "0002_service")
    with eng.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM job_events")).scalar() == 5
        assert "event_seq" not in {c[1] for c in conn.execute(text("PRAGMA table_info(jobs)"))}
    eng.dispose()


# -- the hub, in one event loop -----------------------------------------------------------------


def test_one_poller_reads_every_watched_job_in_one_query_per_tick(engine):
    """50 streams on 5 jobs: one poller task, one SELECT per tick for all of them, every event to
    every stream once and in order, then the end of the job."""
    job_ids = [new_job(engine, "hub", "running") for _ in range(5)]
    selects: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "job_events" in statement:
            selects.append(statement)

    async def collect(watch) -> list[int]:
        got: list[int] = []
        while (item := await watch.queue.get()) is not None:
            got.extend(e[0] for e in item)
        return got

    async def scenario() -> tuple[list[list[int]], int]:
        hub = EventHub(engine, poll_s=0.05)
        watches = [hub.subscribe(job_ids[i % 5], 0) for i in range(50)]
        readers = [asyncio.create_task(collect(w)) for w in watches]
        await asyncio.sleep(0.3)
        for job_id in job_ids:
            await asyncio.to_thread(add_plan, engine, job_id)
        for job_id in job_ids:
            await asyncio.to_thread(end_job, engine, job_id)
        got = await asyncio.wait_for(asyncio.gather(*readers), 30)
        for w in watches:
            hub.unsubscribe(w)
        if hub.task is not None:
            await hub.task  # the poller stops with its last stream
        return got, hub.ticks

    event.listen(engine, "before_cursor_execute", count)
    try:
        got, ticks = asyncio.run(scenario())
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert ticks >= 3 and len(selects) == ticks
    assert got == [[1, 2, 3]] * 50


def test_a_stream_resumes_keeps_alive_and_ends_when_its_job_ends(engine):
    job_id = new_job(engine, "stream", "running")
    for n in range(4):
        with transaction(engine) as s:
            jobs.add_event(s, job_id, "plan", {"n": n})

    async def read(start: int, keepalive_s: float) -> list[str]:
        chunks = []
        async for chunk in job_event_stream(engine, job_id, start, keepalive_s=keepalive_s):
            chunks.append(chunk)
            if len(chunks) == 2:
                await asyncio.to_thread(end_job, engine, job_id)
        return chunks

    chunks = asyncio.run(asyncio.wait_for(read(3, 0.2), 30))
    text_ = "".join(chunks)
    assert [int(line[4:]) for line in text_.splitlines() if line.startswith("id: ")] == [4, 5, 6]
    assert ": keep-alive\n\n" in chunks  # 0.2 s without an event between the reads
    data = [json.loads(line[6:]) for line in text_.splitlines() if line.startswith("data: ")]
    assert data[-1] == {"status": "succeeded"}

    async def ended(start: int) -> list[str]:
        return [c async for c in job_event_stream(engine, job_id, start)]

    assert asyncio.run(asyncio.wait_for(ended(6), 10)) == []  # nothing after the last: ends at once
    assert asyncio.run(asyncio.wait_for(ended(2**31 - 1), 10)) == []
    replay = "".join(asyncio.run(asyncio.wait_for(ended(0), 10)))
    assert replay.count("event: ") == 6


def test_a_closed_stream_leaves_the_hub(engine):
    job_id = new_job(engine, "close", "running")

    async def scenario() -> tuple[int, int, bool]:
        stream = job_event_stream(engine, job_id, 0)
        first = await stream.__anext__()
        assert first.startswith("id: 1\n")
        from kernelcrew.service.events import hub_for

        hub = hub_for(engine)
        open_before = hub.open_streams
        await stream.aclose()  # what the server does when the client goes away
        await asyncio.sleep(hub.poll_s * 3)
        return open_before, hub.open_streams, hub.task is None

    assert asyncio.run(scenario()) == (1, 0, True)


def test_a_deleted_job_ends_its_stream(engine):
    job_id = new_job(engine, "gone", "running")

    async def scenario() -> str:
        stream = job_event_stream(engine, job_id, 0)
        first = await stream.__anext__()
        with transaction(engine) as s:
            s.delete(s.get(jobs.Job, job_id))
        rest = [c async for c in stream]
        return first + "".join(rest)

    assert asyncio.run(asyncio.wait_for(scenario(), 10)).count("event: ") == 1


# -- over HTTP: a real uvicorn server on PostgreSQL ---------------------------------------------


@dataclass
class Server:
    url: str
    engine: Any
    token: str
    other: str


@pytest.fixture(scope="module")
def server(databases, tmp_path_factory) -> Iterator[Server]:  # noqa: F811
    s = Settings(
        database_url=databases("postgresql"),
        data_dir=tmp_path_factory.mktemp("events"),
        broker_url=REDIS_URL,
        api_rate_per_minute=1_000_000,
    )
    app = create_app(s)
    engine = make_engine(resolve_database_url(s))
    with transaction(engine) as session:
        token = jobs.create_token(session, "ann", ["submit", "read"])[1]
        other = jobs.create_token(session, "bob", ["submit", "read"])[1]
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, 30, "uvicorn")
    try:
        yield Server(f"http://127.0.0.1:{port}", engine, token, other)
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        engine.dispose()


def auth(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def test_twenty_five_concurrent_chat_messages_to_one_job_are_all_stored_in_order(server):
    """The issue's case over HTTP: concurrent messages to one job gave 500s and lost messages."""
    job_id = new_job(server.engine, "ann")
    n = 25
    barrier = threading.Barrier(n)

    def post(i: int) -> int:
        with httpx.Client(base_url=server.url, headers=auth(server.token), timeout=60) as c:
            barrier.wait()
            return c.post(f"{PREFIX}/jobs/{job_id}/messages", json={"text": f"message {i}"}).status_code

    with ThreadPoolExecutor(n) as pool:
        codes = list(pool.map(post, range(n)))
    assert codes == [202] * n
    assert seqs(server.engine, job_id) == list(range(1, n + 2))
    with transaction(server.engine) as s:
        texts = s.scalars(select(jobs.JobMessage.text).where(jobs.JobMessage.job_id == job_id)).all()
        events = s.scalars(
            select(jobs.JobEvent).where(jobs.JobEvent.job_id == job_id, jobs.JobEvent.type == "message")
        ).all()
    assert sorted(texts) == sorted(f"message {i}" for i in range(n))
    assert sorted(e.data["text"] for e in events) == sorted(texts)


async def read_stream(client: httpx.AsyncClient, path: str, headers: dict[str, str]) -> list[tuple[int, str]]:
    events: list[tuple[int, str]] = []
    async with client.stream("GET", path, headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        current: dict[str, str] = {}
        async for line in resp.aiter_lines():
            if not line:
                if "id" in current:
                    events.append((int(current["id"]), current["event"]))
                current = {}
            elif not line.startswith(":"):
                key, _, value = line.partition(": ")
                current[key] = value
    return events


def test_many_open_streams_hold_no_thread_and_all_see_every_event(server):
    """More streams than the server's thread pool (40): the API still answers at once, every stream
    gets every event in order and ends with its job."""
    streams, job_count = 120, 4
    job_ids = [new_job(server.engine, "ann", "running") for _ in range(job_count)]

    async def scenario() -> tuple[list[list[tuple[int, str]]], list[float]]:
        limits = httpx.Limits(max_connections=streams + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            readers = [
                asyncio.create_task(
                    read_stream(client, f"{PREFIX}/jobs/{job_ids[i % job_count]}/events", auth(server.token))
                )
                for i in range(streams)
            ]
            await asyncio.sleep(2.0)  # all connected and waiting
            health: list[float] = []
            for _ in range(30):
                t = time.perf_counter()
                r = await client.get("/healthz")
                health.append(time.perf_counter() - t)
                assert r.status_code == 200
            r = await client.get(f"{PREFIX}/jobs", headers=auth(server.token))
            assert r.status_code == 200
            for n in range(3):
                for job_id in job_ids:
                    with transaction(server.engine) as s:
                        jobs.add_event(s, job_id, "plan", {"n": n})
                await asyncio.sleep(0.2)
            for job_id in job_ids:
                end_job(server.engine, job_id)
            return await asyncio.wait_for(asyncio.gather(*readers), 60), health

    results, health = asyncio.run(scenario())
    assert all(r == [(1, "status"), (2, "plan"), (3, "plan"), (4, "plan"), (5, "status")] for r in results)
    # a stalled server (a stream per thread) took seconds; generous for a loaded 2-core machine
    assert statistics.median(health) < 0.25, health


def test_a_stream_over_http_resumes_after_the_last_event_id_and_is_private(server):
    job_id = new_job(server.engine, "ann", "running")
    for n in range(3):
        with transaction(server.engine) as s:
            jobs.add_event(s, job_id, "plan", {"n": n})
    end_job(server.engine, job_id)

    async def scenario() -> tuple[list[tuple[int, str]], list[tuple[int, str]], list[tuple[int, str]], int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            path = f"{PREFIX}/jobs/{job_id}/events"
            full = await read_stream(client, path, auth(server.token))
            resumed = await read_stream(client, path, {**auth(server.token), "last-event-id": "3"})
            after = await read_stream(client, f"{path}?after=4", auth(server.token))
            other = (await client.get(path, headers=auth(server.other))).status_code
            return full, resumed, after, other

    full, resumed, after, other = asyncio.run(scenario())
    assert [e[0] for e in full] == [1, 2, 3, 4, 5]
    assert resumed == full[3:] and after == full[4:]
    assert other == 404


def test_the_web_page_stream_still_works(server):
    """The job page's stream (``/jobs/{id}/events``, cookie session) is the same async stream."""
    job_id = new_job(server.engine, "ann", "running")
    end_job(server.engine, job_id)
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as c:
        page = c.get("/signin")
        assert page.status_code == 200
        r = c.post("/signin", data={"csrf": form_csrf(page.text), "token": server.token})
        assert r.status_code == 303, r.text
        with c.stream("GET", f"/jobs/{job_id}/events") as resp:
            assert resp.status_code == 200
            body = "".join(resp.iter_text())
    assert body.count("event: status") == 2 and "id: 2\n" in body


def test_the_engine_helpers_do_not_leak_connections(server):
    """Every stream and request above returned its connection: nothing idles in a transaction."""
    probe = create_engine(str(server.engine.url))
    with probe.connect() as conn:
        stuck = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'idle in transaction'"
            )
        ).scalar()
    probe.dispose()
    assert stuck == 0


def test_streams_whose_clients_left_leave_the_hub(server):
    """A client that goes away mid-stream (a closed tab) takes its stream out of the poller's set."""
    from kernelcrew.service import events

    job_id = new_job(server.engine, "ann", "running")

    def open_streams() -> int:
        return sum(h.open_streams for per_loop in list(events._hubs.values()) for h in per_loop.values())

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            path = f"{PREFIX}/jobs/{job_id}/events"
            opened = []
            for _ in range(10):
                resp = await client.send(
                    client.build_request("GET", path, headers=auth(server.token)), stream=True
                )
                assert resp.status_code == 200
                opened.append(resp)
            await asyncio.sleep(1.0)
            during = open_streams()
            for resp in opened:
                await resp.aclose()
            return during

    assert asyncio.run(scenario()) == 10
    wait_for(lambda: open_streams() == 0, 20, "the streams to leave the hub")


def test_a_new_stream_wakes_the_poller(engine):
    """A stream's first events come at once, not a tick later (here a 30 s tick)."""
    first, second = new_job(engine, "wake", "running"), new_job(engine, "wake", "running")

    async def scenario() -> tuple[list[Any], list[Any], float]:
        hub = EventHub(engine, poll_s=30)
        a = hub.subscribe(first, 0)
        got_a = await asyncio.wait_for(a.queue.get(), 10)
        await asyncio.sleep(0.2)  # the poller now waits out its tick
        started = time.monotonic()
        b = hub.subscribe(second, 0)
        got_b = await asyncio.wait_for(b.queue.get(), 10)
        waited = time.monotonic() - started
        hub.unsubscribe(a)
        hub.unsubscribe(b)
        hub.task.cancel()
        return got_a, got_b, waited

    got_a, got_b, waited = asyncio.run(scenario())
    assert [e[0] for e in got_a] == [1] and [e[0] for e in got_b] == [1]
    assert waited < 10
