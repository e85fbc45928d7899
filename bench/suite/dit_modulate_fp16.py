"""Diffusion transformer (DiT-XL/2) adaLN modulation of 4096 latent tokens: x * (1 + scale) + shift, float16."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * (1 + scale) + shift


BATCH, TOKENS, HIDDEN = 16, 4096, 1152  # 151 MB read, 151 MB written


def get_inputs():
    return [
        torch.randn(BATCH, TOKENS, HIDDEN, dtype=torch.float16),
        torch.randn(BATCH, 1, HIDDEN, dtype=torch.float16),  # per-sample conditioning, broadcast over tokens
        torch.randn(BATCH, 1, HIDDEN, dtype=torch.float16) * 0.1,
    ]


def get_init_inputs():
    return []


def get_test_inputs():
    return [
        [
            torch.randn(3, 33, 40, dtype=torch.float16),
            torch.randn(3, 1, 40, dtype=torch.float16),
            torch.randn(3, 1, 40, dtype=torch.float16),
        ],
        [
            torch.randn(2, 257, 1152, dtype=torch.float16),
            torch.randn(2, 1, 1152, dtype=torch.float16),
            torch.randn(2, 1, 1152, dtype=torch.float16),
        ],
    ]
