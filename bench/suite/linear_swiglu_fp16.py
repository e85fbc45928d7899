"""LLaMA-style gated MLP input projections: silu(x @ W_gate) * (x @ W_up), hidden 4096 -> 11008, float16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False, dtype=torch.float16)
        self.up = nn.Linear(hidden, intermediate, bias=False, dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.gate(x)) * self.up(x)


TOKENS, HIDDEN, INTERMEDIATE = 4096, 4096, 11008  # 739 GFLOP per call


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.float16)]


def get_init_inputs():
    return [HIDDEN, INTERMEDIATE]


def get_test_inputs():
    return [
        [torch.randn(45, HIDDEN, dtype=torch.float16)],
        [torch.randn(3, 17, HIDDEN, dtype=torch.float16)],
    ]
