"""A job's events as Server-Sent Events, fanned out to every open stream by one poller per process.

A stream is an async generator: it holds no thread and no database connection while it waits, so
an API process keeps answering with hundreds of streams open. The events come from an
:class:`EventHub`, one per database engine and event loop, whose one poller task reads the new
events of every watched job in one query per tick -- with each job's status and event counter, so
a stream ends once its job has ended and every event up to the job's last is sent -- and hands
them to the streams' asyncio queues. The poller runs while a stream is open and stops with the last
one; a new stream wakes it, so its first events come at once.

Sequence numbers of one job become visible in their order (:func:`kernelcrew.service.jobs.add_event`
holds the job's row until its transaction ends), so "every event after the last one sent" is a
complete cursor. A stream starts after ``start`` (the ``Last-Event-ID`` or ``after`` it was
opened with) and sends a keep-alive comment after ``KEEPALIVE_S`` without an event, which tells
a proxy that the connection is alive and the server that the client is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import JSON, Integer, String, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from kernelcrew.service import jobs

log = logging.getLogger(__name__)

#: Seconds between two reads of the watched jobs' new events.
POLL_S = 0.5
#: Seconds without an event after which a stream sends a keep-alive comment.
KEEPALIVE_S = 15.0
#: The least seconds between two reads: a new stream wakes the poller (its first events come at
#: once, not a tick later), and a burst of new streams shares one read.
MIN_GAP_S = 0.05
#: The most events of one job read per tick (a stream that starts far behind catches up in steps).
PER_JOB = 200

Event = tuple[int, str, dict[str, Any]]


@dataclass(eq=False)
class Watch:
    """One open stream: the job it follows, the last sequence number handed to it, its queue."""

    job_id: str
    after: int
    queue: asyncio.Queue[list[Event] | BaseException | None] = field(default_factory=asyncio.Queue)
    """Batches of events in order; ``None`` when the job has ended, an exception if the hub died."""


@dataclass
class JobState:
    """What one tick read of a job: its status, its last event's number, its new events."""

    status: str
    last_seq: int
    events: list[Event] = field(default_factory=list)


#: The watched jobs come as one parameter (an array pair on PostgreSQL, a JSON object on SQLite),
#: so the statement's text never changes: a tick with 500 streams costs one small query, not one
#: compiled afresh with a thousand parameters.
_READ_SQL = {
    "postgresql": """
        SELECT jobs.id, jobs.status, jobs.event_seq, e.seq, e.type, e.data
        FROM unnest(CAST(:ids AS varchar[]), CAST(:afters AS bigint[])) AS w(job_id, after)
        JOIN jobs ON jobs.id = w.job_id
        LEFT OUTER JOIN job_events AS e
          ON e.job_id = w.job_id AND e.seq > w.after AND e.seq <= w.after + :per_job
        ORDER BY jobs.id, e.seq
    """,
    "sqlite": """
        SELECT jobs.id, jobs.status, jobs.event_seq, e.seq, e.type, e.data
        FROM json_each(:watch) AS w
        JOIN jobs ON jobs.id = w.key
        LEFT OUTER JOIN job_events AS e
          ON e.job_id = w.key AND e.seq > w.value AND e.seq <= w.value + :per_job
        ORDER BY jobs.id, e.seq
    """,
}
_COLUMNS = {
    "id": String,
    "status": String,
    "event_seq": Integer,
    "seq": Integer,
    "type": String,
    "data": JSON,
}


def read_new_events(engine: Engine, cursors: dict[str, int], per_job: int = PER_JOB) -> dict[str, JobState]:
    """Each job's status, event counter and up to ``per_job`` events after its cursor, in one query.

    Jobs that no longer exist are absent from the answer.
    """
    dialect = engine.dialect.name
    if dialect not in _READ_SQL:
        raise NotImplementedError(f"event streams support PostgreSQL and SQLite, not {dialect}")
    query = text(_READ_SQL[dialect]).columns(**{k: t() for k, t in _COLUMNS.items()})
    if dialect == "postgresql":
        params: dict[str, Any] = {"ids": list(cursors), "afters": list(cursors.values())}
    else:
        params = {"watch": json.dumps(cursors)}
    found: dict[str, JobState] = {}
    with engine.connect() as conn:
        for job_id, status, last_seq, seq, kind, data in conn.execute(query, {**params, "per_job": per_job}):
            state = found.setdefault(job_id, JobState(status, last_seq))
            if seq is not None:
                state.events.append((seq, kind, data))
    return found


class EventHub:
    """The streams of one process (per engine and event loop) and the one poller task feeding them."""

    def __init__(self, engine: Engine, poll_s: float = POLL_S) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.watches: dict[str, set[Watch]] = {}
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.ticks = 0
        """Reads done so far (one query each)."""

    def subscribe(self, job_id: str, after: int) -> Watch:
        """Follow ``job_id`` from the event after ``after``; the poller starts if it was idle."""
        watch = Watch(job_id, after)
        self.watches.setdefault(job_id, set()).add(watch)
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name="kernelcrew-event-hub")
        return watch

    def unsubscribe(self, watch: Watch) -> None:
        group = self.watches.get(watch.job_id)
        if group is not None:
            group.discard(watch)
            if not group:
                del self.watches[watch.job_id]

    @property
    def open_streams(self) -> int:
        return sum(len(group) for group in self.watches.values())

    async def _run(self) -> None:
        try:
            while self.watches:
                self.wake.clear()
                await self.tick()
                await asyncio.sleep(min(MIN_GAP_S, self.poll_s))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), max(0.0, self.poll_s - MIN_GAP_S))
        except BaseException as exc:  # cancelled or a bug: no stream may wait forever on a dead hub
            for group in self.watches.values():
                for watch in group:
                    watch.queue.put_nowait(exc)
            raise
        finally:
            self.task = None

    async def tick(self) -> None:
        """Read the new events of every watched job once and hand them to the streams."""
        # Only the streams open now get this read's answer: one that opens during the read may
        # start before these cursors, and gets its events on the next tick.
        targets = {job_id: list(group) for job_id, group in self.watches.items()}
        cursors = {job_id: min(w.after for w in group) for job_id, group in targets.items()}
        try:
            found = await asyncio.to_thread(read_new_events, self.engine, cursors)
        except SQLAlchemyError as exc:  # the database is away: streams wait (keep-alives go on)
            log.warning("reading job events failed; retrying in %.1f s: %s", self.poll_s, exc)
            return
        self.ticks += 1
        for job_id, group in targets.items():
            state = found.get(job_id)
            for watch in group:
                if state is None:  # the job was deleted
                    watch.queue.put_nowait(None)
                    continue
                batch = [e for e in state.events if e[0] > watch.after]
                if batch:
                    watch.after = batch[-1][0]
                    watch.queue.put_nowait(batch)
                if state.status in jobs.ENDED and watch.after >= state.last_seq:
                    watch.queue.put_nowait(None)


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Engine, EventHub]] = (
    weakref.WeakKeyDictionary()
)


def hub_for(engine: Engine) -> EventHub:
    """This event loop's hub of ``engine`` (created on first use)."""
    per_loop = _hubs.setdefault(asyncio.get_running_loop(), {})
    hub = per_loop.get(engine)
    if hub is None:
        hub = per_loop[engine] = EventHub(engine)
    return hub


def format_events(batch: list[Event]) -> str:
    return "".join(f"id: {seq}\nevent: {kind}\ndata: {json.dumps(data)}\n\n" for seq, kind, data in batch)


async def job_event_stream(
    engine: Engine, job_id: str, start: int, *, keepalive_s: float = KEEPALIVE_S
) -> AsyncIterator[str]:
    """The job's events after ``start`` as Server-Sent Events; ends once the job has ended and its
    last event is sent."""
    hub = hub_for(engine)
    watch = hub.subscribe(job_id, start)
    try:
        while True:
            try:
                item = await asyncio.wait_for(watch.queue.get(), keepalive_s)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise RuntimeError("the job event hub stopped") from item
            yield format_events(item)
    finally:
        hub.unsubscribe(watch)


__all__ = ["KEEPALIVE_S", "POLL_S", "EventHub", "hub_for", "job_event_stream", "read_new_events"]
