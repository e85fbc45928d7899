"""The timing judge on the GPU: work off the timed stream, deferred work and baseline sabotage.

Each cheat here would have looked faster than it is under a judge that timed one stream with CUDA
events and ran the reference in the candidate's process. ``timing.benchmark`` is called directly:
the static rules (which would refuse most of these sources) are a first filter only, and these
defences must hold without them.
"""

from __future__ import annotations

import textwrap

import pytest

from kernelcrew.config import Settings
from kernelcrew.tools.correctness import make_golden
from kernelcrew.tools.timing import benchmark

pytestmark = pytest.mark.gpu

# A memory-bound chain: about 0.3 ms on an H100, long enough that hiding it is a large fake speedup.
TASK = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class Model(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2 + 1

    def get_inputs():
        return [torch.randn(4096, 8192)]

    def get_init_inputs():
        return []
    """
)

HONEST = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2 + 1
    """
)

SIDE_STREAM = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.side = None

        def forward(self, x):
            if self.side is None:
                self.side = {STREAM}
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                out = torch.tanh(x) * 2 + 1
            return out  # the caller's stream never waits for the side stream
    """
)

# Returns an output whose work is launched only at the start of the next call.
DEFERRED = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.pending = None

        def forward(self, x):
            if self.pending is not None:
                out, src = self.pending
                torch.add(torch.tanh(src) * 2, 1, out=out)
            out = torch.empty_like(x)
            self.pending = (out, x.clone())
            return out
    """
)

SDPA_TASK = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Model(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def get_inputs():
        return [torch.randn(8, 16, 1024, 64, dtype=torch.float16) for _ in range(3)]

    def get_init_inputs():
        return []
    """
)

SDPA_HONEST = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class ModelNew(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
)

# Turns the fast attention back-ends off for every process that imports it.
SDPA_SABOTAGE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)

    class ModelNew(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
)


def run(task: str, source: str, golden=None):
    return benchmark(
        task,
        {"cand": (source, "candidate.py")},
        device="cuda",
        golden=golden,
        settings=Settings(sandbox_timeout_s=300),
    )


@pytest.fixture(scope="module")
def golden():
    made = make_golden(TASK, device="cuda", settings=Settings(sandbox_timeout_s=300))
    yield made
    made.cleanup()


@pytest.fixture(scope="module")
def honest(golden):
    result = run(TASK, HONEST, golden)
    assert result.failure is None, result.failure
    assert result.results["cand"].off_stream_ms is None
    return result


@pytest.mark.parametrize("stream", ["torch.cuda.Stream()", "torch.Stream(device='cuda')"])
def test_work_on_another_stream_is_timed(golden, honest, stream):
    result = run(TASK, SIDE_STREAM.replace("{STREAM}", stream), golden)
    assert result.failure is None, result.failure
    cand = result.results["cand"]
    assert cand.off_stream_ms is not None and cand.off_stream_ms > 0.05, cand
    # timed device-wide, it is as fast as the honest twin, not several times faster
    assert cand.median_ms > 0.8 * honest.results["cand"].median_ms, (cand, honest.results["cand"])
    assert result.ratios["cand"].median < 1.3


def test_work_deferred_to_the_next_call_fails(golden):
    result = run(TASK, DEFERRED, golden)
    assert result.failure is not None and result.failure.stage == "timed_output", result.failure


def test_a_candidate_cannot_turn_the_baselines_attention_off():
    honest = run(SDPA_TASK, SDPA_HONEST)
    sabotage = run(SDPA_TASK, SDPA_SABOTAGE)
    assert honest.failure is None, honest.failure
    if sabotage.failure is not None:  # the global-state check saw the flags change
        assert sabotage.failure.stage == "state", sabotage.failure
        return
    eager_honest = honest.results["eager"].median_ms
    eager_sabotage = sabotage.results["eager"].median_ms
    assert eager_sabotage < 1.3 * eager_honest, (eager_sabotage, eager_honest)
    # the candidate's own process did lose the fast back-ends
    assert sabotage.results["cand"].median_ms > 1.5 * honest.results["cand"].median_ms
