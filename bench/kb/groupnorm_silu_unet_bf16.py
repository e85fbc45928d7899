"""Stable Diffusion UNet resnet block: GroupNorm(32, 320) then SiLU at 64x64, bfloat16, batch 32.
The knowledge-base benchmark's second task: a relative of bench/suite/groupnorm_silu_fp16.py (the
VAE decoder's GroupNorm(32, 512) at 128x128 in float16) in another dtype and shape."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, groups: int, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels, eps=1e-5, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x))


BATCH, GROUPS, CHANNELS, SIZE = 32, 32, 320, 64  # 84 MB read, 84 MB written


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE, dtype=torch.bfloat16)]


def get_init_inputs():
    return [GROUPS, CHANNELS]


def get_test_inputs():
    return [
        [torch.randn(1, CHANNELS, 5, 11, dtype=torch.bfloat16) * 3 - 1],
        [torch.randn(3, CHANNELS, 17, 17, dtype=torch.bfloat16)],
    ]
