"""LayerNorm over the last dimension (1024) of an (8192, 1024) fp32 tensor, with elementwise affine."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


ROWS = 8192
HIDDEN = 1024


def get_inputs():
    return [torch.randn(ROWS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    # The weights fix the last dimension; the number of rows (and the rank) may vary.
    return [
        [torch.randn(1, HIDDEN)],
        [torch.randn(1823, HIDDEN)],
        [torch.randn(3, 7, HIDDEN)],
    ]
