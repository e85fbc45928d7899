"""GPU tests: run on a machine with CUDA (``pytest tests/gpu``); skipped, with the reason, elsewhere.

They drive the public command line (``python -m kernelcrew ...``) where they can, as a user would, and
assert verdicts, never timings.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(skip)


def kernelcrew(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python -m kernelcrew ARGS`` from the repository root, output captured."""
    cmd = [sys.executable, "-m", "kernelcrew", *args]
    return subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def kernelcrew_json(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The JSON object a ``--json`` command printed (the failure shows its output otherwise)."""
    proc = kernelcrew(*args, "--json", timeout=timeout, env=env)
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"kernelcrew {' '.join(args)} printed no JSON (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


@contextlib.contextmanager
def gpu_profiler() -> Iterator[None]:
    """Held while ncu or compute-sanitizer runs: one such tool on the GPU's profiling interface at a
    time, across pytest-xdist workers (a second one fails to attach)."""
    with (Path(tempfile.gettempdir()) / "kernelcrew-gpu-profiler.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
