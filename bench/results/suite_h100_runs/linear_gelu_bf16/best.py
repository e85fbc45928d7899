"""cuBLASLt epilogue (kernelcrew playbook): the linear layer's bias and activation applied inside
the GEMM (torch._addmm_activation) on CUDA tensors; the unfused ops elsewhere. Library candidate.
The reference is copied as _Reference; ModelNew inherits its parameters.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Reference(nn.Module):

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, inner, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x), approximate='tanh')


class ModelNew(_Reference):
    """_Reference with its linear layer and activation in one cuBLASLt call."""

    def forward(self, x):
        weight = self.get_parameter('fc.weight')
        bias = self.get_parameter('fc.bias')
        rows = x.reshape(-1, x.shape[-1])
        if rows.is_cuda:
            out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
        else:
            out = torch.nn.functional.linear(rows, weight, bias)
            out = torch.nn.functional.gelu(out, approximate="tanh")
        return out.reshape(*x.shape[:-1], weight.shape[0])
