"""``kernelcrew verify --json`` on a CUDA C++ candidate (``load_inline``): built with nvcc, verified, memchecked."""

from __future__ import annotations

import shutil

import pytest

from tests.gpu.conftest import gpu_profiler, kernelcrew_json

pytestmark = pytest.mark.gpu


def test_a_cuda_cpp_candidate_builds_and_passes_under_memcheck():
    """A ``load_inline`` candidate builds with nvcc and passes, with compute-sanitizer where installed."""
    memcheck = ["--memcheck"] if shutil.which("compute-sanitizer") else []
    with gpu_profiler():
        report = kernelcrew_json(
            "verify",
            "examples/elementwise_chain.py",
            "examples/elementwise_chain_cuda.py",
            "--device",
            "cuda",
            "--compile-modes",
            "none",
            "--no-timing",
            *memcheck,
            timeout=600,
        )
    assert report["verdict"] == "pass", report.get("message")
    assert report["kind"] == "kernel"
