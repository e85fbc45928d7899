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
