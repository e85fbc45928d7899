"""Transformer attention output projection with bias, layer-scale and residual add, float32
(strict precision: no TF32)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.gamma = nn.Parameter(torch.full((hidden,), 0.1))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.gamma * self.proj(x)


TOKENS, HIDDEN = 4096, 2048  # 34 GFLOP per call


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    return [
        [torch.randn(33, HIDDEN), torch.randn(33, HIDDEN)],
        [torch.randn(2, 7, HIDDEN), torch.randn(2, 7, HIDDEN)],
    ]
