"""Errors of remote execution: no worker for a queue, a time limit hit, a worker lost."""

from __future__ import annotations

from kernelcrew.tools.executor import ExecutorError


class WorkerError(ExecutorError):
    """A call to the workers failed for a reason that is not the task's or candidate's fault."""


class NoWorkerOnline(WorkerError):
    """No worker online serves the queue a request needs (or none started it in time)."""


class WorkerTimeout(WorkerError):
    """The task ran past its soft or hard time limit on the worker."""


class WorkerLost(WorkerError):
    """The worker running the task died, more times than the task may be delivered."""
