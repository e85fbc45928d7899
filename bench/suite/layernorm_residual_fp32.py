"""Post-attention residual add and LayerNorm of a GPT-style block (hidden 4096), float32."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x + residual)


TOKENS, HIDDEN = 8192, 4096  # 268 MB read, 134 MB written


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN), torch.randn(TOKENS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    return [
        [torch.randn(3, HIDDEN) * 10 + 4, torch.randn(3, HIDDEN)],
        [torch.randn(2, 37, HIDDEN), torch.randn(2, 37, HIDDEN)],
        [torch.randn(5, HIDDEN), torch.randn(HIDDEN)],  # a residual broadcast over the tokens
    ]
