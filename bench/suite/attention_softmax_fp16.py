"""Attention probabilities of a non-flash attention layer: softmax(QK^T * d^-0.5 + causal mask) in float16."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim**-0.5

    def forward(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores * self.scale + mask, dim=-1)


BATCH, HEADS, SEQ, HEAD_DIM = 4, 16, 1024, 64  # 268 MB read, 268 MB written


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf"), dtype=torch.float16).triu(1)


def get_inputs():
    return [torch.randn(BATCH, HEADS, SEQ, SEQ, dtype=torch.float16) * 4, causal_mask(SEQ)]


def get_init_inputs():
    return [HEAD_DIM]


def get_test_inputs():
    padding = torch.zeros(2, 1, 1, 77, dtype=torch.float16)
    padding[1, ..., 60:] = float("-inf")  # a padded second sequence, broadcast over heads and queries
    return [
        [torch.randn(1, 3, 129, 129, dtype=torch.float16), causal_mask(129)],
        [torch.randn(2, 5, 77, 77, dtype=torch.float16), padding],
        # decoding: 3 queries over a 5000-key cache, with an ALiBi-like bias per key
        [torch.randn(1, 4, 3, 5000, dtype=torch.float16), -torch.rand(5000).to(torch.float16) * 8],
    ]
