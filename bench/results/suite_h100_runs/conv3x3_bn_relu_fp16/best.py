"""torch.compile candidate (kernelcrew playbook): the task's Model compiled by Inductor.

mode='default', dynamic=False. The reference is copied as _Reference; ModelNew inherits its
parameters and buffers, so the state dict is the reference's.
"""

import torch
import torch.nn as nn


class _Reference(nn.Module):

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False, dtype=torch.float16)
        self.bn = nn.BatchNorm2d(channels, dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class ModelNew(_Reference):
    """_Reference with its forward compiled once per input shape."""

    _reference_forward = _Reference.forward

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._compiled = torch.compile(self._reference_forward, mode='default', dynamic=False)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)
