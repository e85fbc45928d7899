"""The Celery app: Redis broker and result backend, JSON only, late acks, prefetch 1, time limits.

``app`` is what ``celery -A kernelcrew.worker.app:app worker`` (started by ``kernelcrew worker``)
runs; it reads :class:`~kernelcrew.config.Settings` from the environment when its configuration is
first used, never at import. :func:`make_app` builds one from explicit settings (the executor, tests).

Choices, for a queue of GPU jobs that each hold a GPU for seconds to minutes:

* ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged when it ends, so the
  task of a worker that dies goes back to the queue: at once when only its process died, after the
  visibility timeout when the whole worker did. Delivery attempts are counted in ``tasks.py``.
* ``worker_prefetch_multiplier=1`` with one process per GPU: a worker holds one task at a time and
  never sits on a task another GPU could run.
* Soft and hard time limits on every task; the Redis visibility timeout is the hard limit plus a
  margin, so a task still running is never handed to a second worker; a hard timeout acknowledges the
  task (it would time out again).
* The worker looks for lost tasks past the visibility timeout every ``worker_restore_interval_s``
  (kombu's default sweep is every 100 s).
* ``worker_cancel_long_running_tasks_on_connection_loss``: after losing the broker a worker cannot
  acknowledge what it runs, and the task is redelivered anyway; stopping it avoids running it twice.
"""

from __future__ import annotations

import logging
import math
import signal
from typing import Any

from celery import Celery, bootsteps
from celery.signals import worker_process_init, worker_process_shutdown

from kernelcrew.config import Settings, get_settings
from kernelcrew.worker import store, tasks
from kernelcrew.worker.inventory import Heartbeat, own_info
from kernelcrew.worker.supervisor import set_parent_death_signal

log = logging.getLogger(__name__)


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery configuration for ``settings``."""
    visibility = settings.visibility_timeout_s
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.broker_url,
        "broker_transport_options": {
            "visibility_timeout": visibility,
            "unacked_restore_interval": settings.worker_restore_interval_s,
            "unacked_restore_throttle": 1,
        },
        "result_backend_transport_options": {
            "visibility_timeout": visibility,
            # Redis's client reconnects to the result store for as long as a call waits out a broker
            # outage (Celery's default gives up after about 20 s and asks for a restart)
            "retry_policy": {
                "max_retries": max(20, math.ceil(settings.task_queue_timeout_s / 2)),
                "interval_start": 0,
                "interval_step": 1,
                "interval_max": 2,
            },
        },
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "task_soft_time_limit": settings.task_soft_time_limit_s,
        "task_time_limit": settings.task_time_limit_s,
        "result_expires": settings.result_expires_s,
        "worker_prefetch_multiplier": 1,
        "worker_max_tasks_per_child": settings.worker_max_tasks_per_child,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "enable_utc": True,
        "timezone": "UTC",
    }


class InventoryStep(bootsteps.StartStopStep):
    """Publishes this worker to the inventory once its queues are consumed, then every heartbeat,
    from the worker's own event loop (no thread in a process that forks); removes it on shutdown."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.heartbeat: Heartbeat | None = None
        self.tref: Any = None

    def start(self, c: Any) -> None:
        s = get_settings()
        queues = sorted(c.app.amqp.queues.consume_from or c.app.amqp.queues)
        self.heartbeat = Heartbeat(
            store.client(s.broker_url), own_info(c.hostname, queues, s), s.worker_heartbeat_s
        )
        self.heartbeat.beat()
        self.tref = c.timer.call_repeatedly(s.worker_heartbeat_s, self.heartbeat.beat)
        log.info("%s serves %s", c.hostname, ", ".join(queues))

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        if self.heartbeat is not None:
            self.heartbeat.stop(remove_record=True)
            self.heartbeat = None

    shutdown = stop


def _configure_from_environment(sender: Celery, **_: Any) -> None:
    sender.config_from_object(celery_config(get_settings()))


def make_app(settings: Settings | None = None) -> Celery:
    """A Celery app with the three tasks; configured from ``settings``, or from the environment when
    its configuration is first used."""
    celery = Celery("kernelcrew", set_as_current=False)
    if settings is not None:
        celery.config_from_object(celery_config(settings))
    else:
        celery.on_configure.connect(_configure_from_environment, weak=False)
    celery.steps["consumer"].add(InventoryStep)
    tasks.register(celery)
    return celery


@worker_process_init.connect
def _on_process_init(**_: Any) -> None:
    # A worker process whose parent died must not go on running (and timing) on its GPU.
    set_parent_death_signal(signal.SIGKILL)


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    tasks.close_executor()


app = make_app()
