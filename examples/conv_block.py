"""Conv2d(64, 128, 3, padding=1) + BatchNorm2d(128) + ReLU on a (16, 64, 56, 56) fp32 tensor.

A ResNet-style block. Note that a module in training mode (the default) normalizes with the batch
statistics and updates the BatchNorm running statistics; in eval mode the BatchNorm folds into the
convolution's weights and bias.
"""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


BATCH = 16
IN_CHANNELS = 64
OUT_CHANNELS = 128
KERNEL_SIZE = 3
HEIGHT = 56
WIDTH = 56


def get_inputs():
    return [torch.randn(BATCH, IN_CHANNELS, HEIGHT, WIDTH)]


def get_init_inputs():
    return [IN_CHANNELS, OUT_CHANNELS, KERNEL_SIZE]


def get_test_inputs():
    # The weights fix the input channels; batch and spatial sizes may vary.
    return [
        [torch.randn(1, IN_CHANNELS, 17, 23)],
        [torch.randn(3, IN_CHANNELS, 9, 31)],
    ]
