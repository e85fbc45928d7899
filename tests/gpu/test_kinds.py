"""profile_kind on a GPU: own Triton and CUDA kernels, ATen called from C++, cuBLAS beside Triton, torch.compile."""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kernelcrew.tools.kinds import HYBRID_SHARE, KERNEL_SHARE, own_names, profile_kind

pytestmark = pytest.mark.gpu

TRITON_SOURCE = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride + offs, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def touch_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def softmax(x):
    out = torch.empty_like(x)
    softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


class Honest(nn.Module):
    def forward(self, x):
        return softmax(x)


class TokenLaunch(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        scratch = torch.empty(1, device=x.device, dtype=x.dtype)
        touch_kernel[(1,)](x, scratch, 1, BLOCK=16)
        return torch.softmax(self.proj(x), dim=-1)


class SoftmaxThenMatmul(nn.Module):
    def forward(self, x, a, b):
        return softmax(x), a @ b
"""

CUDA_SOURCE = '''
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void kinds_scale_kernel(const float* __restrict__ x, float* __restrict__ y, float s, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}

torch::Tensor scale(torch::Tensor x, double s) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "contiguous fp32 CUDA");
    auto y = torch::empty_like(x);
    long long n = x.numel();
    if (n == 0) return y;
    unsigned int blocks = (unsigned int)((n + 255) / 256);
    kinds_scale_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), (float)s, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}

torch::Tensor matmul(torch::Tensor a, torch::Tensor b) {
    return at::matmul(a, b);
}
"""

CPP = "torch::Tensor scale(torch::Tensor x, double s);\\ntorch::Tensor matmul(torch::Tensor a, torch::Tensor b);"


def build(name):
    return load_inline(name, cpp_sources=CPP, cuda_sources=CUDA, functions=["scale", "matmul"], verbose=False)


class Scale(nn.Module):
    def __init__(self, ext):
        super().__init__()
        self.ext = ext

    def forward(self, x):
        return self.ext.scale(x, 0.5)


class AtenMatmul(nn.Module):
    def __init__(self, ext):
        super().__init__()
        self.ext = ext

    def forward(self, a, b):
        return self.ext.matmul(a, b)
'''


def _import(tmp_path: Path, source: str) -> ModuleType:
    """The source as a module from a file (Triton reads a kernel's source from its file)."""
    name = f"kinds_candidate_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kind(model: Any, source: str, inputs_list: list[list[torch.Tensor]], reps: int = 10) -> tuple[str, dict]:
    """Warm ``model`` up (compiles, autotuning, cuBLAS handles), then profile ``reps`` calls."""
    with torch.no_grad():
        for i in range(3):
            model(*inputs_list[i % len(inputs_list)])
    torch.cuda.synchronize()
    return profile_kind(
        lambda inputs: model(*inputs), inputs_list, device="cuda", own=own_names(source), reps=reps
    )


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda")


def test_an_own_triton_kernel_is_a_kernel(tmp_path):
    module = _import(tmp_path, TRITON_SOURCE)
    kind, evidence = _kind(module.Honest(), TRITON_SOURCE, [[_randn(4096, 1024)], [_randn(4096, 1024)]])
    assert kind == "kernel", evidence
    assert evidence["calls_profiled"] == 10 and evidence["complete"]
    top = evidence["top_kernels"][0]
    assert (top["name"], top["owner"], top["count"]) == ("softmax_kernel", "own", 10), evidence["top_kernels"]


def test_a_token_triton_launch_beside_torch_ops_is_library(tmp_path):
    module = _import(tmp_path, TRITON_SOURCE)
    model = module.TokenLaunch(1024).cuda()
    kind, evidence = _kind(model, TRITON_SOURCE, [[_randn(4096, 1024)], [_randn(4096, 1024)]])
    assert kind == "library", evidence
    owners = {k["name"]: k["owner"] for k in evidence["top_kernels"]}
    assert owners.get("touch_kernel") == "own", evidence["top_kernels"]
    assert evidence["shares"]["own"] < HYBRID_SHARE


def test_triton_beside_a_large_cublas_matmul_is_hybrid_or_library_by_share(tmp_path):
    module = _import(tmp_path, TRITON_SOURCE)
    inputs = [[_randn(8192, 4096), _randn(2048, 2048), _randn(2048, 2048)] for _ in range(2)]
    kind, evidence = _kind(module.SoftmaxThenMatmul(), TRITON_SOURCE, inputs)
    own_share = evidence["shares"]["own"]
    assert 0 < own_share < KERNEL_SHARE, evidence
    assert kind == ("hybrid" if own_share >= HYBRID_SHARE else "library"), evidence
    owners = {k["name"]: k["owner"] for k in evidence["top_kernels"]}
    assert owners.get("softmax_kernel") == "own", evidence["top_kernels"]
    assert evidence["shares"]["library"] > own_share


@pytest.fixture(scope="module")
def extension(tmp_path_factory):
    """One small ``load_inline`` build for both C++ tests, for this GPU's architecture only."""
    major, minor = torch.cuda.get_device_capability()
    module = _import(tmp_path_factory.mktemp("kinds_ext"), CUDA_SOURCE)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        ext = module.build(f"kc_kinds_{uuid.uuid4().hex[:8]}")
    return module, ext


def test_an_own_load_inline_cuda_kernel_is_a_kernel(extension):
    module, ext = extension
    kind, evidence = _kind(module.Scale(ext), CUDA_SOURCE, [[_randn(1 << 22)], [_randn(1 << 22)]])
    assert kind == "kernel", evidence
    top = evidence["top_kernels"][0]
    assert top["name"].split("(")[0].split()[-1] == "kinds_scale_kernel", evidence["top_kernels"]
    assert top["owner"] == "own"


def test_a_load_inline_extension_calling_at_matmul_is_library(extension):
    module, ext = extension
    inputs = [[_randn(1024, 1024), _randn(1024, 1024)] for _ in range(2)]
    kind, evidence = _kind(module.AtenMatmul(ext), CUDA_SOURCE, inputs)
    assert kind == "library", evidence
    assert evidence["shares"]["own"] == 0, evidence["top_kernels"]


def test_torch_compile_inside_the_candidate_is_compiler():
    def chain(x):
        return torch.nn.functional.gelu(x * 2.0 + 1.0) * torch.sigmoid(x)

    compiled = torch.compile(chain)
    kind, evidence = _kind(compiled, "import torch\nf = torch.compile(lambda x: x)\n", [[_randn(4096, 4096)]])
    assert kind == "compiler", evidence
    assert evidence["top_kernels"][0]["name"].startswith("triton_"), evidence["top_kernels"]
