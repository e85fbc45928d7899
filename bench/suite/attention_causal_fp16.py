"""Causal self-attention written out (scores, scale, causal mask, softmax, weighted sum) as in GPT-2
style code: 8 sequences, 16 heads, 1024 tokens, head dim 64, float16."""

import math

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


BATCH, HEADS, SEQ, HEAD_DIM = 8, 16, 1024, 64


def get_inputs():
    return [torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, dtype=torch.float16) for _ in range(3)]


def get_init_inputs():
    return []


def get_test_inputs():
    return [
        [torch.randn(1, 2, 77, HEAD_DIM, dtype=torch.float16) for _ in range(3)],
        [torch.randn(2, 3, 129, HEAD_DIM, dtype=torch.float16) for _ in range(3)],
    ]
