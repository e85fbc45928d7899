"""A deep UNet stage's GroupNorm(32, 1280) then SiLU at 8x8, bfloat16, batch 512: rows of 2560
columns, kept in registers (one pass), over channels of 64 positions (a row task for
bench/micro.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, groups: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-5, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


BATCH, GROUPS, CHANNELS, SIZE = 512, 32, 1280, 8  # 84 MB read, 84 MB written


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE, dtype=torch.bfloat16)]


def get_init_inputs():
    return [GROUPS, CHANNELS]


def get_test_inputs():
    return [
        [torch.randn(1, CHANNELS, 5, 11, dtype=torch.bfloat16) * 3 - 1],
        [torch.randn(3, CHANNELS, 7, 9, dtype=torch.bfloat16)],
    ]
