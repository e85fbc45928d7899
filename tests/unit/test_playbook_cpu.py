"""bench/playbook_cpu.py's shrink: KernelBench's constants made small enough for Triton's interpreter."""

from __future__ import annotations

import ast

from bench.playbook_cpu import check_shrunk, shrink, summarize

TASK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, num_groups):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=1)
        self.norm = nn.GroupNorm(num_groups, out_channels)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))

batch_size = 128
in_channels = 3
out_channels = 64
num_groups = 32
kernel_size = 3
pool_stride = 19
height = width = 250
hidden = 400
rows, cols = 4096, 4095
big = 16384 * 24
input_shape = (32768,)
scale = 2.5

def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]

def get_init_inputs():
    return [in_channels, out_channels, kernel_size, num_groups]
"""


def _constants(source: str) -> dict[str, object]:
    """Module-level names bound to literals, after running the assignments alone."""
    tree = ast.parse(source)
    scope: dict[str, object] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            exec(compile(ast.Module([stmt], []), "<t>", "exec"), scope)
    return {k: v for k, v in scope.items() if not k.startswith("__")}


def test_shrink_scales_sizes_and_keeps_geometry() -> None:
    out, changed = shrink(TASK, 16)
    c = _constants(out)
    # sizes shrink by 16 (never below 4), the very large ones by 256; an odd size stays odd
    assert c["batch_size"] == 8 and c["height"] == c["width"] == 15
    # 400 // 16 = 25 is rounded up to stay a multiple of 4, as 400 was
    assert c["hidden"] == 28
    assert c["rows"] == 256 and c["cols"] == 255 and c["big"] == 16384 * 24 // 256
    # each element of a shape: 32768 // 256 = 128, rounded up to stay a multiple of rows (4096 -> 256)
    assert c["input_shape"] == (256,)
    # window geometry (by name), small values and floats stay as they are
    assert c["kernel_size"] == 3 and c["pool_stride"] == 19 and c["in_channels"] == 3 and c["scale"] == 2.5
    # 64 // 16 = 4 channels would not split into 32 groups: rounded up to a multiple of the groups;
    # the batch (128, a multiple of the 32 groups too) is not
    assert c["num_groups"] == 32 and c["out_channels"] == 32
    assert changed["batch_size"] == [128, 8] and "kernel_size" not in changed
    assert "def forward" in out  # the rest of the file is untouched


def test_a_batch_size_divides_nothing() -> None:
    """240 channels are a multiple of a batch of 10 by chance: 240 // 16 = 15, a multiple of 4 -> 16."""
    out, _ = shrink("batch_size = 10\nchannels = 240\n", 16)
    assert _constants(out) == {"batch_size": 10, "channels": 16}


def test_shrunk_task_builds_and_runs() -> None:
    out, _ = shrink(TASK, 16)
    assert check_shrunk(out, "task.py") == ""


def test_check_names_a_task_that_no_longer_runs() -> None:
    broken = TASK.replace("return torch.relu(", "return x.view(7, -1) + (")
    assert "RuntimeError" in check_shrunk(shrink(broken, 16)[0], "task.py")


def test_summary_counts_tasks_and_groups_failures() -> None:
    def row(task: str, level: int, status: str, *cands: dict) -> dict:
        return {"task": task, "level": level, "stratum": "s", "status": status, "candidates": list(cands)}

    ok = {"strategy": "anchored_fusion", "generated": True, "verdict": "pass", "stage": ""}
    late = {
        "strategy": "anchored_fusion",
        "generated": True,
        "verdict": "fail",
        "stage": "timeout",
        "message": "t",
    }
    none = {"strategy": "fused_pointwise", "generated": False, "why": "ValueError: no"}
    rows = [
        row("a", 1, "verified", ok, none),
        row("b", 2, "generated", late),
        row("c", 2, "no own-kernel strategy"),
        row("d", 3, "shrink failed"),
    ]
    s = summarize(rows)
    assert s["all"] == {
        "tasks": 4,
        "shrink_failed": 1,
        "own_kernel_applicable": 2,
        "generated": 2,
        "verified": 1,
    }
    assert s["by_level"]["level2"]["verified"] == 0
    assert s["failures"]["anchored_fusion / timeout"] == {"count": 1, "tasks": ["b"], "example": "t"}
    assert s["failures"]["fused_pointwise / not generated"]["example"] == "ValueError: no"
    assert s["by_strategy"]["anchored_fusion"] == {"applicable": 2, "generated": 2, "verified": 1}
