"""SwiGLU activation of a LLaMA-7B MLP (intermediate 11008): silu(gate) * up, bfloat16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


TOKENS, INTERMEDIATE = 4096, 11008  # 180 MB read, 90 MB written


def get_inputs():
    return [
        torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16),
        torch.randn(TOKENS, INTERMEDIATE, dtype=torch.bfloat16),
    ]


def get_init_inputs():
    return []


def get_test_inputs():
    return [
        [torch.randn(3, 1001, dtype=torch.bfloat16) * 6, torch.randn(3, 1001, dtype=torch.bfloat16)],
        [torch.randn(2, 5, 37, dtype=torch.bfloat16), torch.randn(2, 5, 37, dtype=torch.bfloat16)],
    ]
