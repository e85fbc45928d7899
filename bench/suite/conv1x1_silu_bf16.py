"""Stable Diffusion UNet pointwise projection: 1x1 convolution (320 -> 320) with bias and SiLU on
8 latents at 64x64, bfloat16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, channels, 1, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(x))


BATCH, CHANNELS, SIZE = 8, 320, 64  # 6.7 GFLOP, 168 MB moved per call


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE, dtype=torch.bfloat16)]


def get_init_inputs():
    return [CHANNELS]


def get_test_inputs():
    return [
        [torch.randn(1, CHANNELS, 9, 23, dtype=torch.bfloat16)],
        [torch.randn(2, CHANNELS, 32, 32, dtype=torch.bfloat16)],
    ]
