"""Swish with a learned gate and a residual: y = x * sigmoid(x * gate) + 0.5 * residual.

Small enough (512 x 384, fp32) to optimize on a CPU with Triton's interpreter in about two
minutes; on a GPU use the larger examples. Eager PyTorch runs four kernels; one fused kernel
reads x and the residual once and writes y once.
"""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x * self.gate) + 0.5 * residual


ROWS = 512
HIDDEN = 384


def get_inputs():
    return [torch.randn(ROWS, HIDDEN), torch.randn(ROWS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    # The gate fixes the last dimension; rows and rank may vary.
    return [
        [torch.randn(1, HIDDEN), torch.randn(1, HIDDEN)],
        [torch.randn(37, HIDDEN), torch.randn(37, HIDDEN)],
        [torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)],
    ]
