"""Linear layer with an epilogue: out = relu(x @ W.T + b) * 0.5, x (1024, 2048) fp32, Linear(2048, 2048).

Eager PyTorch runs the GEMM (with the bias) and then two elementwise kernels over the output; a
Triton matmul can apply bias, ReLU and the scale to the accumulator before the single store.
"""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * 0.5


BATCH = 1024
IN_FEATURES = 2048
OUT_FEATURES = 2048


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]


def get_test_inputs():
    # The weights fix the feature dimension; the batch may be any size.
    return [
        [torch.randn(1, IN_FEATURES)],
        [torch.randn(333, IN_FEATURES)],
        [torch.randn(17, IN_FEATURES)],
    ]
