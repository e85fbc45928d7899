"""GPT-style MLP up-projection with bias and tanh-GELU (hidden 4096 -> 16384), bfloat16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inner, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x), approximate="tanh")


TOKENS, HIDDEN, INNER = 4096, 4096, 16384  # 550 GFLOP per call


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)]


def get_init_inputs():
    return [HIDDEN, INNER]


def get_test_inputs():
    return [
        [torch.randn(37, HIDDEN, dtype=torch.bfloat16)],
        [torch.randn(2, 101, HIDDEN, dtype=torch.bfloat16)],
    ]
