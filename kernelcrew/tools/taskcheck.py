"""Import a task or candidate file in a sandbox child: what only running it shows, before a job is queued.

:func:`kernelcrew.task.check_source` reads a file without running it; an import that never ends, a
module that is not installed or a ``Model`` that is not a module shows only when the file runs,
which happens in a sandbox child only (:mod:`kernelcrew.tools.sandbox`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kernelcrew.task import TaskError, load_candidate, load_task
from kernelcrew.tools import sandbox


def import_child(payload: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Sandbox target of :func:`validate_in_sandbox`: import the file and check what it defines."""
    if payload["kind"] == "task":
        load_task(payload["source"], payload["path"])
    else:
        load_candidate(payload["source"], payload["path"])
    return {"kind": payload["kind"]}


def validate_in_sandbox(
    source: str, kind: str = "task", path: str = "task.py", *, timeout_s: float, settings: Any = None
) -> None:
    """Import a task or candidate in a sandbox child, within ``timeout_s``; raise :class:`TaskError`.

    What only running the file shows (an import that never ends, a module that is not installed,
    ``Model`` not a module) is then refused before a job is queued, not found by a worker later.
    """
    limits = sandbox.SandboxLimits.from_settings(settings, wall_s=timeout_s)
    payload = {"source": source, "kind": kind, "path": path}
    res = sandbox.run("kernelcrew.tools.taskcheck:import_child", payload, limits=limits, settings=settings)
    if res.status == "timeout":
        raise TaskError(f"importing the {kind} did not finish within {timeout_s:g} s", path=path)
    if not res.ok:
        raise TaskError(f"importing the {kind} failed ({res.status}): {res.message[:1000]}", path=path)


__all__ = ["import_child", "validate_in_sandbox"]
