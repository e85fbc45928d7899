"""GPT-2 MLP activation after the first projection: gelu(x + bias, approximate='tanh') at hidden 4096, float16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x + self.bias, approximate="tanh")


TOKENS, HIDDEN = 16384, 4096  # 134 MB read, 134 MB written


def get_inputs():
    return [torch.randn(TOKENS, HIDDEN, dtype=torch.float16) * 3]


def get_init_inputs():
    return [HIDDEN]


def get_test_inputs():
    return [
        [torch.randn(3, HIDDEN, dtype=torch.float16) * 5],
        [torch.randn(2, 33, HIDDEN, dtype=torch.float16)],
    ]
