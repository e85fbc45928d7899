"""Per-output-channel quantization scales of a weight matrix: amax(|W|) over the input dim / 448,
float16 (LLaMA-3-8B MLP down-projection, 28672 x 4096 in the transposed layout). The knowledge-base
benchmark's second task: a relative of bench/suite/absmax_scales_bf16.py in another dtype and shape."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0


ROWS, COLS = 28672, 4096  # 235 MB read


def get_inputs():
    return [torch.randn(ROWS, COLS, dtype=torch.float16)]


def get_init_inputs():
    return []


def get_test_inputs():
    return [
        [torch.randn(7, 4096, dtype=torch.float16)],
        [torch.randn(3, 1001, dtype=torch.float16) * 100],
    ]
