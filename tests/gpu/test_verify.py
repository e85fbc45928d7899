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


@pytest.mark.parametrize("dtype", ["float32", "int64", "bool", "complex64", "float16"])
def test_large_tensors_cross_to_and_from_the_gpu_through_the_stage_unchanged(dtype):
    """Inputs and outputs larger than the staging buffer cross in pieces: every byte arrives, in a
    tensor of its own, nested ones too; small and grad-requiring tensors take the plain copy."""
    import torch

    from kernelcrew.tools.harness import STAGING_BYTES, to_device

    dt = getattr(torch, dtype)
    count = 2 * STAGING_BYTES // torch.empty(0, dtype=dt).element_size() + 12345
    host = (
        torch.randint(0, 255, (count,), dtype=torch.uint8).to(dt)
        if dt != torch.complex64
        else (torch.randn(count, dtype=dt))
    )
    grad = torch.randn(10, requires_grad=True)
    on_gpu = to_device([{"x": host}, grad], "cuda")
    assert on_gpu[0]["x"].device.type == "cuda" and torch.equal(on_gpu[0]["x"].cpu(), host)
    assert on_gpu[1].requires_grad
    back = to_device(on_gpu, "cpu")[0]["x"]
    assert back.device.type == "cpu" and torch.equal(back, host)
    assert back.untyped_storage().data_ptr() != host.untyped_storage().data_ptr()
