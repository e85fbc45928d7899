"""GroupNorm's rows held by thread-block clusters (CUDA C++), against the waiting parts.

``groupnorm_silu_fp16``'s answer (``rowwise``'s waiting parts) reads each part again from L2 to
write it, and L2 is its limit (``suite_h100.md``). Triton 3.6 cannot compile cross-CTA reductions,
so this script writes the other way in CUDA C++ (``load_inline``): a cluster of CS CTAs per row
(``cudaLaunchKernelEx`` with a cluster dimension; 16 is a non-portable size), each CTA loads its
slice of the row into registers once (16-byte streaming loads), reduces its mean and squared
deviations, posts them in its shared memory, and after a cluster barrier merges the CS partials
through distributed shared memory (``map_shared_rank``) and writes its slice from registers. Each
element crosses L2 once each way. ``one row``: a cluster per row, all rows in one grid;
``persistent``: as many clusters as fit at once (``cudaOccupancyMaxActiveClusters``), each walking
rows and loading its next row's slice while it reduces and writes the current one.

The kernel is written for this task's case (fp16, contiguous NCHW, 8 positions of a channel per
vector, a row that splits evenly), beside the suite's answer and a device copy of the same bytes,
all checked against a float64 reference on fresh inputs (the copy is not) and timed by the crew's
protocol in one call. Writes ``cluster_rows.json`` and ``.md``.

    python bench/cluster_rows.py OUT_DIR
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from held_parts import against_answer_markdown, answer_row, time_row  # noqa: E402
from split_rows import rel_error, run_suite  # noqa: E402

TASK = ROOT / "bench/suite/groupnorm_silu_fp16.py"
#: (CTAs a cluster, threads a CTA, persistent)
VARIANTS = [(4, 1024, False), (8, 256, False), (8, 512, False), (8, 1024, False), (16, 256, False)]
VARIANTS += [(16, 512, False), (16, 1024, False), (8, 512, True), (16, 128, True), (16, 256, True)]
VARIANTS += [(16, 512, True), (16, 1024, True)]

CUDA = r"""
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <ATen/cuda/CUDAContext.h>
namespace cg = cooperative_groups;

template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* red) {
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  __syncthreads();  // red is reused by the next call
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x % 32 < THREADS / 32 ? red[threadIdx.x % 32] : 0.f;
  #pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

template <int THREADS, int VECS>
__device__ __forceinline__ void load_slice(uint4 (&v)[VECS], const __half* x) {
  const uint4* src = reinterpret_cast<const uint4*>(x);
  #pragma unroll
  for (int i = 0; i < VECS; i++) v[i] = __ldcs(src + i * THREADS + threadIdx.x);
}

// This CTA's (mean, squared deviations) of its slice.
template <int THREADS, int VECS>
__device__ __forceinline__ float2 slice_moments(const uint4 (&v)[VECS], float* red, float n) {
  float s = 0.f;
  #pragma unroll
  for (int i = 0; i < VECS; i++) {
    const __half2* h = reinterpret_cast<const __half2*>(&v[i]);
    #pragma unroll
    for (int j = 0; j < 4; j++) { float2 f = __half22float2(h[j]); s += f.x + f.y; }
  }
  const float mean = block_sum<THREADS>(s, red) / n;
  float m2 = 0.f;
  #pragma unroll
  for (int i = 0; i < VECS; i++) {
    const __half2* h = reinterpret_cast<const __half2*>(&v[i]);
    #pragma unroll
    for (int j = 0; j < 4; j++) {
      float2 f = __half22float2(h[j]);
      m2 += (f.x - mean) * (f.x - mean) + (f.y - mean) * (f.y - mean);
    }
  }
  return make_float2(mean, block_sum<THREADS>(m2, red));
}

// The row's (mean, rstd) from the cluster's partials (Chan's merge, equal counts), into *stats.
__device__ __forceinline__ void merge_cluster(cg::cluster_group& cluster, float2* part, float2* stats,
                                              float slice, float cols, float eps) {
  const int cs = cluster.num_blocks();
  if (threadIdx.x < 32) {
    const bool mine = threadIdx.x < cs;
    float2 p = mine ? *cluster.map_shared_rank(part, threadIdx.x) : make_float2(0.f, 0.f);
    float mean = p.x;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) mean += __shfl_xor_sync(0xffffffff, mean, o);
    mean /= cs;
    const float d = mine ? p.x - mean : 0.f;
    float q = p.y + slice * d * d;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffff, q, o);
    if (threadIdx.x == 0) *stats = make_float2(mean, rsqrtf(q / cols + eps));
  }
  __syncthreads();
}

// GroupNorm's affine and SiLU on the slice in v, stored streaming at y.
template <int THREADS, int VECS>
__device__ __forceinline__ void write_slice(const uint4 (&v)[VECS], __half* y, const __half* w, const __half* b,
                                            float2 stats, long long first, int hw, int channel0) {
  uint4* dst = reinterpret_cast<uint4*>(y);
  #pragma unroll
  for (int i = 0; i < VECS; i++) {
    const long long e = first + (long long)(i * THREADS + threadIdx.x) * 8;
    const int ch = channel0 + (int)(e / hw);
    const float sc = __half2float(w[ch]) * stats.y;
    const float sh = __half2float(b[ch]) - stats.x * sc;
    const __half2* h = reinterpret_cast<const __half2*>(&v[i]);
    uint4 o;
    __half2* oh = reinterpret_cast<__half2*>(&o);
    #pragma unroll
    for (int j = 0; j < 4; j++) {
      float2 f = __half22float2(h[j]);
      float a = f.x * sc + sh, c = f.y * sc + sh;
      oh[j] = __floats2half2_rn(__fdividef(a, 1.f + __expf(-a)), __fdividef(c, 1.f + __expf(-c)));
    }
    __stcs(dst + i * THREADS + threadIdx.x, o);
  }
}

// Cluster blockIdx.y walks rows blockIdx.y, + gridDim.y, ... (one row when the grid has them all).
template <int THREADS, int VECS, bool PERSISTENT>
__global__ void __launch_bounds__(THREADS) gn_cluster(const __half* __restrict__ x, const __half* __restrict__ w,
    const __half* __restrict__ b, __half* __restrict__ y, long long rows, long long cols, int hw, int cpg,
    int groups, float eps) {
  cg::cluster_group cluster = cg::this_cluster();
  const long long slice = cols / cluster.num_blocks();
  const long long first = cluster.block_rank() * slice;  // this CTA's first column of a row
  __shared__ float red[32];
  __shared__ float2 part[2];  // by row parity: a CTA may post the next row's while others read this one's
  __shared__ float2 stats;
  uint4 v[VECS], next[VECS];
  long long row = blockIdx.y;
  load_slice<THREADS, VECS>(v, x + row * cols + first);
  for (int k = 0; row < rows; row += gridDim.y, k ^= 1) {
    if (PERSISTENT && row + gridDim.y < rows) load_slice<THREADS, VECS>(next, x + (row + gridDim.y) * cols + first);
    const float2 m = slice_moments<THREADS, VECS>(v, red, (float)slice);
    if (threadIdx.x == 0) part[k] = m;
    cluster.sync();
    merge_cluster(cluster, &part[k], &stats, (float)slice, (float)cols, eps);
    write_slice<THREADS, VECS>(v, y + row * cols + first, w, b, stats, first, hw, (int)(row % groups) * cpg);
    if (!PERSISTENT) break;
    #pragma unroll
    for (int i = 0; i < VECS; i++) v[i] = next[i];
  }
  cluster.sync();  // no CTA leaves while another may still read its partials
}

template <int THREADS, int VECS, bool PERSISTENT>
void launch(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, torch::Tensor& y,
            long long rows, long long cols, int hw, int cpg, int groups, float eps, int cs) {
  auto kern = gn_cluster<THREADS, VECS, PERSISTENT>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cs;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(THREADS, 1, 1);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cfg.gridDim = dim3(cs, 1, 1);
  long long clusters = rows;
  if (PERSISTENT) {
    int active = 0;
    auto err = cudaOccupancyMaxActiveClusters(&active, kern, &cfg);
    TORCH_CHECK(err == cudaSuccess && active > 0, "no cluster of ", cs, " fits: ", cudaGetErrorString(err));
    clusters = std::min<long long>(active, rows);
  }
  cfg.gridDim = dim3(cs, clusters, 1);
  auto err = cudaLaunchKernelEx(&cfg, kern, (const __half*)x.data_ptr(), (const __half*)w.data_ptr(),
      (const __half*)b.data_ptr(), (__half*)y.data_ptr(), rows, cols, hw, cpg, groups, eps);
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}

torch::Tensor group_norm_silu(torch::Tensor x, torch::Tensor w, torch::Tensor b, int64_t groups, double eps,
                              int64_t cs, int64_t threads, bool persistent) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kHalf && x.is_contiguous(), "a contiguous fp16 CUDA input");
  auto y = torch::empty_like(x);
  const long long n = x.size(0), c = x.size(1), hw = x.numel() / (n * c);
  const long long cols = c / groups * hw, rows = n * groups;
  TORCH_CHECK(hw % 8 == 0 && cols % (cs * threads * 8) == 0, "a row that splits into whole vectors");
  const long long vecs = cols / (cs * threads * 8);
  const int cpg = c / groups;
#define INSTANCE(T, V)                                                                      \
  if (threads == T && vecs == V) {                                                          \
    if (persistent) launch<T, V, true>(x, w, b, y, rows, cols, hw, cpg, groups, eps, cs);   \
    else launch<T, V, false>(x, w, b, y, rows, cols, hw, cpg, groups, eps, cs);             \
    return y;                                                                               \
  }
  INSTANCE(128, 16) INSTANCE(256, 4) INSTANCE(256, 8) INSTANCE(256, 16) INSTANCE(512, 2) INSTANCE(512, 4)
  INSTANCE(512, 8) INSTANCE(1024, 2) INSTANCE(1024, 4) INSTANCE(1024, 8)
  TORCH_CHECK(false, "no instance of ", threads, " threads and ", vecs, " vectors a thread");
  return y;
}
"""
CPP = (
    "torch::Tensor group_norm_silu(torch::Tensor x, torch::Tensor w, torch::Tensor b, int64_t groups, "
    "double eps, int64_t cs, int64_t threads, bool persistent);"
)


def run_task(path: Path, sms: int) -> dict:
    ext = load_inline(
        "cluster_rows", CPP, cuda_sources=CUDA, functions=["group_norm_silu"], extra_cuda_cflags=["-O3"]
    )
    model, inputs, fresh, golden, _module, row, callables = answer_row(path, "cluster_rows_best")
    norm = model.norm
    copy_dst = torch.empty_like(inputs[0])
    callables["copy of the same bytes"] = lambda xs: copy_dst.copy_(xs[0])
    row["candidates"]["copy of the same bytes"] = {"rel_error": None}
    with torch.no_grad():
        for cs, threads, persistent in VARIANTS:
            name = f"cluster of {cs}, {threads} threads, {'persistent' if persistent else 'one row'}"

            def fn(xs, a=(cs, threads, persistent)):
                return ext.group_norm_silu(xs[0], norm.weight, norm.bias, norm.num_groups, norm.eps, *a)

            row["candidates"][name] = {
                "cluster": cs,
                "threads": threads,
                "persistent": persistent,
                "rel_error": rel_error(fn(fresh), golden),
            }
            callables[name] = fn
            print(name, row["candidates"][name], flush=True)
    return time_row(row, callables, inputs)


def markdown(result: dict) -> str:
    def closing(row: dict, answer: float) -> str:
        clusters = {k: c for k, c in row["candidates"].items() if k.startswith("cluster")}
        fastest = min(clusters, key=lambda k: clusters[k]["median_ms"])
        return (
            f"Fastest cluster kernel: {fastest}, {clusters[fastest]['median_ms']:.4f} ms, "
            f"{clusters[fastest]['median_ms'] / answer:.2f}x the waiting parts' time."
        )

    return against_answer_markdown(
        result,
        "GroupNorm's rows held by thread-block clusters (CUDA C++), against the waiting parts",
        "cluster_rows.py",
        "; the copy moves the same bytes.",
        {},
        closing,
    )


def main() -> None:
    run_suite(
        "cluster_rows", [TASK], run_task, markdown, commit=os.environ.get("KERNELCREW_COMMIT", "unknown")
    )


if __name__ == "__main__":
    main()
