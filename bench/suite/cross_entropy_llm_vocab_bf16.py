"""Language-model training loss: mean cross-entropy over LLaMA-3's 128256-word vocabulary, bfloat16 logits."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


BATCH, SEQ, VOCAB = 2, 1024, 128256  # 525 MB read, one number written


def get_inputs():
    return [torch.randn(BATCH, SEQ, VOCAB, dtype=torch.bfloat16) * 2, torch.randint(0, VOCAB, (BATCH, SEQ))]


def get_init_inputs():
    return []


def get_test_inputs():
    targets = torch.randint(0, 50257, (3, 5))
    targets[0, :2] = -100  # padding positions left out of the mean
    return [
        [torch.randn(3, 5, 50257, dtype=torch.bfloat16), targets],
        [torch.randn(1, 37, 1001, dtype=torch.bfloat16) * 4, torch.randint(0, 1001, (1, 37))],
    ]
