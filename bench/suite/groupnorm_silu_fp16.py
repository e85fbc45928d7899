"""Stable Diffusion VAE decoder block: GroupNorm(32, 512) then SiLU at 128x128, float16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, groups: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6, dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


BATCH, GROUPS, CHANNELS, SIZE = 8, 32, 512, 128  # 134 MB read, 134 MB written


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE, dtype=torch.float16)]


def get_init_inputs():
    return [GROUPS, CHANNELS]


def get_test_inputs():
    return [
        [torch.randn(1, CHANNELS, 7, 9, dtype=torch.float16) * 4 + 2],
        [torch.randn(2, CHANNELS, 33, dtype=torch.float16)],
    ]
