"""The CUDA graph candidate on the GPU: the same outputs, state and random draws as eager, and a
plain forward wherever a graph cannot serve a call."""

from __future__ import annotations

import uuid

import pytest
import torch

from kernelcrew.agents.playbook.graphs import generate_graphed
from kernelcrew.task import import_source
from tests.gpu.conftest import kernelcrew_json

pytestmark = pytest.mark.gpu

RANDOM_STATE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    \"\"\"A recurrent layer whose initial state is drawn in the forward, as KernelBench's LSTMs do.\"\"\"

    def __init__(self, n=32, h=64, layers=2):
        super().__init__()
        self.h, self.layers = h, layers
        self.lstm = nn.LSTM(n, h, layers, batch_first=True)
        self.fc = nn.Linear(h, 8)

    def forward(self, x):
        h0 = torch.randn(self.layers, x.size(0), self.h, device=x.device)
        c0 = torch.randn(self.layers, x.size(0), self.h, device=x.device)
        out, _ = self.lstm(x, (h0, c0))
        return self.fc(out[:, -1, :])


def get_inputs():
    return [torch.randn(4, 16, 32)]


def get_init_inputs():
    return []
"""

BATCHNORM = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x, scale: float = 1.0):
        return torch.relu(self.bn(self.conv(x))) * scale


def get_inputs():
    return [torch.randn(2, 3, 16, 16)]


def get_init_inputs():
    return []
"""

GRU = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(16, 32, 3, batch_first=True)

    def forward(self, x, h0):
        out, h_n = self.gru(x, h0)
        return h_n


def get_inputs():
    return [torch.randn(4, 64, 16), torch.randn(3, 4, 32)]


def get_init_inputs():
    return []
"""

HOST_SYNC = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.sum().item() > 0:  # a host synchronization: no graph can hold it
            return x * 2
        return x - 1


def get_inputs():
    return [torch.randn(8)]


def get_init_inputs():
    return []
"""


def _pair(task: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference and the graphed candidate with the same weights, on the GPU."""
    ref_ns = import_source(task, f"task_{uuid.uuid4().hex}", "task.py")
    cand_ns = import_source(generate_graphed(task), f"candidate_{uuid.uuid4().hex}", "candidate.py")
    torch.manual_seed(0)
    ref = ref_ns.Model().cuda()
    cand = cand_ns.ModelNew().cuda()
    cand.load_state_dict(ref.state_dict())
    return ref, cand


def _seeded(model: torch.nn.Module, seed: int, *args):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(*args)


def test_random_draws_in_the_forward_match_eager_call_after_call():
    ref, cand = _pair(RANDOM_STATE)
    for seed in range(3):
        x = torch.randn(4, 16, 32, device="cuda")
        want, got = _seeded(ref, seed, x), _seeded(cand, seed, x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(cand._graphs) == 1 and cand._graphs[next(iter(cand._graphs))]


def test_training_batchnorm_statistics_match_eager_and_outputs_are_not_overwritten():
    ref, cand = _pair(BATCHNORM)
    xs = [torch.randn(2, 3, 16, 16, device="cuda") for _ in range(3)]
    outs = [_seeded(cand, 0, x, 0.5) for x in xs]
    kept = [o.clone() for o in outs]
    for x, got in zip(xs, outs, strict=True):
        torch.testing.assert_close(got, _seeded(ref, 0, x, 0.5))
    for got, was in zip(outs, kept, strict=True):  # a later replay never writes a returned output
        assert torch.equal(got, was)
    torch.testing.assert_close(cand.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(cand.bn.running_var, ref.bn.running_var)
    assert int(cand.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 3


def test_a_new_signature_or_moved_weights_capture_again():
    ref, cand = _pair(BATCHNORM)
    ref.eval(), cand.eval()
    small, large = torch.randn(2, 3, 16, 16, device="cuda"), torch.randn(5, 3, 20, 20, device="cuda")
    for x in (small, large, small):
        torch.testing.assert_close(_seeded(cand, 0, x), _seeded(ref, 0, x))
    assert len(cand._graphs) == 2
    with torch.no_grad():
        new = torch.randn_like(ref.conv.weight)
        ref.conv.weight.data = new.clone()
        cand.conv.weight.data = new.clone()  # a new allocation: the captured graph reads the old one
    torch.testing.assert_close(_seeded(cand, 0, small), _seeded(ref, 0, small))
    different = _seeded(cand, 0, small, 2.0)  # another scalar value is another signature
    torch.testing.assert_close(different, _seeded(ref, 0, small, 2.0))


def test_a_forward_that_cannot_be_captured_runs_plainly():
    ref, cand = _pair(HOST_SYNC)
    for sign in (1.0, -1.0, 1.0):
        x = torch.rand(8, device="cuda") * sign
        torch.testing.assert_close(_seeded(cand, 0, x), _seeded(ref, 0, x))
    assert list(cand._graphs.values()) == [False]


def test_the_graphed_candidate_passes_verify(tmp_path):
    task = tmp_path / "task.py"
    task.write_text(GRU)
    candidate = tmp_path / "candidate.py"
    candidate.write_text(generate_graphed(GRU))
    report = kernelcrew_json(
        "verify", str(task), str(candidate), "--device", "cuda", "--compile-modes", "none", "--quick"
    )
    assert report["verdict"] == "pass", report.get("message")
    assert report["kind"] in ("library", "hybrid", "kernel"), report
