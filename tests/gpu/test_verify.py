"""``kernelcrew verify --json`` on the GPU: the examples' Triton candidates pass, cheating ones fail."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import kernelcrew_json

pytestmark = pytest.mark.gpu

CASES = [
    # task, candidate, expected verdict
    ("examples/elementwise_chain.py", "examples/elementwise_chain_triton.py", "pass"),
    ("examples/softmax.py", "examples/softmax_triton.py", "pass"),
    ("tests/fixtures/tasks/softmax.py", "tests/fixtures/candidates/partial_write.py", "fail"),
    ("tests/fixtures/tasks/softmax.py", "tests/fixtures/candidates/cache_by_ptr.py", "fail"),
    ("tests/fixtures/tasks/softmax.py", "tests/fixtures/candidates/hardcoded_shape.py", "fail"),
    ("tests/fixtures/tasks/softmax.py", "tests/fixtures/candidates/zeros.py", "fail"),
]


@pytest.mark.parametrize(
    ("task", "candidate", "expected"), CASES, ids=[c[1].rsplit("/", 1)[1] for c in CASES]
)
def test_verdicts_on_the_gpu(task, candidate, expected):
    report = kernelcrew_json(
        "verify", task, candidate, "--device", "cuda", "--compile-modes", "none", "--quick"
    )
    assert report["verdict"] == expected, report.get("message")
    if expected == "pass":
        assert report["kind"] == "kernel" and report["candidate_ms"] > 0
    else:
        assert report["stage"] != "input", report.get("message")  # judged, not refused as a bad file


LARGE_TASK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * 2 - 1

def get_inputs():
    return [torch.randn(8192, 32768)]

def get_init_inputs():
    return []
"""

LARGE_HONEST = """
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, x):
        return torch.sigmoid(x) * 2 - 1
"""

# Right everywhere but one element in a billion-element-class output: only a full judgement sees it.
LARGE_ONE_WRONG = """
import torch
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.sigmoid(x) * 2 - 1
        out.view(-1)[123457] += 0.01
        return out
"""


def test_large_outputs_are_judged_on_the_gpu_with_the_cpu_s_verdicts(monkeypatch):
    """A 1 GB output's golden is stored in float32 and judged on the verification's GPU by the
    parent: the same verdicts as the CPU's judgement, the one wrong element found, in less time."""
    import torch

    from kernelcrew.tools import correctness
    from kernelcrew.tools.correctness import make_golden, verify

    golden = make_golden(LARGE_TASK, device="cuda", seed=11, task_path="large.py")
    try:
        gold = torch.load(golden.file("golden.pt"), weights_only=True, mmap=True)
        assert gold[0][0].dtype == torch.float32
        seen = {}
        for where in ("gpu", "cpu"):
            if where == "cpu":
                monkeypatch.setattr(correctness, "_parent_gpu", lambda device: False)
            honest = verify(LARGE_TASK, LARGE_HONEST, golden=golden, candidate_path="h.py")
            wrong = verify(LARGE_TASK, LARGE_ONE_WRONG, golden=golden, candidate_path="w.py")
            assert honest.passed, honest.message
            assert not wrong.passed and wrong.stage == "correctness", wrong.message
            assert wrong.failures[0]["first_bad_index"] == [123457 // 32768, 123457 % 32768]
            seen[where] = (honest.max_rel_error, honest.phase_s["judge"])
        assert seen["gpu"][0] == pytest.approx(seen["cpu"][0], rel=1e-6)
        assert seen["gpu"][1] < seen["cpu"][1], seen
    finally:
        golden.cleanup()
