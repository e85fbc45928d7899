"""ResNet-50 stage-1 block body: 3x3 convolution (64 -> 64), BatchNorm in inference mode and ReLU,
32 images at 56x56, float16."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False, dtype=torch.float16)
        self.bn = nn.BatchNorm2d(channels, dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


BATCH, CHANNELS, SIZE = 32, 64, 56  # 7.4 GFLOP per call


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE, dtype=torch.float16)]


def get_init_inputs():
    return [CHANNELS]


def get_test_inputs():
    return [
        [torch.randn(1, CHANNELS, 13, 17, dtype=torch.float16)],
        [torch.randn(3, CHANNELS, 28, 28, dtype=torch.float16)],
    ]
