"""torch.compile candidate (kernelcrew playbook): the task's Model compiled by Inductor.

mode='default', dynamic=False. The reference is copied as _Reference; ModelNew inherits its
parameters and buffers, so the state dict is the reference's.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Reference(nn.Module):

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, channels, 1, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.proj(x))


class ModelNew(_Reference):
    """_Reference with its forward compiled once per input shape."""

    _reference_forward = _Reference.forward

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._compiled = torch.compile(self._reference_forward, mode='default', dynamic=False)

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)
