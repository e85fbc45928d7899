"""ViT-B/16 MLP expansion (768 -> 3072) on 32 images of 197 tokens, bias and ReLU, float16."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden, dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


BATCH, TOKENS, DIM, HIDDEN = 32, 197, 768, 3072  # 6304 rows, 30 GFLOP per call


def get_inputs():
    return [torch.randn(BATCH, TOKENS, DIM, dtype=torch.float16)]


def get_init_inputs():
    return [DIM, HIDDEN]


def get_test_inputs():
    return [
        [torch.randn(1, 197, DIM, dtype=torch.float16)],
        [torch.randn(3, 5, DIM, dtype=torch.float16)],
    ]
