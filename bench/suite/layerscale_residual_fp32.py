"""ViT-H block output (hidden 1280): residual + gamma * (x + bias), a bias and layer-scale residual chain, float32."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.gamma = nn.Parameter(torch.full((hidden,), 1e-5))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.gamma * (x + self.bias)


IMAGES, TOKENS, HIDDEN = 64, 257, 1280  # 169 MB read, 84 MB written


def get_inputs():
    return [torch.randn(IMAGES, TOKENS, HIDDEN), torch.randn(IMAGES, TOKENS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    return [
        [torch.randn(3, 5, HIDDEN), torch.randn(3, 5, HIDDEN)],
        [torch.randn(1, 257, HIDDEN) * 100, torch.randn(1, 257, HIDDEN)],
    ]
