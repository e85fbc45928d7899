"""Hostile files and out-of-bounds kernels through the real verifier on the GPU.

The CPU side of the sandbox is ``tests/unit/test_hostile.py``; here the same box holds with a CUDA
child: hostile files are judged (and leak nothing), a kernel that reads out of bounds fails (a far
read kills only its child; a read just past the tail is caught by compute-sanitizer), and an honest
candidate still passes afterwards.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from tests.gpu.conftest import gpu_profiler, kernelcrew_json

pytestmark = pytest.mark.gpu

SECRET = "kc-hostile-gpu-secret-d3adb33f"
#: Marks a hostile file prints only when its attack worked.
SUCCESS_MARKS = ("HOSTILE read:", "HOSTILE wrote", "HOSTILE connected", SECRET)

TASK = """import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x * 2


def get_inputs():
    return [torch.randn(1823)]


def get_init_inputs():
    return []
"""

KERNEL = """import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def double_kernel(x_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs{LOAD})
    tl.store(out_ptr + offs, x * 2, mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        double_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
        return out
"""
HONEST = KERNEL.replace("{LOAD}", ", mask=mask, other=0.0")
OOB_TAIL = KERNEL.replace("{LOAD}", "")  # 1823 elements, 2048 read: 225 past the end, no crash
OOB_FAR = KERNEL.replace("{LOAD}", " + (1 << 30)")  # 4 GiB past the start: an illegal address


def verify(tmp_path: Path, candidate: str, *extra: str) -> dict:
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "candidate.py").write_text(candidate)
    args = [str(tmp_path / "task.py"), str(tmp_path / "candidate.py"), "--device", "cuda", "--no-timing"]
    # the secret is in the verifier's initial environment, where /proc/PID/environ would show it
    return kernelcrew_json("verify", *args, *extra, env={"KC_HOSTILE_SECRET": SECRET})


@pytest.mark.parametrize(
    ("hostile", "expect"),
    [
        ("read_environment.py", "parent environ: refused"),
        ("read_outside.py", "PermissionError"),
        ("write_outside.py", "PermissionError"),
        ("open_socket.py", "Network is unreachable"),
    ],
)
def test_a_hostile_candidate_fails_and_leaks_nothing(tmp_path, hostile, expect):
    report = verify(tmp_path, (FIXTURES / "hostile" / hostile).read_text())
    text = f"{report['stage']} {report['message']}"
    assert report["verdict"] == "fail"
    assert not [m for m in SUCCESS_MARKS if m in text], text
    assert expect in text or report["stage"] == "static", text  # or refused before it ran


def test_a_read_far_out_of_bounds_fails_and_the_next_candidate_passes(tmp_path):
    far = verify(tmp_path, OOB_FAR)
    assert far["verdict"] == "fail", far
    honest = verify(tmp_path, HONEST)
    assert honest["verdict"] == "pass", honest.get("message")


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_an_unmasked_tail_read_is_caught_by_memcheck(tmp_path):
    with gpu_profiler():
        report = verify(tmp_path, OOB_TAIL, "--memcheck")
    assert report["verdict"] == "fail" and "memcheck" in f"{report['stage']} {report['message']}".lower()
