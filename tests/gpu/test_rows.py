"""Row kernels on the GPU stay correct across calls: two shapes in turn, a second stream, CUDA graphs.

A row candidate may keep state between calls (the waiting launch of long GroupNorm rows keeps its
per-row counters rather than clearing them before each launch). Each call here runs on new random
inputs and is checked against the module in float64: many eager calls with two shapes in turn, calls
on a second stream and back, replays of a CUDA graph captured around the module, then eager again.
The candidates come from the row strategy's public generator API.
"""

from __future__ import annotations

import pytest
import torch

from kernelcrew.agents.playbook import rows
from kernelcrew.task import load_candidate, load_task
from tests.conftest import local_analysis
from tests.gpu.conftest import ROOT

pytestmark = pytest.mark.gpu

TASK = ROOT / "bench" / "suite" / "groupnorm_silu_fp16.py"
CALLS, REPLAYS = 10, 5
BOUND = 2e-3  # float16 output: eager's own error against float64 is about 3e-4


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    return float("nan") if not o.isfinite().all() else float((o - r).norm() / r.norm())


def test_row_candidates_stay_correct_across_calls_streams_and_graphs(tmp_path):
    source = TASK.read_text()
    analysis = local_analysis(source, str(TASK))
    plan, reason = rows.match(analysis)
    assert plan is not None, reason
    space = rows.tuning_space(plan, "sm_90")
    configs = {i: p for i, p in enumerate(space) if i == 0 or "WAIT_PART" in p}  # the stateful ones
    task = load_task(source, str(TASK))
    torch.manual_seed(0)
    model = task.model_cls(*task.get_init_inputs()).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    ref64 = task.model_cls(*task.get_init_inputs()).cuda().eval().double()
    ref64.load_state_dict(model.state_dict())
    (x,) = task.get_inputs()
    shape, half = x.shape, (max(1, x.shape[0] // 2), *x.shape[1:])

    def fresh(s):
        return [torch.randn(s, dtype=x.dtype, device="cuda") * 2 + 1]

    worst: dict[str, float] = {}
    for i, params in configs.items():
        file = tmp_path / f"rows_{i}.py"  # Triton reads a kernel's source from its file
        file.write_text(rows.generate(source, analysis, plan, params))
        new = load_candidate(file.read_text(), str(file))(*task.get_init_inputs()).cuda().eval()
        new.load_state_dict(model.state_dict())

        def error(xs, new=new) -> float:
            with torch.no_grad():
                return rel_error(new(*xs), ref64(*[t.double() for t in xs]))

        errors = {"eager": [error(fresh(s)) for _ in range(CALLS) for s in (shape, half)]}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            errors["second stream"] = [error(fresh(shape)) for _ in range(3)]
        torch.cuda.current_stream().wait_stream(side)
        errors["second stream"] += [error(fresh(shape)) for _ in range(3)]
        static = fresh(shape)
        with torch.no_grad():
            warm = torch.cuda.Stream()
            warm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warm):
                new(*static)
            torch.cuda.current_stream().wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = new(*static)
            errors["graph replays"] = []
            for _ in range(REPLAYS):
                xs = fresh(shape)
                static[0].copy_(xs[0])
                graph.replay()
                torch.cuda.synchronize()
                errors["graph replays"].append(rel_error(captured, ref64(xs[0].double())))
        errors["eager after the graph"] = [error(fresh(shape)) for _ in range(3)]
        for what, values in errors.items():
            worst[f"config {i} {params}: {what}"] = max(values)
    bad = {k: v for k, v in worst.items() if not v < BOUND}
    assert not bad, bad
