"""Elementwise chain: y = gelu(x * scale + bias) * sigmoid(x), over a (4096, 4096) fp32 tensor.

Eager PyTorch runs this as five kernels (mul, add, gelu, sigmoid, mul), each reading and writing
the whole tensor; a fused kernel reads x once and writes y once.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, hidden: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(hidden) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x * self.scale + self.bias) * torch.sigmoid(x)


ROWS = 4096
HIDDEN = 4096
SCALE = 1.5


def get_inputs():
    return [torch.randn(ROWS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN, SCALE]


def get_test_inputs():
    # The bias fixes the last dimension; the number of rows (and the rank) may vary.
    return [
        [torch.randn(1, HIDDEN)],
        [torch.randn(257, HIDDEN)],
        [torch.randn(3, 5, HIDDEN)],
    ]
