"""Shared fixtures: an isolated cache and data directory for every test session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernelcrew.config import get_settings

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]


def interpreted_json(args: list[str], timeout: float = 600) -> Any:
    """``python ARGS`` from the repository root in a fresh interpreter under Triton's interpreter
    (``TRITON_INTERPRET`` must be set before Triton is imported, and the interpreter patches
    ``triton.language`` of the kernel's module, which another test may have imported anew): the last
    line it printed, as JSON. A nonzero exit fails the test with the end of its stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(autouse=True, scope="session")
def _isolated_dirs(tmp_path_factory):
    """Build caches and data under a temporary directory, never the user's home."""
    root = tmp_path_factory.mktemp("kernelcrew")
    root.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KERNELCREW_CACHE_DIR", str(root / "cache"))
        mp.setenv("KERNELCREW_DATA_DIR", str(root / "data"))
        get_settings.cache_clear()
        yield root
    get_settings.cache_clear()


def fixture_meta(path: Path) -> tuple[str, str]:
    """The ``TASK:`` and ``EXPECT:`` lines of a fixture candidate's docstring."""
    text = path.read_text()
    task = re.search(r"^TASK: (\w+)$", text, re.M)
    expect = re.search(r"^EXPECT: (\w+)$", text, re.M)
    assert task and expect, f"{path.name} lacks TASK/EXPECT lines"
    return task.group(1), expect.group(1)


def local_analysis(source: str, path: str = "task.py"):
    """The analysis computed in this process (trusted test sources only: no sandbox, fast)."""
    from kernelcrew.agents.playbook.analysis import TaskAnalysis, analyze_child

    value = analyze_child({"task_source": source, "task_path": path, "seed": 0}, Path("."))
    return TaskAnalysis(value, task_source=source, task_path=path)
