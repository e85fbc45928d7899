"""``kernelcrew profile --json`` on the GPU: Nsight Compute runs, floors and speed of light are computed."""

from __future__ import annotations

import shutil

import pytest

from tests.gpu.conftest import gpu_profiler, kernelcrew_json

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report() -> dict:
    args = ["profile", "examples/softmax.py", "--candidate", "examples/softmax_triton.py", "--device", "cuda"]
    with gpu_profiler():
        return kernelcrew_json(*args, "--compile-modes", "none", "--quick", timeout=600)


def test_the_floor_and_the_fractions_of_speed_of_light(report):
    assert report["candidate_verdict"]["verdict"] == "pass"
    assert report["floor"]["floor_ms"] > 0 and report["floor"]["bound"]
    for who in ("eager", "candidate"):
        assert 0 < report["sol_fraction"][who] < 1.5, report["sol_fraction"]
    assert report["diagnosis"]["reference"]["bound"]


@pytest.mark.skipif(shutil.which("ncu") is None, reason="Nsight Compute (ncu) not installed")
def test_nsight_compute_reads_the_hot_kernels_of_both(report):
    for who in ("reference", "candidate"):
        result = report["ncu"][who]
        assert result["available"], result.get("reason")
        assert result["summary"]["kernels"], result
