"""Bidirectional attention with an additive bias (relative-position or padding mask), as in
T5/ViT-style encoders: 4 sequences, 16 heads, 2048 tokens, head dim 64, bfloat16."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scale + bias, dim=-1)
        return torch.matmul(weights, v)


BATCH, HEADS, SEQ, HEAD_DIM = 4, 16, 2048, 64


def get_inputs():
    qkv = [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
    return [*qkv, torch.randn(1, HEADS, SEQ, SEQ, dtype=torch.bfloat16)]


def get_init_inputs():
    return [HEAD_DIM]


def get_test_inputs():
    small = [torch.randn(2, 2, 100, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
    odd = [torch.randn(1, 3, 33, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
    return [
        [*small, torch.randn(1, 2, 100, 100, dtype=torch.bfloat16)],
        [*odd, torch.randn(1, 3, 33, 33, dtype=torch.bfloat16)],
    ]
