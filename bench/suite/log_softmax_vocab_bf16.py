"""Token log-probabilities of a language model head: log_softmax over a 32000-word vocabulary, bfloat16."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(logits / self.temperature, dim=-1)


TOKENS, VOCAB = 4096, 32000  # 262 MB read, 262 MB written: rows longer than one register block


def get_inputs():
    return [torch.randn(TOKENS, VOCAB, dtype=torch.bfloat16) * 3]


def get_init_inputs():
    return [0.7]


def get_test_inputs():
    return [
        [torch.randn(7, 50257, dtype=torch.bfloat16) * 3],
        [torch.randn(2, 3, 1001, dtype=torch.bfloat16)],
        [torch.randn(33, 17, dtype=torch.bfloat16)],
    ]
