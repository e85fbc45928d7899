"""CUDA C++ candidate for examples/elementwise_chain.py: gelu(x * scale + bias) * sigmoid(x) in one kernel.

Built with torch.utils.cpp_extension.load_inline on first construction (the build is cached by
content hash). Each thread handles 4 consecutive floats through one 16-byte load and store when
the row length allows it, with a scalar path for the rest; fp32 throughout, like the reference.
CUDA only: on a machine without a GPU it fails to build, as it should.
"""

import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>

__device__ __forceinline__ float chain(float x, float b, float scale) {
    float z = x * scale + b;
    float gelu = 0.5f * z * (1.0f + erff(z * 0.70710678118654752f));
    return gelu / (1.0f + expf(-x));
}

__global__ void elementwise_chain_kernel(const float* __restrict__ x, const float* __restrict__ bias,
                                         float* __restrict__ out, long long n, long long cols,
                                         float scale, bool vec4) {
    long long i = (long long)(blockIdx.x * (long long)blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    if (vec4 && i + 3 < n) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        long long c = i % cols;
        float4 r;
        r.x = chain(v.x, bias[c], scale);
        r.y = chain(v.y, bias[c + 1], scale);
        r.z = chain(v.z, bias[c + 2], scale);
        r.w = chain(v.w, bias[c + 3], scale);
        *reinterpret_cast<float4*>(out + i) = r;
    } else {
        for (long long k = i; k < n && k < i + 4; ++k) out[k] = chain(x[k], bias[k % cols], scale);
    }
}

torch::Tensor elementwise_chain(torch::Tensor x, torch::Tensor bias, double scale) {
    TORCH_CHECK(x.is_cuda() && bias.is_cuda(), "inputs must be CUDA tensors");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && bias.scalar_type() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(x.size(-1) == bias.numel(), "last dimension must match the bias");
    auto xc = x.contiguous();
    auto out = torch::empty_like(xc);
    long long n = xc.numel(), cols = bias.numel();
    if (n == 0) return out;
    bool vec4 = (cols % 4 == 0);
    int threads = 256;
    long long blocks = (n + 4LL * threads - 1) / (4LL * threads);
    elementwise_chain_kernel<<<(unsigned)blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), bias.contiguous().data_ptr<float>(), out.data_ptr<float>(), n, cols,
        (float)scale, vec4);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}
"""

CPP_SOURCE = "torch::Tensor elementwise_chain(torch::Tensor x, torch::Tensor bias, double scale);"

_module = None


def _ext():
    global _module
    if _module is None:
        _module = load_inline(
            name="kc_elementwise_chain",
            cpp_sources=CPP_SOURCE,
            cuda_sources=CUDA_SOURCE.replace(
                "#include <cuda_runtime.h>", "#include <cuda_runtime.h>\n#include <ATen/cuda/CUDAContext.h>"
            ),
            functions=["elementwise_chain"],
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )
    return _module


class ModelNew(nn.Module):
    def __init__(self, hidden: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.zeros(hidden))
        _ext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ext().elementwise_chain(x, self.bias, self.scale)
